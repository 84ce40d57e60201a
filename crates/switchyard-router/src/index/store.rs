//! How events change the index: pairs added and removed, the bookkeeping that keeps each
//! worker's prefix-closure flag honest (see the module docs of `mod.rs`), the FIFO eviction
//! under the memory bound, and the sweep of the per-worker insertion queues.

use switchyard_core::{BlockHash, KvEvent, SnapshotBlock, StoredBlock};

use super::PrefixIndex;
use super::holders::{ALL_TIERS, CHILD_MAX, DEVICE, PairChange, tier_bit};
use crate::hasher::FxHashMap;

/// Buffers reused by each `Removed` event.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// The pairs the event removed, in its order.
    gone: Vec<(BlockHash, Gone)>,
    /// Position in `gone` of each block, for events too long to search `gone` itself; built
    /// only when a parent is not next to its child in the list (engines list a chain tail or
    /// head first, so most events never need it).
    at: FxHashMap<BlockHash, usize>,
}

/// Events removing more pairs than this find a removed parent through a map, shorter ones by
/// scanning (which beats building a map for an engine's usual run of a few blocks).
const SCAN_MAX: usize = 32;

/// `Stored` chains of at least this many blocks go straight into the old block map (see
/// `HolderMap::set_straight_to_old`); an engine's shorter stores, often evicted soon after (the
/// churn of a busy worker), stay in the young map.
const STRAIGHT_TO_OLD: usize = 64;

/// A pair removed by the current `Removed` event.
#[derive(Debug, Clone, Copy)]
struct Gone {
    parent: BlockHash,
    /// The pair's child count when it went.
    children: u32,
    /// Of those, children removed by the same event.
    children_gone: u32,
}

/// Whether a tier mask makes a pair count against the jump search (held elsewhere than, or
/// besides, the device).
#[inline]
fn mixed(mask: u8) -> bool {
    mask != 0 && mask != DEVICE
}

impl PrefixIndex {
    pub(super) fn apply_unsequenced(&mut self, slot: u32, event: &KvEvent) {
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => self.store_chain(
                slot,
                parent.unwrap_or(BlockHash::ROOT),
                blocks,
                tier_bit(*tier),
            ),
            KvEvent::Removed { blocks, tier } => {
                self.remove_blocks(slot, blocks, tier_bit(*tier));
                self.maybe_sweep(slot);
            }
            KvEvent::Cleared => self.clear_worker(slot),
        }
    }

    /// Stores a chain under `parent`. It goes in tail first: each block's child in the event is
    /// then known to be new or not when the block itself is added, so its child count is set in
    /// the same map access (one lookup per block), and the tail ends up older than its head in
    /// the eviction queue, so eviction takes children before parents.
    fn store_chain(&mut self, slot: u32, parent: BlockHash, blocks: &[StoredBlock], bit: u8) {
        // The parent too: its child count changes last, after the chain, and its lookup would
        // otherwise be a miss of its own.
        let known_parent = (parent != BlockHash::ROOT).then_some(parent);
        let long = blocks.len() >= STRAIGHT_TO_OLD;
        self.holders.set_straight_to_old(long);
        self.holders
            .warm(blocks.iter().map(|b| b.hash).chain(known_parent));
        let mut child_added = false;
        for i in (0..blocks.len()).rev() {
            let parent_i = if i == 0 { parent } else { blocks[i - 1].hash };
            child_added = self.store(slot, blocks[i].hash, bit, parent_i, u32::from(child_added));
        }
        self.holders.set_straight_to_old(false);
        if child_added
            && parent != BlockHash::ROOT
            && !self.holders.adjust_children(parent, slot, 1)
        {
            // Stored under a parent the worker does not hold.
            self.state_mut(slot).broken = true;
        }
    }

    /// Stores `(block, slot)` under `parent`, with `children` of its children newly held,
    /// evicting first if the pair is new and the index is full. Returns whether the pair is new.
    fn store(
        &mut self,
        slot: u32,
        block: BlockHash,
        bit: u8,
        parent: BlockHash,
        children: u32,
    ) -> bool {
        if !self.make_room(slot, block) {
            return false;
        }
        let (change, recorded) = self.add_pair(slot, block, bit, parent, children);
        if change == PairChange::Added && recorded != parent {
            self.state_mut(slot).broken = true;
        }
        change == PairChange::Added
    }

    /// Whether `(block, slot)` may be stored: it exists already, or there is room, or room was
    /// made by evicting. A pair that cannot be stored is counted as evicted.
    fn make_room(&mut self, slot: u32, block: BlockHash) -> bool {
        if self.entries < self.config.max_entries || self.holders.tiers_of(block, slot) != 0 {
            return true;
        }
        while self.entries >= self.config.max_entries {
            if !self.evict_one(slot) {
                self.evicted += 1;
                // Dropped, so whatever the worker stores under it is an orphan.
                self.state_mut(slot).broken = true;
                return false;
            }
        }
        true
    }

    /// Adds the pair and keeps the counters; returns the change and the block's recorded parent.
    fn add_pair(
        &mut self,
        slot: u32,
        block: BlockHash,
        bit: u8,
        parent: BlockHash,
        children: u32,
    ) -> (PairChange, BlockHash) {
        let (change, before, recorded) = self.holders.add(block, slot, bit, parent, children);
        if change == PairChange::Absent {
            // Could not be stored (see `HolderMap::add`): dropped like an evicted pair, so
            // whatever the worker stores under it is an orphan.
            self.evicted += 1;
            self.state_mut(slot).broken = true;
            return (change, recorded);
        }
        let after = before | bit;
        let added = change == PairChange::Added;
        if added {
            self.entries += 1;
        }
        let state = self.state_mut(slot);
        if added {
            state.live += 1;
            state.order.push(block);
        }
        if mixed(after) && !mixed(before) {
            state.mixed += 1;
        }
        (change, recorded)
    }

    /// Removes `bit` from each listed pair. A pair that goes while the worker still holds one of
    /// its children breaks the worker's closure, unless those children go in the same event: the
    /// links between the pairs that went are settled after the whole event, among the event's
    /// removed pairs (a list, searched next to each pair first), so the order of the event's
    /// blocks does not matter and a parent that goes too costs no lookup in the index.
    fn remove_blocks(&mut self, slot: u32, blocks: &[BlockHash], bit: u8) {
        let Scratch { mut gone, mut at } = std::mem::take(&mut self.scratch);
        gone.clear();
        self.holders.warm(blocks.iter().copied());
        for &block in blocks {
            let r = self.holders.remove(block, slot, bit);
            let after = r.before.tiers() & !bit;
            match r.change {
                PairChange::Absent => continue,
                PairChange::Kept => {
                    if mixed(r.before.tiers()) && !mixed(after) {
                        self.state_mut(slot).mixed -= 1;
                    }
                    continue;
                }
                PairChange::Removed | PairChange::Added => {}
            }
            self.entries -= 1;
            let state = self.state_mut(slot);
            state.live -= 1;
            if mixed(r.before.tiers()) {
                state.mixed -= 1;
            }
            // A pair goes once per event (a second listing finds it absent): keys are unique.
            gone.push((
                block,
                Gone {
                    parent: r.parent,
                    children: r.before.children(),
                    children_gone: 0,
                },
            ));
        }
        let n = gone.len();
        // The order queue, newest entries first: a chain went in tail first, so its head is the
        // newest entry, and a chain evicted whole then leaves the queue from its end (see
        // `order.rs`), whichever end of the chain the event lists first.
        if let Some(state) = self.workers[slot as usize].as_mut() {
            let head_first = n > 1 && state.order.newest() == Some(gone[0].0);
            for i in 0..n {
                let (block, _) = gone[if head_first { i } else { n - 1 - i }];
                state.order.note_removed(block);
            }
        }
        let mut mapped = false;
        for i in 0..n {
            let parent = gone[i].1.parent;
            if parent == BlockHash::ROOT {
                continue;
            }
            // Engines evict a chain tail first (the parent is the next block) or head first.
            let found = if gone.get(i + 1).is_some_and(|(b, _)| *b == parent) {
                Some(i + 1)
            } else if i > 0 && gone[i - 1].0 == parent {
                Some(i - 1)
            } else if n > SCAN_MAX {
                if !mapped {
                    at.clear();
                    at.extend(gone.iter().enumerate().map(|(i, (b, _))| (*b, i)));
                    mapped = true;
                }
                at.get(&parent).copied()
            } else {
                gone.iter().position(|(b, _)| *b == parent)
            };
            match found {
                Some(j) => gone[j].1.children_gone += 1,
                None => {
                    self.holders.adjust_children(parent, slot, -1);
                }
            }
        }
        let mut broken = false;
        for (_, g) in &gone {
            // A saturated count means the true number is unknown.
            if g.children == CHILD_MAX || g.children > g.children_gone {
                broken = true;
            }
        }
        if broken {
            self.state_mut(slot).broken = true;
        }
        // Keep the buffers for the next event unless a huge one made them large.
        if gone.capacity() <= 4096 {
            self.scratch = Scratch { gone, at };
        }
    }

    /// Replaces nothing (the caller cleared the worker): stores every snapshot block, then
    /// checks the snapshot's closure as a whole, so its order does not matter.
    ///
    /// A snapshot in which no block names a parent comes from a source that does not track
    /// parents: its `None`s cannot be told from first blocks, so the worker's closure is unknown
    /// and it is marked broken (walked, never jumped over) until its blocks are all replaced.
    pub(super) fn store_snapshot(&mut self, slot: u32, blocks: &[SnapshotBlock]) {
        if !blocks.is_empty() && blocks.iter().all(|b| b.parent.is_none()) {
            self.state_mut(slot).broken = true;
        }
        let mut added: Vec<(BlockHash, BlockHash)> = Vec::with_capacity(blocks.len());
        for b in blocks {
            let parent = b.parent.unwrap_or(BlockHash::ROOT);
            if !self.make_room(slot, b.hash) {
                continue;
            }
            if let (PairChange::Added, recorded) =
                self.add_pair(slot, b.hash, tier_bit(b.tier), parent, 0)
            {
                if recorded != parent {
                    self.state_mut(slot).broken = true;
                }
                added.push((b.hash, recorded));
            }
        }
        for (block, parent) in added {
            if self.holders.tiers_of(block, slot) == 0 {
                // Evicted again while the snapshot was loading.
                continue;
            }
            if parent != BlockHash::ROOT && !self.holders.adjust_children(parent, slot, 1) {
                self.state_mut(slot).broken = true;
            }
        }
    }

    /// Evicts the oldest pair of the worker chosen by the module-docs rule.
    pub(super) fn evict_one(&mut self, storing: u32) -> bool {
        let workers = self.by_id.len().max(1);
        let fair_share = self.config.max_entries / workers;
        let storing_live = self.workers[storing as usize]
            .as_ref()
            .map_or(0, |w| w.live);
        let victim = if storing_live > 0 && storing_live >= fair_share {
            storing
        } else {
            let largest = self
                .workers
                .iter()
                .enumerate()
                .filter_map(|(i, w)| w.as_ref().map(|w| (w.live, std::cmp::Reverse(i))))
                .max();
            match largest {
                Some((live, std::cmp::Reverse(i))) if live > 0 => i as u32,
                _ => return false,
            }
        };
        loop {
            let Some(block) = self.workers[victim as usize]
                .as_mut()
                .and_then(|s| s.order.pop_oldest())
            else {
                return false;
            };
            let before = self.entries;
            self.remove_blocks(victim, &[block], ALL_TIERS);
            self.refresh_jumpable(victim);
            if self.entries < before {
                self.evicted += 1;
                self.maybe_sweep(victim);
                return true;
            }
        }
    }

    /// Drops every pair of the worker (its state and sequence tracking stay).
    pub(super) fn clear_worker(&mut self, slot: u32) {
        let Some(state) = self.workers[slot as usize].as_mut() else {
            return;
        };
        let order = state.order.take();
        state.live = 0;
        state.mixed = 0;
        state.broken = false;
        if !state.jumpable {
            state.jumpable = true;
            self.unjumpable -= 1;
        }
        for block in order {
            if self.holders.remove(block, slot, ALL_TIERS).change == PairChange::Removed {
                self.entries -= 1;
            }
        }
    }

    /// Sweeps stale entries out of the worker's order queue when due (see `order.rs`).
    fn maybe_sweep(&mut self, slot: u32) {
        if let Some(state) = self.workers[slot as usize].as_mut() {
            state.order.maybe_sweep(state.live, &mut self.sweep_scratch);
        }
    }

    /// Brings `slot`'s cached jumpable flag and the index's count of unjumpable workers up to
    /// date; called at the end of every change to a worker.
    pub(super) fn refresh_jumpable(&mut self, slot: u32) {
        let Some(state) = self.workers.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        let now = !state.broken && state.mixed == 0;
        if now != state.jumpable {
            state.jumpable = now;
            if now {
                self.unjumpable -= 1;
            } else {
                self.unjumpable += 1;
            }
        }
    }

    /// Whether the overlap query may jump over `slot`'s blocks (see the module docs).
    #[inline]
    pub(super) fn jumpable(&self, slot: u32) -> bool {
        self.workers
            .get(slot as usize)
            .and_then(Option::as_ref)
            .is_some_and(|w| !w.broken && w.mixed == 0)
    }
}
