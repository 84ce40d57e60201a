//! How events change the index: blocks stored and removed in a worker's tier (see `runs.rs`),
//! the count of `(block, worker)` pairs across tiers, the memory bound, snapshots and clearing.

use switchyard_core::{BlockHash, KvEvent, SnapshotBlock, StorageTier};

use super::PrefixIndex;
use super::runs::{TIERS, set_bit, set_of};
use crate::hasher::{FxHashMap, FxHashSet};

impl PrefixIndex {
    pub(super) fn apply_unsequenced(&mut self, slot: u32, event: &KvEvent) {
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => {
                let mut chain = std::mem::take(&mut self.chain);
                chain.clear();
                chain.extend(blocks.iter().map(|b| b.hash));
                self.store_chain(slot, *tier, *parent, &chain);
                self.chain = chain;
            }
            KvEvent::Removed { blocks, tier } => {
                self.remove_blocks(slot, set_of(slot, *tier), blocks);
            }
            KvEvent::Cleared => self.clear_worker(slot),
        }
        self.enforce_bound(slot);
    }

    /// Stores a chain in the worker's tier and counts the pairs it adds: a block new to the
    /// tier is a new pair unless the worker holds it in another tier.
    fn store_chain(
        &mut self,
        slot: u32,
        tier: StorageTier,
        parent: Option<BlockHash>,
        chain: &[BlockHash],
    ) {
        let set = set_of(slot, tier);
        let mut added = std::mem::take(&mut self.added);
        added.clear();
        self.runs.store(set, parent, chain, &mut added);
        let new = self.pairs_of(slot, set, &added);
        self.entries += new;
        self.state_mut(slot).live += new;
        self.added = added;
    }

    /// Removes blocks from one of the worker's tiers; a pair goes with its last tier.
    fn remove_blocks(&mut self, slot: u32, set: u32, blocks: &[BlockHash]) {
        let mut gone = std::mem::take(&mut self.added);
        gone.clear();
        self.runs.remove(set, blocks, &mut gone);
        let lost = self.pairs_of(slot, set, &gone);
        self.entries -= lost;
        self.state_mut(slot).live -= lost;
        self.added = gone;
    }

    /// How many of `blocks`, just stored in or removed from `set`, the worker holds in no other
    /// tier: the `(block, worker)` pairs they add or remove.
    fn pairs_of(&self, slot: u32, set: u32, blocks: &[BlockHash]) -> usize {
        if self.runs.tiers(slot) & !set_bit(set) == 0 {
            return blocks.len();
        }
        blocks
            .iter()
            .filter(|&&b| !self.held_elsewhere(slot, set, b))
            .count()
    }

    /// Whether the worker holds `block` in a tier other than `set`'s.
    fn held_elsewhere(&self, slot: u32, set: u32, block: BlockHash) -> bool {
        (0..TIERS)
            .map(|t| slot * TIERS + t)
            .any(|s| s != set && self.runs.len(s) > 0 && self.runs.holds(s, block))
    }

    /// Replaces nothing (the caller cleared the worker): stores the snapshot's blocks, tier by
    /// tier, as chains: each block after its parent when the snapshot has the parent (in any
    /// order), so a snapshot of long sequences becomes long runs.
    ///
    /// A snapshot in which no block names a parent comes from a source that does not track
    /// parents: its blocks are stored alone, as if first blocks, and since any of them may be
    /// another's child, the worker's later stores look every block up among its run heads.
    pub(super) fn store_snapshot(&mut self, slot: u32, blocks: &[SnapshotBlock]) {
        let parents_unknown = blocks.iter().all(|b| b.parent.is_none());
        for tier in StorageTier::ALL {
            let of_tier: Vec<&SnapshotBlock> = blocks.iter().filter(|b| b.tier == tier).collect();
            if of_tier.is_empty() {
                continue;
            }
            if parents_unknown {
                self.runs.mark_orphans(set_of(slot, tier));
            }
            for (parent, chain) in chains(&of_tier) {
                self.store_chain(slot, tier, parent, &chain);
            }
        }
        self.enforce_bound(slot);
    }

    /// Evicts pairs while the index holds more than its bound (see the module docs of `mod.rs`).
    fn enforce_bound(&mut self, storing: u32) {
        while self.entries > self.config.max_entries {
            if !self.evict_one(storing) {
                break;
            }
        }
    }

    /// Evicts one pair of the worker chosen by the module-docs rule: the tail of its least
    /// recently made or extended run, from every tier holding it.
    fn evict_one(&mut self, storing: u32) -> bool {
        let workers = self.by_id.len().max(1);
        let fair_share = self.config.max_entries / workers;
        // Evicting after the event, the storing worker is judged by what it held when each
        // pair over the bound was added: its pairs now, less those still over the bound.
        let over = self.entries.saturating_sub(self.config.max_entries);
        let storing_live = self.workers[storing as usize]
            .as_ref()
            .map_or(0, |w| w.live.saturating_sub(over));
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
        let Some((_, block)) = self.runs.eviction_candidate(victim) else {
            return false;
        };
        let mut gone = std::mem::take(&mut self.added);
        gone.clear();
        for t in 0..TIERS {
            let set = victim * TIERS + t;
            if self.runs.len(set) > 0 {
                self.runs.remove(set, &[block], &mut gone);
            }
        }
        self.added = gone;
        self.entries -= 1;
        self.state_mut(victim).live -= 1;
        self.evicted += 1;
        true
    }

    /// Drops every pair of the worker (its state and sequence tracking stay).
    pub(super) fn clear_worker(&mut self, slot: u32) {
        let Some(state) = self.workers[slot as usize].as_mut() else {
            return;
        };
        self.entries -= state.live;
        state.live = 0;
        self.runs.clear_slot(slot);
    }
}

/// One tier's snapshot blocks as chains to store: each chain's parent and blocks, a block after
/// its parent when the parent is in the snapshot (depth first, so a sequence is one chain and a
/// branch starts a chain under the block it leaves). Blocks whose parent is missing, or none,
/// start chains under it; blocks only reachable through a cycle (which chained hashes cannot
/// make) are stored alone under their parent.
fn chains(blocks: &[&SnapshotBlock]) -> Vec<(Option<BlockHash>, Vec<BlockHash>)> {
    let present: FxHashSet<BlockHash> = blocks.iter().map(|b| b.hash).collect();
    let mut children: FxHashMap<BlockHash, Vec<BlockHash>> = FxHashMap::default();
    let mut starts: Vec<(Option<BlockHash>, BlockHash)> = Vec::new();
    let mut parent_of: FxHashMap<BlockHash, Option<BlockHash>> = FxHashMap::default();
    for b in blocks {
        if parent_of.insert(b.hash, b.parent).is_some() {
            continue;
        }
        match b.parent {
            Some(p) if present.contains(&p) && p != b.hash => {
                children.entry(p).or_default().push(b.hash);
            }
            parent => starts.push((parent, b.hash)),
        }
    }
    let mut out = Vec::new();
    let mut placed: FxHashSet<BlockHash> = FxHashSet::default();
    let mut stack: Vec<(Option<BlockHash>, BlockHash)> = starts.into_iter().rev().collect();
    let place = |stack: &mut Vec<(Option<BlockHash>, BlockHash)>,
                 placed: &mut FxHashSet<BlockHash>,
                 out: &mut Vec<(Option<BlockHash>, Vec<BlockHash>)>| {
        while let Some((parent, first)) = stack.pop() {
            if !placed.insert(first) {
                continue;
            }
            let mut chain = vec![first];
            let mut at = first;
            loop {
                let kids = children.get(&at).map_or(&[][..], Vec::as_slice);
                let mut next = None;
                for &kid in kids.iter().rev() {
                    if placed.contains(&kid) {
                        continue;
                    }
                    match next {
                        None => next = Some(kid),
                        Some(_) => stack.push((Some(at), kid)),
                    }
                }
                let Some(kid) = next else {
                    break;
                };
                placed.insert(kid);
                chain.push(kid);
                at = kid;
            }
            out.push((parent, chain));
        }
    };
    place(&mut stack, &mut placed, &mut out);
    // Blocks on a cycle of parents: alone, under their parent.
    for b in blocks {
        if !placed.contains(&b.hash) {
            stack.push((b.parent, b.hash));
            place(&mut stack, &mut placed, &mut out);
        }
    }
    out
}
