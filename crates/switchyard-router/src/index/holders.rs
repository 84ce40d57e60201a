//! Compact storage of which workers hold each block, and each block's parent.
//!
//! One `(block, worker)` pair is a packed `u32` [`Holder`]: the worker's dense slot in the low
//! 23 bits, the mask of tiers it holds the block in above them (4 bits), and in the next 4 bits
//! how many children of the block the same worker holds (saturating at 15, which then means "15
//! or more"; the index uses it to know whether a worker's blocks stay prefix-closed, see
//! `mod.rs`). A block's entry is its parent hash ([`BlockHash::ROOT`] for the first block of a
//! prompt) and either the only holder itself (the common case: most blocks live on one or a few
//! workers) or the offset, length and chunk class of a sorted holder list in one flat slab (see
//! `slab.rs`). An entry is 24 bytes with its 8-byte key (key, parent, two `u32`s) plus
//! hashbrown's control byte; a block shared by `k` workers adds a chunk of `4 · 2^⌈log2 k⌉`
//! bytes.
//!
//! ## Two generations
//! Blocks are kept in two maps, each block in exactly one: a small *young* map of the blocks stored
//! since the last promotion, and the big *old* map of every other block. A block is first stored
//! into the young map (but for the blocks of a long chain, which go straight into the old map: see
//! `HolderMap::set_straight_to_old`), and the young map is moved into the old one (promoted) once
//! it holds `old / 32` blocks (at least 64, at most 4,096; a few hundred KiB, so it stays in the
//! caches). At a million pairs the old map is far larger than the caches, so every access to it is
//! a cache miss; an engine's churn (a sequence stored, then evicted soon after, the steady state of
//! a busy worker) now happens in the young map and never touches the old one but to look up, once
//! per event and all its blocks at once, whether the blocks are there (independent lookups, whose
//! misses overlap), and the old map's presence filter (`old.rs`) answers most of those lookups for
//! new blocks without touching the map. Queries look in the old map first (where almost every block
//! of a long prompt is) and in the young one only for a block the old map lacks.

use std::collections::hash_map::{Entry as MapEntry, OccupiedEntry};

use switchyard_core::{BlockHash, StorageTier};

use super::old::OldMap;
use super::slab::{MIN_CLASS, Slab, chunk_len};
use crate::hasher::FxHashMap;

/// Largest number of worker slots a holder can name.
pub const MAX_SLOTS: usize = 1 << 23;
const SLOT_MASK: u32 = (1 << 23) - 1;
const TIER_SHIFT: u32 = 23;
const TIER_MASK: u32 = 0xf;
const CHILD_SHIFT: u32 = 27;
/// Child counts saturate here; a saturated count is never decremented.
pub const CHILD_MAX: u32 = 15;

/// Bounds of the young map's size before a promotion (see the module docs).
const YOUNG_MIN: usize = 64;
const YOUNG_MAX: usize = 4096;
/// The young map is promoted once it holds this fraction of the old map's blocks.
const YOUNG_SHARE: usize = 32;

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
    /// A free slab cell.
    pub const EMPTY: Holder = Holder(0);

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
    /// The child count moved by `delta`, unless saturated (then the true count is unknown).
    #[inline]
    fn step_children(self, delta: i32) -> Self {
        let n = self.children();
        if n == CHILD_MAX {
            self
        } else {
            self.with_children(n.saturating_add_signed(delta))
        }
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
    /// The pair did not exist and still does not (for [`HolderMap::add`]: it could not be
    /// stored, the slab being out of offsets).
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

const ABSENT: Removal = Removal {
    change: PairChange::Absent,
    before: Holder::EMPTY,
    parent: BlockHash::ROOT,
};

/// Bits of [`Entry::list`] that hold the list's length; the chunk class is above them.
const LEN_BITS: u32 = 24;
const LEN_MASK: u32 = (1 << LEN_BITS) - 1;

/// A block's entry: its parent and its holders (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Entry {
    parent: BlockHash,
    /// The only holder when `list` is 0; otherwise the bits are the list's offset in the slab.
    value: Holder,
    /// 0 for a single holder; otherwise the list's length (low 24 bits, at least 2) and its
    /// chunk class (above them). Kept here, in what would be padding, so reading the holders
    /// takes no access to the slab beyond the holders themselves.
    list: u32,
}

impl Entry {
    fn single(parent: BlockHash, holder: Holder) -> Self {
        Entry {
            parent,
            value: holder,
            list: 0,
        }
    }

    /// Offset, length and class of the shared list.
    #[inline]
    fn shared(&self) -> (u32, u32, u8) {
        (
            self.value.0,
            self.list & LEN_MASK,
            (self.list >> LEN_BITS) as u8,
        )
    }

    #[inline]
    fn set_list(&mut self, at: u32, len: u32, class: u8) {
        self.value = Holder(at);
        self.list = len | (u32::from(class) << LEN_BITS);
    }

    #[inline]
    fn holders<'a>(&'a self, slab: &'a Slab) -> &'a [Holder] {
        if self.list == 0 {
            std::slice::from_ref(&self.value)
        } else {
            let (at, len, _) = self.shared();
            slab.get(at, len)
        }
    }

    /// See [`HolderMap::add`]; returns the change and the pair's tier mask before.
    fn add(&mut self, slab: &mut Slab, new: Holder, children: u32) -> (PairChange, u8) {
        let (slot, tiers) = (new.slot(), new.tiers());
        let grow = |h: Holder| {
            h.with_tiers(h.tiers() | tiers)
                .step_children(children as i32)
        };
        if self.list == 0 {
            let old = self.value;
            if old.slot() == slot {
                self.value = grow(old);
                return (PairChange::Kept, old.tiers());
            }
            let Some(at) = slab.alloc(MIN_CLASS) else {
                return (PairChange::Absent, 0);
            };
            let pair = if old.slot() < slot {
                [old, new]
            } else {
                [new, old]
            };
            slab.get_mut(at, 2).copy_from_slice(&pair);
            self.set_list(at, 2, MIN_CLASS);
            return (PairChange::Added, 0);
        }
        let (mut at, len, mut class) = self.shared();
        let list = slab.get_mut(at, len);
        let i = match list.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => {
                let old = list[i];
                list[i] = grow(old);
                return (PairChange::Kept, old.tiers());
            }
            Err(i) => i,
        };
        if len as usize == chunk_len(class) {
            let Some(moved) = slab.grow_or_shrink(at, class, len, class + 1) else {
                return (PairChange::Absent, 0);
            };
            (at, class) = (moved, class + 1);
        }
        let list = slab.get_mut(at, len + 1);
        list.copy_within(i..len as usize, i + 1);
        list[i] = new;
        self.set_list(at, len + 1, class);
        (PairChange::Added, 0)
    }

    /// See [`HolderMap::adjust_children`].
    fn adjust(&mut self, slab: &mut Slab, slot: u32, delta: i32) -> bool {
        if self.list == 0 {
            if self.value.slot() != slot {
                return false;
            }
            self.value = self.value.step_children(delta);
            return true;
        }
        let (at, len, _) = self.shared();
        let list = slab.get_mut(at, len);
        match list.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => {
                list[i] = list[i].step_children(delta);
                true
            }
            Err(_) => false,
        }
    }

    /// Clears `tiers` from `slot`'s mask; the caller drops the entry when the change is
    /// `Removed` and the entry had a single holder (`true` in the second place).
    fn remove(&mut self, slab: &mut Slab, slot: u32, tiers: u8) -> (Removal, bool) {
        let parent = self.parent;
        let removal = |change, before| Removal {
            change,
            before,
            parent,
        };
        if self.list == 0 {
            let old = self.value;
            if old.slot() != slot {
                return (ABSENT, false);
            }
            let left = old.tiers() & !tiers;
            if left == 0 {
                return (removal(PairChange::Removed, old), true);
            }
            self.value = old.with_tiers(left);
            return (removal(PairChange::Kept, old), false);
        }
        let (at, len, class) = self.shared();
        let list = slab.get_mut(at, len);
        let Ok(i) = list.binary_search_by_key(&slot, |h| h.slot()) else {
            return (ABSENT, false);
        };
        let old = list[i];
        let left = old.tiers() & !tiers;
        if left != 0 {
            list[i] = old.with_tiers(left);
            return (removal(PairChange::Kept, old), false);
        }
        list.copy_within(i + 1.., i);
        let len = len - 1;
        if len == 1 {
            // Back to the inline form so the slab only holds shared blocks.
            self.value = list[0];
            self.list = 0;
            slab.release(at, class);
        } else if class > MIN_CLASS && len as usize * 4 <= chunk_len(class) {
            // A quarter full: halve the chunk (it keeps room to grow back without moving).
            match slab.grow_or_shrink(at, class, len, class - 1) {
                Some(moved) => self.set_list(moved, len, class - 1),
                None => self.set_list(at, len, class),
            }
        } else {
            self.set_list(at, len, class);
        }
        (removal(PairChange::Removed, old), false)
    }
}

/// The young and old maps and the slab (see the module docs).
#[derive(Debug)]
pub struct HolderMap {
    young: FxHashMap<BlockHash, Entry>,
    /// Behind a presence filter that spares the write path most of its misses (see `old.rs`).
    old: OldMap<Entry>,
    slab: Slab,
    /// Most blocks the young map holds before a promotion (tests make it small).
    young_max: usize,
    /// New blocks go straight into the old map (see [`Self::set_straight_to_old`]).
    straight_to_old: bool,
}

impl Default for HolderMap {
    fn default() -> Self {
        Self {
            young: FxHashMap::default(),
            old: OldMap::default(),
            slab: Slab::default(),
            young_max: YOUNG_MAX,
            straight_to_old: false,
        }
    }
}

impl HolderMap {
    pub fn blocks(&self) -> usize {
        self.old.len() + self.young.len()
    }

    /// Looks every block up in the old map once, so their buckets are in cache when an event
    /// changes them. The lookups are independent of one another, so the processor overlaps their
    /// cache misses (the change that follows depends on each lookup's result, which serialises
    /// its misses); at a million pairs the old map is far larger than the caches and this
    /// halves an event's time. A block the old map's filter proves absent (see `old.rs`: a block
    /// stored for the first time, or one in the young map) is not looked for at all, and one found
    /// in the young map is not looked for in the old one: a removal soon after a store then costs
    /// no miss at all.
    ///
    /// While new blocks go straight into the old map, a block the filter proves absent is looked
    /// for in the map all the same: that brings in the control bytes its insert will read.
    #[inline]
    pub fn warm(&self, blocks: impl Iterator<Item = BlockHash>) {
        let mut held = 0usize;
        for block in blocks {
            if !self.old.may_hold(block) {
                if self.straight_to_old {
                    held += usize::from(self.old.touch(block));
                }
                continue;
            }
            if self.young.contains_key(&block) {
                continue;
            }
            // A shared block's change reads its holder list too, one more miss after the
            // entry's: touched here, it overlaps with the other blocks' misses as well.
            held += self.old.get(block).map_or(0, |e| {
                e.holders(&self.slab).first().map_or(1, |h| h.0 as usize)
            });
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
        match self.old.get(block).or_else(|| self.young.get(&block)) {
            None => &[],
            Some(e) => e.holders(&self.slab),
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
        // One probe of the young map, whose vacant entry takes the block if it is new.
        let e = match self.young.entry(block) {
            MapEntry::Occupied(o) => o.into_mut(),
            MapEntry::Vacant(v) => match self.old.get_mut(block) {
                Some(e) => e,
                None => {
                    let entry = Entry::single(parent, new);
                    if self.straight_to_old {
                        self.old.insert_new(block, entry);
                    } else {
                        v.insert(entry);
                        if self.young.len() >= self.young_limit() {
                            self.promote();
                        }
                    }
                    return (PairChange::Added, 0, parent);
                }
            },
        };
        let (change, before) = e.add(&mut self.slab, new, children);
        (change, before, e.parent)
    }

    /// Adds `delta` to the child count of `(block, slot)` (saturating; a saturated count stays).
    /// Returns whether the pair exists.
    pub fn adjust_children(&mut self, block: BlockHash, slot: u32, delta: i32) -> bool {
        match self.young.get_mut(&block) {
            Some(e) => e.adjust(&mut self.slab, slot, delta),
            None => match self.old.get_mut(block) {
                Some(e) => e.adjust(&mut self.slab, slot, delta),
                None => false,
            },
        }
    }

    /// Clears `tiers` from the mask of `(block, slot)`; the pair goes when its mask empties.
    pub fn remove(&mut self, block: BlockHash, slot: u32, tiers: u8) -> Removal {
        if let MapEntry::Occupied(o) = self.young.entry(block) {
            return remove_in(o, &mut self.slab, slot, tiers).0;
        }
        let Some(o) = self.old.occupied(block) else {
            return ABSENT;
        };
        let (removal, dropped) = remove_in(o, &mut self.slab, slot, tiers);
        if dropped {
            self.old.note_removed();
        }
        removal
    }

    /// Sends new blocks straight into the old map (`true`) or into the young one. A long chain
    /// (an agent's prompt tail, hundreds of blocks) is what an engine keeps until its cache
    /// evicts it least recently used, long after the young map would have been promoted: stored
    /// in the young map it would be inserted twice, there and then in the old map.
    pub fn set_straight_to_old(&mut self, on: bool) {
        self.straight_to_old = on;
    }

    /// Blocks the young map may hold before a promotion (see the module docs).
    fn young_limit(&self) -> usize {
        (self.old.len() / YOUNG_SHARE).clamp(YOUNG_MIN.min(self.young_max), self.young_max)
    }

    /// Moves every young block into the old map.
    fn promote(&mut self) {
        self.old.take_all(&mut self.young);
    }

    /// Approximate heap bytes: hashbrown buckets (entry + control byte) plus the slab.
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(BlockHash, Entry)>();
        let buckets = buckets_for(self.old.capacity()) + buckets_for(self.young.capacity());
        buckets * (entry + 1) + self.old.filter_bytes() + self.slab.heap_bytes()
    }

    /// Every block and its holders, in hash-map order (callers sort when order matters).
    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, &[Holder])> + '_ {
        self.old
            .iter()
            .chain(self.young.iter())
            .map(|(&b, e)| (b, e.holders(&self.slab)))
    }
}

/// [`HolderMap::remove`] on a block found in one of the two maps; also returns whether its
/// entry went.
fn remove_in(
    mut o: OccupiedEntry<'_, BlockHash, Entry>,
    slab: &mut Slab,
    slot: u32,
    tiers: u8,
) -> (Removal, bool) {
    let (removal, drop_entry) = o.get_mut().remove(slab, slot, tiers);
    if drop_entry {
        // Through the entry: no second probe.
        o.remove();
    }
    (removal, drop_entry)
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

#[cfg(test)]
#[path = "holders_tests.rs"]
mod tests;
