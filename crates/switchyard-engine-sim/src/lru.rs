//! The device cache's eviction order: cached, unreferenced, unpinned blocks by release tick,
//! smallest first.
//!
//! Almost every block joins at a fresh tick, larger than any before it, so the order is mostly
//! an append-only queue: a doubly linked list threaded through the blocks gives O(1) append,
//! removal from the middle (a prefix hit takes a reference) and eviction from the front, where
//! an ordered map cost a search on each (the cache's bookkeeping was a tenth of a replay). The
//! few blocks that come back at an old tick (a retention pin that expired or was displaced puts
//! its block back at its release position) wait in a small ordered map beside the list, and
//! eviction takes whichever of the two fronts is older, so the order is exactly the ticks'.

use std::collections::BTreeMap;

use crate::kv_cache::BlockId;

/// No block.
const NIL: BlockId = BlockId::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: BlockId,
    next: BlockId,
    tick: u64,
    /// On the list (not in the map of late arrivals).
    listed: bool,
}

impl Default for Link {
    fn default() -> Self {
        Self {
            prev: NIL,
            next: NIL,
            tick: 0,
            listed: false,
        }
    }
}

/// Blocks ordered by tick; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct LruQueue {
    /// Per block (indexed by id, grown on demand); meaningful while the block is queued.
    links: Vec<Link>,
    /// Oldest and newest listed block.
    head: BlockId,
    tail: BlockId,
    /// Blocks queued at a tick older than the list's newest.
    late: BTreeMap<u64, BlockId>,
    len: usize,
}

impl LruQueue {
    pub(crate) fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            ..Self::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn link(&self, block: BlockId) -> Option<&Link> {
        self.links.get(block as usize)
    }

    fn link_mut(&mut self, block: BlockId) -> Option<&mut Link> {
        self.links.get_mut(block as usize)
    }

    /// Queues `block` (not queued now) at `tick`; ticks are unique.
    pub(crate) fn insert(&mut self, tick: u64, block: BlockId) {
        if self.links.len() <= block as usize {
            self.links.resize(block as usize + 1, Link::default());
        }
        self.len += 1;
        let newest = self.link(self.tail).map(|l| l.tick);
        if newest.is_some_and(|newest| tick < newest) {
            self.late.insert(tick, block);
            if let Some(l) = self.link_mut(block) {
                *l = Link {
                    tick,
                    ..Link::default()
                };
            }
            return;
        }
        let tail = self.tail;
        if let Some(l) = self.link_mut(block) {
            *l = Link {
                prev: tail,
                next: NIL,
                tick,
                listed: true,
            };
        }
        match self.link_mut(tail) {
            Some(t) => t.next = block,
            None => self.head = block,
        }
        self.tail = block;
    }

    /// Takes `block`, queued at `tick`, out of the order.
    pub(crate) fn remove(&mut self, tick: u64, block: BlockId) {
        let Some(&link) = self.link(block) else {
            return;
        };
        if !link.listed {
            if self.late.remove(&tick).is_some() {
                self.len -= 1;
            }
            return;
        }
        self.unlink(block, link);
    }

    fn unlink(&mut self, block: BlockId, link: Link) {
        match self.link_mut(link.prev) {
            Some(p) => p.next = link.next,
            None => self.head = link.next,
        }
        match self.link_mut(link.next) {
            Some(n) => n.prev = link.prev,
            None => self.tail = link.prev,
        }
        if let Some(l) = self.link_mut(block) {
            l.listed = false;
        }
        self.len -= 1;
    }

    /// Takes the block with the smallest tick.
    pub(crate) fn pop_first(&mut self) -> Option<(u64, BlockId)> {
        let listed = self.link(self.head).map(|l| (l.tick, self.head));
        let late = self.late.first_key_value().map(|(&t, &b)| (t, b));
        match (listed, late) {
            (Some(l), Some(e)) if e.0 < l.0 => self.pop_late(),
            (Some((tick, block)), _) => {
                let link = *self.link(block)?;
                self.unlink(block, link);
                Some((tick, block))
            }
            (None, Some(_)) => self.pop_late(),
            (None, None) => None,
        }
    }

    fn pop_late(&mut self) -> Option<(u64, BlockId)> {
        let first = self.late.pop_first()?;
        self.len -= 1;
        Some(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Queue a block not queued, at a fresh tick or at an old one.
        Insert {
            block: BlockId,
            old: Option<u64>,
        },
        /// Take the n-th queued block out.
        Remove(usize),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..40u32, proptest::option::weighted(0.2, 0..1000u64))
                .prop_map(|(block, old)| Op::Insert { block, old }),
            2 => (0..40usize).prop_map(Op::Remove),
            2 => Just(Op::Pop),
        ]
    }

    proptest! {
        /// The queue pops in exactly the order of an ordered map of the same ticks.
        #[test]
        fn pops_in_tick_order_like_an_ordered_map(ops in proptest::collection::vec(op(), 0..300)) {
            let mut queue = LruQueue::new();
            let mut model: BTreeMap<u64, BlockId> = BTreeMap::new();
            let mut at: BTreeMap<BlockId, u64> = BTreeMap::new();
            let mut fresh = 1_000_000u64;
            for op in ops {
                match op {
                    Op::Insert { block, old } => {
                        if at.contains_key(&block) {
                            continue;
                        }
                        let tick = match old {
                            // An old tick, made unique by the block id.
                            Some(t) => t * 64 + u64::from(block),
                            None => {
                                fresh += 1;
                                fresh * 64
                            }
                        };
                        if model.contains_key(&tick) {
                            continue;
                        }
                        queue.insert(tick, block);
                        model.insert(tick, block);
                        at.insert(block, tick);
                    }
                    Op::Remove(n) => {
                        let Some((&block, &tick)) = at.iter().nth(n % at.len().max(1)) else {
                            continue;
                        };
                        queue.remove(tick, block);
                        model.remove(&tick);
                        at.remove(&block);
                    }
                    Op::Pop => {
                        let want = model.pop_first();
                        prop_assert_eq!(queue.pop_first(), want);
                        if let Some((_, block)) = want {
                            at.remove(&block);
                        }
                    }
                }
                prop_assert_eq!(queue.len(), model.len());
            }
            while let Some(want) = model.pop_first() {
                prop_assert_eq!(queue.pop_first(), Some(want));
            }
            prop_assert_eq!(queue.pop_first(), None);
        }
    }
}
