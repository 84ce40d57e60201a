//! The prefix index: which workers hold which blocks, in which tier, built from KV events.
//!
//! ## Sequence tracking
//! Each worker's events carry `(incarnation, seq)`. The index keeps, per worker, the incarnation
//! it knows and the next sequence number it expects:
//! - an event of another incarnation than the known one means the engine restarted: everything
//!   known of the worker is dropped and sequence numbers start again at 0 (a brand-new worker is
//!   treated the same way);
//! - `seq < expected` is a stale or duplicate event and is ignored;
//! - `seq > expected` is a gap: the event is not applied, the worker is marked as awaiting a
//!   snapshot, and the caller is told to resync ([`ApplyOutcome::ResyncNeeded`]). Until
//!   [`PrefixIndex::apply_snapshot`] arrives, the worker's last known blocks stay in the index
//!   (slightly stale knowledge routes better than none) and further events are refused the same
//!   way.
//!
//! ## Memory layout
//! Workers are interned to dense `u32` slots. Blocks live in a [`HolderMap`] (24-byte entries,
//! in a small young map of recently stored blocks and a big old one behind a one-bit presence
//! filter; shared blocks' holder lists in one slab; see `holders.rs` and `old.rs`). Each worker also keeps its blocks in insertion order in a queue of
//! hashes (8 bytes per entry), used to drop a worker wholesale and to pick eviction victims.
//! Removals do not search that queue: they leave a stale entry, skipped when met, and a note in
//! a log from which a sweep drops the stale entries without reading the block map (see
//! `order.rs`).
//!
//! ## Prefix closure and the jump search
//! A worker's blocks are *prefix-closed* when, for every block it holds, it also holds the
//! block's parent. Engines publish that way (a chain is stored under a cached parent; a finished
//! sequence is evicted tail first), and then, because a block hash names its whole prefix,
//! holding block `j` of a prompt means holding blocks `0..=j`: the overlap query can jump ahead
//! and bisect to where workers drop out instead of visiting every block (see `overlap.rs`).
//!
//! The index knows each block's parent (recorded when the block is first stored: the event's
//! `parent` for its first block, the previous block for the others, the snapshot's `parent`)
//! and, per `(block, worker)` pair, how many of the block's children the same worker holds
//! (4 bits, saturating). A worker is marked `broken` when that can stop being true: a block
//! stored under a parent the worker does not hold, a block stored with another parent than the
//! one recorded, or a pair removed (by an event or by eviction) while the worker still holds one
//! of its children — within one `Removed` event the check is made after the whole event, so the
//! order of its blocks does not matter. `broken` only clears when all of the worker's blocks go
//! (`Cleared`, a new incarnation, a snapshot, which is checked as a whole; a snapshot in which
//! no block names a parent leaves the worker broken, since its closure cannot be checked). The
//! query jumps only when every worker it follows is closed and holds its blocks on the device
//! only; otherwise it walks block by block, so answers are exact either way.
//!
//! ## Bounded memory
//! [`IndexConfig::max_entries`] caps the `(block, worker)` pairs. When a new pair would exceed
//! it, the index evicts the oldest pair (first stored, FIFO; a `Stored` chain goes in tail
//! first, so its tail is evicted before its head) of one worker: the storing worker
//! itself if it holds at least its fair share (`max_entries / workers`), otherwise the worker
//! holding the most pairs. So a worker whose `Removed` events are lost cannot push the other
//! workers out of the index. An evicted pair under-reports what the worker holds, which only
//! makes the router a little pessimistic about that worker's cache.

mod digest;
mod holders;
mod order;
pub(crate) use holders::tier_bit as holders_tier_bit;
mod old;
mod overlap;
mod slab;
mod store;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use switchyard_core::{
    BlockHash, BlockSize, EventSeq, Incarnation, KvEvent, SnapshotBlock, StorageTier, WorkerId,
};

use crate::error::IndexError;
use crate::hasher::FxHashMap;
use holders::{HolderMap, tier_bit};
pub use overlap::{OverlapScores, TierOverlap};

/// A worker's blocks and tier masks, as the dump gathers them.
type WorkerBlocks = Vec<(BlockHash, u8)>;

/// Settings of a [`PrefixIndex`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block; `Stored` events with other block lengths are refused.
    pub block_size: BlockSize,
    /// Most `(block, worker)` pairs kept; see the module docs for the eviction rule.
    pub max_entries: usize,
    /// Recompute each stored block's chained hash from its tokens and refuse mismatches.
    /// Turn off only for events produced in-process (replay, the simulator) that are known good.
    pub verify_hashes: bool,
}

impl IndexConfig {
    pub fn new(block_size: BlockSize) -> Self {
        Self {
            block_size,
            max_entries: 16 << 20,
            verify_hashes: true,
        }
    }
}

/// A worker's dense slot in one [`PrefixIndex`]. Valid only for that index, until the worker is
/// removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey(pub(crate) u32);

/// What [`PrefixIndex::apply`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ApplyOutcome {
    /// The event was in order and is now reflected in the index.
    Applied,
    /// The event was older than the next expected one (a duplicate); nothing changed.
    Stale { expected: EventSeq, got: EventSeq },
    /// Events were missed; nothing changed. The caller must fetch a snapshot of the worker and
    /// pass it to [`PrefixIndex::apply_snapshot`]. `expected` is `None` when the worker was
    /// already awaiting a snapshot.
    ResyncNeeded {
        expected: Option<EventSeq>,
        got: EventSeq,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    Expecting(EventSeq),
    AwaitingSnapshot,
}

#[derive(Debug)]
struct WorkerState {
    id: WorkerId,
    incarnation: Incarnation,
    sync: Sync,
    /// The worker's blocks in insertion order, possibly with stale entries (see module docs).
    order: order::InsertionOrder,
    /// Number of `(block, this worker)` pairs in the index.
    live: usize,
    /// The worker's blocks may not be prefix-closed (see the module docs); sticky until the
    /// worker's blocks are all dropped or replaced by a snapshot.
    broken: bool,
    /// Pairs of this worker held in some tier other than the device only.
    mixed: usize,
    /// `!broken && mixed == 0` as of the end of the last change (counted in `unjumpable`).
    jumpable: bool,
}

/// Counters and sizes, for the admin API and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IndexStats {
    pub workers: usize,
    pub blocks: usize,
    pub entries: usize,
    pub max_entries: usize,
    pub evicted_entries: u64,
    pub resyncs_requested: u64,
    pub stale_events: u64,
    pub heap_bytes: usize,
}

/// Which workers hold which blocks; see the module docs.
#[derive(Debug)]
pub struct PrefixIndex {
    config: IndexConfig,
    holders: HolderMap,
    workers: Vec<Option<WorkerState>>,
    by_id: FxHashMap<WorkerId, u32>,
    free_slots: Vec<u32>,
    entries: usize,
    evicted: u64,
    resyncs: u64,
    stale: u64,
    /// Known workers that are not jumpable (see `store.rs`); when 0 the jump search compares
    /// holder counts instead of holder sets.
    unjumpable: usize,
    /// Reused by each `Removed` event (see `store.rs`).
    scratch: store::Scratch,
    /// Shared by every worker's order-queue sweeps (see `order.rs`).
    sweep_scratch: order::SweepScratch,
    /// The slot of the worker of the last event or snapshot (see `slot_for`); possibly freed
    /// since, which `slot_for` notices.
    last_slot: u32,
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            holders: HolderMap::default(),
            workers: Vec::new(),
            by_id: FxHashMap::default(),
            free_slots: Vec::new(),
            entries: 0,
            evicted: 0,
            resyncs: 0,
            stale: 0,
            unjumpable: 0,
            scratch: store::Scratch::default(),
            sweep_scratch: order::SweepScratch::default(),
            last_slot: 0,
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    pub fn block_size(&self) -> BlockSize {
        self.config.block_size
    }

    /// Applies one event of `worker`'s stream; see the module docs for the sequence rules.
    ///
    /// An invalid event (partial block, hash not matching its tokens) is refused with an error
    /// and changes nothing, not even the sequence tracking.
    pub fn apply(
        &mut self,
        worker: &WorkerId,
        incarnation: Incarnation,
        seq: EventSeq,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, IndexError> {
        self.check_event(event)?;
        let slot = self.slot_for(worker, incarnation)?;
        let state = self.state_mut(slot);
        let outcome = match state.sync {
            Sync::AwaitingSnapshot => ApplyOutcome::ResyncNeeded {
                expected: None,
                got: seq,
            },
            Sync::Expecting(expected) if seq < expected => {
                ApplyOutcome::Stale { expected, got: seq }
            }
            Sync::Expecting(expected) if seq > expected => {
                state.sync = Sync::AwaitingSnapshot;
                ApplyOutcome::ResyncNeeded {
                    expected: Some(expected),
                    got: seq,
                }
            }
            Sync::Expecting(expected) => {
                // Nothing can follow the last sequence number (only a peer that is wrong sends
                // it): after it, the worker's blocks are taken from a snapshot again.
                state.sync = expected
                    .checked_add(1)
                    .map_or(Sync::AwaitingSnapshot, Sync::Expecting);
                ApplyOutcome::Applied
            }
        };
        match outcome {
            ApplyOutcome::Applied => {
                self.apply_unsequenced(slot, event);
                self.refresh_jumpable(slot);
            }
            ApplyOutcome::Stale { .. } => self.stale += 1,
            ApplyOutcome::ResyncNeeded { .. } => self.resyncs += 1,
        }
        Ok(outcome)
    }

    /// Replaces everything known of `worker` with a snapshot of its blocks; the next event
    /// expected is `next_seq` of `incarnation`.
    pub fn apply_snapshot(
        &mut self,
        worker: &WorkerId,
        incarnation: Incarnation,
        next_seq: EventSeq,
        blocks: &[SnapshotBlock],
    ) -> Result<(), IndexError> {
        let slot = self.slot_for(worker, incarnation)?;
        self.clear_worker(slot);
        self.store_snapshot(slot, blocks);
        self.refresh_jumpable(slot);
        self.state_mut(slot).sync = Sync::Expecting(next_seq);
        Ok(())
    }

    /// Drops `worker` and every block it held. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: &WorkerId) -> bool {
        let Some(slot) = self.by_id.remove(worker) else {
            return false;
        };
        self.clear_worker(slot);
        // A cleared worker is jumpable, so the count of the others is right as it stands.
        self.workers[slot as usize] = None;
        self.free_slots.push(slot);
        true
    }

    /// The worker's key, if the index knows it.
    pub fn worker_key(&self, worker: &WorkerId) -> Option<WorkerKey> {
        self.by_id.get(worker).map(|&s| WorkerKey(s))
    }

    pub fn worker_id(&self, key: WorkerKey) -> Option<&WorkerId> {
        self.workers
            .get(key.0 as usize)
            .and_then(Option::as_ref)
            .map(|w| &w.id)
    }

    /// Known workers, sorted by id.
    pub fn workers(&self) -> Vec<&WorkerId> {
        let mut ids: Vec<&WorkerId> = self.by_id.keys().collect();
        ids.sort();
        ids
    }

    /// Number of `(block, worker)` pairs `worker` has in the index.
    pub fn worker_entries(&self, worker: &WorkerId) -> usize {
        self.by_id.get(worker).map_or(0, |&s| {
            self.workers[s as usize].as_ref().map_or(0, |w| w.live)
        })
    }

    /// Whether `worker` is waiting for a snapshot after a gap.
    pub fn awaiting_snapshot(&self, worker: &WorkerId) -> bool {
        self.by_id.get(worker).is_some_and(|&s| {
            self.workers[s as usize]
                .as_ref()
                .is_some_and(|w| w.sync == Sync::AwaitingSnapshot)
        })
    }

    /// Tiers in which `worker` holds `block`, in tier order.
    pub fn tiers_of(&self, worker: &WorkerId, block: BlockHash) -> Vec<StorageTier> {
        let Some(&slot) = self.by_id.get(worker) else {
            return Vec::new();
        };
        let mask = self.holders.tiers_of(block, slot);
        StorageTier::ALL
            .into_iter()
            .filter(|t| mask & tier_bit(*t) != 0)
            .collect()
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            workers: self.by_id.len(),
            blocks: self.holders.blocks(),
            entries: self.entries,
            max_entries: self.config.max_entries,
            evicted_entries: self.evicted,
            resyncs_requested: self.resyncs,
            stale_events: self.stale,
            heap_bytes: self.heap_bytes(),
        }
    }

    /// Approximate heap bytes held, computed from the containers' capacities.
    pub fn heap_bytes(&self) -> usize {
        let order: usize = self
            .workers
            .iter()
            .flatten()
            .map(|w| w.order.heap_bytes())
            .sum();
        self.holders.heap_bytes()
            + self.sweep_scratch.heap_bytes()
            + order
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
    }

    /// A deterministic text rendering of the whole index: workers sorted by id, each with its
    /// incarnation, sequence state and blocks sorted by hash with their tiers. Two indexes fed
    /// the same events in the same order dump to the same bytes.
    pub fn dump(&self) -> String {
        let mut per_worker: BTreeMap<&WorkerId, (u32, WorkerBlocks)> = self
            .by_id
            .iter()
            .map(|(id, &slot)| (id, (slot, Vec::new())))
            .collect();
        let slot_to_id: FxHashMap<u32, &WorkerId> =
            self.by_id.iter().map(|(id, &s)| (s, id)).collect();
        for (block, holders) in self.holders.iter() {
            for h in holders {
                if let Some(id) = slot_to_id.get(&h.slot())
                    && let Some(entry) = per_worker.get_mut(id)
                {
                    entry.1.push((block, h.tiers()));
                }
            }
        }
        let mut out = String::new();
        for (id, (slot, mut blocks)) in per_worker {
            blocks.sort_unstable();
            let Some(state) = self.workers[slot as usize].as_ref() else {
                continue;
            };
            let sync = match state.sync {
                Sync::Expecting(s) => format!("next_seq={s}"),
                Sync::AwaitingSnapshot => "awaiting_snapshot".to_owned(),
            };
            let _ = writeln!(
                out,
                "worker {id} incarnation={} {sync} blocks={}",
                state.incarnation,
                blocks.len()
            );
            for (block, mask) in blocks {
                let tiers: Vec<&str> = StorageTier::ALL
                    .into_iter()
                    .filter(|t| mask & tier_bit(*t) != 0)
                    .map(StorageTier::as_str)
                    .collect();
                let _ = writeln!(out, "  {block} {}", tiers.join(","));
            }
        }
        out
    }

    fn check_event(&self, event: &KvEvent) -> Result<(), IndexError> {
        if let KvEvent::Stored { blocks, .. } = event {
            if self.config.verify_hashes {
                return event
                    .validate(self.config.block_size)
                    .map_err(IndexError::InvalidEvent);
            }
            let bs = self.config.block_size;
            if let Some(b) = blocks.iter().find(|b| b.tokens.len() != bs.as_usize()) {
                return Err(IndexError::InvalidEvent(
                    switchyard_core::CoreError::PartialBlock {
                        got: b.tokens.len(),
                        block_size: bs.get(),
                    },
                ));
            }
        }
        Ok(())
    }

    /// The worker's slot, created if new; a different incarnation resets the worker.
    fn slot_for(&mut self, worker: &WorkerId, incarnation: Incarnation) -> Result<u32, IndexError> {
        // Events come in runs from one worker (a subscriber drains a worker's stream in
        // batches): comparing the id with the last one's skips hashing it into `by_id`.
        let last = self.last_slot;
        let known = if self
            .workers
            .get(last as usize)
            .and_then(Option::as_ref)
            .is_some_and(|w| w.id == *worker)
        {
            Some(last)
        } else {
            self.by_id.get(worker).copied()
        };
        if let Some(slot) = known {
            self.last_slot = slot;
            if self.state_mut(slot).incarnation != incarnation {
                self.clear_worker(slot);
                let state = self.state_mut(slot);
                state.incarnation = incarnation;
                state.sync = Sync::Expecting(0);
            }
            return Ok(slot);
        }
        let state = WorkerState {
            id: worker.clone(),
            incarnation,
            sync: Sync::Expecting(0),
            order: order::InsertionOrder::default(),
            live: 0,
            broken: false,
            mixed: 0,
            jumpable: true,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(state);
                slot
            }
            None => {
                if self.workers.len() >= holders::MAX_SLOTS {
                    return Err(IndexError::TooManyWorkers {
                        max: holders::MAX_SLOTS,
                    });
                }
                self.workers.push(Some(state));
                (self.workers.len() - 1) as u32
            }
        };
        self.by_id.insert(worker.clone(), slot);
        self.last_slot = slot;
        Ok(slot)
    }

    fn state_mut(&mut self, slot: u32) -> &mut WorkerState {
        match self.workers[slot as usize].as_mut() {
            Some(state) => state,
            // Slots in `by_id` always point at a live state; this is an internal invariant.
            None => unreachable!("worker slot {slot} has no state"),
        }
    }
}

#[cfg(test)]
mod tests;
