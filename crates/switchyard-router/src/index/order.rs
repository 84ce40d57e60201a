//! A worker's blocks in insertion order, for dropping the worker wholesale and picking FIFO
//! eviction victims.
//!
//! Removals do not search the queue: they leave a stale entry behind and are noted in a log,
//! with the position the next insertion would take at that moment. A sweep, once the log
//! outgrows the worker's live pairs, keeps an entry only if no removal of its block was logged
//! after it was queued. So the sweep reads only the queue and the log (a few hundred KiB at
//! most, cache-resident), never the index's big block map: a sweep used to look every queued
//! block up in that map, one cache miss each, which cost more than the removals themselves.
//!
//! Positions count from the last sweep: the queue's front is at `base`, which grows as entries
//! are popped, and a sweep restarts them at 0 with an empty log.

use std::collections::VecDeque;

use switchyard_core::BlockHash;

use crate::hasher::FxHashMap;

/// Scratch space of [`InsertionOrder::maybe_sweep`].
#[derive(Debug, Default)]
pub(super) struct SweepScratch(FxHashMap<BlockHash, u64>);

impl SweepScratch {
    pub fn heap_bytes(&self) -> usize {
        super::holders::buckets_for(self.0.capacity())
            * (std::mem::size_of::<(BlockHash, u64)>() + 1)
    }
}

#[derive(Debug, Default)]
pub(super) struct InsertionOrder {
    queue: VecDeque<BlockHash>,
    /// Position of `queue[0]`.
    base: u64,
    /// Blocks removed since the last sweep, each with the position the next insertion took
    /// when it went.
    removed: Vec<(BlockHash, u64)>,
}

impl InsertionOrder {
    /// Queues a block the worker now holds (it did not just before).
    #[inline]
    pub fn push(&mut self, block: BlockHash) {
        self.queue.push_back(block);
    }

    /// Notes that the worker no longer holds `block`. The newest entry goes from the queue
    /// itself (a sequence evicted soon after it was stored, the usual churn, leaves nothing to
    /// sweep), unless that would hand a position already in the log to a later insertion, which
    /// the sweep would then take for stale.
    #[inline]
    pub fn note_removed(&mut self, block: BlockHash) {
        let next = self.base + self.queue.len() as u64;
        if self.queue.back() == Some(&block) && self.removed.last().is_none_or(|&(_, at)| at < next)
        {
            self.queue.pop_back();
            return;
        }
        self.removed.push((block, next));
    }

    /// The newest entry, possibly stale.
    #[inline]
    pub fn newest(&self) -> Option<BlockHash> {
        self.queue.back().copied()
    }

    /// The oldest entry, possibly stale (the caller checks the block map).
    pub fn pop_oldest(&mut self) -> Option<BlockHash> {
        let block = self.queue.pop_front()?;
        self.base += 1;
        Some(block)
    }

    /// Sweeps stale entries out once the removals logged since the last sweep outnumber half
    /// the worker's `live` pairs (plus a little, so tiny workers do not sweep on every event).
    /// The queue then never holds more than `1.5 · live + 64` entries, nor the log more than
    /// `live / 2 + 64`.
    ///
    /// `gone` is scratch space, shared by every worker's sweeps and kept between them: a table
    /// allocated afresh for each sweep cost more than the sweep's own work (every insert a first
    /// touch of a new page), and one kept per worker would cost memory per worker.
    pub fn maybe_sweep(&mut self, live: usize, gone: &mut SweepScratch) {
        if self.removed.len() <= live / 2 + 64 {
            return;
        }
        // The last position at which each block was removed.
        let gone = &mut gone.0;
        gone.clear();
        gone.reserve(self.removed.len());
        for &(block, at) in &self.removed {
            let last = gone.entry(block).or_insert(at);
            *last = (*last).max(at);
        }
        let mut pos = self.base;
        self.queue.retain(|block| {
            let queued_at = pos;
            pos += 1;
            // Queued at or after its last removal: this is the copy the worker holds.
            gone.get(block).is_none_or(|&at| at <= queued_at)
        });
        debug_assert!(self.queue.len() <= live, "sweep left stale entries");
        self.base = 0;
        self.removed.clear();
        self.removed.shrink_to(live / 2 + 64);
        self.queue.shrink_to(self.queue.len() * 2);
    }

    /// Empties the queue and the log; returns the queue (with its stale entries).
    pub fn take(&mut self) -> VecDeque<BlockHash> {
        self.base = 0;
        self.removed = Vec::new();
        std::mem::take(&mut self.queue)
    }

    /// Queued blocks, oldest first: each block the worker holds once, and stale entries.
    pub fn iter(&self) -> impl Iterator<Item = &BlockHash> + '_ {
        self.queue.iter()
    }

    /// Queued entries, stale ones included.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn heap_bytes(&self) -> usize {
        self.queue.capacity() * std::mem::size_of::<BlockHash>()
            + self.removed.capacity() * std::mem::size_of::<(BlockHash, u64)>()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Step {
        Add(u64),
        Remove(u64),
        PopOldest,
    }

    fn step() -> impl Strategy<Value = Step> {
        // Few distinct blocks, so blocks are removed and added again often.
        prop_oneof![
            5 => (0u64..12).prop_map(Step::Add),
            4 => (0u64..12).prop_map(Step::Remove),
            1 => Just(Step::PopOldest),
        ]
    }

    #[test]
    fn newest_entries_leave_from_the_end_unless_a_logged_position_would_be_reused() {
        let mut order = InsertionOrder::default();
        for b in 0..16 {
            order.push(BlockHash(b));
        }
        for b in (8..16).rev() {
            order.note_removed(BlockHash(b));
        }
        assert_eq!(
            (order.len(), order.removed.len()),
            (8, 0),
            "popped, not logged"
        );
        // An older entry goes through the log; the newest may then not leave from the end,
        // or block 0, queued again, would take position 7 and pass for removed at 7.
        order.note_removed(BlockHash(0));
        order.note_removed(BlockHash(7));
        assert_eq!((order.len(), order.removed.len()), (8, 2));
        order.push(BlockHash(0));
        order.maybe_sweep(0, &mut SweepScratch::default());
        order
            .removed
            .extend((0..70).map(|_| (BlockHash(u64::MAX), 0)));
        order.maybe_sweep(7, &mut SweepScratch::default());
        let left: Vec<u64> = order.iter().map(|b| b.0).collect();
        assert_eq!(left, vec![1, 2, 3, 4, 5, 6, 0]);
    }

    proptest! {
        /// Against a worker's true holdings: after any steps, the queue names every held block,
        /// once, in the order it was (last) added, plus only stale entries; a sweep leaves
        /// exactly the held blocks in that order.
        #[test]
        fn sweeps_keep_exactly_the_held_blocks_in_insertion_order(
            steps in proptest::collection::vec(step(), 0..300)
        ) {
            let mut order = InsertionOrder::default();
            // Kept across sweeps, as the index keeps it.
            let mut scratch = SweepScratch::default();
            // The worker's blocks, in the order they were added.
            let mut held: Vec<u64> = Vec::new();
            for s in &steps {
                match *s {
                    Step::Add(b) if !held.contains(&b) => {
                        held.push(b);
                        order.push(BlockHash(b));
                    }
                    Step::Remove(b) if held.contains(&b) => {
                        held.retain(|&h| h != b);
                        order.note_removed(BlockHash(b));
                    }
                    Step::PopOldest => {
                        // Eviction: the popped entry, if the worker holds it, goes.
                        if let Some(BlockHash(b)) = order.pop_oldest()
                            && held.contains(&b)
                        {
                            held.retain(|&h| h != b);
                            order.note_removed(BlockHash(b));
                        }
                    }
                    Step::Add(_) | Step::Remove(_) => {}
                }
                order.maybe_sweep(held.len(), &mut scratch);
                prop_assert!(order.iter().count() <= held.len() + held.len() / 2 + 64);
                prop_assert!(order.removed.len() <= held.len() / 2 + 65);
                let queued: BTreeSet<u64> = order.iter().map(|b| b.0).collect();
                prop_assert!(held.iter().all(|b| queued.contains(b)));
            }
            // Force a sweep: only the held blocks remain, oldest first.
            let live = held.len();
            for _ in 0..=live / 2 + 64 {
                order.removed.push((BlockHash(u64::MAX), 0));
            }
            order.maybe_sweep(live, &mut scratch);
            let left: Vec<u64> = order.iter().map(|b| b.0).collect();
            prop_assert_eq!(left, held);
        }
    }
}
