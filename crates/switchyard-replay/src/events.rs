//! KV-event replay: a gateway recording (`docs/kv-recording.md`) replayed against several
//! routing policies side by side.
//!
//! The recording holds every input the live router saw, in the order it applied them. Replay
//! rebuilds one [`PrefixIndex`] per model from the recorded events and snapshots (the workers'
//! real cache state, shared by every policy), and gives each policy its own [`LoadView`], fed
//! the recorded load reports and the in-flight bookkeeping of the policy's *own* choices. At
//! each recorded routing request every policy chooses among the recorded candidates; the report
//! says how often it agreed with the live decision, how many prompt blocks its choice had
//! cached (a prediction against the real caches: a policy that routed differently would, over
//! time, have built different caches, which a recording cannot show) and how evenly it spread
//! the requests. Policies that sample are seeded, so the same file and seed give the same
//! report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::Serialize;
use switchyard_core::{BlockSize, WorkerId};
use switchyard_router::{
    ApplyOutcome, Candidate, IndexConfig, LoadConfig, LoadView, Policy, PolicyConfig, PolicyKind,
    PrefixIndex, RouteRequest,
};

use crate::error::ReplayError;
use crate::events_filter::RouteFilter;
use crate::metrics::Percentiles;

/// The format name a recording's header must carry.
pub use switchyard_router::recording::{FORMAT, OLDEST_VERSION, VERSION};
use switchyard_router::recording::{Record as Line, RouteRecord};
use switchyard_router::serve::Booking;

/// What the index made of the recorded events (all but `applied` should be rare: gaps appear
/// before a worker's first recorded snapshot or where the recording dropped records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IndexCounts {
    pub snapshots: u64,
    pub applied: u64,
    pub stale: u64,
    pub gaps: u64,
    pub invalid: u64,
}

/// One policy's figures over the recording.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// The policy, or `live (<policy>)` for the decisions the gateway actually made.
    pub policy: String,
    pub decisions: u64,
    /// Requests the policy could not route (no candidate it accepts).
    pub failures: u64,
    /// Fraction of decisions that chose the live decision's worker.
    pub agreement: f64,
    /// Leading prompt blocks the chosen worker held in its device tier.
    pub cached_blocks: Percentiles,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Most requests routed to one worker over the mean per worker (1 = perfectly even).
    pub load_spread: f64,
    pub routed_per_worker: BTreeMap<WorkerId, u64>,
}

/// Everything `switchyard replay events` measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventsReport {
    pub recording: String,
    pub seed: u64,
    /// The live policy when the recording started.
    pub live_policy: String,
    /// Whether the recording ended with a trailer saying no record was dropped.
    pub complete: bool,
    pub dropped: u64,
    pub records: u64,
    /// The session or tenant the decisions were narrowed to (`--session`, `--tenant`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    pub index: IndexCounts,
    pub policies: Vec<PolicyReport>,
}

#[derive(Debug, Default)]
struct Tally {
    decisions: u64,
    failures: u64,
    agreed: u64,
    cached_blocks: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    routed: BTreeMap<WorkerId, u64>,
}

impl Tally {
    fn add(&mut self, record: &RouteRecord, chosen: &WorkerId, cached_blocks: u32) {
        self.decisions += 1;
        self.agreed += u64::from(*chosen == record.chosen);
        self.cached_blocks.push(f64::from(cached_blocks));
        self.prompt_tokens += record.prompt_tokens;
        let cached = u64::from(cached_blocks) * u64::from(record.block_size);
        self.cached_tokens += cached.min(record.prompt_tokens);
        for c in &record.candidates {
            self.routed.entry(c.clone()).or_default();
        }
        *self.routed.entry(chosen.clone()).or_default() += 1;
    }

    fn report(mut self, policy: String) -> PolicyReport {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let max = self.routed.values().copied().max().unwrap_or(0);
        let total: u64 = self.routed.values().sum();
        let mean = ratio(total, self.routed.len() as u64);
        PolicyReport {
            policy,
            decisions: self.decisions,
            failures: self.failures,
            agreement: ratio(self.agreed, self.decisions),
            cached_blocks: Percentiles::of(&mut self.cached_blocks),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            hit_rate: ratio(self.cached_tokens, self.prompt_tokens),
            load_spread: if mean > 0.0 { max as f64 / mean } else { 0.0 },
            routed_per_worker: self.routed,
        }
    }
}

/// One policy's own view: its policy state, its load view and where it sent each request.
#[derive(Debug)]
struct Lane {
    policy: Box<dyn Policy>,
    load: LoadView,
    routed: BTreeMap<u64, WorkerId>,
}

#[derive(Debug)]
struct ModelState {
    index: PrefixIndex,
    lanes: Vec<Lane>,
}

struct Replayer {
    kinds: Vec<PolicyKind>,
    settings: PolicyConfig,
    models: BTreeMap<String, ModelState>,
    tallies: Vec<Tally>,
    live: Tally,
    counts: IndexCounts,
    filter: RouteFilter,
}

impl Replayer {
    fn model(&mut self, name: &str, block_size: BlockSize) -> Result<&mut ModelState, ReplayError> {
        if !self.models.contains_key(name) {
            let mut lanes = Vec::with_capacity(self.kinds.len());
            for kind in &self.kinds {
                lanes.push(Lane {
                    policy: kind
                        .build(&self.settings)
                        .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?,
                    load: LoadView::new(LoadConfig::default()),
                    routed: BTreeMap::new(),
                });
            }
            let state = ModelState {
                index: PrefixIndex::new(IndexConfig::new(block_size)),
                lanes,
            };
            self.models.insert(name.to_owned(), state);
        }
        self.models
            .get_mut(name)
            .ok_or_else(|| ReplayError::InvalidConfig(format!("model {name} vanished")))
    }

    fn apply(&mut self, line: Line) -> Result<(), ReplayError> {
        match line {
            Line::Header(_) | Line::Trailer { .. } => {}
            Line::WorkerJoined { worker, .. } => {
                self.model(&worker.model, worker.block_size)?;
            }
            Line::WorkerLeft { model, worker, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    m.index.remove_worker(&worker);
                    for lane in &mut m.lanes {
                        lane.load.remove_worker(&worker);
                        lane.policy.worker_removed(&worker);
                    }
                }
            }
            Line::Snapshot {
                model,
                worker,
                incarnation,
                next_seq,
                blocks,
                ..
            } => {
                if let Some(m) = self.models.get_mut(&model) {
                    match m
                        .index
                        .apply_snapshot(&worker, incarnation, next_seq, &blocks)
                    {
                        Ok(()) => self.counts.snapshots += 1,
                        Err(_) => self.counts.invalid += 1,
                    }
                }
            }
            Line::KvEvent {
                model,
                worker,
                incarnation,
                seq,
                event,
                ..
            } => {
                if let Some(m) = self.models.get_mut(&model) {
                    match m.index.apply(&worker, incarnation, seq, &event) {
                        Ok(ApplyOutcome::Applied) => self.counts.applied += 1,
                        Ok(ApplyOutcome::Stale { .. }) => self.counts.stale += 1,
                        Ok(ApplyOutcome::ResyncNeeded { .. }) => self.counts.gaps += 1,
                        Err(_) => self.counts.invalid += 1,
                    }
                }
            }
            Line::IndexDropped { model, worker, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    m.index.remove_worker(&worker);
                }
            }
            Line::Load {
                tick,
                model,
                worker,
                stats,
            } => {
                if let Some(m) = self.models.get_mut(&model) {
                    for lane in &mut m.lanes {
                        lane.load.report(&worker, stats, tick);
                    }
                }
            }
            Line::Route(record) => self.route(&record)?,
            Line::PrefillDone { model, key, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    for lane in &mut m.lanes {
                        if let Some(w) = lane.routed.get(&key) {
                            lane.load.on_prefill_done(w, key);
                        }
                    }
                }
            }
            Line::Finished { model, key, .. } => {
                if let Some(m) = self.models.get_mut(&model) {
                    for lane in &mut m.lanes {
                        if let Some(w) = lane.routed.remove(&key) {
                            lane.load.on_finished(&w, key);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn route(&mut self, record: &RouteRecord) -> Result<(), ReplayError> {
        let block_size = BlockSize::new(record.block_size)
            .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
        let request = RouteRequest {
            block_hashes: record.block_hashes.clone(),
            prompt_tokens: record.prompt_tokens,
            block_size,
            session: record.session.clone(),
            now: record.tick,
        };
        let candidates: Vec<Candidate> = record
            .candidates
            .iter()
            .cloned()
            .map(Candidate::from)
            .collect();
        let counted = self.filter.matches(record);
        if counted {
            self.live.add(record, &record.chosen, record.cached_blocks);
        }
        let model = self.model(&record.model, block_size)?;
        let mut outcomes = Vec::with_capacity(model.lanes.len());
        for lane in &mut model.lanes {
            match lane
                .policy
                .choose(&request, &candidates, &model.index, &lane.load)
            {
                Ok(decision) => {
                    let cached_blocks = decision.chosen().map_or(0, |c| c.overlap.device);
                    // Booked by the serving core's rule, as the live gateway booked it.
                    let booking =
                        Booking::aggregated(record.key, &decision, &request, record.max_tokens);
                    lane.load.on_routed(
                        &booking.worker,
                        booking.key,
                        booking.prefill_tokens,
                        booking.blocks,
                        request.now,
                    );
                    lane.routed.insert(record.key, decision.worker.clone());
                    outcomes.push(Some((decision.worker, cached_blocks)));
                }
                Err(_) => outcomes.push(None),
            }
        }
        for (tally, outcome) in self.tallies.iter_mut().zip(outcomes).filter(|_| counted) {
            match outcome {
                Some((worker, cached)) => tally.add(record, &worker, cached),
                None => tally.failures += 1,
            }
        }
        Ok(())
    }
}

/// Replays the recording at `path` against `policies`. `seed` overrides the seed of the
/// recorded policy settings (the other settings are the live gateway's).
pub fn replay_recording(
    path: &Path,
    policies: &[PolicyKind],
    seed: Option<u64>,
) -> Result<EventsReport, ReplayError> {
    replay_recording_for(path, policies, seed, &RouteFilter::default())
}

/// [`replay_recording`], counting only the decisions `filter` matches (all are replayed).
pub fn replay_recording_for(
    path: &Path,
    policies: &[PolicyKind],
    seed: Option<u64>,
    filter: &RouteFilter,
) -> Result<EventsReport, ReplayError> {
    if policies.is_empty() {
        return Err(ReplayError::InvalidConfig("--policies is empty".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| ReplayError::io(path, e))?;
    let reader = std::io::BufReader::new(file);
    let invalid = |line: usize, reason: String| ReplayError::TraceInvalid {
        path: PathBuf::from(path),
        line,
        reason,
    };
    let mut replayer: Option<Replayer> = None;
    let (mut live_policy, mut used_seed) = (String::new(), 0);
    let (mut records, mut dropped, mut complete) = (0u64, 0u64, false);
    for (i, text) in reader.lines().enumerate() {
        let number = i + 1;
        let text = text.map_err(|e| ReplayError::io(path, e))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(&text).map_err(|source| ReplayError::TraceParse {
            path: PathBuf::from(path),
            line: number,
            source,
        })?;
        let Some(r) = replayer.as_mut() else {
            let Line::Header(header) = line else {
                return Err(invalid(number, "the first line must be the header".into()));
            };
            if header.format != FORMAT || !(OLDEST_VERSION..=VERSION).contains(&header.version) {
                return Err(invalid(
                    number,
                    format!(
                        "not a {FORMAT} file of version {OLDEST_VERSION} to {VERSION} (format {:?}, version {})",
                        header.format, header.version
                    ),
                ));
            }
            filter.check_version(header.version)?;
            let mut settings = header.policy_settings;
            settings.seed = seed.unwrap_or(settings.seed);
            (live_policy, used_seed) = (header.policy, settings.seed);
            let mut r = Replayer {
                kinds: policies.to_vec(),
                settings,
                models: BTreeMap::new(),
                tallies: policies.iter().map(|_| Tally::default()).collect(),
                live: Tally::default(),
                counts: IndexCounts::default(),
                filter: filter.clone(),
            };
            for worker in header.workers {
                r.model(&worker.model, worker.block_size)?;
            }
            replayer = Some(r);
            continue;
        };
        if let Line::Trailer(trailer) = &line {
            (dropped, complete) = (trailer.dropped, trailer.complete);
        } else {
            records += 1;
            complete = false;
        }
        r.apply(line).map_err(|e| invalid(number, e.to_string()))?;
    }
    let Some(r) = replayer else {
        return Err(invalid(0, "the recording is empty".into()));
    };
    let mut reports = vec![r.live.report(format!("live ({live_policy})"))];
    for (kind, tally) in policies.iter().zip(r.tallies) {
        reports.push(tally.report(kind.as_str().to_owned()));
    }
    Ok(EventsReport {
        recording: path.display().to_string(),
        seed: used_seed,
        live_policy,
        complete,
        dropped,
        records,
        filter: filter.describe(),
        index: r.counts,
        policies: reports,
    })
}

impl EventsReport {
    /// The comparison table, one row per policy (the live decisions first).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kv-event replay: {} ({} records{}; index: {} snapshots, {} events, {} gaps)",
            self.recording,
            self.records,
            if self.complete {
                String::new()
            } else {
                format!(", INCOMPLETE: {} dropped", self.dropped)
            },
            self.index.snapshots,
            self.index.applied,
            self.index.gaps,
        );
        if let Some(filter) = &self.filter {
            let _ = writeln!(
                s,
                "decisions of {filter} only (every request replayed, these counted)"
            );
        }
        let header = [
            "policy",
            "decisions",
            "fail",
            "agree",
            "cached p50",
            "cached p99",
            "cached mean",
            "hit rate",
            "spread",
        ];
        let widths = [16, 9, 5, 7, 10, 10, 11, 8, 6];
        let mut line = String::new();
        for (h, w) in header.iter().zip(widths) {
            let _ = write!(line, "{h:>w$} ");
        }
        let _ = writeln!(s, "{}", line.trim_end());
        let _ = writeln!(s, "{}", "-".repeat(line.trim_end().len()));
        for p in &self.policies {
            let cells = [
                p.policy.clone(),
                p.decisions.to_string(),
                p.failures.to_string(),
                format!("{:.1}%", p.agreement * 100.0),
                format!("{:.0}", p.cached_blocks.p50),
                format!("{:.0}", p.cached_blocks.p99),
                format!("{:.1}", p.cached_blocks.mean),
                format!("{:.1}%", p.hit_rate * 100.0),
                format!("{:.2}", p.load_spread),
            ];
            let mut row = String::new();
            for (c, w) in cells.iter().zip(widths) {
                let _ = write!(row, "{c:>w$} ");
            }
            let _ = writeln!(s, "{}", row.trim_end());
        }
        s
    }

    pub fn to_json(&self) -> Result<String, ReplayError> {
        serde_json::to_string_pretty(self).map_err(|e| ReplayError::Report(e.to_string()))
    }

    pub fn to_csv(&self) -> String {
        let mut s = String::from(
            "policy,decisions,failures,agreement,cached_blocks_p50,cached_blocks_p90,\
             cached_blocks_p99,cached_blocks_mean,prompt_tokens,cached_tokens,hit_rate,load_spread\n",
        );
        for p in &self.policies {
            let c = &p.cached_blocks;
            let _ = writeln!(
                s,
                "{},{},{},{:.5},{},{},{},{:.3},{},{},{:.5},{:.3}",
                p.policy,
                p.decisions,
                p.failures,
                p.agreement,
                c.p50,
                c.p90,
                c.p99,
                c.mean,
                p.prompt_tokens,
                p.cached_tokens,
                p.hit_rate,
                p.load_spread
            );
        }
        s
    }

    /// Writes `<stem>.json` and `<stem>.csv` into `dir`.
    pub fn write_files(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>, ReplayError> {
        std::fs::create_dir_all(dir).map_err(|e| ReplayError::io(dir, e))?;
        let json = dir.join(format!("{stem}.json"));
        let csv = dir.join(format!("{stem}.csv"));
        std::fs::write(&json, self.to_json()?).map_err(|e| ReplayError::io(&json, e))?;
        std::fs::write(&csv, self.to_csv()).map_err(|e| ReplayError::io(&csv, e))?;
        Ok(vec![json, csv])
    }
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
