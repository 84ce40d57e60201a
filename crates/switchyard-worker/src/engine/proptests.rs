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
    }
}
