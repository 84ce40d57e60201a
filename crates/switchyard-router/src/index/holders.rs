//! Compact storage of which workers hold each block.
//!
//! One `(block, worker)` pair is a packed `u32` [`Holder`]: the worker's dense slot in the low
//! 24 bits and a mask of the tiers it holds the block in above them. The block map's value is a
//! single `u32`: either the only holder itself (the common case: most blocks live on one or a
//! few workers), or, with the top bit set, the index of a sorted `Vec<Holder>` in a side arena.
//! A map entry is therefore 16 bytes (8-byte key, 4-byte value, padding) plus hashbrown's one
//! control byte, and a block shared by `k` workers adds a 24-byte arena vector and `4k` bytes.

use switchyard_core::{BlockHash, StorageTier};

use crate::hasher::FxHashMap;

/// Largest number of worker slots a holder can name.
pub const MAX_SLOTS: usize = 1 << 24;
const SLOT_MASK: u32 = (1 << 24) - 1;
const ARENA_FLAG: u32 = 1 << 31;

pub const DEVICE: u8 = 1;
pub const HOST: u8 = 2;
pub const DISK: u8 = 4;

pub fn tier_bit(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => DEVICE,
        StorageTier::Host => HOST,
        StorageTier::Disk => DISK,
    }
}

/// A worker slot and the tiers it holds a block in, packed into 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder(u32);

impl Holder {
    pub fn new(slot: u32, tiers: u8) -> Self {
        debug_assert!(slot <= SLOT_MASK && tiers != 0 && tiers < 8);
        Holder(slot | (u32::from(tiers) << 24))
    }
    #[inline]
    pub fn slot(self) -> u32 {
        self.0 & SLOT_MASK
    }
    #[inline]
    pub fn tiers(self) -> u8 {
        ((self.0 >> 24) & 0x7) as u8
    }
}

/// What a change did to the `(block, worker)` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairChange {
    /// The pair did not exist and now does.
    Added,
    /// The pair existed before and after (only its tier mask may have changed).
    Kept,
    /// The pair existed and is now gone.
    Removed,
    /// The pair did not exist and still does not.
    Absent,
}

#[derive(Debug, Default)]
pub struct HolderMap {
    /// Value: the only holder, or `ARENA_FLAG | index` into `arena`.
    map: FxHashMap<BlockHash, Holder>,
    arena: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl HolderMap {
    pub fn blocks(&self) -> usize {
        self.map.len()
    }

    /// Holders of `block`, sorted by slot.
    #[inline]
    pub fn get(&self, block: BlockHash) -> &[Holder] {
        match self.map.get(&block) {
            None => &[],
            Some(v) if v.0 & ARENA_FLAG != 0 => &self.arena[(v.0 & !ARENA_FLAG) as usize],
            Some(v) => std::slice::from_ref(v),
        }
    }

    pub fn tiers_of(&self, block: BlockHash, slot: u32) -> u8 {
        let holders = self.get(block);
        match holders.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => holders[i].tiers(),
            Err(_) => 0,
        }
    }

    /// Adds `tiers` to the mask of `(block, slot)`.
    pub fn add(&mut self, block: BlockHash, slot: u32, tiers: u8) -> PairChange {
        let new = Holder::new(slot, tiers);
        let Some(v) = self.map.get_mut(&block) else {
            self.map.insert(block, new);
            return PairChange::Added;
        };
        if v.0 & ARENA_FLAG == 0 {
            let old = *v;
            if old.slot() == slot {
                *v = Holder::new(slot, old.tiers() | tiers);
                return PairChange::Kept;
            }
            let pair = if old.slot() < slot {
                vec![old, new]
            } else {
                vec![new, old]
            };
            *v = Holder(ARENA_FLAG | alloc(&mut self.arena, &mut self.free, pair));
            return PairChange::Added;
        }
        let list = &mut self.arena[(v.0 & !ARENA_FLAG) as usize];
        match list.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => {
                list[i] = Holder::new(slot, list[i].tiers() | tiers);
                PairChange::Kept
            }
            Err(i) => {
                list.insert(i, new);
                PairChange::Added
            }
        }
    }

    /// Clears `tiers` from the mask of `(block, slot)`; the pair goes when its mask empties.
    pub fn remove(&mut self, block: BlockHash, slot: u32, tiers: u8) -> PairChange {
        let Some(v) = self.map.get_mut(&block) else {
            return PairChange::Absent;
        };
        if v.0 & ARENA_FLAG == 0 {
            let old = *v;
            if old.slot() != slot {
                return PairChange::Absent;
            }
            let left = old.tiers() & !tiers;
            if left == 0 {
                self.map.remove(&block);
                return PairChange::Removed;
            }
            *v = Holder::new(slot, left);
            return PairChange::Kept;
        }
        let idx = (v.0 & !ARENA_FLAG) as usize;
        let list = &mut self.arena[idx];
        let Ok(i) = list.binary_search_by_key(&slot, |h| h.slot()) else {
            return PairChange::Absent;
        };
        let left = list[i].tiers() & !tiers;
        if left != 0 {
            list[i] = Holder::new(slot, left);
            return PairChange::Kept;
        }
        list.remove(i);
        if list.len() == 1 {
            // Back to the inline form so the arena only holds shared blocks.
            *v = list[0];
            let mut list = std::mem::take(&mut self.arena[idx]);
            list.clear();
            self.arena[idx] = list;
            self.free.push(idx as u32);
        }
        PairChange::Removed
    }

    /// Approximate heap bytes: hashbrown buckets (entry + control byte) plus the arena.
    pub fn heap_bytes(&self) -> usize {
        let buckets = buckets_for(self.map.capacity());
        let entry = std::mem::size_of::<(BlockHash, Holder)>();
        let arena: usize = self
            .arena
            .iter()
            .map(|v| v.capacity() * std::mem::size_of::<Holder>())
            .sum();
        buckets * (entry + 1) + self.arena.capacity() * std::mem::size_of::<Vec<Holder>>() + arena
    }
}

/// Number of buckets hashbrown allocates for a table that reports `capacity`.
pub fn buckets_for(capacity: usize) -> usize {
    if capacity == 0 {
        0
    } else if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    }
}

fn alloc(arena: &mut Vec<Vec<Holder>>, free: &mut Vec<u32>, list: Vec<Holder>) -> u32 {
    if let Some(i) = free.pop() {
        let slot = &mut arena[i as usize];
        slot.extend_from_slice(&list);
        i
    } else {
        arena.push(list);
        (arena.len() - 1) as u32
    }
}

impl HolderMap {
    /// Every block and its holders, in hash-map order (callers sort when order matters).
    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, &[Holder])> + '_ {
        self.map.keys().map(|&b| (b, self.get(b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_stay_sorted_and_fold_back_inline() {
        let mut m = HolderMap::default();
        let b = BlockHash(42);
        assert_eq!(m.add(b, 5, DEVICE), PairChange::Added);
        assert_eq!(m.add(b, 5, HOST), PairChange::Kept);
        assert_eq!(m.tiers_of(b, 5), DEVICE | HOST);
        assert_eq!(m.add(b, 2, DEVICE), PairChange::Added);
        assert_eq!(m.add(b, 9, DISK), PairChange::Added);
        let slots: Vec<u32> = m.get(b).iter().map(|h| h.slot()).collect();
        assert_eq!(slots, vec![2, 5, 9]);
        assert_eq!(m.remove(b, 2, DEVICE), PairChange::Removed);
        assert_eq!(m.remove(b, 9, DEVICE), PairChange::Kept);
        assert_eq!(m.remove(b, 9, DISK), PairChange::Removed);
        assert_eq!(m.get(b).len(), 1);
        assert_eq!(m.free.len(), 1);
        assert_eq!(m.remove(b, 5, DEVICE), PairChange::Kept);
        assert_eq!(m.remove(b, 7, DEVICE), PairChange::Absent);
        assert_eq!(m.remove(b, 5, HOST), PairChange::Removed);
        assert_eq!(m.blocks(), 0);
        // The freed arena vector is reused.
        m.add(b, 1, DEVICE);
        m.add(b, 3, DEVICE);
        assert_eq!(m.arena.len(), 1);
        assert!(m.free.is_empty());
    }
}
