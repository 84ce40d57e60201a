//! Agent sessions in the Weka trace format, replayed closed loop.
//!
//! A trace is one recorded session: parent calls and subagent entries in order (see
//! `shared/data/agentx/README.md`). Replay semantics:
//!
//! - **Lanes.** Concurrency N = N lanes, each running one session tree; when a tree drains
//!   (background subagents included) the lane starts the next trace at once. Each session
//!   instance gets its own hash-id namespace, shared by its subagents, so concurrent sessions
//!   never share cache but a parent and its subagents do.
//! - **Parent calls** are sequential: a call is sent a recorded gap after the previous parent
//!   event (the previous call's completion, or the launch of a subagent entry), the gap being
//!   `t - (previous t + api_time)` clamped at 0, times the time scale, capped at `max_gap`.
//! - **Subagents** launch when the parent reaches their entry (after the same kind of gap) and
//!   run their calls sequentially with the same gap rule, from a fresh context. A parent call
//!   after one or more non-`async_launched` subagents waits until they all finished (join),
//!   then at least the recorded gap from the subagents' recorded end.
//! - Calls send `max_tokens = max(out, 1)` with `ignore_eos`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;

use super::{Micros, Outbox, RequestSpec, Workload};
use crate::error::ReplayError;
use crate::synth::{PromptSpec, mix};

/// One model call of a trace. `t` is on the parent timeline for parent calls and relative to
/// the subagent's start for subagent calls.
#[derive(Debug, Clone, PartialEq)]
pub struct WekaCall {
    pub t: f64,
    pub input: u64,
    pub output: u64,
    pub hash_ids: Vec<u32>,
    /// Recorded server time (0 when absent).
    pub api_time: f64,
}

/// A subagent entry: calls on its own fresh context.
#[derive(Debug, Clone, PartialEq)]
pub struct WekaSubagent {
    pub t: f64,
    pub agent_id: String,
    /// `status == "async_launched"`: the parent does not wait for it.
    pub is_async: bool,
    pub calls: Vec<WekaCall>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WekaEntry {
    Call(WekaCall),
    Subagent(WekaSubagent),
}

/// One recorded session.
#[derive(Debug, Clone, PartialEq)]
pub struct WekaTrace {
    pub id: String,
    pub block_size: u32,
    pub entries: Vec<WekaEntry>,
}

impl WekaTrace {
    /// Model calls in the trace, subagents included.
    pub fn calls(&self) -> usize {
        self.entries
            .iter()
            .map(|e| match e {
                WekaEntry::Call(_) => 1,
                WekaEntry::Subagent(s) => s.calls.len(),
            })
            .sum()
    }
}

#[derive(Debug, Deserialize)]
struct RawEntry {
    t: f64,
    #[serde(rename = "type")]
    kind: String,
    #[serde(rename = "in", default)]
    input: u64,
    #[serde(default)]
    out: u64,
    #[serde(default)]
    hash_ids: Vec<u32>,
    #[serde(default)]
    api_time: Option<f64>,
    #[serde(default)]
    agent_id: Option<String>,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    requests: Vec<RawEntry>,
}

#[derive(Debug, Deserialize)]
struct RawTrace {
    id: String,
    block_size: u32,
    requests: Vec<RawEntry>,
}

fn call(raw: &RawEntry, base: f64) -> WekaCall {
    WekaCall {
        t: raw.t - base,
        input: raw.input,
        output: raw.out,
        hash_ids: raw.hash_ids.clone(),
        api_time: raw.api_time.unwrap_or(0.0).max(0.0),
    }
}

fn convert(raw: RawTrace) -> Result<WekaTrace, String> {
    if raw.block_size == 0 {
        return Err(format!("trace {}: block_size must be positive", raw.id));
    }
    let mut entries = Vec::with_capacity(raw.requests.len());
    for e in &raw.requests {
        match e.kind.as_str() {
            "n" | "s" => entries.push(WekaEntry::Call(call(e, 0.0))),
            "subagent" => {
                let Some(first) = e.requests.first() else {
                    continue; // nothing to replay
                };
                // WEKA data times inner calls from the subagent's start, SemiAnalysis data on
                // the parent timeline (first inner t == the entry's t).
                let base = if first.t + 1e-9 >= e.t { e.t } else { 0.0 };
                entries.push(WekaEntry::Subagent(WekaSubagent {
                    t: e.t,
                    agent_id: e.agent_id.clone().unwrap_or_default(),
                    is_async: e.status.as_deref() == Some("async_launched"),
                    calls: e.requests.iter().map(|c| call(c, base)).collect(),
                }));
            }
            other => return Err(format!("trace {}: unknown entry type {other:?}", raw.id)),
        }
    }
    Ok(WekaTrace {
        id: raw.id,
        block_size: raw.block_size,
        entries,
    })
}

/// Reads Weka traces, one per line, from a `.jsonl` or `.jsonl.gz` file; `limit` keeps the
/// first ones.
pub fn load(path: &Path, limit: Option<usize>) -> Result<Vec<WekaTrace>, ReplayError> {
    let file = std::fs::File::open(path).map_err(|e| ReplayError::io(path, e))?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|x| x == "gz") {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    let mut traces = Vec::new();
    for (i, line) in BufReader::with_capacity(1 << 20, reader)
        .lines()
        .enumerate()
    {
        if limit.is_some_and(|n| traces.len() >= n) {
            break;
        }
        let line = line.map_err(|e| ReplayError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let raw: RawTrace =
            serde_json::from_str(&line).map_err(|source| ReplayError::TraceParse {
                path: path.to_owned(),
                line: i + 1,
                source,
            })?;
        let trace = convert(raw).map_err(|reason| ReplayError::TraceInvalid {
            path: path.to_owned(),
            line: i + 1,
            reason,
        })?;
        traces.push(trace);
    }
    Ok(traces)
}

/// Closed-loop settings.
#[derive(Debug, Clone, PartialEq)]
pub struct WekaConfig {
    /// Live session trees at once.
    pub concurrency: usize,
    /// Multiplies every recorded gap (think time); 0 sends back to back.
    pub time_scale: f64,
    /// Longest gap after scaling, in seconds (idle cap).
    pub max_gap_s: f64,
    /// Sessions to run in total (each draws the next trace, wrapping around); `None` runs each
    /// trace once.
    pub sessions: Option<usize>,
    /// Draw traces in a seeded shuffled order instead of file order.
    pub shuffle_seed: Option<u64>,
}

impl Default for WekaConfig {
    fn default() -> Self {
        Self {
            concurrency: 1,
            time_scale: 1.0,
            max_gap_s: 300.0,
            sessions: None,
            shuffle_seed: None,
        }
    }
}

/// What happened to one call, for tests and per-session reports.
#[derive(Debug, Clone, PartialEq)]
pub struct CallLog {
    pub trace: String,
    /// Session instance (draw number).
    pub session: u64,
    /// `None` for a parent call, else the subagent's entry index in the trace.
    pub subagent: Option<usize>,
    /// Index of the call in its lane (parent calls, or the subagent's calls).
    pub index: usize,
    pub sent_at: Micros,
    pub finished_at: Option<Micros>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parent {
    Ready,
    InFlight,
    WaitingJoin,
    Done,
}

#[derive(Debug)]
struct SubRun {
    entry: usize,
    /// (actual time, recorded time on the subagent's timeline) of its last event.
    anchor: (Micros, f64),
    done_at: Option<Micros>,
    /// Recorded end on the parent timeline.
    rec_end: f64,
}

#[derive(Debug)]
struct SessionRun {
    trace: usize,
    draw: u64,
    next_entry: usize,
    parent: Parent,
    parent_calls: usize,
    /// (actual time, recorded parent time) of the last parent event.
    anchor: (Micros, f64),
    gating: Vec<usize>,
    subs: Vec<SubRun>,
}

#[derive(Debug, Clone, Copy)]
enum Lane {
    Parent,
    Sub(usize),
}

/// The closed-loop session replayer.
#[derive(Debug)]
pub struct WekaWorkload {
    traces: Vec<WekaTrace>,
    config: WekaConfig,
    order: Vec<usize>,
    draws: u64,
    lanes: Vec<Option<SessionRun>>,
    in_flight: HashMap<u64, (usize, Lane, usize)>,
    log: Vec<CallLog>,
    completed: u64,
}

impl WekaWorkload {
    pub fn new(traces: Vec<WekaTrace>, config: WekaConfig) -> Result<Self, ReplayError> {
        if config.concurrency == 0 {
            return Err(ReplayError::InvalidConfig(
                "concurrency must be at least 1".into(),
            ));
        }
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        if !(non_negative(config.time_scale) && non_negative(config.max_gap_s)) {
            return Err(ReplayError::InvalidConfig(
                "time scale and gap cap must be finite and non-negative".into(),
            ));
        }
        if traces.is_empty() {
            return Err(ReplayError::InvalidConfig("no traces to replay".into()));
        }
        let mut order: Vec<usize> = (0..traces.len()).collect();
        if let Some(seed) = config.shuffle_seed {
            // Fisher–Yates with SplitMix64, so the order only depends on the seed.
            let mut state = seed;
            for i in (1..order.len()).rev() {
                state = mix(state);
                order.swap(i, (state % (i as u64 + 1)) as usize);
            }
        }
        let lanes = (0..config.concurrency).map(|_| None).collect();
        Ok(Self {
            traces,
            config,
            order,
            draws: 0,
            lanes,
            in_flight: HashMap::new(),
            log: Vec::new(),
            completed: 0,
        })
    }

    /// Every call sent so far, indexed by request id.
    pub fn log(&self) -> &[CallLog] {
        &self.log
    }

    fn total_sessions(&self) -> u64 {
        self.config.sessions.unwrap_or(self.traces.len()) as u64
    }

    fn gap(&self, from_rec: f64, to_rec: f64) -> Micros {
        let scaled = (to_rec - from_rec).max(0.0) * self.config.time_scale;
        (scaled.min(self.config.max_gap_s) * 1e6).round() as Micros
    }

    /// Starts the next session in `lane` at `now`, if any is left.
    fn draw(&mut self, lane: usize, now: Micros, out: &mut Outbox) {
        if self.draws >= self.total_sessions() {
            self.lanes[lane] = None;
            return;
        }
        let trace = self.order[(self.draws % self.order.len() as u64) as usize];
        self.lanes[lane] = Some(SessionRun {
            trace,
            draw: self.draws,
            next_entry: 0,
            parent: Parent::Ready,
            parent_calls: 0,
            anchor: (now, 0.0),
            gating: Vec::new(),
            subs: Vec::new(),
        });
        self.draws += 1;
        self.advance_parent(lane, now, out);
    }

    fn send(
        &mut self,
        lane: usize,
        which: Lane,
        index: usize,
        call: &WekaCall,
        at: Micros,
        out: &mut Outbox,
    ) {
        let Some(run) = self.lanes[lane].as_ref() else {
            return;
        };
        let trace = &self.traces[run.trace];
        let id = self.log.len() as u64;
        self.log.push(CallLog {
            trace: trace.id.clone(),
            session: run.draw,
            subagent: match which {
                Lane::Parent => None,
                Lane::Sub(k) => Some(run.subs[k].entry),
            },
            index,
            sent_at: at,
            finished_at: None,
        });
        self.in_flight.insert(id, (lane, which, index));
        out.send_at(
            at,
            RequestSpec {
                id,
                prompt: PromptSpec {
                    namespace: run.draw + 1,
                    block_size: trace.block_size,
                    hash_ids: call.hash_ids.clone(),
                    input_tokens: call.input,
                    tail_seed: id,
                },
                max_tokens: call.output.clamp(1, u64::from(u32::MAX)) as u32,
                session: Some(format!("{}#{}", trace.id, run.draw)),
            },
        );
    }

    fn advance_parent(&mut self, lane: usize, now: Micros, out: &mut Outbox) {
        loop {
            let Some(run) = self.lanes[lane].as_ref() else {
                return;
            };
            let trace = &self.traces[run.trace];
            let Some(entry) = trace.entries.get(run.next_entry).cloned() else {
                if let Some(run) = self.lanes[lane].as_mut() {
                    run.parent = Parent::Done;
                }
                self.maybe_finish(lane, now, out);
                return;
            };
            let (anchor_at, anchor_rec) = run.anchor;
            match entry {
                WekaEntry::Subagent(sub) => {
                    let launch = anchor_at + self.gap(anchor_rec, sub.t);
                    let last = sub.calls.last().map_or(0.0, |c| c.t + c.api_time);
                    let Some(run) = self.lanes[lane].as_mut() else {
                        return;
                    };
                    let k = run.subs.len();
                    run.subs.push(SubRun {
                        entry: run.next_entry,
                        anchor: (launch, 0.0),
                        done_at: None,
                        rec_end: sub.t + last,
                    });
                    if !sub.is_async {
                        run.gating.push(k);
                    }
                    run.anchor = (launch, sub.t);
                    run.next_entry += 1;
                    if let Some(first) = sub.calls.first() {
                        let at = launch + self.gap(0.0, first.t);
                        self.send(lane, Lane::Sub(k), 0, first, at, out);
                    }
                }
                WekaEntry::Call(call) => {
                    let mut at = anchor_at + self.gap(anchor_rec, call.t);
                    if !run.gating.is_empty() {
                        let mut join_at = 0;
                        let mut join_rec = f64::MIN;
                        for &k in &run.gating {
                            match run.subs[k].done_at {
                                Some(done) => join_at = join_at.max(done),
                                None => {
                                    if let Some(run) = self.lanes[lane].as_mut() {
                                        run.parent = Parent::WaitingJoin;
                                    }
                                    return;
                                }
                            }
                            join_rec = join_rec.max(run.subs[k].rec_end);
                        }
                        at = at.max(join_at + self.gap(join_rec, call.t));
                    }
                    let at = at.max(now);
                    let Some(run) = self.lanes[lane].as_mut() else {
                        return;
                    };
                    run.gating.clear();
                    run.parent = Parent::InFlight;
                    run.next_entry += 1;
                    let index = run.parent_calls;
                    run.parent_calls += 1;
                    self.send(lane, Lane::Parent, index, &call, at, out);
                    return;
                }
            }
        }
    }

    fn maybe_finish(&mut self, lane: usize, now: Micros, out: &mut Outbox) {
        let done = self.lanes[lane].as_ref().is_some_and(|run| {
            run.parent == Parent::Done && run.subs.iter().all(|s| s.done_at.is_some())
        });
        if done {
            self.completed += 1;
            if let Some(run) = self.lanes[lane].as_ref() {
                let trace = &self.traces[run.trace];
                out.end_session(format!("{}#{}", trace.id, run.draw));
            }
            self.draw(lane, now, out);
        }
    }

    /// The parent call or subagent call `index` of the running session in `lane`.
    fn call_of(&self, lane: usize, which: Lane, index: usize) -> Option<WekaCall> {
        let run = self.lanes[lane].as_ref()?;
        let trace = &self.traces[run.trace];
        match which {
            Lane::Parent => trace
                .entries
                .iter()
                .filter_map(|e| match e {
                    WekaEntry::Call(c) => Some(c),
                    WekaEntry::Subagent(_) => None,
                })
                .nth(index)
                .cloned(),
            Lane::Sub(k) => match trace.entries.get(run.subs.get(k)?.entry)? {
                WekaEntry::Subagent(s) => s.calls.get(index).cloned(),
                WekaEntry::Call(_) => None,
            },
        }
    }
}

impl Workload for WekaWorkload {
    fn start(&mut self, out: &mut Outbox) {
        for lane in 0..self.lanes.len() {
            self.draw(lane, 0, out);
        }
    }

    fn on_finished(&mut self, id: u64, _ok: bool, now: Micros, out: &mut Outbox) {
        let Some((lane, which, index)) = self.in_flight.remove(&id) else {
            return;
        };
        if let Some(entry) = self.log.get_mut(id as usize) {
            entry.finished_at = Some(now);
        }
        let Some(call) = self.call_of(lane, which, index) else {
            return;
        };
        let end_rec = call.t + call.api_time;
        match which {
            Lane::Parent => {
                if let Some(run) = self.lanes[lane].as_mut() {
                    run.anchor = (now, end_rec);
                    run.parent = Parent::Ready;
                }
                self.advance_parent(lane, now, out);
            }
            Lane::Sub(k) => {
                let next = self.call_of(lane, which, index + 1);
                let Some(run) = self.lanes[lane].as_mut() else {
                    return;
                };
                let sub = &mut run.subs[k];
                sub.anchor = (now, end_rec);
                match next {
                    Some(next_call) => {
                        let at = now + self.gap(end_rec, next_call.t);
                        self.send(lane, which, index + 1, &next_call, at, out);
                    }
                    None => {
                        sub.done_at = Some(now);
                        if run.parent == Parent::WaitingJoin {
                            run.parent = Parent::Ready;
                            self.advance_parent(lane, now, out);
                        } else {
                            self.maybe_finish(lane, now, out);
                        }
                    }
                }
            }
        }
    }

    fn expected_requests(&self) -> Option<u64> {
        let per_pass: u64 = self
            .order
            .iter()
            .map(|&t| self.traces[t].calls() as u64)
            .sum();
        match self.config.sessions {
            None => Some(per_pass),
            Some(n) => {
                let n = n as u64;
                let len = self.order.len() as u64;
                let partial: u64 = self.order[..(n % len) as usize]
                    .iter()
                    .map(|&t| self.traces[t].calls() as u64)
                    .sum();
                Some(per_pass * (n / len) + partial)
            }
        }
    }

    fn sessions_completed(&self) -> u64 {
        self.completed
    }
}

#[cfg(test)]
#[path = "weka_tests.rs"]
mod tests;
