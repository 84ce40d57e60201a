//! Replays whose every figure is pinned: each case's step and event counts, end time, per-worker
//! stats, summary and a digest of every request record (and token gap) must match
//! `tests/golden/<case>.json`, written by the replayer before its speed work. A change to the
//! simulator, the cluster loop or the router that moves any request by one microsecond fails
//! here; a deliberate change of behaviour re-blesses the file with
//! `SWITCHYARD_BLESS=1 cargo nextest run -p switchyard-replay --test it golden::` and says why in
//! its commit.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::PathBuf;

use support::{cluster, shared, weka_sessions};

use serde_json::{Value, json};
use switchyard_core::rng::splitmix;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::workload::mix::{MixConfig, MixWorkload};
use switchyard_replay::workload::mooncake::{self, MooncakeWorkload};
use switchyard_replay::{
    Cluster, ClusterConfig, ClusterRun, DisaggConfig, DisaggMode, Summary, Workload,
};
use switchyard_router::{PolicyConfig, PolicyKind};

/// Folds every field of every record and gap into one number.
fn digest(run: &ClusterRun) -> String {
    let mut h = 0u64;
    let mut put = |x: u64| h = splitmix(h ^ x);
    for r in &run.records {
        for x in [
            r.id,
            u64::from(r.worker),
            r.arrival,
            r.first_token.map_or(u64::MAX, |t| t),
            r.finished.map_or(u64::MAX, |t| t),
            r.prompt_tokens,
            r.cached_tokens,
            r.output_tokens,
            u64::from(r.ok),
        ] {
            put(x);
        }
    }
    for g in &run.token_gaps {
        put(u64::from(g.prompt_tokens) << 32 | u64::from(g.gap_us));
    }
    format!("{h:016x}")
}

fn fingerprint(workload: &mut dyn Workload, config: &ClusterConfig) -> Value {
    let bar = indicatif::ProgressBar::hidden();
    let run = Cluster::new(config.clone())
        .unwrap()
        .run(workload, &bar)
        .unwrap();
    let summary = Summary::from_records(
        config.policy.as_str(),
        1.0,
        config.workers,
        workload.sessions_completed(),
        &run.records,
    );
    json!({
        "requests": run.records.len(),
        "steps": run.steps,
        "kv_events": run.kv_events,
        "end_us": run.end,
        "records_digest": digest(&run),
        "workers": run.workers,
        "disagg": run.disagg,
        "summary": summary,
    })
}

fn mooncake_case(rows: usize, config: &ClusterConfig) -> Value {
    let records = mooncake::load(
        &shared("traces/mooncake/conversation_trace.jsonl"),
        Some(rows),
    )
    .unwrap();
    let mut workload = MooncakeWorkload::new(records, 1.0).unwrap();
    fingerprint(&mut workload, config)
}

/// Compares `got` with `tests/golden/<name>.json`, or writes it there when blessing.
pub(crate) fn check(name: &str, got: Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.json"));
    // Compared as text: serde_json prints every f64 exactly (shortest round trip) but does not
    // parse every one back to the same bits.
    let got = serde_json::to_string_pretty(&got).unwrap() + "\n";
    if std::env::var_os("SWITCHYARD_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (bless with SWITCHYARD_BLESS=1)", path.display()));
    // Both texts parsed alike (the same printed f64 reads back to the same bits), compared as
    // values: key order depends on serde_json's `preserve_order`, which the workspace's
    // feature unification turns on in some builds and not in others.
    let parse = |text: &str| serde_json::from_str::<Value>(text).unwrap();
    assert_eq!(parse(&got), parse(&want), "{name}\ngot: {got}");
}

/// The benchmark's shape (64-token blocks) with a small cache, so that eviction and
/// preemption happen, under each policy.
fn mooncake_policy(policy: PolicyKind) -> Value {
    mooncake_case(120, &cluster(policy, 64, 1024, 5))
}

#[test]
fn mooncake_kv() {
    check("mooncake-kv", mooncake_policy(PolicyKind::Kv));
}

#[test]
fn mooncake_round_robin() {
    check(
        "mooncake-round-robin",
        mooncake_policy(PolicyKind::RoundRobin),
    );
}

#[test]
fn mooncake_random() {
    check("mooncake-random", mooncake_policy(PolicyKind::Random));
}

#[test]
fn mooncake_approx_kv() {
    check("mooncake-approx-kv", mooncake_policy(PolicyKind::ApproxKv));
}

/// Dynamo's KV router cost (the comparison policy of issue 45) through the same cluster.
#[test]
fn mooncake_dynamo_kv() {
    check("mooncake-dynamo-kv", mooncake_policy(PolicyKind::DynamoKv));
}

/// The SGLang router's cache-aware policy (issue 45's other comparison) through the same cluster.
#[test]
fn mooncake_sglang_ca() {
    check("mooncake-sglang-ca", mooncake_policy(PolicyKind::SglangCa));
}

/// Delayed events and periodic load reports take the other paths of the cluster loop.
#[test]
fn mooncake_kv_delayed_events_and_reports() {
    let config = ClusterConfig {
        event_delay_us: 3_000,
        load_report_interval_us: 50_000,
        ..cluster(PolicyKind::Kv, 64, 2048, 1)
    };
    check("mooncake-kv-delayed", mooncake_case(120, &config));
}

/// Closed-loop agent sessions with subagents.
#[test]
fn agentx_sessions() {
    let mut workload = weka_sessions("weka_kv_cache_tester/dev_120.jsonl.gz", 2, 2, 0.1);
    check(
        "agentx-kv",
        fingerprint(&mut workload, &cluster(PolicyKind::Kv, 64, 4096, 2)),
    );
}

/// Disaggregated serving: exports, transfers, imports, token gaps.
fn disaggregated(mode: DisaggMode) -> Value {
    let mut disagg = DisaggConfig::split(1, 3, mode);
    disagg.min_uncached_tokens = 2048;
    let config = ClusterConfig {
        disagg: Some(disagg),
        token_gaps: true,
        sim: SimConfig {
            seed: 3,
            ..SimConfig::default()
        },
        policy_config: PolicyConfig::default(),
        ..cluster(PolicyKind::Kv, 64, 1024, 3)
    };
    let mut workload = MixWorkload::new(&MixConfig {
        seconds: 10.0,
        chat_rate: 4.0,
        long_rate: 0.4,
        ..MixConfig::default()
    })
    .unwrap();
    fingerprint(&mut workload, &config)
}

#[test]
fn mix_disaggregated_enforce() {
    check("mix-enforce", disaggregated(DisaggMode::Enforce));
}

#[test]
fn mix_disaggregated_auto() {
    check("mix-auto", disaggregated(DisaggMode::Auto));
}
