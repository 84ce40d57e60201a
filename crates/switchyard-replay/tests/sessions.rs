//! Sessions scheduled as programs on the simulated cluster: with room for every working set
//! the scheduler changes nothing; with too little, a held turn waits between turns and takes
//! nothing from the resident session, and no session waits for good.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::workload::weka::{WekaCall, WekaConfig, WekaEntry, WekaTrace, WekaWorkload};
use switchyard_replay::{ClusterConfig, OfflineRun, replay_offline};
use switchyard_router::PolicyKind;

use crate::support::{cluster, dev_b_short};

fn run(workload: &mut WekaWorkload, config: &ClusterConfig) -> OfflineRun {
    replay_offline(workload, config, 1.0, &indicatif::ProgressBar::hidden()).unwrap()
}

fn scheduled(config: &ClusterConfig) -> ClusterConfig {
    ClusterConfig {
        session_scheduling: true,
        ..config.clone()
    }
}

#[test]
fn with_room_for_every_working_set_nothing_is_held_and_nothing_changes() {
    // Four short dev_b_120 sessions two at a time on four workers of 16,384 blocks: every
    // working set fits.
    let config = cluster(PolicyKind::Kv, 64, 16_384, 0);
    let plain = run(&mut dev_b_short(2, 0.1), &config);
    let with = run(&mut dev_b_short(2, 0.1), &scheduled(&config));
    assert_eq!(with.run.sessions.held_turns, 0);
    assert_eq!(with.summary.label, "kv+sessions");
    assert_eq!(with.run.records, plain.run.records);
}

#[test]
fn with_too_little_kv_turns_wait_and_every_session_still_finishes() {
    // The same sessions, four at a time, on two workers of 512 blocks: working sets of tens of
    // thousands of tokens each do not fit side by side.
    let mut config = cluster(PolicyKind::Kv, 64, 512, 0);
    config.workers = 2;
    let plain = run(&mut dev_b_short(4, 0.1), &config);
    let mut workload = dev_b_short(4, 0.1);
    let with = run(&mut workload, &scheduled(&config));
    let stats = with.run.sessions;
    assert!(stats.held_turns > 0, "{stats:?}");
    // Nobody waits for good: every turn ran, every session finished. (The calls longer than
    // a worker's whole cache are refused by the engine, with or without scheduling.)
    assert_eq!(with.summary.sessions_completed, 4);
    assert_eq!(with.summary.requests_failed, plain.summary.requests_failed);
    assert_eq!(
        with.summary.requests_completed + with.summary.requests_failed,
        workload.log().len() as u64
    );
    assert!(stats.longest_hold_us > 0 && stats.held_us >= stats.longest_hold_us);
    // A held turn's TTFT counts its wait: some first token comes at least the longest hold
    // after its arrival.
    let longest_ttft = with
        .run
        .records
        .iter()
        .filter_map(|r| Some(r.first_token? - r.arrival))
        .max()
        .unwrap();
    assert!(longest_ttft >= stats.longest_hold_us);
}

const BLOCK: u32 = 64;

fn call(t: f64, blocks: u32) -> WekaCall {
    WekaCall {
        t,
        input: u64::from(blocks * BLOCK),
        output: 2,
        hash_ids: (0..blocks).collect(),
        api_time: 0.0,
    }
}

/// Session `a` sends a 60-block turn at once, then three turns growing by two blocks back to
/// back; session `b` sends one 190-block turn `b_at` seconds in. On one worker of 200 blocks
/// the two working sets cannot both stay.
fn two_sessions(b_at: f64) -> WekaWorkload {
    let a = WekaTrace {
        id: "a".into(),
        block_size: BLOCK,
        entries: [60, 62, 64, 66]
            .into_iter()
            .map(|blocks| WekaEntry::Call(call(0.0, blocks)))
            .collect(),
    };
    let b = WekaTrace {
        id: "b".into(),
        block_size: BLOCK,
        entries: vec![WekaEntry::Call(call(b_at, 190))],
    };
    WekaWorkload::new(
        vec![a, b],
        WekaConfig {
            concurrency: 2,
            ..WekaConfig::default()
        },
    )
    .unwrap()
}

fn one_worker() -> ClusterConfig {
    ClusterConfig {
        workers: 1,
        sim: SimConfig {
            block_size: BlockSize::new(BLOCK).unwrap(),
            num_device_blocks: 200,
            ..SimConfig::default()
        },
        ..ClusterConfig::default()
    }
}

/// Cached prompt tokens of `a`'s later turns.
fn a_later_hits(workload: &WekaWorkload, run: &OfflineRun) -> Vec<u64> {
    workload
        .log()
        .iter()
        .enumerate()
        .filter(|(_, c)| c.trace == "a" && c.index > 0)
        .map(|(id, _)| run.run.records[id].cached_tokens)
        .collect()
}

#[test]
fn a_held_turn_evicts_nothing_of_the_resident_session() {
    // b arrives 10 ms after a's first turn ended (measured in a run where b comes late), so
    // b's turn lands while a goes from turn to turn.
    let mut probe = two_sessions(1_000.0);
    let probe_run = run(&mut probe, &one_worker());
    let a_first = probe.log().iter().position(|c| c.trace == "a").unwrap();
    let first_end = probe_run.run.records[a_first].finished.unwrap();
    let b_at = first_end as f64 / 1e6 + 0.01;

    let mut plain_workload = two_sessions(b_at);
    let plain = run(&mut plain_workload, &one_worker());
    let mut workload = two_sessions(b_at);
    let with = run(&mut workload, &scheduled(&one_worker()));
    assert_eq!(with.summary.sessions_completed, 2);
    assert_eq!(with.run.sessions.held_turns, 1, "b's turn waits");
    // While b waits, a's next turns find their whole history.
    let full: Vec<u64> = [60, 62, 64].iter().map(|b| b * u64::from(BLOCK)).collect();
    assert_eq!(a_later_hits(&workload, &with), full);
    // Let in at once, b's turn takes part of it.
    assert_ne!(a_later_hits(&plain_workload, &plain), full);
}
