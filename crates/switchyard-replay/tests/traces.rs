//! Replays of the shared traces: DAG semantics on the Weka fixture, determinism, and KV-aware
//! routing against round-robin on a Mooncake slice. The traces are read from the workspace's
//! sibling `shared/data` directory.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use support::{cluster, shared, weka_sessions};

use switchyard_replay::workload::mooncake::{self, MooncakeWorkload};
use switchyard_replay::workload::weka::{self, WekaConfig, WekaWorkload};
use switchyard_replay::{Report, progress_bar, replay_offline};
use switchyard_router::PolicyKind;

fn hidden() -> indicatif::ProgressBar {
    indicatif::ProgressBar::hidden()
}

#[test]
fn weka_fixture_subagent_starts_after_its_launch_point_and_parent_joins() {
    let traces = weka::load(&shared("agentx/fixtures/weka-two-plays.jsonl"), None).unwrap();
    assert_eq!(traces.len(), 2);
    let mut workload = WekaWorkload::new(
        traces,
        WekaConfig {
            concurrency: 1,
            ..WekaConfig::default()
        },
    )
    .unwrap();
    let config = cluster(PolicyKind::Kv, 4, 1024, 0);
    let run = replay_offline(&mut workload, &config, 1.0, &hidden()).unwrap();
    let log = workload.log();
    // play-a: parent call, then its subagent's call; play-b (out = 0 is sent as 1 token).
    assert_eq!(log.len(), 3);
    assert_eq!(run.summary.requests_completed, 3);
    assert_eq!(run.summary.sessions_completed, 2);
    let parent = &log[0];
    let sub = &log[1];
    assert_eq!((parent.trace.as_str(), parent.subagent), ("play-a", None));
    assert_eq!((sub.trace.as_str(), sub.subagent), ("play-a", Some(1)));
    // The subagent is reached only after the parent's first call completed.
    assert!(sub.sent_at >= parent.finished_at.unwrap());
    // The next session starts only after the whole tree (subagent included) drained.
    let next = &log[2];
    assert_eq!(next.trace, "play-b");
    assert!(next.sent_at >= sub.finished_at.unwrap());
    assert_eq!(run.run.records[2].output_tokens, 1);
}

#[test]
fn weka_sample_parent_turn_waits_for_its_subagents() {
    let traces = weka::load(
        &shared("agentx/weka_kv_cache_tester/sample_20.jsonl.gz"),
        None,
    )
    .unwrap();
    assert_eq!(traces.len(), 20);
    // Keep the session with subagents (trace_0003) and drop most of its calls' weight by
    // replaying it alone with no think time.
    let with_subs: Vec<_> = traces
        .into_iter()
        .filter(|t| {
            t.entries
                .iter()
                .any(|e| matches!(e, weka::WekaEntry::Subagent(_)))
        })
        .take(1)
        .collect();
    let mut workload = WekaWorkload::new(
        with_subs,
        WekaConfig {
            time_scale: 0.0,
            ..WekaConfig::default()
        },
    )
    .unwrap();
    let config = cluster(PolicyKind::Kv, 64, 16_384, 0);
    replay_offline(&mut workload, &config, 1.0, &hidden()).unwrap();
    let log = workload.log();
    let mut checked = 0;
    for (i, entry) in log.iter().enumerate() {
        let Some(sub) = entry.subagent else { continue };
        // The next parent call sent after this subagent's calls starts after its last one ended.
        let last_of_sub = log
            .iter()
            .filter(|l| l.subagent == Some(sub) && l.session == entry.session)
            .filter_map(|l| l.finished_at)
            .max()
            .unwrap();
        if let Some(next_parent) = log[i..].iter().find(|l| l.subagent.is_none()) {
            assert!(
                next_parent.sent_at >= last_of_sub,
                "parent call before its join"
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

fn mooncake_report(policy: PolicyKind, seed: u64, limit: usize) -> Report {
    let path = shared("traces/mooncake/conversation_trace.jsonl");
    let records = mooncake::load(&path, Some(limit)).unwrap();
    let mut workload = MooncakeWorkload::new(records, 1.0).unwrap();
    let config = cluster(policy, 512, 1024, seed);
    let run = replay_offline(&mut workload, &config, 1.0, &hidden()).unwrap();
    Report {
        workload: "mooncake".into(),
        trace: "slice".into(),
        mode: "offline".into(),
        level_kind: "speed".into(),
        seed,
        settings: serde_json::Value::Null,
        runs: vec![run.summary],
    }
}

#[test]
fn same_seed_gives_a_byte_identical_report() {
    let a = mooncake_report(PolicyKind::Random, 7, 400)
        .to_json()
        .unwrap();
    let b = mooncake_report(PolicyKind::Random, 7, 400)
        .to_json()
        .unwrap();
    assert_eq!(a, b);
    let c = mooncake_report(PolicyKind::Random, 8, 400)
        .to_json()
        .unwrap();
    assert_ne!(a, c, "the random policy's seed should change the run");
}

#[test]
fn kv_routing_finds_more_cache_than_round_robin_on_mooncake() {
    let kv = mooncake_report(PolicyKind::Kv, 0, 1500);
    let rr = mooncake_report(PolicyKind::RoundRobin, 0, 1500);
    let (kv, rr) = (&kv.runs[0], &rr.runs[0]);
    assert_eq!(kv.requests_completed, 1500);
    assert_eq!(rr.requests_completed, 1500);
    assert!(
        kv.cache_hit_rate > rr.cache_hit_rate,
        "kv {} vs round-robin {}",
        kv.cache_hit_rate,
        rr.cache_hit_rate
    );
}

#[test]
fn reports_write_json_csv_and_svg() {
    let report = mooncake_report(PolicyKind::Kv, 0, 100);
    let dir = tempfile::tempdir().unwrap();
    let files = report.write_files(dir.path(), "slice").unwrap();
    assert_eq!(files.len(), 4);
    let csv = std::fs::read_to_string(&files[1]).unwrap();
    assert_eq!(csv.lines().count(), 2);
    let svg = std::fs::read_to_string(&files[2]).unwrap();
    assert!(svg.contains("<svg") && svg.contains("kv"));
    let png = std::fs::read(&files[3]).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG file");
    assert!(
        png.len() > 10_000,
        "the PNG has content ({} bytes)",
        png.len()
    );
    assert!(report.table().contains("kv"));
    let _ = progress_bar(Some(1), "x".into());
}

/// Two sessions of the sample corpus at concurrency 2, back to back on a small cache, under
/// `policy`.
fn weka_floor_run(policy: PolicyKind) -> switchyard_replay::OfflineRun {
    let mut workload = weka_sessions("weka_kv_cache_tester/sample_20.jsonl.gz", 2, 2, 0.0);
    let config = cluster(policy, 64, 4096, 0);
    replay_offline(&mut workload, &config, 2.0, &hidden()).unwrap()
}

#[test]
fn no_request_reaches_its_first_token_before_its_ttft_floor() {
    let kv = weka_floor_run(PolicyKind::Kv);
    let rr = weka_floor_run(PolicyKind::RoundRobin);
    for run in [&kv, &rr] {
        let records = &run.run.records;
        assert_eq!(run.run.ttft_floor_us.len(), records.len());
        let mut at_floor = 0;
        for (r, &floor) in records.iter().zip(&run.run.ttft_floor_us) {
            let ttft = r.first_token.unwrap() - r.arrival;
            // The cluster's clock drops each step's sub-microsecond part, the floor only its
            // total's: 1 µs of slack per prefill chunk (8,192 tokens).
            let slack = r.prompt_tokens / 8192 + 1;
            assert!(
                ttft + slack >= floor,
                "request {}: ttft {ttft} < floor {floor}",
                r.id
            );
            at_floor += usize::from(ttft <= floor + slack);
        }
        // The first request of the run meets an idle cluster with nothing cached: its floor.
        let first = &records[0];
        let ttft = first.first_token.unwrap() - first.arrival;
        assert!(ttft + first.prompt_tokens / 8192 + 1 >= run.run.ttft_floor_us[0]);
        assert!(ttft <= run.run.ttft_floor_us[0]);
        assert!(at_floor >= 1);
        let floor = run.summary.ttft_floor_ms.unwrap();
        // Within the per-chunk slack above (well under 0.1 ms).
        let ttft = run.summary.ttft_ms;
        assert!(floor.p99 <= ttft.p99 + 0.1 && floor.p50 <= ttft.p50 + 0.1);
        assert!(floor.mean <= ttft.mean + 0.1);
    }
}
