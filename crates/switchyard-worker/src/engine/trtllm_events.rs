//! TensorRT-LLM's KV cache events: turning what `trtllm-serve` hands out (read by
//! [`trtllm_wire`](super::trtllm_wire)) into the [`EngineBatch`]es the relay
//! ([`kv_relay`](super::kv_relay)) applies, with the loss of events detected rather than papered
//! over.
//!
//! TensorRT-LLM does not push its events: `trtllm-serve` drains its in-engine queue into the body
//! of each `POST /kv_cache_events`, a JSON list (the poller is [`trtllm`](super::trtllm)). The
//! queue holds at most `kv_cache_config.event_buffer_max_size` events and drops the oldest when a
//! reader is slow, so loss has to be found in the events themselves. The shape below is read from
//! TensorRT-LLM's own serializer (`tensorrt_llm/_utils.py`, `KVCacheEventSerializer`; its route
//! in `tensorrt_llm/serve/openai_server.py`) and from how Dynamo's TensorRT-LLM publisher
//! (`components/src/dynamo/trtllm/publisher.py`) reads it:
//!
//! ```text
//! [{"event_id": 7, "window_size": 4096, "attention_dp_rank": 1,      // rank: with attention DP only
//!   "data": {"type": "stored", "parent_hash": 12 | null,
//!            "blocks": [{"type": "stored_block", "block_hash": 13,
//!                        "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, …],
//!                        "cache_level": 0, "priority": 35,
//!                        // newer releases: "mm_keys": [{"type": "mm_key", "hash": "<hex>", "start_offset": 4}],
//!                        //                 "cache_salt": null, "lora_id": null
//!                       }, …]}}, …]
//! data {"type": "created", "num_blocks_per_cache_level": [primary, secondary]}
//!      {"type": "removed", "block_hashes": [13, …]}
//!      {"type": "updated", "block_hash": 13,
//!       "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}, "priority": {…}}
//! ```
//!
//! What [`TrtllmEvents`] makes of them, per attention-DP rank (each its own stream and its own
//! engine-hash namespace, as vLLM's data-parallel ranks):
//!
//! - `event_id` grows by one per event from 0 at engine start. A jump forward is a gap (at the
//!   start of a poll: the engine's buffer wrapped); a jump back, or a `created` after blocks were
//!   stored, is a restart. Nothing can be replayed, so either way the rank's blocks are removed
//!   from the worker's view ([`Step::Reset`]) and rebuilt from the events that follow.
//! - Only the largest attention window (`window_size`) names reusable prefixes (variable
//!   sliding-window models keep one pool per window); events of smaller windows are skipped and
//!   counted (`other_groups`). The one event id counter of a rank spans every window. Newer
//!   releases (KV cache manager V2) also name a `layer_group_id`: each group is its own
//!   engine-hash namespace, as vLLM's KV-cache groups, so a block leaves the view when the last
//!   group holding it drops it.
//! - Blocks are rehashed from their token ids by the relay, so the engine's hash algorithm
//!   (`v1_block_key`, `v2_sha256`) does not matter; hashes are read as unsigned or signed 64-bit
//!   integers or hex digests and only ever compared with each other.
//! - A block of fewer tokens than the block size (TensorRT-LLM stores partial blocks for reuse)
//!   is never indexed; its later removal is dropped quietly.
//! - `cache_level` is the tier (0 the device, 1 host memory); an `updated` event that changes it
//!   moves the block: stored in its new tier, then removed from its old one.
//! - The adapter (`lora_id`, or `lora_name` where a release names it), the salt (`cache_salt`, on
//!   a prompt's first block) and multimodal keys (`mm_keys`, non-zero `token_extra_id`s) are part
//!   of a block's identity, as with the other engines.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use switchyard_core::BlockSize;

use super::kv_decode::{EngineBatch, EngineEvent, StoredEvent};
use super::stats::AdapterCounters;
pub use super::trtllm_wire::{Parsed, PollError, TrtBlock, TrtData, parse_event, parse_poll};
use super::zmq_events::{SeqStep, classify};

/// The medium the relay maps to a tier for a TensorRT-LLM cache level.
fn medium(level: u64) -> String {
    match level {
        0 => "GPU".to_owned(),
        1 => "CPU".to_owned(),
        // A level this worker does not know: the relay counts it and prices it as remote.
        n => format!("CACHE_LEVEL_{n}"),
    }
}

/// Why a rank's blocks were dropped from the worker's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Events `expected..got` never arrived; `wrapped` when at the start of a poll (the engine's
    /// buffer dropped them before it was read).
    Gap {
        expected: u64,
        got: u64,
        wrapped: bool,
    },
    /// Event ids went back: the engine restarted.
    Restart { last: u64, got: u64 },
    /// A `created` event after blocks were stored: the engine made a new cache.
    Recreated,
    /// A larger attention window appeared after blocks of a smaller one were taken (the worker
    /// joined after the engine announced its windows).
    WindowGrew { from: u64, to: u64 },
}

/// What the poller does next, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Apply { rank: u32, batch: EngineBatch },
    Reset { rank: u32, loss: Loss },
}

/// A block as the engine names it: (layer group, engine hash).
type BlockId = (u32, u64);

/// A block the rank holds, kept so a change of cache level can store it again in its new tier.
#[derive(Debug, Clone)]
struct Known {
    parent: Option<u64>,
    tokens: Vec<u32>,
    key: Option<u64>,
    level: u64,
}

/// One attention-DP rank's stream.
#[derive(Debug, Default)]
struct RankStream {
    last_id: Option<u64>,
    window: Option<u64>,
    /// Something was applied since the last reset (a `created` then means a new cache).
    dirty: bool,
    partials: HashSet<BlockId>,
    known: HashMap<BlockId, Known>,
    /// Insertion order of `known` and `partials`, for the bound; may hold stale keys.
    order: VecDeque<BlockId>,
    /// Told the log about this rank's joining a running engine.
    joined: bool,
}

impl RankStream {
    fn reset(&mut self) {
        self.dirty = false;
        self.partials.clear();
        self.known.clear();
        self.order.clear();
    }

    fn remember(&mut self, id: BlockId, known: Option<Known>, capacity: usize) {
        while self.known.len() + self.partials.len() >= capacity {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.known.remove(&old);
            self.partials.remove(&old);
        }
        match known {
            Some(k) => {
                self.known.insert(id, k);
            }
            None => {
                self.partials.insert(id);
            }
        }
        self.order.push_back(id);
    }
}

/// Every attention-DP rank's stream state: sequence, window, partial and held blocks.
#[derive(Debug)]
pub struct TrtllmEvents {
    block_size: BlockSize,
    capacity: usize,
    ranks: Vec<RankStream>,
    /// Ranks past the configured ones, reported once.
    reported_ranks: HashSet<u32>,
}

impl TrtllmEvents {
    /// `capacity`: how many blocks per rank are remembered for moves between tiers (above the
    /// engine's blocks across tiers, and nothing is forgotten).
    pub fn new(block_size: BlockSize, dp_ranks: u32, capacity: usize) -> Self {
        Self {
            block_size,
            capacity: capacity.max(1),
            ranks: (0..dp_ranks.max(1))
                .map(|_| RankStream::default())
                .collect(),
            reported_ranks: HashSet::new(),
        }
    }

    /// Turns one poll's events into the steps that apply them, counting what it finds.
    pub fn ingest(&mut self, events: Vec<Parsed>, c: &AdapterCounters) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut pending: BTreeMap<u32, EngineBatch> = BTreeMap::new();
        let mut seen: HashSet<u32> = HashSet::new();
        let capacity = self.capacity;
        let bs = self.block_size.as_usize();
        for event in events {
            let rank = event.rank;
            let rc = c.rank(rank);
            let Some(stream) = self.ranks.get_mut(rank as usize) else {
                rc.add(&rc.skipped_events, 1);
                if self.reported_ranks.insert(rank) {
                    tracing::warn!(
                        rank,
                        ranks = self.ranks.len(),
                        "TensorRT-LLM kv events name an attention-DP rank past --dp-ranks; they are skipped"
                    );
                }
                continue;
            };
            match classify(stream.last_id, event.event_id) {
                SeqStep::InOrder => {}
                SeqStep::First => {
                    if event.event_id > 0 && !stream.joined {
                        tracing::info!(
                            rank,
                            first = event.event_id,
                            "joined a running TensorRT-LLM engine: blocks stored before event {} stay unknown until evicted or stored again",
                            event.event_id
                        );
                    }
                }
                SeqStep::Gap { missing_from } => {
                    let wrapped = !seen.contains(&rank);
                    rc.add(&rc.gaps, 1);
                    rc.add(&rc.resyncs, 1);
                    if wrapped {
                        rc.add(&rc.buffer_wraps, 1);
                    }
                    tracing::warn!(
                        rank,
                        missing_from,
                        got = event.event_id,
                        wrapped,
                        "TensorRT-LLM kv events lost{}; clearing the rank's blocks and rebuilding",
                        if wrapped {
                            " (the engine's event buffer wrapped: raise event_buffer_max_size or poll faster)"
                        } else {
                            ""
                        }
                    );
                    let loss = Loss::Gap {
                        expected: missing_from,
                        got: event.event_id,
                        wrapped,
                    };
                    reset(&mut pending, &mut steps, stream, rank, loss);
                }
                SeqStep::Restart => {
                    rc.add(&rc.restarts, 1);
                    let last = stream.last_id.unwrap_or_default();
                    tracing::warn!(
                        rank,
                        last,
                        got = event.event_id,
                        "TensorRT-LLM engine restarted; clearing its blocks"
                    );
                    let loss = Loss::Restart {
                        last,
                        got: event.event_id,
                    };
                    reset(&mut pending, &mut steps, stream, rank, loss);
                }
            }
            stream.last_id = Some(event.event_id);
            stream.joined = true;
            seen.insert(rank);
            let data = match event.data {
                Ok(data) => data,
                Err(skipped) => {
                    batch_of(&mut pending, rank).skipped.push(skipped);
                    continue;
                }
            };
            let group = event.group;
            if let Some(w) = event.window {
                match stream.window {
                    Some(current) if w < current => {
                        // A sliding-window pool: its blocks name no reusable prefix.
                        if !matches!(data, TrtData::Created) {
                            rc.add(&rc.other_groups, 1);
                        }
                        continue;
                    }
                    Some(current) if w > current && stream.dirty => {
                        rc.add(&rc.resyncs, 1);
                        tracing::warn!(
                            rank,
                            from = current,
                            to = w,
                            "a larger TensorRT-LLM attention window appeared; rebuilding the rank's blocks from it"
                        );
                        let loss = Loss::WindowGrew {
                            from: current,
                            to: w,
                        };
                        reset(&mut pending, &mut steps, stream, rank, loss);
                    }
                    _ => {}
                }
                stream.window = Some(stream.window.map_or(w, |current| current.max(w)));
            }
            if matches!(data, TrtData::Created) {
                if stream.dirty {
                    rc.add(&rc.restarts, 1);
                    tracing::warn!(
                        rank,
                        "TensorRT-LLM created a new KV cache; clearing the rank's blocks"
                    );
                    reset(&mut pending, &mut steps, stream, rank, Loss::Recreated);
                }
                continue;
            }
            let batch = batch_of(&mut pending, rank);
            match data {
                TrtData::Created => {}
                TrtData::Stored { parent, blocks } => {
                    stream.dirty = true;
                    let at = Place {
                        group,
                        bs,
                        capacity,
                    };
                    convert_stored(stream, parent, &blocks, at, batch, rc);
                }
                TrtData::Removed { hashes } => {
                    let mut by_level: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
                    for h in hashes {
                        if stream.partials.remove(&(group, h)) {
                            continue;
                        }
                        let level = stream.known.remove(&(group, h)).map_or(0, |k| k.level);
                        by_level.entry(level).or_default().push(h);
                    }
                    for (level, block_hashes) in by_level {
                        batch.events.push(EngineEvent::BlockRemoved {
                            block_hashes,
                            medium: Some(medium(level)),
                            group,
                        });
                    }
                }
                TrtData::Updated {
                    hash,
                    cache_level: Some((old, new)),
                } if old != new => match stream.known.get_mut(&(group, hash)) {
                    Some(known) => {
                        // Stored in the new tier first, so the block's mapping (and its
                        // children's parent) never lapses, then removed from the old one.
                        batch.events.push(EngineEvent::BlockStored(StoredEvent {
                            block_hashes: vec![hash],
                            parent: known.parent,
                            token_ids: known.tokens.clone(),
                            block_size: u32::try_from(known.tokens.len()).ok(),
                            medium: Some(medium(new)),
                            group,
                            block_keys: if known.key.is_some() {
                                vec![known.key]
                            } else {
                                Vec::new()
                            },
                            ..StoredEvent::default()
                        }));
                        batch.events.push(EngineEvent::BlockRemoved {
                            block_hashes: vec![hash],
                            medium: Some(medium(known.level)),
                            group,
                        });
                        known.level = new;
                    }
                    None => rc.add(&rc.unknown_removals, 1),
                },
                // A priority change, or a level "change" to the same level: nothing moves.
                TrtData::Updated { .. } => {}
            }
        }
        for (rank, batch) in pending {
            if !batch.events.is_empty() || !batch.skipped.is_empty() {
                steps.push(Step::Apply { rank, batch });
            }
        }
        steps
    }
}

/// The batch being gathered for `rank` in this poll.
fn batch_of(pending: &mut BTreeMap<u32, EngineBatch>, rank: u32) -> &mut EngineBatch {
    pending.entry(rank).or_insert_with(|| EngineBatch {
        events: Vec::new(),
        skipped: Vec::new(),
        dp_rank: Some(rank),
    })
}

/// Applies what `rank` gathered so far, then drops its blocks from the worker's view.
fn reset(
    pending: &mut BTreeMap<u32, EngineBatch>,
    steps: &mut Vec<Step>,
    stream: &mut RankStream,
    rank: u32,
    loss: Loss,
) {
    if let Some(batch) = pending.remove(&rank) {
        steps.push(Step::Apply { rank, batch });
    }
    stream.reset();
    steps.push(Step::Reset { rank, loss });
}

/// A stored run as the relay takes it: no keys at all when no block has one.
fn finish(mut run: StoredEvent) -> EngineEvent {
    if run.block_keys.iter().all(Option::is_none) {
        run.block_keys.clear();
    }
    EngineEvent::BlockStored(run)
}

/// Converts one `stored` event: its full blocks, split where the cache level changes; a partial
/// block ends it (and is remembered, so its removal is dropped), a larger block is handed to the
/// relay as it is, which refuses and reports it.
/// Where a stored event's blocks go: their layer group, the block size, the bound on what is
/// remembered.
#[derive(Debug, Clone, Copy)]
struct Place {
    group: u32,
    bs: usize,
    capacity: usize,
}

fn convert_stored(
    stream: &mut RankStream,
    parent: Option<u64>,
    blocks: &[TrtBlock],
    at: Place,
    batch: &mut EngineBatch,
    rc: &super::stats::RankCounters,
) {
    let Place {
        group,
        bs,
        capacity,
    } = at;
    let mut run: Option<StoredEvent> = None;
    let mut run_level = 0;
    let mut prev = parent;
    for (i, block) in blocks.iter().enumerate() {
        let n = block.tokens.len();
        if n != bs {
            if let Some(done) = run.take() {
                batch.events.push(finish(done));
            }
            if n < bs {
                rc.add(&rc.partial_blocks, (blocks.len() - i) as u64);
                stream.remember((group, block.hash), None, capacity);
            } else {
                batch.events.push(EngineEvent::BlockStored(StoredEvent {
                    block_hashes: vec![block.hash],
                    parent: prev,
                    token_ids: block.tokens.clone(),
                    block_size: u32::try_from(n).ok(),
                    medium: Some(medium(block.cache_level)),
                    group,
                    ..StoredEvent::default()
                }));
            }
            return;
        }
        // The salt keys a prompt's first block, from which every later hash chains (as the
        // gateway hashes a salted prompt).
        let first = i == 0 && parent.is_none();
        let key = switchyard_core::identity_block_key(
            block.lora.as_deref(),
            block.salt.as_deref().filter(|_| first),
            block.other.as_deref(),
        );
        if run.is_some()
            && run_level != block.cache_level
            && let Some(done) = run.take()
        {
            batch.events.push(finish(done));
        }
        let current = run.get_or_insert_with(|| StoredEvent {
            parent: prev,
            block_size: u32::try_from(bs).ok(),
            medium: Some(medium(block.cache_level)),
            group,
            ..StoredEvent::default()
        });
        run_level = block.cache_level;
        current.block_hashes.push(block.hash);
        current.token_ids.extend_from_slice(&block.tokens);
        current.block_keys.push(key);
        stream.remember(
            (group, block.hash),
            Some(Known {
                parent: prev,
                tokens: block.tokens.clone(),
                key,
                level: block.cache_level,
            }),
            capacity,
        );
        prev = Some(block.hash);
    }
    if let Some(done) = run {
        batch.events.push(finish(done));
    }
}

#[cfg(test)]
#[path = "trtllm_events_tests.rs"]
mod tests;
