//! Idle device blocks a retention hint pins: kept apart from the LRU list so eviction takes
//! unpinned blocks first, bounded by a budget so pins can only ever reorder eviction, never
//! hold the cache: when nothing unpinned is left, pinned blocks are evicted too (lowest
//! priority, soonest expiry, least recently released first).

use std::collections::BTreeMap;

use crate::kv_cache::BlockId;

/// A block's pin: kept until `expiry_us` on the simulator's clock, at `priority`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Pin {
    pub(crate) priority: u8,
    pub(crate) expiry_us: u64,
}

impl Pin {
    /// The stronger of two pins on one block: the later expiry and the higher priority.
    pub(crate) fn merge(self, other: Pin) -> Pin {
        Pin {
            priority: self.priority.max(other.priority),
            expiry_us: self.expiry_us.max(other.expiry_us),
        }
    }
}

/// Position of a pinned idle block: eviction order is the key order.
pub(crate) type RetainedKey = (u8, u64, u64);

/// The pinned idle blocks, at most `budget` of them.
#[derive(Debug, Default)]
pub(crate) struct Retained {
    budget: usize,
    /// `(priority, expiry, release tick)` → block: the first entry is the next victim.
    order: BTreeMap<RetainedKey, BlockId>,
    /// `(expiry, release tick)` → priority, to find expired pins without a scan.
    expiries: BTreeMap<(u64, u64), u8>,
}

/// What [`Retained::insert`] did with a block.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Placed {
    /// Pinned; the block that lost its place to it (budget full), if any, goes to the LRU list
    /// with its release tick.
    Pinned(Option<(u64, BlockId)>),
    /// Not pinned (expired, or weaker than every pin of a full budget): the LRU list takes it.
    Unpinned,
}

impl Retained {
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// Pins an idle block released at `tick`, within the budget.
    pub(crate) fn insert(&mut self, block: BlockId, pin: Pin, tick: u64, now_us: u64) -> Placed {
        if pin.expiry_us <= now_us || self.budget == 0 {
            return Placed::Unpinned;
        }
        let key = (pin.priority, pin.expiry_us, tick);
        let mut displaced = None;
        if self.order.len() >= self.budget {
            match self.order.first_key_value() {
                Some((&weakest, _)) if weakest < key => displaced = self.take(weakest),
                _ => return Placed::Unpinned,
            }
        }
        self.order.insert(key, block);
        self.expiries.insert((pin.expiry_us, tick), pin.priority);
        Placed::Pinned(displaced)
    }

    /// Takes a block off the list (it was referenced again, or is being evicted); returns its
    /// release tick and id.
    pub(crate) fn take(&mut self, key: RetainedKey) -> Option<(u64, BlockId)> {
        let block = self.order.remove(&key)?;
        self.expiries.remove(&(key.1, key.2));
        Some((key.2, block))
    }

    /// The next victim among the pinned blocks.
    pub(crate) fn pop_weakest(&mut self) -> Option<(RetainedKey, BlockId)> {
        let (&key, _) = self.order.first_key_value()?;
        let (_, block) = self.take(key)?;
        Some((key, block))
    }

    /// Unpins every block whose pin expired by `now_us`: `(release tick, block)` for the LRU.
    pub(crate) fn expire(&mut self, now_us: u64) -> Vec<(u64, BlockId)> {
        let mut out = Vec::new();
        while let Some((&(expiry, tick), &priority)) = self.expiries.first_key_value() {
            if expiry > now_us {
                break;
            }
            if let Some(taken) = self.take((priority, expiry, tick)) {
                out.push(taken);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(priority: u8, expiry_us: u64) -> Pin {
        Pin {
            priority,
            expiry_us,
        }
    }

    #[test]
    fn a_full_budget_keeps_the_strongest_pins() {
        let mut r = Retained::new(2);
        assert_eq!(r.insert(1, pin(0, 100), 1, 0), Placed::Pinned(None));
        assert_eq!(r.insert(2, pin(1, 50), 2, 0), Placed::Pinned(None));
        // Weaker than both: not pinned.
        assert_eq!(r.insert(3, pin(0, 10), 3, 0), Placed::Unpinned);
        // Stronger than block 1 (same priority, later expiry): block 1 loses its place.
        assert_eq!(r.insert(4, pin(0, 200), 4, 0), Placed::Pinned(Some((1, 1))));
        assert_eq!(r.len(), 2);
        assert_eq!(r.pop_weakest(), Some(((0, 200, 4), 4)));
    }

    #[test]
    fn expired_pins_are_released_and_new_ones_refused() {
        let mut r = Retained::new(4);
        r.insert(1, pin(3, 100), 1, 0);
        r.insert(2, pin(0, 300), 2, 0);
        assert_eq!(r.insert(3, pin(9, 50), 3, 50), Placed::Unpinned);
        assert_eq!(r.expire(99), vec![]);
        assert_eq!(r.expire(100), vec![(1, 1)]);
        assert_eq!(r.len(), 1);
        assert!(Retained::new(0).insert(1, pin(0, 10), 1, 0) == Placed::Unpinned);
    }

    #[test]
    fn merged_pins_take_the_later_expiry_and_higher_priority() {
        assert_eq!(pin(2, 10).merge(pin(1, 20)), pin(2, 20));
    }
}
