//! The policy sweep (issue 45): every policy on every trace across worker counts and arrival
//! rates, under, at and over capacity, and in each cell where `kv` stands against the others
//! on cache hit rate and TTFT p99 ([`verdict`]), rendered as a table, a Markdown grid, CSV and
//! JSON ([`render`]).
//!
//! Each run is an ordinary offline replay ([`crate::replay_offline`]) on the simulated
//! cluster; the sweep only chooses the runs and compares their summaries. The rate means what
//! a trace's load means:
//!
//! - **Mooncake** (open loop): the recorded timestamps divided by the rate (`--speed`).
//! - **Agent sessions** (closed loop): the rate times a base concurrency, rounded, at least 1
//!   (`--concurrency`): twice the live session trees send about twice the calls while the
//!   fleet keeps up, and queue them when it does not.
//!
//! With `replicas` above 1 each policy runs several times per cell, each replica's timing
//! stretched or shrunk by 0.1 % steps ([`replica_timing`]: the agent traces' think times, the
//! Mooncake arrival times), and the cell keeps, per policy, the replica with the median TTFT
//! p99. One run's p99 is decided by a few dozen calls and moves by 5–70 % under a 0.2 % change
//! of timing (`docs/results/sweep-issue45-replicas.md`); the median of several is what a
//! verdict can rest on. Replica 0 is the unperturbed run, so one replica is today's sweep.

pub mod render;
pub mod verdict;

use indicatif::ProgressBar;
use serde::Serialize;
use switchyard_router::PolicyKind;

use crate::error::ReplayError;
use crate::metrics::Summary;
use crate::workload::Workload;
use crate::workload::mooncake::{MooncakeRecord, MooncakeWorkload};
use crate::workload::weka::{WekaConfig, WekaTrace, WekaWorkload};
use crate::{ClusterConfig, parallel, replay_offline};

pub use verdict::{Beaten, Judgement, Metric, Standing, Verdict};

/// The policy every cell judges.
pub const REFERENCE: PolicyKind = PolicyKind::Kv;

/// Issue 45's tie band: figures within 2 % of each other are level.
pub const DEFAULT_TIE: f64 = 0.02;

/// A loaded trace and how a rate becomes its load.
#[derive(Debug, Clone)]
pub struct SweepTrace {
    /// Short name for the report (`mooncake`, `dev_120`).
    pub name: String,
    /// Where it was read from, as given.
    pub path: String,
    pub source: TraceSource,
}

#[derive(Debug, Clone)]
pub enum TraceSource {
    /// Open loop at `rate` × the recorded arrival rate.
    Mooncake(Vec<MooncakeRecord>),
    /// Closed loop at `rate` × `config.concurrency` live session trees.
    Agentx {
        traces: Vec<WekaTrace>,
        config: WekaConfig,
    },
}

impl SweepTrace {
    /// The load level `rate` becomes: a speed factor, or a concurrency.
    pub fn level(&self, rate: f64) -> f64 {
        match &self.source {
            TraceSource::Mooncake(_) => rate,
            TraceSource::Agentx { config, .. } => concurrency(config.concurrency, rate) as f64,
        }
    }

    /// `speed` or `concurrency`.
    pub fn level_kind(&self) -> &'static str {
        match &self.source {
            TraceSource::Mooncake(_) => "speed",
            TraceSource::Agentx { .. } => "concurrency",
        }
    }

    /// Requests (Mooncake) or sessions (agent traces) one run replays.
    pub fn size(&self) -> usize {
        match &self.source {
            TraceSource::Mooncake(records) => records.len(),
            TraceSource::Agentx { traces, config } => config.sessions.unwrap_or(traces.len()),
        }
    }

    /// The trace as the report names it.
    fn info(&self) -> TraceInfo {
        let agent = match &self.source {
            TraceSource::Agentx { config, .. } => Some(config),
            TraceSource::Mooncake(_) => None,
        };
        TraceInfo {
            name: self.name.clone(),
            path: self.path.clone(),
            level_kind: self.level_kind().to_owned(),
            size: self.size(),
            concurrency: agent.map(|c| c.concurrency),
            time_scale: agent.map(|c| c.time_scale),
            max_gap_s: agent.map(|c| c.max_gap_s),
        }
    }

    /// The workload at `rate`, its timing scaled by `timing` ([`replica_timing`]).
    fn workload(&self, rate: f64, timing: f64) -> Result<Box<dyn Workload>, ReplayError> {
        Ok(match &self.source {
            // Arrival times divided by the speed: a faster replica arrives `timing` sooner.
            TraceSource::Mooncake(records) => {
                Box::new(MooncakeWorkload::new(records.clone(), rate / timing)?)
            }
            TraceSource::Agentx { traces, config } => Box::new(WekaWorkload::new(
                traces.clone(),
                WekaConfig {
                    concurrency: concurrency(config.concurrency, rate),
                    time_scale: config.time_scale * timing,
                    ..config.clone()
                },
            )?),
        })
    }
}

/// How replica `replica` scales its trace's timing: 1 for replica 0, then 0.999, 1.001,
/// 0.998, 1.002, … (a step of 0.1 % each way in turn).
pub fn replica_timing(replica: usize) -> f64 {
    let step = replica.div_ceil(2) as f64 * REPLICA_STEP;
    if replica % 2 == 1 {
        1.0 - step
    } else {
        1.0 + step
    }
}

/// The timing step between replicas ([`replica_timing`]).
pub const REPLICA_STEP: f64 = 0.001;

/// Most replicas a sweep runs per policy and cell.
pub const MAX_REPLICAS: usize = 9;

fn concurrency(base: usize, rate: f64) -> usize {
    ((base as f64 * rate).round() as usize).max(1)
}

/// What to sweep.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// Policies to run in every cell; `kv` (the judged one) among them with at least one other.
    pub policies: Vec<PolicyKind>,
    /// Worker counts.
    pub workers: Vec<usize>,
    /// Arrival-rate multipliers (1 = the recorded rate, or the base concurrency).
    pub rates: Vec<f64>,
    /// Every run's cluster; its `workers` and `policy` are the cell's and the run's.
    pub cluster: ClusterConfig,
    /// Figures within this share of each other are level (issue 45: 0.02).
    pub tie: f64,
    /// Runs per policy per cell, odd, each at its [`replica_timing`]; the cell keeps the one
    /// with the median TTFT p99 (1: the unperturbed run alone).
    pub replicas: usize,
}

impl SweepConfig {
    /// Refuses a sweep that could not judge kv or has an empty axis.
    pub fn validate(&self) -> Result<(), ReplayError> {
        let bad = |msg: String| Err(ReplayError::InvalidConfig(msg));
        if !self.policies.contains(&REFERENCE) {
            return bad(format!(
                "the sweep judges {}: put it in --policies",
                REFERENCE.as_str()
            ));
        }
        if self.policies.len() < 2 {
            return bad(format!(
                "the sweep compares {} with other policies: add at least one to --policies",
                REFERENCE.as_str()
            ));
        }
        for (i, p) in self.policies.iter().enumerate() {
            if self.policies[..i].contains(p) {
                return bad(format!("--policies names {} twice", p.as_str()));
            }
        }
        if self.workers.is_empty() || self.workers.contains(&0) {
            return bad(format!(
                "--workers needs worker counts of at least 1, got {:?}",
                self.workers
            ));
        }
        if self.rates.is_empty() || self.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return bad(format!(
                "--rates needs positive arrival-rate multipliers, got {:?}",
                self.rates
            ));
        }
        if !(self.tie.is_finite() && (0.0..1.0).contains(&self.tie)) {
            return bad(format!("--tie must be in [0, 1), got {}", self.tie));
        }
        if self.replicas.is_multiple_of(2) || self.replicas > MAX_REPLICAS {
            return bad(format!(
                "--replicas must be odd, from 1 to {MAX_REPLICAS} (the median is then one run's), got {}",
                self.replicas
            ));
        }
        Ok(())
    }

    /// The label `policy`'s runs carry (the policy's name, plus the cluster's variant).
    fn cluster_label(&self, policy: PolicyKind) -> String {
        ClusterConfig {
            policy,
            ..self.cluster.clone()
        }
        .label()
    }
}

/// A trace as the report names it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceInfo {
    pub name: String,
    pub path: String,
    /// `speed` (open loop) or `concurrency` (closed loop).
    pub level_kind: String,
    /// Requests or sessions per run.
    pub size: usize,
    /// Agent traces: live session trees at rate 1, think-time scale and gap cap (seconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_gap_s: Option<f64>,
}

/// One trace × worker count × rate, every policy run in it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepCell {
    pub trace: String,
    pub workers: usize,
    pub rate: f64,
    /// The load the rate became: speed factor or concurrency.
    pub level: f64,
    #[serde(flatten)]
    pub judgement: Judgement,
    /// One run per policy, in the sweep's policy order: with replicas, the one with the median
    /// TTFT p99.
    pub runs: Vec<Summary>,
    /// With more than one replica: every replica's figures, by policy then replica.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaFigures>,
}

/// One replica's judged figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaFigures {
    pub policy: String,
    pub replica: usize,
    /// Its timing factor ([`replica_timing`]).
    pub timing: f64,
    pub cache_hit_rate: f64,
    /// `None` when the run completed nothing.
    pub ttft_p99_ms: Option<f64>,
}

/// One policy's replicas in a cell, as the JSON lists them.
fn replica_figures(replicas: &[Summary]) -> impl Iterator<Item = ReplicaFigures> + '_ {
    replicas
        .iter()
        .enumerate()
        .map(|(replica, s)| ReplicaFigures {
            policy: s.label.clone(),
            replica,
            timing: replica_timing(replica),
            cache_hit_rate: s.cache_hit_rate,
            ttft_p99_ms: Metric::TtftP99.of(s),
        })
}

/// Of one policy's replicas in a cell, the one with the median TTFT p99 (a run that completed
/// nothing counts as the slowest; equal figures keep replica order).
fn median_run(replicas: Vec<Summary>) -> Option<Summary> {
    let mut ranked: Vec<(usize, Summary)> = replicas.into_iter().enumerate().collect();
    let p99 = |s: &Summary| Metric::TtftP99.of(s).unwrap_or(f64::INFINITY);
    ranked.sort_by(|a, b| p99(&a.1).total_cmp(&p99(&b.1)).then(a.0.cmp(&b.0)));
    let middle = ranked.len() / 2;
    ranked.into_iter().nth(middle).map(|(_, s)| s)
}

impl SweepCell {
    /// The run of `policy`'s label in this cell.
    pub fn run(&self, label: &str) -> Option<&Summary> {
        self.runs.iter().find(|r| r.label == label)
    }
}

/// Cells kv leads, ties and trails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub leads: usize,
    pub ties: usize,
    pub trails: usize,
}

impl Tally {
    pub fn of<'a>(cells: impl IntoIterator<Item = &'a SweepCell>) -> Self {
        let mut tally = Self::default();
        for cell in cells {
            match cell.judgement.verdict {
                Verdict::Leads => tally.leads += 1,
                Verdict::Ties => tally.ties += 1,
                Verdict::Trails => tally.trails += 1,
            }
        }
        tally
    }

    pub fn cells(&self) -> usize {
        self.leads + self.ties + self.trails
    }
}

/// Everything a sweep measured and judged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    /// The judged policy (`kv`).
    pub reference: String,
    pub tie: f64,
    /// Runs per policy per cell ([`SweepConfig::replicas`]).
    pub replicas: usize,
    pub policies: Vec<String>,
    pub workers: Vec<usize>,
    pub rates: Vec<f64>,
    pub traces: Vec<TraceInfo>,
    /// The cluster's settings every run shares, for reproduction.
    pub settings: serde_json::Value,
    pub tally: Tally,
    /// Trace by trace, then worker count, then rate, in the order given.
    pub cells: Vec<SweepCell>,
}

/// Runs every policy of `config` on every trace × worker count × rate, `threads` runs at once
/// (the figures do not depend on it), each with a progress bar from `bar(requests, label)`.
pub fn run_sweep(
    traces: &[SweepTrace],
    config: &SweepConfig,
    threads: usize,
    bar: impl Fn(Option<u64>, String) -> ProgressBar + Sync,
) -> Result<SweepReport, ReplayError> {
    config.validate()?;
    if traces.is_empty() {
        return Err(ReplayError::InvalidConfig("no trace to sweep".into()));
    }
    let mut cells: Vec<(usize, usize, f64)> = Vec::new();
    for t in 0..traces.len() {
        for &workers in &config.workers {
            for &rate in &config.rates {
                cells.push((t, workers, rate));
            }
        }
    }
    let policies = config.policies.len();
    let replicas = config.replicas;
    let jobs = cells.len() * policies * replicas;
    let summaries = parallel::run_ordered(jobs, parallel::threads_for(jobs, threads), |i| {
        let (t, workers, rate) = cells[i / (policies * replicas)];
        let replica = i % replicas;
        let trace = &traces[t];
        let cluster = ClusterConfig {
            workers,
            policy: config.policies[(i / replicas) % policies],
            ..config.cluster.clone()
        };
        let mut workload = trace.workload(rate, replica_timing(replica))?;
        let level = trace.level(rate);
        let replica_label = if replicas > 1 {
            format!(" replica {replica}")
        } else {
            String::new()
        };
        let progress = bar(
            workload.expected_requests(),
            format!(
                "{} {} w{workers} {}={level}{replica_label}",
                trace.name,
                cluster.label(),
                trace.level_kind()
            ),
        );
        let run = replay_offline(workload.as_mut(), &cluster, level, &progress)?;
        progress.finish_and_clear();
        Ok::<_, ReplayError>(run.summary)
    });
    // `validate` made sure kv is among the policies.
    let judged_at = config
        .policies
        .iter()
        .position(|&p| p == REFERENCE)
        .unwrap_or_default();
    let mut summaries = summaries.into_iter();
    let mut judged = Vec::with_capacity(cells.len());
    for &(t, workers, rate) in &cells {
        let mut runs = Vec::with_capacity(policies);
        let mut figures = Vec::new();
        for _ in 0..policies {
            let all = summaries
                .by_ref()
                .take(replicas)
                .collect::<Result<Vec<_>, _>>()?;
            if replicas > 1 {
                figures.extend(replica_figures(&all));
            }
            runs.extend(median_run(all));
        }
        let others: Vec<&Summary> = runs
            .iter()
            .enumerate()
            .filter_map(|(i, r)| (i != judged_at).then_some(r))
            .collect();
        let Some(reference) = runs.get(judged_at) else {
            return Err(ReplayError::InvalidConfig(
                "a sweep cell has fewer runs than policies".into(),
            ));
        };
        let judgement = verdict::judge(reference, &others, config.tie);
        judged.push(SweepCell {
            trace: traces[t].name.clone(),
            workers,
            rate,
            level: traces[t].level(rate),
            judgement,
            runs,
            replicas: figures,
        });
    }
    Ok(SweepReport {
        reference: config.cluster_label(REFERENCE),
        tie: config.tie,
        replicas: config.replicas,
        policies: config
            .policies
            .iter()
            .map(|&p| config.cluster_label(p))
            .collect(),
        workers: config.workers.clone(),
        rates: config.rates.clone(),
        traces: traces.iter().map(SweepTrace::info).collect(),
        settings: serde_json::json!({
            "sim": config.cluster.sim,
            "event_delay_us": config.cluster.event_delay_us,
            "load_report_interval_us": config.cluster.load_report_interval_us,
            "seed": config.cluster.policy_config.seed,
        }),
        tally: Tally::of(&judged),
        cells: judged,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use switchyard_core::BlockSize;
    use switchyard_engine_sim::SimConfig;

    use super::*;

    /// Twelve short requests, every second one sharing the first one's prefix.
    fn small_trace() -> SweepTrace {
        let records = (0..12u32)
            .map(|i| MooncakeRecord {
                timestamp: u64::from(i) * 200,
                input_length: 1024,
                output_length: 4,
                hash_ids: if i % 2 == 0 {
                    vec![1, 2]
                } else {
                    vec![100 + i, 200 + i]
                },
            })
            .collect();
        SweepTrace {
            name: "tiny".into(),
            path: "in memory".into(),
            source: TraceSource::Mooncake(records),
        }
    }

    fn config(policies: &[PolicyKind]) -> SweepConfig {
        SweepConfig {
            policies: policies.to_vec(),
            workers: vec![1, 2],
            rates: vec![1.0, 4.0],
            cluster: ClusterConfig {
                sim: SimConfig {
                    block_size: BlockSize::new(64).unwrap(),
                    num_device_blocks: 256,
                    ..SimConfig::default()
                },
                ..ClusterConfig::default()
            },
            tie: DEFAULT_TIE,
            replicas: 1,
        }
    }

    fn hidden(_: Option<u64>, _: String) -> ProgressBar {
        ProgressBar::hidden()
    }

    #[test]
    fn every_trace_worker_count_and_rate_is_a_cell_with_one_run_per_policy() {
        let policies = [PolicyKind::RoundRobin, PolicyKind::Kv, PolicyKind::ApproxKv];
        let report = run_sweep(&[small_trace()], &config(&policies), 2, hidden).unwrap();
        let cells: Vec<(usize, f64)> = report.cells.iter().map(|c| (c.workers, c.rate)).collect();
        assert_eq!(cells, [(1, 1.0), (1, 4.0), (2, 1.0), (2, 4.0)]);
        assert_eq!(report.policies, ["round-robin", "kv", "approx-kv"]);
        for cell in &report.cells {
            let labels: Vec<&str> = cell.runs.iter().map(|r| r.label.as_str()).collect();
            assert_eq!(labels, report.policies);
            assert!(cell.runs.iter().all(|r| r.workers == cell.workers));
            assert!(cell.runs.iter().all(|r| r.requests_completed == 12));
            // The verdict is the judgement of kv's run against the others in the cell.
            let kv = cell.run("kv").unwrap();
            let others: Vec<&Summary> = cell.runs.iter().filter(|r| r.label != "kv").collect();
            assert_eq!(cell.judgement, verdict::judge(kv, &others, DEFAULT_TIE));
        }
        assert_eq!(report.tally, Tally::of(&report.cells));
        assert_eq!(report.tally.cells(), 4);
        // One worker: every policy sends every request to it, so they all tie.
        assert!(
            report.cells[..2]
                .iter()
                .all(|c| c.judgement.verdict == Verdict::Ties),
            "{}",
            report.table()
        );
        // Threads do not change a figure.
        let serial = run_sweep(&[small_trace()], &config(&policies), 1, hidden).unwrap();
        assert_eq!(serial, report);
    }

    #[test]
    fn replicas_step_the_timing_and_keep_the_median_run() {
        let timings: Vec<f64> = (0..5).map(replica_timing).collect();
        assert_eq!(timings, [1.0, 0.999, 1.001, 0.998, 1.002]);

        let p99s = |runs: &[f64]| {
            runs.iter()
                .enumerate()
                .map(|(i, &p99)| {
                    let mut s = Summary::from_records(&format!("replica {i}"), 1.0, 4, 0, &[]);
                    s.requests_completed = 1;
                    s.ttft_ms.p99 = p99;
                    s
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            median_run(p99s(&[30.0, 10.0, 20.0])).unwrap().label,
            "replica 2"
        );
        // A run that completed nothing is the slowest; equal figures keep replica order.
        let mut none = p99s(&[5.0, 1.0, 2.0]);
        none[1].requests_completed = 0;
        assert_eq!(median_run(none).unwrap().label, "replica 0");
        assert_eq!(
            median_run(p99s(&[7.0, 7.0, 7.0])).unwrap().label,
            "replica 1"
        );

        // One worker at eight times the trace's rate: requests queue, so their first tokens
        // move with their arrivals.
        let policies = [PolicyKind::Kv, PolicyKind::RoundRobin];
        let queued = SweepConfig {
            workers: vec![1],
            rates: vec![8.0],
            ..config(&policies)
        };
        let one = run_sweep(&[small_trace()], &queued, 2, hidden).unwrap();
        let three = SweepConfig {
            replicas: 3,
            ..queued
        };
        let report = run_sweep(&[small_trace()], &three, 2, hidden).unwrap();
        assert_eq!(report.replicas, 3);
        assert!(one.cells.iter().all(|c| c.replicas.is_empty()));
        for (cell, single) in report.cells.iter().zip(&one.cells) {
            let listed: Vec<(&str, usize, f64)> = (cell.replicas.iter())
                .map(|r| (r.policy.as_str(), r.replica, r.timing))
                .collect();
            assert_eq!(
                listed,
                [
                    ("kv", 0, 1.0),
                    ("kv", 1, 0.999),
                    ("kv", 2, 1.001),
                    ("round-robin", 0, 1.0),
                    ("round-robin", 1, 0.999),
                    ("round-robin", 2, 1.001),
                ]
            );
            for run in &cell.runs {
                let of_policy: Vec<&ReplicaFigures> = (cell.replicas.iter())
                    .filter(|r| r.policy == run.label)
                    .collect();
                // Replica 0 is the unperturbed run, the one a single-replica sweep makes.
                let alone = single.run(&run.label).unwrap();
                assert_eq!(of_policy[0].ttft_p99_ms, Metric::TtftP99.of(alone));
                assert_eq!(of_policy[0].cache_hit_rate, alone.cache_hit_rate);
                // The cell keeps the replica with the median p99, and judges on it.
                let mut sorted: Vec<f64> =
                    of_policy.iter().map(|r| r.ttft_p99_ms.unwrap()).collect();
                // The replicas' arrivals moved: so did their first tokens.
                assert!(
                    sorted[0] != sorted[1] && sorted[1] != sorted[2],
                    "{sorted:?}"
                );
                sorted.sort_by(f64::total_cmp);
                assert_eq!(Metric::TtftP99.of(run), Some(sorted[1]));
            }
            let kv = cell.run("kv").unwrap();
            let others: Vec<&Summary> = cell.runs.iter().filter(|r| r.label != "kv").collect();
            assert_eq!(cell.judgement, verdict::judge(kv, &others, DEFAULT_TIE));
        }
        assert!(
            report
                .table()
                .contains("3 replicas with the median TTFT p99")
        );
    }

    #[test]
    fn an_agent_trace_turns_the_rate_into_live_sessions() {
        let trace = SweepTrace {
            name: "sessions".into(),
            path: String::new(),
            source: TraceSource::Agentx {
                traces: Vec::new(),
                config: WekaConfig {
                    concurrency: 8,
                    ..WekaConfig::default()
                },
            },
        };
        let levels: Vec<f64> = [0.05, 0.5, 1.0, 1.5, 3.0]
            .iter()
            .map(|&r| trace.level(r))
            .collect();
        assert_eq!(levels, [1.0, 4.0, 8.0, 12.0, 24.0]);
        assert_eq!(trace.level_kind(), "concurrency");
        assert_eq!(small_trace().level(1.5), 1.5);
    }

    #[test]
    fn a_sweep_that_cannot_judge_kv_is_refused_before_any_run() {
        let refused = |config: SweepConfig| {
            let err = run_sweep(&[small_trace()], &config, 1, |_, _| {
                panic!("no run may start")
            })
            .unwrap_err();
            assert!(matches!(err, ReplayError::InvalidConfig(_)), "{err}");
            err.to_string()
        };
        assert!(refused(config(&[PolicyKind::ApproxKv, PolicyKind::RoundRobin])).contains("kv"));
        assert!(refused(config(&[PolicyKind::Kv])).contains("at least one"));
        assert!(
            refused(SweepConfig {
                workers: vec![2, 0],
                ..config(&[PolicyKind::Kv, PolicyKind::Random])
            })
            .contains("--workers")
        );
        for replicas in [0, 2, MAX_REPLICAS + 2] {
            assert!(
                refused(SweepConfig {
                    replicas,
                    ..config(&[PolicyKind::Kv, PolicyKind::Random])
                })
                .contains("--replicas")
            );
        }
        assert!(
            refused(SweepConfig {
                rates: vec![f64::NAN],
                ..config(&[PolicyKind::Kv, PolicyKind::Random])
            })
            .contains("--rates")
        );
        let none = run_sweep(
            &[],
            &config(&[PolicyKind::Kv, PolicyKind::Random]),
            1,
            hidden,
        );
        assert!(none.unwrap_err().to_string().contains("no trace"));
    }
}
