//! Sub-agent placement on the simulated cluster: a small session tree (one parent call, then
//! three sub-agents sharing its 64-block prefix, each with 200 blocks of its own) on two
//! workers. The first sub-agent takes the hit on the parent's worker; with placement, the
//! next finds that worker saturated and goes to the other one with the prefix copied over the
//! workers' link, where without placement it recomputes it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::workload::weka::{
    WekaCall, WekaConfig, WekaEntry, WekaSubagent, WekaTrace, WekaWorkload,
};
use switchyard_replay::{ClusterConfig, OfflineRun, replay_offline};

const BLOCK: u32 = 16;
const PREFIX: u32 = 64;
const OWN: u32 = 200;

fn call(ids: Vec<u32>) -> WekaCall {
    WekaCall {
        t: 0.0,
        input: ids.len() as u64 * u64::from(BLOCK),
        output: 4,
        hash_ids: ids,
        api_time: 0.0,
    }
}

/// The parent's call, then three sub-agents launched together, each one call on the parent's
/// prefix plus blocks of its own.
fn tree() -> WekaTrace {
    let prefix: Vec<u32> = (0..PREFIX).collect();
    let mut entries = vec![WekaEntry::Call(call(prefix.clone()))];
    for k in 0..3u32 {
        let mut ids = prefix.clone();
        ids.extend((0..OWN).map(|i| 10_000 * (k + 1) + i));
        entries.push(WekaEntry::Subagent(WekaSubagent {
            t: 0.0,
            agent_id: format!("sub-{k}"),
            is_async: false,
            calls: vec![call(ids)],
        }));
    }
    WekaTrace {
        id: "tree".into(),
        block_size: BLOCK,
        entries,
    }
}

/// Two workers of 4,096 blocks of 16 tokens under `kv`.
fn two_workers() -> ClusterConfig {
    ClusterConfig {
        workers: 2,
        sim: SimConfig {
            block_size: BlockSize::new(BLOCK).unwrap(),
            num_device_blocks: 4096,
            ..SimConfig::default()
        },
        ..ClusterConfig::default()
    }
}

/// Replays `trace` once, back to back (no think times), on `config`.
fn replay(trace: WekaTrace, config: &ClusterConfig) -> (OfflineRun, WekaWorkload) {
    let mut workload = WekaWorkload::new(
        vec![trace],
        WekaConfig {
            time_scale: 0.0,
            ..WekaConfig::default()
        },
    )
    .unwrap();
    let run = replay_offline(
        &mut workload,
        config,
        1.0,
        &indicatif::ProgressBar::hidden(),
    )
    .unwrap();
    (run, workload)
}

fn run(placement: bool) -> (OfflineRun, WekaWorkload) {
    let config = two_workers();
    let config = if placement {
        config.with_placement()
    } else {
        config
    };
    let (run, workload) = replay(tree(), &config);
    assert_eq!(run.summary.requests_completed, 4);
    assert_eq!(run.summary.sessions_completed, 1);
    (run, workload)
}

/// (worker, cached prompt tokens) of the parent call and of each sub-agent's call.
fn placed(run: &OfflineRun, workload: &WekaWorkload) -> (u32, Vec<(u32, u64)>) {
    let record = |id: usize| &run.run.records[id];
    let parent = workload
        .log()
        .iter()
        .position(|c| c.subagent.is_none())
        .unwrap();
    let subs = workload
        .log()
        .iter()
        .enumerate()
        .filter(|(_, c)| c.subagent.is_some())
        .map(|(id, _)| (record(id).worker, record(id).cached_tokens))
        .collect();
    (record(parent).worker, subs)
}

#[test]
fn a_saturated_parent_worker_has_its_sub_agents_prefix_copied_not_recomputed() {
    let (with, workload) = run(true);
    assert_eq!(with.summary.label, "kv+placement");
    let (parent, subs) = placed(&with, &workload);
    assert_eq!(subs.len(), 3);
    let prefix_tokens = u64::from(PREFIX * BLOCK);
    // The first sub-agent takes the hit where its parent ran.
    assert_eq!(subs[0], (parent, prefix_tokens));
    // A later one runs on the other worker, and finds the prefix there: copied.
    let moved: Vec<_> = subs.iter().filter(|(w, _)| *w != parent).collect();
    assert!(!moved.is_empty(), "{subs:?}");
    for (_, cached) in &moved {
        assert!(*cached >= prefix_tokens, "{subs:?}");
    }
    let stats = &with.run.disagg;
    assert_eq!(stats.peer_copies, moved.len() as u64);
    assert_eq!(stats.peer_blocks, u64::from(PREFIX) * moved.len() as u64);
    assert_eq!(
        stats.peer_bytes,
        stats.peer_blocks * u64::from(BLOCK) * 131_072,
        "128 KiB of KV per token"
    );
    assert!(with.summary.peer_hit_rate > 0.0);
    assert!(with.summary.transferred_bytes >= stats.peer_bytes);

    // Without placement the same tree recomputes what the copies brought.
    let (without, workload) = run(false);
    assert_eq!(without.summary.label, "kv");
    assert_eq!(without.run.disagg.peer_copies, 0);
    assert_eq!(without.summary.peer_hit_rate, 0.0);
    let (parent, subs) = placed(&without, &workload);
    for (w, cached) in subs {
        if w != parent {
            assert_eq!(cached, 0, "no copy without placement");
        }
    }
    assert!(without.summary.recomputed_tokens > with.summary.recomputed_tokens);
}

#[test]
fn an_idle_parent_worker_keeps_its_sub_agents_without_copies() {
    // One sub-agent at a time (each joins before the next launches): the parent's worker is
    // never saturated, so every sub-agent takes the hit there and nothing is copied.
    let mut trace = tree();
    let subs: Vec<WekaEntry> = trace.entries.drain(1..).collect();
    for sub in subs {
        trace.entries.push(sub);
        trace
            .entries
            .push(WekaEntry::Call(call((0..PREFIX).collect())));
    }
    let (run, workload) = replay(trace, &two_workers().with_placement());
    assert_eq!(run.summary.requests_completed, 7);
    let (parent, subs) = placed(&run, &workload);
    assert_eq!(subs.len(), 3);
    for (w, cached) in subs {
        assert_eq!((w, cached), (parent, u64::from(PREFIX * BLOCK)));
    }
    assert_eq!(run.run.disagg.peer_copies, 0);
}
