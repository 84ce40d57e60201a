//! `zmq_event`: KV-event messages as an engine's ZeroMQ publisher (vLLM, SGLang) sends them,
//! through the worker's own code: frame splitting
//! (`switchyard_worker::engine::zmq_events::split_live_frames`, `split_replay`), MessagePack
//! batch decoding (`kv_decode::decode_batch`) and the relay of each batch into the worker's
//! event log (`RelayShared::apply`), as the adapter's rank followers do.
//!
//! Input: one header byte, then either the payload itself or the message's frames.
//!
//! - header bits 0–1: the data-parallel rank (the relay is configured with two, so ranks 2
//!   and 3 are ones no follower produces);
//! - header bits 2–3 (mod 3): 0 = the rest is one MessagePack payload; 1 = the rest is a live
//!   message's frames; 2 = a replay reply's frames. Frames are each a 2-byte big-endian length
//!   and that many bytes (a last frame shorter than its length takes what is left).
//!
//! Checks: nothing panics; every payload is counted either as a batch or as malformed; after
//! each batch the relay's blocks and the event log's blocks (what gateways are told) agree.

use std::sync::{Arc, Mutex};

use switchyard_core::{BlockSize, WorkerId};
use switchyard_worker::engine::kv_decode::decode_batch;
use switchyard_worker::engine::kv_relay::KvRelay;
use switchyard_worker::engine::stats::AdapterCounters;
use switchyard_worker::engine::zmq_events::{RelayShared, split_live_frames, split_replay};
use switchyard_worker::event_log::EventLog;

/// The relay's configuration: two ranks, block size 4 (the size of the worked examples in
/// `WIRE_FORMATS.md`), a small engine-hash map so eviction paths are reached.
const DP_RANKS: u32 = 2;
const BLOCK_SIZE: u32 = 4;
const MAP_CAPACITY: usize = 64;
const MAX_FRAMES: usize = 6;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&header, rest)) = data.split_first() else {
        return;
    };
    let rank = u32::from(header & 3);
    let message = match (header >> 2) & 3 {
        0 => Some((0, rest.to_vec())),
        1 => split_live_frames(&frames(rest)),
        _ => split_replay(&frames(rest)),
    };
    let Some((seq, payload)) = message else {
        return;
    };
    let shared = relay();
    // The payload twice: the second application exercises re-announcement and removal of what
    // the first one stored.
    for round in 1..=2u64 {
        shared.apply(rank, seq, &payload);
        let stats = shared.counters.rank(rank).snapshot();
        assert_eq!(
            stats.batches + stats.malformed,
            round,
            "a payload was neither applied nor counted as malformed"
        );
        assert_eq!(
            stats.batches > 0,
            decode_batch(&payload).is_ok(),
            "the relay and the decoder disagree on whether the payload is a batch"
        );
        check_relay_matches_log(&shared);
    }
}

fn relay() -> RelayShared {
    relay_shared(BLOCK_SIZE, DP_RANKS, MAP_CAPACITY)
}

/// A worker's relay and event log as an adapter's reader shares them, for a fuzz target.
pub(crate) fn relay_shared(block_size: u32, ranks: u32, map_capacity: usize) -> RelayShared {
    let block_size = BlockSize::new(block_size).unwrap_or_else(|_| unreachable!("a valid size"));
    let worker = WorkerId::new("fuzz-worker").unwrap_or_else(|_| unreachable!("a valid id"));
    RelayShared {
        relay: Mutex::new(KvRelay::new(block_size, ranks, map_capacity)),
        log: Arc::new(EventLog::new(worker, 1, 256)),
        counters: Arc::new(AdapterCounters::new(ranks)),
    }
}

/// The check every relay target ends an input with: the relay holds the blocks the event log
/// announced to gateways.
pub(crate) fn check_relay_matches_log(shared: &RelayShared) {
    let relay_blocks = shared
        .relay
        .lock()
        .map(|relay| relay.block_count())
        .unwrap_or_else(|poisoned| poisoned.into_inner().block_count());
    assert_eq!(
        relay_blocks,
        shared.log.block_count(),
        "the relay holds other blocks than the event log announced"
    );
}

/// Splits `bytes` into length-prefixed frames (see the module docs).
fn frames(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while out.len() < MAX_FRAMES {
        let Some((len, rest)) = bytes.split_first_chunk::<2>() else {
            break;
        };
        let len = usize::from(u16::from_be_bytes(*len)).min(rest.len());
        let (frame, rest) = rest.split_at(len);
        out.push(frame);
        bytes = rest;
    }
    out
}
