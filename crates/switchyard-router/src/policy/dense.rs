//! One decision's overlap, keyed by the index's worker slot: a dense array read by a small
//! integer instead of a search per candidate. Its buffer is kept per thread between decisions
//! and only the slots a decision filled are cleared after it, so a decision neither allocates
//! nor clears in proportion to the fleet: it touches the prefix's holders only.

use std::cell::RefCell;

use switchyard_core::WorkerId;

use crate::index::{OverlapScores, PrefixIndex, TierOverlap, WorkerKey};

thread_local! {
    static BUFFER: RefCell<Vec<TierOverlap>> = const { RefCell::new(Vec::new()) };
}

/// The overlap of every worker for one prompt, by slot; see the module docs.
pub(crate) struct SlotOverlap<'a> {
    index: &'a PrefixIndex,
    by_slot: Vec<TierOverlap>,
    /// The slots filled (the holders), cleared on drop.
    filled: Vec<u32>,
}

impl<'a> SlotOverlap<'a> {
    pub(crate) fn new(index: &'a PrefixIndex, scores: &OverlapScores) -> Self {
        let mut by_slot = BUFFER.with(|b| std::mem::take(&mut *b.borrow_mut()));
        let mut filled = Vec::with_capacity(scores.len());
        for (key, overlap) in scores.iter() {
            let slot = key.0 as usize;
            if by_slot.len() <= slot {
                by_slot.resize(slot + 1, TierOverlap::default());
            }
            by_slot[slot] = overlap;
            filled.push(key.0);
        }
        Self {
            index,
            by_slot,
            filled,
        }
    }

    /// The overlap of the worker in `key`'s slot (zero when it holds none of the prompt).
    pub(crate) fn by_key(&self, key: WorkerKey) -> TierOverlap {
        self.by_slot
            .get(key.0 as usize)
            .copied()
            .unwrap_or_default()
    }

    /// The worker's overlap: its slot looked up once, then read by slot.
    pub(crate) fn of(&self, worker: &WorkerId) -> TierOverlap {
        self.index
            .worker_key(worker)
            .map_or_else(TierOverlap::default, |k| self.by_key(k))
    }
}

impl Drop for SlotOverlap<'_> {
    fn drop(&mut self) {
        for &slot in &self.filled {
            self.by_slot[slot as usize] = TierOverlap::default();
        }
        let by_slot = std::mem::take(&mut self.by_slot);
        BUFFER.with(|b| {
            let mut b = b.borrow_mut();
            if b.len() < by_slot.len() {
                *b = by_slot;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;
    use switchyard_core::{BlockHash, BlockSize, SnapshotBlock, StorageTier};

    fn w(n: &str) -> WorkerId {
        WorkerId::new(n).unwrap()
    }

    fn index_with(workers: &[(&str, &[BlockHash])]) -> PrefixIndex {
        let mut index = PrefixIndex::new(IndexConfig::new(BlockSize::new(4).unwrap()));
        for (id, blocks) in workers {
            let chain: Vec<_> = SnapshotBlock::chain(blocks, StorageTier::Device).collect();
            index.apply_snapshot(&w(id), 1, 0, &chain).unwrap();
        }
        index
    }

    /// A worker leaving frees its slot; the next to join takes it. Read by slot, the newcomer
    /// must get its own overlap, not the leaver's, and a buffer reused from an earlier
    /// decision must hold nothing of it.
    #[test]
    fn a_reused_slot_reads_the_worker_that_holds_it_now() {
        let prompt: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let mut index = index_with(&[("a", &prompt), ("b", &prompt[..2])]);
        {
            let scores = index.overlap(&prompt);
            let dense = SlotOverlap::new(&index, &scores);
            assert_eq!(dense.of(&w("a")), TierOverlap::uniform(4));
            assert_eq!(dense.of(&w("b")), TierOverlap::uniform(2));
        }
        let a_slot = index.worker_key(&w("a")).unwrap();
        assert!(index.remove_worker(&w("a")));
        let other: Vec<BlockHash> = (100..=101).map(BlockHash).collect();
        let chain: Vec<_> = SnapshotBlock::chain(&other, StorageTier::Device).collect();
        index.apply_snapshot(&w("c"), 1, 0, &chain).unwrap();
        assert_eq!(
            index.worker_key(&w("c")),
            Some(a_slot),
            "the slot is reused"
        );
        let scores = index.overlap(&prompt);
        let dense = SlotOverlap::new(&index, &scores);
        assert_eq!(dense.of(&w("c")), TierOverlap::default());
        assert_eq!(dense.of(&w("a")), TierOverlap::default());
        assert_eq!(dense.of(&w("b")), TierOverlap::uniform(2));
        assert_eq!(dense.by_key(a_slot), TierOverlap::default());
    }
}
