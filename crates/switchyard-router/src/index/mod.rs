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
//! ## Memory layout: runs
//! Workers are interned to dense `u32` slots. A worker's blocks in one tier are kept as *runs*
//! (see `runs.rs`): a run is a chain of blocks, head first, in one vector, each block the
//! parent of the next. A `Stored` chain under the tail of one of the worker's runs in that tier
//! extends the run (an engine stores a sequence's next blocks under its last one); any other
//! starts a run. Maps keyed by block hash point at runs' first and last blocks; no map holds
//! every block, so storing or evicting a sequence costs a few map accesses per event, not one
//! per block. Each run keeps a 256-bit summary of its blocks (a worker's summaries side by side)
//! and a bit set over them (two bytes per block), through which a block that is no run's head or
//! end (a branch off the middle of a run, a block removed from inside a run) is found in one
//! sweep, without reading every run. A block is kept at most once per worker and tier, whatever
//! the events repeat, and the index counts `(block, worker)` pairs across tiers.
//!
//! ## The overlap query
//! Block hashes are chained (a block's hash names its whole prefix), so a run starting at prompt
//! block `p` holds prompt blocks `p..p+m` exactly when its `m`-th block is prompt block `p+m-1`:
//! the query follows each worker along its runs from the prompt's first block, comparing one
//! block per run, and looks up the worker's next run only where one ends or the prompt leaves
//! it. The runs starting at one block form a *family*: its first run leads, and once the family
//! has eight runs each member keeps how many blocks it shares with the leader and its block
//! after those, so the query matches the leader and settles the members of a shared system
//! prompt without reading their runs. A worker holding blocks in several tiers is walked position by position. Answers are
//! exact for any stream of valid events, in any order: a block stored under a parent the worker
//! does not hold is simply never reached (see `overlap.rs`).
//!
//! ## Bounded memory
//! [`IndexConfig::max_entries`] caps the `(block, worker)` pairs. When an event leaves more,
//! the index evicts pairs one at a time from one worker: the storing worker itself if it holds
//! at least its fair share (`max_entries / workers`), otherwise the worker holding the most
//! pairs. The pair evicted is the tail of that worker's least recently made or extended run
//! (tail first, so what stays is still a prefix), from every tier holding it. So a worker whose
//! `Removed` events are lost cannot push the other workers out of the index. An evicted pair
//! under-reports what the worker holds, which only makes the router a little pessimistic about
//! that worker's cache.
//!
//! Memory per pair follows from the runs: a block in a run costs its 8-byte hash and two bytes
//! of bit set, a run a few dozen bytes more and its entries in the maps (`docs/BENCHMARKS.md`:
//! 24–32 bytes per pair for stored chains of 16 blocks, 37–54 on the trace replays). A block
//! stored alone (a snapshot naming no parents) is a run of its own and costs several times that;
//! the cap counts pairs, not bytes.

mod digest;
mod overlap;
mod runs;
mod store;
pub(crate) use runs::tier_bit;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use switchyard_core::{
    BlockHash, BlockSize, EventSeq, Incarnation, KvEvent, SnapshotBlock, StorageTier, WorkerId,
};

use crate::error::IndexError;
use crate::hasher::FxHashMap;
pub use overlap::{OverlapScores, TierOverlap};
use runs::{RunStore, set_of};

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
    /// Number of `(block, this worker)` pairs in the index.
    live: usize,
    /// What a reader attached to the slot ([`PrefixIndex::tag_slot`]); 0 when none. A new
    /// state starts without one, so a slot given to another worker never keeps the last one's.
    tag: AtomicU64,
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

/// The index's counters with a copy of every indexed block, taken where the index is guarded
/// (a copy is a sweep over the runs); the distinct blocks are counted from the copy by
/// [`StatsDraft::finish`], wherever the caller chooses, so whatever guards the index is held
/// for the copy only.
#[derive(Debug, Clone)]
pub struct StatsDraft {
    stats: IndexStats,
    blocks: Vec<BlockHash>,
}

impl StatsDraft {
    /// The statistics, `blocks` counted (O(pairs · log pairs), in place).
    pub fn finish(mut self) -> IndexStats {
        self.blocks.sort_unstable();
        self.blocks.dedup();
        IndexStats {
            blocks: self.blocks.len(),
            ..self.stats
        }
    }
}

/// Which workers hold which blocks; see the module docs.
#[derive(Debug)]
pub struct PrefixIndex {
    config: IndexConfig,
    runs: RunStore,
    workers: Vec<Option<WorkerState>>,
    by_id: FxHashMap<WorkerId, u32>,
    free_slots: Vec<u32>,
    entries: usize,
    evicted: u64,
    resyncs: u64,
    stale: u64,
    /// Reused by each event: a `Stored` chain's hashes, and the blocks an event added or removed.
    chain: Vec<BlockHash>,
    added: Vec<BlockHash>,
    /// The slot of the worker of the last event or snapshot (see `slot_for`); possibly freed
    /// since, which `slot_for` notices.
    last_slot: u32,
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            runs: RunStore::default(),
            workers: Vec::new(),
            by_id: FxHashMap::default(),
            free_slots: Vec::new(),
            entries: 0,
            evicted: 0,
            resyncs: 0,
            stale: 0,
            chain: Vec::new(),
            added: Vec::new(),
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
            ApplyOutcome::Applied => self.apply_unsequenced(slot, event),
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
        self.state_mut(slot).sync = Sync::Expecting(next_seq);
        Ok(())
    }

    /// Drops `worker` and every block it held. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: &WorkerId) -> bool {
        let Some(slot) = self.by_id.remove(worker) else {
            return false;
        };
        self.clear_worker(slot);
        self.workers[slot as usize] = None;
        self.free_slots.push(slot);
        true
    }

    /// The worker's key, if the index knows it.
    pub fn worker_key(&self, worker: &WorkerId) -> Option<WorkerKey> {
        self.by_id.get(worker).map(|&s| WorkerKey(s))
    }

    /// The value last attached to the worker's slot with [`PrefixIndex::tag_slot`] since the
    /// slot was given to this worker; 0 when none (or no such slot).
    ///
    /// A reader keeps a look-up of its own there (the routing decision: the worker's place in
    /// the load view's ranking, with the ranking's epoch, so it can tell a stale one), written
    /// under a shared borrow: relaxed, as the value checks itself.
    pub fn slot_tag(&self, key: WorkerKey) -> u64 {
        self.workers
            .get(key.0 as usize)
            .and_then(Option::as_ref)
            .map_or(0, |w| w.tag.load(Ordering::Relaxed))
    }

    /// Attaches `tag` to the worker's slot (see [`PrefixIndex::slot_tag`]).
    pub fn tag_slot(&self, key: WorkerKey, tag: u64) {
        if let Some(w) = self.workers.get(key.0 as usize).and_then(Option::as_ref) {
            w.tag.store(tag, Ordering::Relaxed);
        }
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
        StorageTier::ALL
            .into_iter()
            .filter(|&t| self.runs.holds(set_of(slot, t), block))
            .collect()
    }

    /// Pairs evicted by the memory bound so far (cheap, unlike [`Self::stats`]).
    pub fn evicted_entries(&self) -> u64 {
        self.evicted
    }

    /// Counters and sizes. Counting distinct blocks reads every block of every run (no map holds
    /// every block): O(pairs), for the admin API, not for a hot path.
    pub fn stats(&self) -> IndexStats {
        self.stats_draft().finish()
    }

    /// The counters and a copy of every indexed block, to count the distinct ones later (see
    /// [`StatsDraft`]): O(pairs), a copy per run, no hashing.
    pub fn stats_draft(&self) -> StatsDraft {
        StatsDraft {
            stats: self.counters(),
            blocks: self.runs.all_blocks(),
        }
    }

    /// Every statistic but the distinct blocks (left 0).
    fn counters(&self) -> IndexStats {
        IndexStats {
            workers: self.by_id.len(),
            blocks: 0,
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
        self.runs.heap_bytes()
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
            + map_bytes(&self.by_id)
            + self.free_slots.capacity() * 4
            + (self.chain.capacity() + self.added.capacity()) * 8
    }

    /// A deterministic text rendering of the whole index: workers sorted by id, each with its
    /// incarnation, sequence state and blocks sorted by hash with their tiers. Two indexes fed
    /// the same events in the same order dump to the same bytes.
    pub fn dump(&self) -> String {
        let mut workers: Vec<(&WorkerId, u32)> =
            self.by_id.iter().map(|(id, &s)| (id, s)).collect();
        workers.sort();
        let mut out = String::new();
        for (id, slot) in workers {
            let Some(state) = self.workers[slot as usize].as_ref() else {
                continue;
            };
            let mut blocks: BTreeMap<BlockHash, Vec<&str>> = BTreeMap::new();
            for tier in StorageTier::ALL {
                for block in self.runs.blocks_of(set_of(slot, tier)) {
                    blocks.entry(block).or_default().push(tier.as_str());
                }
            }
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
            for (block, tiers) in blocks {
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
            live: 0,
            tag: AtomicU64::new(0),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(state);
                slot
            }
            None => {
                if self.workers.len() >= runs::MAX_SLOTS {
                    return Err(IndexError::TooManyWorkers {
                        max: runs::MAX_SLOTS,
                    });
                }
                self.workers.push(Some(state));
                (self.workers.len() - 1) as u32
            }
        };
        self.runs.ensure_slot(slot);
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

/// Heap bytes of a hash map's buckets (entries and control bytes), from its capacity.
fn map_bytes<K, V>(map: &FxHashMap<K, V>) -> usize {
    map.capacity() * (std::mem::size_of::<(K, V)>() + 1)
}

#[cfg(test)]
mod tests;
