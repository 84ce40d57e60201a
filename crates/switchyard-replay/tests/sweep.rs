//! The sweep's verdicts pinned (issue 45): on small slices of both kinds of shared trace, where
//! `kv` leads, ties or trails approx-kv, dynamo-kv and sglang-ca on hit rate and TTFT p99 in
//! each cell of worker count × arrival rate must match `tests/golden/sweep-<case>.json`. Only
//! the verdicts are pinned (which policy beats kv on which metric, the tally), not the
//! figures, which the replay goldens (`golden::`) pin. A change to a policy that flips a
//! verdict fails here; a deliberate one re-blesses with
//! `SWITCHYARD_BLESS=1 cargo nextest run -p switchyard-replay --test it sweep::` and says in
//! its commit which verdicts moved and why.
//!
//! The slices are small because a debug build replays about 3 M prompt tokens a second and a
//! sweep runs every policy in every cell: the first 60 Mooncake requests, and four short whole
//! sessions of each agent corpus, on caches small enough to evict.

use serde_json::{Value, json};
use switchyard_replay::sweep::{SweepConfig, SweepReport, SweepTrace, TraceSource, run_sweep};
use switchyard_replay::workload::mooncake;
use switchyard_replay::workload::weka::{self, WekaConfig};
use switchyard_router::PolicyKind;

use crate::golden::check;
use crate::support::{cluster, shared};

/// The peers of issue 45 beside kv.
const POLICIES: [PolicyKind; 4] = [
    PolicyKind::Kv,
    PolicyKind::ApproxKv,
    PolicyKind::DynamoKv,
    PolicyKind::SglangCa,
];

fn sweep(trace: SweepTrace, workers: &[usize], rates: &[f64], kv_blocks: u64) -> SweepReport {
    let config = SweepConfig {
        policies: POLICIES.to_vec(),
        workers: workers.to_vec(),
        rates: rates.to_vec(),
        cluster: cluster(PolicyKind::Kv, 64, kv_blocks, 0),
        tie: 0.02,
        replicas: 1,
    };
    let report = run_sweep(&[trace], &config, 1, |_, _| {
        indicatif::ProgressBar::hidden()
    })
    .unwrap();
    // Shown by nextest when the verdicts differ: the figures behind them.
    eprintln!("{}", report.table());
    report
}

/// What is pinned: each cell's verdict, standings and the policies that beat kv, and the
/// tally.
fn verdicts(report: &SweepReport) -> Value {
    let cells: Vec<Value> = report
        .cells
        .iter()
        .map(|c| {
            let j = &c.judgement;
            json!({
                "cell": format!("{} workers={} rate={}", c.trace, c.workers, c.rate),
                "verdict": j.verdict,
                "hit_rate": j.hit_rate,
                "ttft_p99": j.ttft_p99,
                "behind": j
                    .behind
                    .iter()
                    .map(|b| format!("{} on {}", b.policy, b.metric.as_str()))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "tally": report.tally, "cells": cells })
}

fn mooncake_slice() -> SweepTrace {
    let path = "traces/mooncake/conversation_trace.jsonl";
    SweepTrace {
        name: "mooncake".into(),
        path: path.into(),
        source: TraceSource::Mooncake(mooncake::load(&shared(path), Some(60)).unwrap()),
    }
}

/// The sessions named `ids` among the first `first` of an agent corpus, at a base concurrency
/// of 2 with think times cut tenfold.
fn agent_sessions(corpus: &str, first: usize, ids: &[&str]) -> SweepTrace {
    let path = format!("agentx/weka_kv_cache_tester/{corpus}.jsonl.gz");
    let mut traces = weka::load(&shared(&path), Some(first)).unwrap();
    traces.retain(|t| ids.contains(&t.id.as_str()));
    assert_eq!(
        traces.len(),
        ids.len(),
        "every named session is in the slice"
    );
    SweepTrace {
        name: corpus.into(),
        path,
        source: TraceSource::Agentx {
            traces,
            config: WekaConfig {
                concurrency: 2,
                time_scale: 0.1,
                ..WekaConfig::default()
            },
        },
    }
}

#[test]
fn mooncake_two_workers() {
    let report = sweep(mooncake_slice(), &[2], &[1.0, 3.0], 1024);
    check("sweep-mooncake-2w", verdicts(&report));
}

#[test]
fn mooncake_four_workers() {
    let report = sweep(mooncake_slice(), &[4], &[1.0, 3.0], 1024);
    check("sweep-mooncake-4w", verdicts(&report));
}

fn dev_120_sessions() -> SweepTrace {
    agent_sessions(
        "dev_120",
        52,
        &["trace_0022", "trace_0026", "trace_0057", "trace_0058"],
    )
}

fn dev_b_120_sessions() -> SweepTrace {
    agent_sessions(
        "dev_b_120",
        40,
        &["trace_0248", "trace_0251", "trace_0265", "trace_0288"],
    )
}

// One cell per agent-session test: a closed-loop cell costs a debug build as much as two
// Mooncake cells.

#[test]
fn dev_120_two_workers_rate_1() {
    let report = sweep(dev_120_sessions(), &[2], &[1.0], 1024);
    check("sweep-dev_120-2w-rate1", verdicts(&report));
}

#[test]
fn dev_120_two_workers_rate_2() {
    let report = sweep(dev_120_sessions(), &[2], &[2.0], 1024);
    check("sweep-dev_120-2w-rate2", verdicts(&report));
}

#[test]
fn dev_b_120_two_workers_rate_1() {
    let report = sweep(dev_b_120_sessions(), &[2], &[1.0], 1024);
    check("sweep-dev_b_120-2w-rate1", verdicts(&report));
}

#[test]
fn dev_b_120_two_workers_rate_2() {
    let report = sweep(dev_b_120_sessions(), &[2], &[2.0], 1024);
    check("sweep-dev_b_120-2w-rate2", verdicts(&report));
}

/// Replicas of an agent-session cell scale its think times (`sweep::replica_timing`): the
/// closed loop's calls arrive at other moments, so their first tokens move, and the cell keeps
/// each policy's replica with the median TTFT p99.
#[test]
fn agent_replicas_scale_the_think_times() {
    let config = SweepConfig {
        policies: vec![PolicyKind::Kv, PolicyKind::RoundRobin],
        workers: vec![2],
        rates: vec![2.0],
        cluster: cluster(PolicyKind::Kv, 64, 1024, 0),
        tie: 0.02,
        replicas: 3,
    };
    let report = run_sweep(&[dev_b_120_sessions()], &config, 1, |_, _| {
        indicatif::ProgressBar::hidden()
    })
    .unwrap();
    let cell = &report.cells[0];
    for run in &cell.runs {
        let mut p99: Vec<f64> = (cell.replicas.iter())
            .filter(|r| r.policy == run.label)
            .map(|r| r.ttft_p99_ms.unwrap())
            .collect();
        assert_eq!(p99.len(), 3);
        assert!(p99[0] != p99[1] && p99[0] != p99[2], "{p99:?}");
        p99.sort_by(f64::total_cmp);
        assert_eq!(run.ttft_ms.p99, p99[1]);
    }
}
