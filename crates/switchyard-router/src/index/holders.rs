//! Compact storage of which workers hold each block, and each block's parent.
//!
//! One `(block, worker)` pair is a packed `u32` [`Holder`]: the worker's dense slot in the low
//! 23 bits, the mask of tiers it holds the block in above them (4 bits), and in the next 4 bits
//! how many children of the block the same worker holds (saturating at 15, which then means "15
//! or more"; the index uses it to know whether a worker's blocks stay prefix-closed, see
//! `mod.rs`). The block map's value is the block's parent hash ([`BlockHash::ROOT`] for the first
//! block of a prompt) and a `u32`: either the only holder itself (the common case: most blocks
//! live on one or a few workers), or, with the top bit set, the index of a sorted `Vec<Holder>`
//! in a side arena. A map entry is therefore 24 bytes (8-byte key, 8-byte parent, 4-byte value,
//! padding) plus hashbrown's one control byte, and a block shared by `k` workers adds a 24-byte
//! arena vector and `4k` bytes.

use std::collections::hash_map::Entry as MapEntry;

use switchyard_core::{BlockHash, StorageTier};

use crate::hasher::FxHashMap;

/// Largest number of worker slots a holder can name.
pub const MAX_SLOTS: usize = 1 << 23;
const SLOT_MASK: u32 = (1 << 23) - 1;
const TIER_SHIFT: u32 = 23;
const TIER_MASK: u32 = 0xf;
const CHILD_SHIFT: u32 = 27;
/// Child counts saturate here; a saturated count is never decremented.
pub const CHILD_MAX: u32 = 15;
const ARENA_FLAG: u32 = 1 << 31;

pub const DEVICE: u8 = 1;
pub const HOST: u8 = 2;
pub const DISK: u8 = 4;
pub const REMOTE: u8 = 8;
/// Every tier: removing it removes the pair.
pub const ALL_TIERS: u8 = DEVICE | HOST | DISK | REMOTE;

pub fn tier_bit(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => DEVICE,
        StorageTier::Host => HOST,
        StorageTier::Disk => DISK,
        StorageTier::Remote => REMOTE,
    }
}

/// A worker slot, the tiers it holds a block in and how many of the block's children it holds,
/// packed into 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder(u32);

impl Holder {
    pub fn new(slot: u32, tiers: u8) -> Self {
        debug_assert!(slot <= SLOT_MASK && tiers != 0 && u32::from(tiers) <= TIER_MASK);
        Holder(slot | (u32::from(tiers) << TIER_SHIFT))
    }
    #[inline]
    pub fn slot(self) -> u32 {
        self.0 & SLOT_MASK
    }
    #[inline]
    pub fn tiers(self) -> u8 {
        ((self.0 >> TIER_SHIFT) & TIER_MASK) as u8
    }
    #[inline]
    pub fn children(self) -> u32 {
        (self.0 >> CHILD_SHIFT) & CHILD_MAX
    }
    #[inline]
    fn with_tiers(self, tiers: u8) -> Self {
        Holder((self.0 & !(TIER_MASK << TIER_SHIFT)) | (u32::from(tiers) << TIER_SHIFT))
    }
    #[inline]
    fn with_children(self, n: u32) -> Self {
        Holder((self.0 & !(CHILD_MAX << CHILD_SHIFT)) | (n.min(CHILD_MAX) << CHILD_SHIFT))
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

/// What [`HolderMap::remove`] did, with what the caller needs to keep closure counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Removal {
    pub change: PairChange,
    /// The pair as it was (tiers and child count); meaningless when `change` is `Absent`.
    pub before: Holder,
    /// The block's parent ([`BlockHash::ROOT`] for a first block).
    pub parent: BlockHash,
}

/// A block's entry: its parent and its holders (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Entry {
    parent: BlockHash,
    /// The only holder, or `ARENA_FLAG | index` into the arena.
    value: Holder,
}

#[derive(Debug, Default)]
pub struct HolderMap {
    map: FxHashMap<BlockHash, Entry>,
    arena: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl HolderMap {
    pub fn blocks(&self) -> usize {
        self.map.len()
    }

    /// Looks every block up once, so their buckets are in cache when an event changes them.
    /// The lookups are independent of one another, so the processor overlaps their cache misses
    /// (the change that follows depends on each lookup's result, which serialises its misses);
    /// at a million pairs the map is far larger than the caches and this halves an event's time.
    #[inline]
    pub fn warm(&self, blocks: impl Iterator<Item = BlockHash>) {
        let mut held = 0usize;
        for block in blocks {
            held += usize::from(self.map.contains_key(&block));
        }
        std::hint::black_box(held);
    }

    /// Looks up every block's holders, so a query's next probes find them in cache; as in
    /// [`Self::warm`], the lookups are independent and their cache misses overlap.
    #[inline]
    pub fn warm_holders(&self, blocks: impl Iterator<Item = BlockHash>) {
        let mut sum = 0u32;
        for block in blocks {
            sum = sum.wrapping_add(self.get(block).first().map_or(0, |h| h.0));
        }
        std::hint::black_box(sum);
    }

    /// Holders of `block`, sorted by slot.
    #[inline]
    pub fn get(&self, block: BlockHash) -> &[Holder] {
        match self.map.get(&block) {
            None => &[],
            Some(e) => self.holders(e),
        }
    }

    #[inline]
    fn holders<'a>(&'a self, e: &'a Entry) -> &'a [Holder] {
        if e.value.0 & ARENA_FLAG != 0 {
            &self.arena[(e.value.0 & !ARENA_FLAG) as usize]
        } else {
            std::slice::from_ref(&e.value)
        }
    }

    pub fn tiers_of(&self, block: BlockHash, slot: u32) -> u8 {
        self.holder(block, slot).map_or(0, Holder::tiers)
    }

    fn holder(&self, block: BlockHash, slot: u32) -> Option<Holder> {
        let holders = self.get(block);
        holders
            .binary_search_by_key(&slot, |h| h.slot())
            .ok()
            .map(|i| holders[i])
    }

    /// Adds `tiers` to the mask of `(block, slot)` and `children` to its child count. A new
    /// block records `parent`; an existing block keeps the parent it was first stored with.
    /// Returns the change, the pair's tier mask before (0 when new) and the block's recorded
    /// parent.
    pub fn add(
        &mut self,
        block: BlockHash,
        slot: u32,
        tiers: u8,
        parent: BlockHash,
        children: u32,
    ) -> (PairChange, u8, BlockHash) {
        let new = Holder::new(slot, tiers).with_children(children);
        let grow = |h: Holder| {
            let n = h.children();
            if n == CHILD_MAX {
                h
            } else {
                h.with_children(n + children)
            }
        };
        // One probe whether the block is new or not.
        let e = match self.map.entry(block) {
            MapEntry::Vacant(v) => {
                v.insert(Entry { parent, value: new });
                return (PairChange::Added, 0, parent);
            }
            MapEntry::Occupied(o) => o.into_mut(),
        };
        let recorded = e.parent;
        if e.value.0 & ARENA_FLAG == 0 {
            let old = e.value;
            if old.slot() == slot {
                e.value = grow(old.with_tiers(old.tiers() | tiers));
                return (PairChange::Kept, old.tiers(), recorded);
            }
            let pair = if old.slot() < slot {
                vec![old, new]
            } else {
                vec![new, old]
            };
            e.value = Holder(ARENA_FLAG | alloc(&mut self.arena, &mut self.free, pair));
            return (PairChange::Added, 0, recorded);
        }
        let list = &mut self.arena[(e.value.0 & !ARENA_FLAG) as usize];
        match list.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => {
                let old = list[i];
                list[i] = grow(old.with_tiers(old.tiers() | tiers));
                (PairChange::Kept, old.tiers(), recorded)
            }
            Err(i) => {
                list.insert(i, new);
                (PairChange::Added, 0, recorded)
            }
        }
    }

    /// Adds `delta` to the child count of `(block, slot)` (saturating; a saturated count stays).
    /// Returns whether the pair exists.
    pub fn adjust_children(&mut self, block: BlockHash, slot: u32, delta: i32) -> bool {
        let Some(e) = self.map.get_mut(&block) else {
            return false;
        };
        let step = |h: Holder| {
            let n = h.children();
            if n == CHILD_MAX {
                h
            } else {
                h.with_children(n.saturating_add_signed(delta))
            }
        };
        if e.value.0 & ARENA_FLAG == 0 {
            let h = e.value;
            if h.slot() != slot {
                return false;
            }
            e.value = step(h);
            return true;
        }
        let list = &mut self.arena[(e.value.0 & !ARENA_FLAG) as usize];
        match list.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => {
                list[i] = step(list[i]);
                true
            }
            Err(_) => false,
        }
    }

    /// Clears `tiers` from the mask of `(block, slot)`; the pair goes when its mask empties.
    pub fn remove(&mut self, block: BlockHash, slot: u32, tiers: u8) -> Removal {
        let absent = Removal {
            change: PairChange::Absent,
            before: Holder(0),
            parent: BlockHash::ROOT,
        };
        let MapEntry::Occupied(mut o) = self.map.entry(block) else {
            return absent;
        };
        let e = o.get_mut();
        let parent = e.parent;
        if e.value.0 & ARENA_FLAG == 0 {
            let old = e.value;
            if old.slot() != slot {
                return absent;
            }
            let left = old.tiers() & !tiers;
            let change = if left == 0 {
                // Through the entry: no second probe.
                o.remove();
                PairChange::Removed
            } else {
                e.value = old.with_tiers(left);
                PairChange::Kept
            };
            return Removal {
                change,
                before: old,
                parent,
            };
        }
        let idx = (e.value.0 & !ARENA_FLAG) as usize;
        let list = &mut self.arena[idx];
        let Ok(i) = list.binary_search_by_key(&slot, |h| h.slot()) else {
            return absent;
        };
        let old = list[i];
        let left = old.tiers() & !tiers;
        if left != 0 {
            list[i] = old.with_tiers(left);
            return Removal {
                change: PairChange::Kept,
                before: old,
                parent,
            };
        }
        list.remove(i);
        if list.len() == 1 {
            // Back to the inline form so the arena only holds shared blocks.
            e.value = list[0];
            let mut list = std::mem::take(&mut self.arena[idx]);
            list.clear();
            self.arena[idx] = list;
            self.free.push(idx as u32);
        }
        Removal {
            change: PairChange::Removed,
            before: old,
            parent,
        }
    }

    /// Approximate heap bytes: hashbrown buckets (entry + control byte) plus the arena.
    pub fn heap_bytes(&self) -> usize {
        let buckets = buckets_for(self.map.capacity());
        let entry = std::mem::size_of::<(BlockHash, Entry)>();
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
        self.map.iter().map(|(&b, e)| (b, self.holders(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: BlockHash = BlockHash::ROOT;

    fn add(m: &mut HolderMap, b: BlockHash, slot: u32, tiers: u8) -> PairChange {
        m.add(b, slot, tiers, R, 0).0
    }

    fn remove(m: &mut HolderMap, b: BlockHash, slot: u32, tiers: u8) -> PairChange {
        m.remove(b, slot, tiers).change
    }

    #[test]
    fn holders_stay_sorted_and_fold_back_inline() {
        let mut m = HolderMap::default();
        let b = BlockHash(42);
        assert_eq!(add(&mut m, b, 5, DEVICE), PairChange::Added);
        assert_eq!(add(&mut m, b, 5, HOST), PairChange::Kept);
        assert_eq!(m.tiers_of(b, 5), DEVICE | HOST);
        assert_eq!(add(&mut m, b, 2, DEVICE), PairChange::Added);
        assert_eq!(add(&mut m, b, 9, DISK), PairChange::Added);
        let slots: Vec<u32> = m.get(b).iter().map(|h| h.slot()).collect();
        assert_eq!(slots, vec![2, 5, 9]);
        assert_eq!(remove(&mut m, b, 2, DEVICE), PairChange::Removed);
        assert_eq!(remove(&mut m, b, 9, DEVICE), PairChange::Kept);
        assert_eq!(remove(&mut m, b, 9, DISK), PairChange::Removed);
        assert_eq!(m.get(b).len(), 1);
        assert_eq!(m.free.len(), 1);
        assert_eq!(remove(&mut m, b, 5, DEVICE), PairChange::Kept);
        assert_eq!(remove(&mut m, b, 7, DEVICE), PairChange::Absent);
        assert_eq!(remove(&mut m, b, 5, HOST), PairChange::Removed);
        assert_eq!(m.blocks(), 0);
        // The freed arena vector is reused.
        add(&mut m, b, 1, DEVICE);
        add(&mut m, b, 3, DEVICE);
        assert_eq!(m.arena.len(), 1);
        assert!(m.free.is_empty());
    }

    #[test]
    fn the_four_tier_bits_slot_and_child_count_do_not_overlap() {
        let top = (MAX_SLOTS - 1) as u32;
        let all = ALL_TIERS;
        let h = Holder::new(top, all).with_children(CHILD_MAX);
        assert_eq!((h.slot(), h.tiers(), h.children()), (top, all, CHILD_MAX));
        assert_eq!(
            h.0 & ARENA_FLAG,
            0,
            "a holder must never look like an arena index"
        );
        let h = h.with_tiers(REMOTE);
        assert_eq!(
            (h.slot(), h.tiers(), h.children()),
            (top, REMOTE, CHILD_MAX)
        );
        let remote_only = Holder::new(0, REMOTE);
        assert_eq!((remote_only.slot(), remote_only.children()), (0, 0));
    }

    #[test]
    fn parents_are_kept_and_child_counts_survive_tier_changes_and_saturate() {
        let mut m = HolderMap::default();
        let (p, c) = (BlockHash(1), BlockHash(2));
        assert_eq!(m.add(p, 3, DEVICE, R, 0), (PairChange::Added, 0, R));
        assert_eq!(m.add(c, 3, DEVICE, p, 0), (PairChange::Added, 0, p));
        // A later claim of another parent does not overwrite the first one.
        assert_eq!(
            m.add(c, 4, DEVICE, BlockHash(9), 2),
            (PairChange::Added, 0, p)
        );
        assert_eq!(m.holder(c, 4).map(Holder::children), Some(2));
        assert!(m.adjust_children(p, 3, 1));
        assert!(
            !m.adjust_children(p, 4, 1),
            "worker 4 does not hold the parent"
        );
        assert_eq!(m.add(p, 3, HOST, R, 1).1, DEVICE);
        assert_eq!(m.holder(p, 3).map(Holder::children), Some(2));
        assert!(m.adjust_children(p, 3, -1));
        let r = m.remove(p, 3, DEVICE);
        assert_eq!(
            (r.change, r.before.children(), r.before.tiers()),
            (PairChange::Kept, 1, DEVICE | HOST)
        );
        assert!(m.adjust_children(p, 3, -1));
        assert!(m.adjust_children(p, 3, -1), "saturates at zero");
        assert_eq!(m.holder(p, 3).map(Holder::children), Some(0));
        for _ in 0..20 {
            m.adjust_children(p, 3, 1);
        }
        m.adjust_children(p, 3, -1);
        assert_eq!(
            m.holder(p, 3).map(Holder::children),
            Some(CHILD_MAX),
            "a saturated count stays"
        );
        assert_eq!(m.holder(p, 3).map(Holder::slot), Some(3));
        assert_eq!(m.tiers_of(p, 3), HOST);
        let r = m.remove(c, 4, DEVICE);
        assert_eq!((r.change, r.parent), (PairChange::Removed, p));
    }
}
