//! The events below are in the exact shape TensorRT-LLM's serializer gives them
//! (`tensorrt_llm/_utils.py`, `KVCacheEventSerializer`: `event_id`, `data`, `window_size`, and
//! `attention_dp_rank` only when set; `stored_block`s with `unique_token`s, `cache_level` and
//! `priority`; newer releases add `mm_keys` and `cache_salt` per block, as its
//! `tests/unittest/llmapi/test_llm_kv_cache_events.py` checks), as `trtllm-serve` returns them
//! from `POST /kv_cache_events` (`tensorrt_llm/serve/openai_server.py`).

use serde_json::{Value, json};
use switchyard_core::{BlockSize, StorageTier, WorkerId, block_hashes};

use super::*;
use crate::engine::kv_relay::KvRelay;
use crate::engine::stats::AdapterStats;
use crate::event_log::EventLog;

const BS: usize = 2;

fn tokens(ids: &[u32]) -> Value {
    Value::Array(
        ids.iter()
            .map(|t| json!({"type": "unique_token", "token_id": t, "token_extra_id": 0}))
            .collect(),
    )
}

fn block(hash: u64, ids: &[u32], level: u64) -> Value {
    json!({"type": "stored_block", "block_hash": hash, "tokens": tokens(ids),
           "cache_level": level, "priority": 35, "mm_keys": [], "cache_salt": null})
}

fn envelope(id: u64, data: Value) -> Value {
    json!({"event_id": id, "data": data, "window_size": 256})
}

fn created(id: u64) -> Value {
    envelope(
        id,
        json!({"type": "created", "num_blocks_per_cache_level": [128, 0]}),
    )
}

fn stored(id: u64, parent: Option<u64>, blocks: Vec<Value>) -> Value {
    envelope(
        id,
        json!({"type": "stored", "parent_hash": parent, "blocks": blocks}),
    )
}

fn removed(id: u64, hashes: &[u64]) -> Value {
    envelope(id, json!({"type": "removed", "block_hashes": hashes}))
}

fn updated(id: u64, hash: u64, old: u64, new: u64) -> Value {
    envelope(
        id,
        json!({"type": "updated", "block_hash": hash,
               "cache_level": {"type": "event_diff", "new_value": new, "old_value": old},
               "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}}),
    )
}

/// The converter, the relay and the worker's log, driven as the poller drives them.
struct Rig {
    events: TrtllmEvents,
    relay: KvRelay,
    log: EventLog,
    counters: AdapterCounters,
    resets: Vec<Loss>,
}

impl Rig {
    fn new(ranks: u32) -> Self {
        let bs = BlockSize::new(BS as u32).unwrap();
        Self {
            events: TrtllmEvents::new(bs, ranks, 1000),
            relay: KvRelay::new(bs, ranks, 1000),
            log: EventLog::new(WorkerId::new("w").unwrap(), 1, 1000),
            counters: AdapterCounters::new(ranks),
            resets: Vec::new(),
        }
    }

    /// One poll's body.
    fn poll(&mut self, body: Vec<Value>) {
        let (parsed, unreadable) = parse_poll(&Value::Array(body).to_string()).unwrap();
        assert!(unreadable.is_empty(), "{unreadable:?}");
        self.apply(parsed);
    }

    fn apply(&mut self, parsed: Vec<Parsed>) {
        for step in self.events.ingest(parsed, &self.counters) {
            match step {
                Step::Apply { rank, batch } => {
                    self.relay.apply(rank, &batch, &self.log, &self.counters)
                }
                Step::Reset { rank, loss } => {
                    self.resets.push(loss);
                    self.relay.reset_and_publish(rank, &self.log);
                }
            }
        }
    }

    fn stats(&self) -> AdapterStats {
        self.counters.snapshot()
    }

    /// Our hashes of the blocks held in `tier`.
    fn held(&self, tier: StorageTier) -> Vec<switchyard_core::BlockHash> {
        let mut held: Vec<_> = self
            .relay
            .held_blocks()
            .into_iter()
            .filter(|(_, t)| *t == tier)
            .map(|(h, _)| h)
            .collect();
        held.sort();
        held
    }
}

fn ours(tokens: &[u32]) -> Vec<switchyard_core::BlockHash> {
    let mut hashes = block_hashes(tokens, BlockSize::new(BS as u32).unwrap());
    hashes.sort();
    hashes
}

#[test]
fn the_serialized_shape_parses_with_every_field() {
    let body = json!([
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [1024, 512]},
         "window_size": 4096},
        {"event_id": 1, "window_size": 4096, "attention_dp_rank": 1,
         "data": {"type": "stored", "parent_hash": null, "blocks": [
            {"type": "stored_block", "block_hash": 18_000_000_000_000_000_000u64,
             "tokens": [{"type": "unique_token", "token_id": 5, "token_extra_id": 0},
                        {"type": "unique_token", "token_id": 6, "token_extra_id": 0}],
             "cache_level": 1, "priority": 35, "lora_id": 3, "cache_salt": "s",
             "mm_keys": [{"type": "mm_key", "hash": "0102", "start_offset": 4}]}]}},
        {"event_id": 2, "window_size": 4096,
         "data": {"type": "removed", "block_hashes": [-5, "ff00000000000000000000000000000a"]}},
        {"event_id": 3, "window_size": 4096,
         "data": {"type": "updated", "block_hash": 7,
                  "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                  "priority": {"type": "event_diff", "new_value": 20, "old_value": 35}}},
        {"event_id": 4, "window_size": 4096, "data": {"type": "updated", "block_hash": 7,
         "cache_level": null, "priority": {"type": "event_diff", "new_value": 1, "old_value": 2}}},
    ]);
    let (events, unreadable) = parse_poll(&body.to_string()).unwrap();
    assert!(unreadable.is_empty());
    assert_eq!(events.len(), 5);
    assert_eq!(
        (events[0].event_id, events[0].window, events[0].rank),
        (0, Some(4096), 0)
    );
    assert_eq!(events[0].data, Ok(TrtData::Created));
    let Ok(TrtData::Stored { parent, blocks }) = &events[1].data else {
        panic!("{:?}", events[1].data)
    };
    assert_eq!((events[1].rank, *parent), (1, None));
    let b = &blocks[0];
    assert_eq!(b.hash, 18_000_000_000_000_000_000);
    assert_eq!((b.tokens.as_slice(), b.cache_level), (&[5, 6][..], 1));
    assert_eq!(b.lora.as_deref(), Some("lora_id:3"));
    assert_eq!(b.salt.as_deref(), Some("s"));
    assert!(b.other.is_some(), "multimodal keys name the block");
    assert_eq!(
        events[2].data,
        Ok(TrtData::Removed {
            hashes: vec![(-5i64) as u64, 0x0a]
        })
    );
    assert_eq!(
        events[3].data,
        Ok(TrtData::Updated {
            hash: 7,
            cache_level: Some((0, 1))
        })
    );
    assert_eq!(
        events[4].data,
        Ok(TrtData::Updated {
            hash: 7,
            cache_level: None
        })
    );
}

#[test]
fn bad_bodies_and_bad_events_are_refused_or_skipped_alone() {
    assert!(matches!(parse_poll("<html>"), Err(PollError::NotJson(_))));
    assert_eq!(parse_poll("{\"events\": []}"), Err(PollError::NotAList));
    let (events, unreadable) = parse_poll(
        &json!([
            {"data": {"type": "removed", "block_hashes": []}},
            {"event_id": 1, "data": {"type": "teleported"}},
            {"event_id": 2, "data": {"type": "stored", "parent_hash": null, "blocks": [
                {"block_hash": 1, "tokens": [{"token_id": -1}]}]}},
            {"event_id": 3, "data": {"type": "removed", "block_hashes": [1.5]}},
            {"event_id": 4, "attention_dp_rank": "one", "data": {}},
        ])
        .to_string(),
    )
    .unwrap();
    assert_eq!(unreadable.len(), 2, "no event id; a rank that is no number");
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|e| e.data.is_err()));
    let mut rig = Rig::new(1);
    rig.apply(events);
    assert_eq!(rig.stats().skipped_events, 3);
    // The unusable events still advance the sequence: no gap is seen after them.
    rig.poll(vec![stored(4, None, vec![block(10, &[1, 2], 0)])]);
    assert_eq!(rig.stats().gaps, 0);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
}

#[test]
fn stored_blocks_are_rehashed_into_our_chain_and_removed_by_engine_hash() {
    let mut rig = Rig::new(1);
    rig.poll(vec![
        created(0),
        stored(1, None, vec![block(10, &[1, 2], 0), block(11, &[3, 4], 0)]),
    ]);
    rig.poll(vec![stored(2, Some(11), vec![block(12, &[5, 6], 0)])]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2, 3, 4, 5, 6]));
    assert_eq!(rig.log.block_count(), 3);
    rig.poll(vec![removed(3, &[12, 11])]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
    let s = rig.stats();
    assert_eq!((s.gaps, s.restarts, s.unknown_removals), (0, 0, 0));
}

#[test]
fn partial_blocks_are_never_indexed_and_their_removal_is_quiet() {
    let mut rig = Rig::new(1);
    // TensorRT-LLM stores the prompt's last, partial block for reuse.
    rig.poll(vec![stored(
        0,
        None,
        vec![block(10, &[1, 2], 0), block(11, &[3], 0)],
    )]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
    assert_eq!(rig.stats().partial_blocks, 1);
    rig.poll(vec![removed(1, &[11])]);
    assert_eq!(rig.stats().unknown_removals, 0);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
}

#[test]
fn a_gap_inside_a_poll_and_a_wrapped_buffer_are_counted_and_resynchronised() {
    let mut rig = Rig::new(1);
    rig.poll(vec![
        created(0),
        stored(1, None, vec![block(10, &[1, 2], 0)]),
    ]);
    // Event 2 never comes, inside one poll: a gap, not a wrap.
    rig.poll(vec![
        stored(3, None, vec![block(20, &[7, 8], 0)]),
        stored(5, None, vec![block(30, &[9, 9], 0)]),
    ]);
    assert_eq!(
        rig.resets,
        vec![
            Loss::Gap {
                expected: 2,
                got: 3,
                wrapped: true
            },
            Loss::Gap {
                expected: 4,
                got: 5,
                wrapped: false
            }
        ]
    );
    let s = rig.stats();
    assert_eq!((s.gaps, s.buffer_wraps, s.resyncs), (2, 1, 2));
    // What was held before each gap is gone; what came after it is held.
    assert_eq!(rig.held(StorageTier::Device), ours(&[9, 9]));
    assert_eq!(rig.log.block_count(), 1);
}

#[test]
fn an_engine_restart_is_seen_by_ids_going_back_or_a_new_cache() {
    let mut rig = Rig::new(1);
    rig.poll(vec![
        created(0),
        stored(1, None, vec![block(10, &[1, 2], 0)]),
        stored(2, None, vec![block(11, &[3, 4], 0)]),
    ]);
    // A new engine: ids from 0 again, with its created event.
    rig.poll(vec![
        created(0),
        stored(1, None, vec![block(99, &[5, 6], 0)]),
    ]);
    assert_eq!(rig.resets, vec![Loss::Restart { last: 2, got: 0 }]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[5, 6]));
    // A created event after stores, whatever its id: a new cache.
    rig.poll(vec![created(2)]);
    assert_eq!(rig.resets.last(), Some(&Loss::Recreated));
    assert!(rig.held(StorageTier::Device).is_empty());
    assert_eq!(rig.stats().restarts, 2);
}

#[test]
fn only_the_largest_attention_window_is_kept() {
    let mut rig = Rig::new(1);
    let with_window = |mut event: Value, w: u64| {
        event["window_size"] = json!(w);
        event
    };
    rig.poll(vec![
        with_window(created(0), 512),
        with_window(created(1), 4096),
        with_window(stored(2, None, vec![block(10, &[1, 2], 0)]), 512),
        with_window(stored(3, None, vec![block(11, &[1, 2], 0)]), 4096),
        with_window(removed(4, &[10]), 512),
    ]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
    assert_eq!(rig.stats().other_groups, 2);
    // Joined late: blocks of a small window came first, then the global one shows.
    let mut late = Rig::new(1);
    late.poll(vec![
        with_window(stored(7, None, vec![block(10, &[1, 2], 0)]), 512),
        with_window(stored(8, None, vec![block(11, &[3, 4], 0)]), 4096),
    ]);
    assert_eq!(
        late.resets,
        vec![Loss::WindowGrew {
            from: 512,
            to: 4096
        }]
    );
    assert_eq!(late.held(StorageTier::Device), ours(&[3, 4]));
}

#[test]
fn cache_level_changes_move_blocks_between_tiers() {
    let mut rig = Rig::new(1);
    rig.poll(vec![stored(
        0,
        None,
        vec![block(10, &[1, 2], 0), block(11, &[3, 4], 0)],
    )]);
    // Offloaded to host memory, then one brought back.
    rig.poll(vec![updated(1, 11, 0, 1)]);
    let chain = block_hashes(&[1, 2, 3, 4], BlockSize::new(BS as u32).unwrap());
    assert_eq!(rig.held(StorageTier::Device), vec![chain[0]]);
    assert_eq!(rig.held(StorageTier::Host), vec![chain[1]]);
    // Removed from where it is now.
    rig.poll(vec![removed(2, &[11])]);
    assert!(rig.held(StorageTier::Host).is_empty());
    // A block stored straight into host memory, and an unknown block's move.
    rig.poll(vec![
        stored(3, Some(10), vec![block(12, &[5, 6], 1)]),
        updated(4, 77, 0, 1),
    ]);
    assert_eq!(rig.held(StorageTier::Host).len(), 1);
    let s = rig.stats();
    assert_eq!((s.unknown_removals, s.unknown_media), (1, 0));
}

#[test]
fn adapters_and_salts_name_blocks_apart_from_plain_ones() {
    let mut rig = Rig::new(1);
    let mut lora = block(20, &[1, 2], 0);
    lora["lora_id"] = json!(4);
    let mut salted = block(30, &[1, 2], 0);
    salted["cache_salt"] = json!("tenant");
    rig.poll(vec![
        stored(0, None, vec![block(10, &[1, 2], 0)]),
        stored(1, None, vec![lora]),
        stored(2, None, vec![salted]),
    ]);
    assert_eq!(rig.relay.block_count(), 3, "same tokens, three blocks");
    let plain = ours(&[1, 2]);
    let salted_key = switchyard_core::identity_block_key(None, Some("tenant"), None);
    let salted_hash = switchyard_core::chain_hash_keyed(None, &[1, 2], salted_key);
    let held = rig.held(StorageTier::Device);
    assert!(
        held.contains(&plain[0]) && held.contains(&salted_hash),
        "{held:?}"
    );
}

#[test]
fn attention_dp_ranks_are_streams_of_their_own() {
    let mut rig = Rig::new(2);
    let on = |mut event: Value, rank: u32| {
        event["attention_dp_rank"] = json!(rank);
        event
    };
    rig.poll(vec![
        on(stored(0, None, vec![block(10, &[1, 2], 0)]), 0),
        on(stored(0, None, vec![block(10, &[3, 4], 0)]), 1),
        on(stored(1, None, vec![block(11, &[5, 6], 0)]), 1),
        on(stored(0, None, vec![block(12, &[7, 8], 0)]), 5),
    ]);
    // The same engine hash on two ranks names different blocks; rank 5 is past --dp-ranks.
    assert_eq!(rig.relay.block_count(), 3);
    assert_eq!(rig.stats().gaps, 0);
    assert_eq!(rig.counters.per_rank()[1].skipped_events, 1);
    // A gap on rank 1 clears rank 1 only.
    rig.poll(vec![on(stored(5, None, vec![block(13, &[9, 9], 0)]), 1)]);
    let mut want = ours(&[1, 2]);
    want.extend(ours(&[9, 9]));
    want.sort();
    assert_eq!(rig.held(StorageTier::Device), want);
    assert_eq!(rig.counters.per_rank()[1].gaps, 1);
}

#[test]
fn a_larger_engine_block_is_refused_and_reported() {
    let mut rig = Rig::new(1);
    rig.poll(vec![stored(0, None, vec![block(10, &[1, 2, 3, 4], 0)])]);
    assert_eq!(rig.stats().block_size_mismatches, 1);
    assert_eq!(rig.relay.block_count(), 0);
}

#[test]
fn layer_groups_hold_a_block_until_the_last_one_drops_it() {
    let mut rig = Rig::new(1);
    let in_group = |mut event: Value, group: u32| {
        event["layer_group_id"] = json!(group);
        event
    };
    // KV cache manager V2: the same block announced by two layer groups of the global window.
    rig.poll(vec![
        in_group(stored(0, None, vec![block(10, &[1, 2], 0)]), 0),
        in_group(stored(1, None, vec![block(10, &[1, 2], 0)]), 1),
        in_group(removed(2, &[10]), 0),
    ]);
    assert_eq!(rig.held(StorageTier::Device), ours(&[1, 2]));
    rig.poll(vec![in_group(removed(3, &[10]), 1)]);
    assert!(rig.held(StorageTier::Device).is_empty());
    assert_eq!(rig.stats().unknown_removals, 0);
}
