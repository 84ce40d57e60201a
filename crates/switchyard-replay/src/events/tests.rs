#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write as _;

use serde_json::{Value, json};
use switchyard_core::{BlockSize, block_hashes};

use super::*;

const BS: u32 = 4;

fn worker(id: &str) -> Value {
    json!({
        "id": id, "address": "127.0.0.1:1", "model": "m", "role": "both", "block_size": BS,
        "kv_capacity_blocks": 100, "max_context_tokens": 1000, "engine": "sim", "incarnation": 1
    })
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|i| seed * 1000 + i).collect()
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    block_hashes(tokens, BlockSize::new(BS).unwrap())
        .iter()
        .map(|h| h.get())
        .collect()
}

/// Blocks `from..to` of `tokens` stored, chained to block `from - 1`.
fn stored(id: &str, seq: u64, tokens: &[u32], from: usize, to: usize) -> Value {
    let all = hashes(tokens);
    let blocks: Vec<Value> = all[from..to]
        .iter()
        .zip(tokens.chunks(BS as usize).skip(from))
        .map(|(h, t)| json!({"hash": h, "tokens": t}))
        .collect();
    let parent = from.checked_sub(1).map(|i| all[i]);
    json!({"type": "kv_event", "tick": seq, "model": "m", "worker": id, "incarnation": 1,
           "seq": seq, "event": {"type": "stored", "parent": parent, "blocks": blocks, "tier": "device"}})
}

fn route(key: u64, tokens: &[u32], candidates: &[&str], chosen: &str, cached: u32) -> Value {
    json!({"type": "route", "tick": 1000 + key, "model": "m", "key": key, "attempt": 0,
           "block_size": BS, "prompt_tokens": tokens.len(), "max_tokens": 4, "session": null,
           "block_hashes": hashes(tokens), "candidates": candidates, "policy": "kv",
           "chosen": chosen, "cached_blocks": cached})
}

fn finished(key: u64, worker: &str) -> Value {
    json!({"type": "finished", "tick": 2000 + key, "model": "m", "key": key, "worker": worker})
}

/// Two workers; `a` is resynced from a snapshot, `b` sends gap-free events from seq 0; `a`
/// then leaves. Live decisions are what kv decides.
fn recording(lines: &[Value]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    for line in lines {
        writeln!(file, "{line}").unwrap();
    }
    file.flush().unwrap();
    file
}

fn sample() -> Vec<Value> {
    let shared = prompt(1, 8);
    let other = prompt(2, 6);
    let snapshot_blocks: Vec<Value> = hashes(&shared)
        .iter()
        .map(|h| json!({"hash": h, "parent": null, "tier": "device"}))
        .collect();
    vec![
        json!({"type": "header", "format": FORMAT, "version": VERSION, "policy": "kv",
               "policy_settings": {"seed": 7}, "workers": [worker("a")]}),
        json!({"type": "worker_joined", "tick": 1, "worker": worker("b")}),
        json!({"type": "snapshot", "tick": 2, "model": "m", "worker": "a", "incarnation": 1,
               "next_seq": 10, "blocks": snapshot_blocks}),
        stored("b", 0, &other, 0, 2),
        stored("b", 1, &other, 2, 6),
        json!({"type": "load", "tick": 3, "model": "m", "worker": "a", "stats": {
            "queued_prefill_tokens": 0, "waiting_requests": 0, "running_requests": 0,
            "active_decode_sequences": 0, "active_blocks": 0, "used_blocks": 8,
            "capacity_blocks": 100, "preemptions_total": 0, "cached_prompt_tokens_total": 0,
            "prompt_tokens_total": 0}}),
        route(1, &shared, &["a", "b"], "a", 8),
        finished(1, "a"),
        route(2, &shared, &["a", "b"], "a", 8),
        json!({"type": "prefill_done", "tick": 2100, "model": "m", "key": 2, "worker": "a"}),
        finished(2, "a"),
        route(3, &other, &["a", "b"], "b", 6),
        finished(3, "b"),
        json!({"type": "worker_left", "tick": 3000, "model": "m", "worker": "a"}),
        route(4, &shared, &["b"], "b", 0),
        finished(4, "b"),
        json!({"type": "trailer", "records": 15, "dropped": 0, "complete": true,
               "ended_by": "stopped"}),
    ]
}

#[test]
fn kv_agrees_with_the_live_decisions_and_beats_round_robin() {
    let file = recording(&sample());
    let policies = [PolicyKind::Kv, PolicyKind::RoundRobin];
    let report = replay_recording(file.path(), &policies, None).unwrap();
    assert!(report.complete);
    assert_eq!(report.records, 15);
    assert_eq!(report.seed, 7);
    assert_eq!(report.live_policy, "kv");
    assert_eq!(
        report.index,
        IndexCounts {
            snapshots: 1,
            applied: 2,
            ..IndexCounts::default()
        }
    );
    let [live, kv, rr] = &report.policies[..] else {
        panic!("{report:?}")
    };
    assert_eq!(live.policy, "live (kv)");
    assert_eq!(live.agreement, 1.0);
    assert_eq!(kv.decisions, 4);
    assert_eq!(kv.agreement, 1.0, "{kv:?}");
    // The same predicted caches as live: 8 + 8 + 6 + 0 blocks of 4 tokens.
    assert_eq!(kv.cached_tokens, live.cached_tokens);
    assert_eq!(kv.cached_tokens, (8 + 6 + 8) * u64::from(BS));
    assert_eq!(kv.prompt_tokens, (8 + 6 + 8 + 8) * u64::from(BS));
    assert!(kv.hit_rate > rr.hit_rate, "{kv:?} vs {rr:?}");
    assert!(rr.agreement < 1.0);
    assert_eq!(kv.routed_per_worker.values().sum::<u64>(), 4);
    // Same file, same seed: the same report, byte for byte.
    let again = replay_recording(file.path(), &policies, None).unwrap();
    assert_eq!(report.to_json().unwrap(), again.to_json().unwrap());
    assert_eq!(report.to_csv(), again.to_csv());
    assert!(report.table().contains("round-robin"));
}

#[test]
fn a_gap_is_counted_and_an_incomplete_recording_is_flagged() {
    let mut lines = sample();
    lines.pop(); // no trailer: the gateway stopped before the recording did
    lines.insert(5, stored("b", 5, &prompt(3, 1), 0, 1)); // seq 5 after 0, 1: a gap
    let file = recording(&lines);
    let report = replay_recording(file.path(), &[PolicyKind::Random], Some(1)).unwrap();
    assert!(!report.complete);
    assert_eq!(report.index.gaps, 1);
    assert_eq!(report.seed, 1);
    assert_eq!(report.policies[1].decisions, 4);
}

#[test]
fn other_files_are_refused_with_the_line() {
    let file = recording(&[json!({"type": "route"})]);
    assert!(replay_recording(file.path(), &[PolicyKind::Kv], None).is_err());
    let file = recording(&[json!({"type": "header", "format": "x", "version": 1})]);
    let err = replay_recording(file.path(), &[PolicyKind::Kv], None).unwrap_err();
    assert!(err.to_string().contains(":1:"), "{err}");
    let file = recording(&[]);
    assert!(replay_recording(file.path(), &[PolicyKind::Kv], None).is_err());
}

#[test]
fn a_version_1_recording_reads_as_disaggregation_off() {
    let mut lines = sample();
    lines[0]["version"] = json!(1);
    let file = recording(&lines);
    let report = replay_recording(file.path(), &[PolicyKind::Kv], None).unwrap();
    assert_eq!(report.disaggregation, "off");
    let kv = &report.policies[1];
    assert_eq!((kv.agreement, kv.stage_agreement), (1.0, 1.0), "{kv:?}");
    assert_eq!((kv.disaggregated, kv.prefill_agreement), (0, None));
    lines[0]["version"] = json!(VERSION + 1);
    let file = recording(&lines);
    let err = replay_recording(file.path(), &[PolicyKind::Kv], None).unwrap_err();
    assert!(err.to_string().contains("version"), "{err}");
}

fn pd_worker(id: &str, role: &str) -> Value {
    let mut w = worker(id);
    w["role"] = json!(role);
    w
}

fn snapshot(id: &str, tokens: &[u32]) -> Value {
    let blocks: Vec<Value> = hashes(tokens)
        .iter()
        .map(|h| json!({"hash": h, "parent": null, "tier": "device"}))
        .collect();
    json!({"type": "snapshot", "tick": 2, "model": "m", "worker": id, "incarnation": 1,
           "next_seq": 0, "blocks": blocks})
}

/// A route record of a request served through the prefill pool.
fn pd_route(key: u64, tokens: &[u32], decode: &str, prefill: Option<(u64, &str)>) -> Value {
    let mut r = route(key, tokens, &["d1", "d2"], decode, tokens.len() as u32 / BS);
    r["prefill_pool"] = json!(true);
    r["served"] = json!(if prefill.is_some() {
        "disaggregated"
    } else {
        "aggregated"
    });
    if let Some((key, chosen)) = prefill {
        r["prefill"] = json!({"key": key, "candidates": ["p1", "p2"], "chosen": chosen,
                              "cached_blocks": tokens.len() as u32 / BS});
    }
    r
}

/// Two decode and two prefill workers; each prompt is cached on one of each, so the live `kv`
/// decisions (decode and prefill) are the cached ones.
fn pd_sample(mode: &str, min_uncached: u64) -> Vec<Value> {
    let (first, second) = (prompt(1, 8), prompt(2, 6));
    vec![
        json!({"type": "header", "format": FORMAT, "version": VERSION, "policy": "kv",
               "policy_settings": {"seed": 7},
               "serve": {"disaggregation": mode, "min_uncached_tokens": min_uncached},
               "workers": [pd_worker("d1", "decode"), pd_worker("d2", "decode"),
                           pd_worker("p1", "prefill"), pd_worker("p2", "prefill")]}),
        snapshot("d1", &first[..16]),
        snapshot("p1", &first),
        snapshot("d2", &second[..12]),
        snapshot("p2", &second),
        pd_route(1, &first, "d1", Some((2, "p1"))),
        json!({"type": "prefill_done", "tick": 1100, "model": "m", "key": 2, "worker": "p1"}),
        json!({"type": "prefill_done", "tick": 1101, "model": "m", "key": 1, "worker": "d1"}),
        finished(2, "p1"),
        finished(1, "d1"),
        pd_route(3, &second, "d2", Some((4, "p2"))),
        json!({"type": "prefill_failed", "tick": 1200, "model": "m", "key": 4, "decode_key": 3}),
        finished(3, "d2"),
    ]
}

#[test]
fn disaggregated_decisions_replay_with_their_prefill_worker() {
    // The decode workers hold half the prompt: 16 and 12 uncached tokens, both above the
    // threshold of 8, so `auto` prefills both as `enforce` does.
    for mode in ["enforce", "auto"] {
        let file = recording(&pd_sample(mode, 8));
        let report = replay_recording(file.path(), &[PolicyKind::Kv], None).unwrap();
        assert_eq!(report.disaggregation, mode);
        let [live, kv] = &report.policies[..] else {
            panic!("{report:?}")
        };
        assert_eq!(live.disaggregated, 2);
        assert_eq!(live.prefill_agreement, Some(1.0));
        assert_eq!(kv.decisions, 2);
        assert_eq!(kv.agreement, 1.0, "{mode}: {kv:?}");
        assert_eq!(kv.stage_agreement, 1.0, "{mode}: {kv:?}");
        assert_eq!(kv.disaggregated, 2, "{mode}: {kv:?}");
        assert_eq!(kv.prefill_decisions, 2);
        assert_eq!(kv.prefill_agreement, Some(1.0), "{mode}: {kv:?}");
        assert!(report.table().contains("100.0%"));
        assert!(
            report
                .to_csv()
                .lines()
                .nth(1)
                .unwrap()
                .ends_with(",1.00000,2,2,1.00000")
        );
    }
}

#[test]
fn a_replay_that_serves_otherwise_than_live_disagrees_on_the_stage() {
    // Recorded as disaggregated, but the header's threshold says the decode worker's uncached
    // tokens were too few: the replay serves aggregated and says so.
    let file = recording(&pd_sample("auto", 1000));
    let report = replay_recording(file.path(), &[PolicyKind::Kv], None).unwrap();
    let kv = &report.policies[1];
    assert_eq!(kv.agreement, 1.0, "{kv:?}");
    assert_eq!(kv.stage_agreement, 0.0, "{kv:?}");
    assert_eq!(kv.disaggregated, 0);
    assert_eq!(kv.prefill_agreement, Some(0.0));
}
