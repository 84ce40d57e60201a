//! Property tests of the KV event decoder and relay on hostile input: arbitrary bytes and
//! mutations of valid batches never panic, and every payload is either applied or counted as
//! malformed.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use rmpv::Value;
use switchyard_core::{BlockSize, WorkerId};

use super::kv_decode::decode_batch;
use super::kv_relay::KvRelay;
use super::stats::AdapterCounters;
use super::zmq_events::RelayShared;
use crate::event_log::EventLog;

fn shared() -> RelayShared {
    RelayShared {
        relay: Mutex::new(KvRelay::new(BlockSize::new(2).unwrap(), 2, 64)),
        log: Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 64)),
        counters: Arc::new(AdapterCounters::default()),
    }
}

/// A valid batch in one of the encodings, built from small random parts.
fn valid_batch() -> impl Strategy<Value = Vec<u8>> {
    let hash = prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 1..40).prop_map(Value::Binary),
    ];
    let stored = (
        prop::collection::vec(hash.clone(), 0..4),
        prop::option::of(hash.clone()),
        prop::collection::vec(0u32..100, 0..10),
        any::<bool>(),
    )
        .prop_map(|(hashes, parent, tokens, keyed)| {
            let tokens = Value::Array(tokens.into_iter().map(Value::from).collect());
            let parent = parent.unwrap_or(Value::Nil);
            if keyed {
                Value::Map(vec![
                    ("type".into(), "BlockStored".into()),
                    ("block_hashes".into(), Value::Array(hashes)),
                    ("parent_block_hash".into(), parent),
                    ("token_ids".into(), tokens),
                    ("block_size".into(), 2.into()),
                    ("extra".into(), Value::Boolean(true)),
                ])
            } else {
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(hashes),
                    parent,
                    tokens,
                    2.into(),
                    Value::Nil,
                    "GPU".into(),
                ])
            }
        });
    let removed = prop::collection::vec(hash, 0..4)
        .prop_map(|hashes| Value::Array(vec!["BlockRemoved".into(), Value::Array(hashes)]));
    let cleared = Just(Value::Array(vec!["AllBlocksCleared".into()]));
    let event = prop_oneof![4 => stored, 2 => removed, 1 => cleared];
    (prop::collection::vec(event, 0..6), 0u32..3).prop_map(|(events, rank)| {
        let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events), rank.into()]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &batch).unwrap();
        out
    })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_and_are_counted(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let s = shared();
        s.apply(0, 0, &bytes);
        let stats = s.counters.snapshot();
        prop_assert_eq!(stats.batches + stats.malformed, 1);
        prop_assert_eq!(decode_batch(&bytes).is_err(), stats.malformed == 1);
    }

    #[test]
    fn valid_batches_decode_and_mutations_never_panic(
        batch in valid_batch(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        prop_assert!(decode_batch(&batch).is_ok());
        let s = shared();
        s.apply(1, 0, &batch);
        let mut mutated = batch.clone();
        for (at, byte) in flips {
            let i = at.index(mutated.len());
            mutated[i] = byte;
        }
        mutated.truncate(cut.index(mutated.len() + 1));
        s.apply(1, 1, &mutated);
        let stats = s.counters.snapshot();
        prop_assert_eq!(stats.batches + stats.malformed, 2);
        // The relay's view never names more blocks than it was told about.
        prop_assert!(s.log.block_count() <= 2 * 4 * 6);
        // What the log announced is what the relay holds.
        prop_assert_eq!(s.log.block_count(), s.relay.lock().unwrap().block_count());
    }
}

fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

/// Found by the `zmq_event` fuzz target (fuzz/regressions/zmq_event/): an engine hash stored
/// again with other tokens used to announce the new block while the relay kept counting the
/// old one, so the old block stayed announced for ever and the new one could never be removed.
#[test]
fn an_engine_hash_reused_for_other_tokens_replaces_its_block() {
    let s = shared();
    let store = |tokens: [u32; 2]| {
        encode(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                Value::Array(vec![7.into()]),
                Value::Nil,
                Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
                2.into(),
            ])]),
        ]))
    };
    s.apply(0, 0, &store([1, 2]));
    s.apply(0, 1, &store([3, 4]));
    let held = |s: &RelayShared| s.relay.lock().unwrap().held_blocks();
    let ours = switchyard_core::block_hashes(&[3, 4], BlockSize::new(2).unwrap());
    assert_eq!(
        held(&s),
        vec![(ours[0], switchyard_core::StorageTier::Device)]
    );
    assert_eq!(s.log.block_count(), 1);
    let remove = encode(&Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![Value::Array(vec![
            "BlockRemoved".into(),
            Value::Array(vec![7.into()]),
        ])]),
    ]));
    s.apply(0, 2, &remove);
    assert!(held(&s).is_empty());
    assert_eq!(s.log.block_count(), 0);
}

/// One step an engine takes, as the relay sees it.
#[derive(Debug, Clone)]
enum EngineStep {
    /// Stores the first `blocks` blocks of chain `chain` in `group` and `medium`, from the root
    /// (also how vLLM's `full` report mode re-announces a prefix it holds).
    Store {
        chain: u32,
        blocks: usize,
        group: u32,
        medium: &'static str,
    },
    /// Removes block `block` of chain `chain` from `group` and `medium` (held or not).
    Remove {
        chain: u32,
        block: usize,
        group: u32,
        medium: &'static str,
    },
    Clear,
}

const CHAIN_BLOCKS: usize = 4;

fn chain_tokens(chain: u32) -> Vec<u32> {
    (0..CHAIN_BLOCKS as u32 * 2)
        .map(|t| chain * 100 + t)
        .collect()
}

/// The engine's hash of block `block` of `chain`: the same in every group, as vLLM's hybrid
/// models publish it.
fn engine_hash(chain: u32, block: usize) -> u64 {
    u64::from(chain) << 8 | block as u64
}

fn engine_step() -> impl Strategy<Value = EngineStep> {
    let medium = prop::sample::select(vec!["GPU", "CPU", "GPU"]);
    prop_oneof![
        4 => (0u32..3, 1usize..=CHAIN_BLOCKS, 0u32..2, medium.clone())
            .prop_map(|(chain, blocks, group, medium)| EngineStep::Store { chain, blocks, group, medium }),
        3 => (0u32..3, 0usize..CHAIN_BLOCKS, 0u32..2, medium)
            .prop_map(|(chain, block, group, medium)| EngineStep::Remove { chain, block, group, medium }),
        1 => Just(EngineStep::Clear),
    ]
}

proptest! {
    /// Random interleavings of stores, re-announcements, per-group removals and clears: what the
    /// worker's event log holds is exactly the set of blocks the engine holds in some group and
    /// medium, tier by tier.
    #[test]
    fn the_relay_follows_the_engines_true_set(steps in prop::collection::vec(engine_step(), 1..60)) {
        use std::collections::BTreeSet;
        use switchyard_core::{StorageTier, block_hashes};
        use super::kv_decode::{EngineBatch, EngineEvent, StoredEvent};
        use super::kv_relay::tier;

        let bs = BlockSize::new(2).unwrap();
        let mut relay = KvRelay::new(bs, 1, 1024);
        let log = EventLog::new(WorkerId::new("w").unwrap(), 1, 4096);
        let counters = AdapterCounters::default();
        // The engine's truth: (group, engine hash, medium).
        let mut truth: BTreeSet<(u32, u64, &'static str)> = BTreeSet::new();
        for step in steps {
            let event = match step {
                EngineStep::Store { chain, blocks, group, medium } => {
                    for b in 0..blocks {
                        truth.insert((group, engine_hash(chain, b), medium));
                    }
                    EngineEvent::BlockStored(StoredEvent {
                        block_hashes: (0..blocks).map(|b| engine_hash(chain, b)).collect(),
                        parent: None,
                        token_ids: chain_tokens(chain)[..blocks * 2].to_vec(),
                        block_size: Some(2),
                        medium: Some(medium.into()),
                        group,
                        ..StoredEvent::default()
                    })
                }
                EngineStep::Remove { chain, block, group, medium } => {
                    truth.remove(&(group, engine_hash(chain, block), medium));
                    EngineEvent::BlockRemoved {
                        block_hashes: vec![engine_hash(chain, block)],
                        medium: Some(medium.into()),
                        group,
                    }
                }
                EngineStep::Clear => {
                    truth.clear();
                    EngineEvent::AllBlocksCleared
                }
            };
            let batch = EngineBatch { events: vec![event], skipped: Vec::new(), dp_rank: Some(0) };
            relay.apply(0, &batch, &log, &counters);

            let expected: BTreeSet<(switchyard_core::BlockHash, StorageTier)> = truth
                .iter()
                .map(|&(_, h, medium)| {
                    let (chain, block) = ((h >> 8) as u32, (h & 0xff) as usize);
                    (block_hashes(&chain_tokens(chain), bs)[block], tier(Some(medium)).0)
                })
                .collect();
            let held: BTreeSet<_> = relay.held_blocks().into_iter().collect();
            prop_assert_eq!(&held, &expected);
            // And the event log, which gateways index, says the same.
            let logged: BTreeSet<_> = match log.subscribe(None, 0).start {
                crate::event_log::SubscriptionStart::Snapshot { blocks, .. } => {
                    blocks.iter().map(|b| (b.hash, b.tier)).collect()
                }
                _ => BTreeSet::new(),
            };
            prop_assert_eq!(&logged, &expected);
        }
    }
}
