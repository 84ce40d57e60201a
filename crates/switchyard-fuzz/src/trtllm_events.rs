//! `trtllm_events`: bodies of `trtllm-serve`'s `POST /kv_cache_events` through the worker's own
//! code: the JSON read (`switchyard_worker::engine::trtllm_wire::parse_poll`), the conversion
//! that finds lost events and keeps the global window
//! (`trtllm_events::TrtllmEvents::ingest`), and the relay of its steps into the worker's event
//! log (`RelayShared::apply_batch`, `reset`), as the adapter's poller does.
//!
//! Input: one or more poll bodies separated by a 0x00 byte (bytes that are not UTF-8 are read
//! lossily, as a body a server mangled), applied one after another to one converter.
//!
//! Checks: nothing panics; a body is either a list of events or an error; after each poll the
//! relay's blocks and the event log's blocks (what gateways are told) agree.

use switchyard_core::BlockSize;
use switchyard_worker::engine::trtllm_events::{Step, TrtllmEvents, parse_poll};

use crate::zmq_event::{check_relay_matches_log, relay_shared};

/// Two attention-DP ranks, block size 2 (small blocks so short inputs fill some), a small map so
/// the bounds are reached.
const DP_RANKS: u32 = 2;
const BLOCK_SIZE: u32 = 2;
const MAP_CAPACITY: usize = 64;
const MAX_POLLS: usize = 8;

/// Runs one input.
pub fn run(data: &[u8]) {
    let block_size = BlockSize::new(BLOCK_SIZE).unwrap_or_else(|_| unreachable!("2 is valid"));
    let shared = relay_shared(BLOCK_SIZE, DP_RANKS, MAP_CAPACITY);
    let mut events = TrtllmEvents::new(block_size, DP_RANKS, MAP_CAPACITY);
    for body in data.split(|b| *b == 0).take(MAX_POLLS) {
        let body = String::from_utf8_lossy(body);
        let Ok((parsed, _unreadable)) = parse_poll(&body) else {
            continue;
        };
        for step in events.ingest(parsed, &shared.counters) {
            match step {
                Step::Apply { rank, batch } => shared.apply_batch(rank, &batch),
                Step::Reset { rank, .. } => shared.reset(rank),
            }
        }
        check_relay_matches_log(&shared);
    }
}
