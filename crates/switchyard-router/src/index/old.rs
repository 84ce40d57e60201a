//! The old block map (see `holders.rs`) behind a presence filter.
//!
//! At a million pairs the old map is far larger than the caches, so asking it about a block costs
//! a cache miss even when the answer is "not here", and on the write path that is the common
//! answer: every block an engine stores for the first time is looked for there (a store must
//! know whether the block exists) and then lives in the young map, where its removal finds it.
//! The filter has eight bits per bucket of the map (nine to eighteen per block, as the map fills);
//! each block hashes to one bit, set for every key of the map, so a clear bit proves the block
//! absent without touching the map (about one absent block in ten finds its bit set). It is a
//! byte per bucket (1 MiB for the synthetic million pairs over 64 workers), small enough to stay
//! in the processor's second-level cache, where the map's buckets do not.
//!
//! Bits are set when blocks are inserted and never cleared one by one (a bit may stand for several
//! blocks): the filter is rebuilt from the map's keys when the map is resized and once the
//! removals since the last rebuild reach half of its blocks, so stale bits stay a small part (a
//! rebuild reads the whole map: at a quarter it took 3 % of the Mooncake replay's time).
//! A set bit only sends the lookup to the map, so a stale or shared bit costs time, never an
//! answer. Queries do not ask the filter: their blocks are mostly in the map, and for them the
//! filter would be one more access.

use std::collections::hash_map::{Entry as MapEntry, OccupiedEntry};

use switchyard_core::BlockHash;

use super::holders::buckets_for;
use crate::hasher::FxHashMap;

/// Spreads a block hash over the filter's index bits (the golden-ratio multiplier, unrelated to
/// the map's own hasher, so a block's filter bit does not follow its bucket).
const SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;
/// Bits of filter per bucket of the map.
const BITS_PER_BUCKET: usize = 8;
/// Fewest bits: the filter of an empty map (all clear, all absent).
const MIN_BITS_LOG2: u32 = 6;
/// Removals since the last rebuild that always trigger one, whatever the map's size, so small
/// maps are not rebuilt on every few removals.
const STALE_SLACK: usize = 1024;

/// The old block map and its presence filter; see the module docs.
#[derive(Debug)]
pub struct OldMap<V> {
    map: FxHashMap<BlockHash, V>,
    /// Bit `i` is set when some key of `map` spreads to `i`.
    bits: Vec<u64>,
    /// log2 of the number of bits.
    bits_log2: u32,
    /// Removals since the last rebuild.
    stale: usize,
    /// See `STALE_SLACK` (tests make it small).
    pub(super) stale_slack: usize,
}

impl<V> Default for OldMap<V> {
    fn default() -> Self {
        Self {
            map: FxHashMap::default(),
            bits: vec![0; 1 << (MIN_BITS_LOG2 - 6)],
            bits_log2: MIN_BITS_LOG2,
            stale: 0,
            stale_slack: STALE_SLACK,
        }
    }
}

impl<V> OldMap<V> {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// `false` proves the block is not in the map; `true` means it may be.
    #[inline]
    pub fn may_hold(&self, block: BlockHash) -> bool {
        let i = bit(block, self.bits_log2);
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    /// The block's value, without asking the filter (for queries; see the module docs).
    #[inline]
    pub fn get(&self, block: BlockHash) -> Option<&V> {
        self.map.get(&block)
    }

    /// The block's value, asking the filter first.
    #[inline]
    pub fn get_mut(&mut self, block: BlockHash) -> Option<&mut V> {
        if !self.may_hold(block) {
            return None;
        }
        self.map.get_mut(&block)
    }

    /// The block's entry when the map holds it, asking the filter first. A caller that removes
    /// the entry calls [`Self::note_removed`] afterwards.
    #[inline]
    pub fn occupied(&mut self, block: BlockHash) -> Option<OccupiedEntry<'_, BlockHash, V>> {
        if !self.may_hold(block) {
            return None;
        }
        match self.map.entry(block) {
            MapEntry::Occupied(o) => Some(o),
            MapEntry::Vacant(_) => None,
        }
    }

    /// Looks the block up in the map without asking the filter, for its control bytes (see
    /// `HolderMap::warm`).
    #[inline]
    pub fn touch(&self, block: BlockHash) -> bool {
        self.map.contains_key(&block)
    }

    /// Inserts a block that is in neither map; its filter bit is set (the whole filter is rebuilt
    /// when the insert resized the map).
    pub fn insert_new(&mut self, block: BlockHash, v: V) {
        let before = self.map.insert(block, v);
        debug_assert!(before.is_none(), "{block} was in the old map already");
        if self.wanted_log2() == self.bits_log2 {
            mark(&mut self.bits, bit(block, self.bits_log2));
        } else {
            self.rebuild();
        }
    }

    /// Counts a removal; rebuilds the filter once they reach half the map.
    pub fn note_removed(&mut self) {
        self.stale += 1;
        if self.stale >= self.map.len() / 2 + self.stale_slack {
            self.rebuild();
        }
    }

    /// Moves every block of `young` (none of which is in the map) into the map.
    pub fn take_all(&mut self, young: &mut FxHashMap<BlockHash, V>) {
        self.map.reserve(young.len());
        // Each insert first reads the control bytes where the block goes, a cache miss, and
        // writes after it: looking all the blocks up first, independent loads whose misses
        // overlap, brings those bytes in, as `HolderMap::warm` does for an event's blocks.
        let mut found = 0usize;
        for block in young.keys() {
            found += usize::from(self.map.contains_key(block));
        }
        std::hint::black_box(found);
        let resized = self.wanted_log2() != self.bits_log2;
        for (block, v) in young.drain() {
            if !resized {
                mark(&mut self.bits, bit(block, self.bits_log2));
            }
            let before = self.map.insert(block, v);
            debug_assert!(before.is_none(), "{block} was in both maps");
        }
        if resized {
            self.rebuild();
        }
    }

    /// Size of the filter for the map's current bucket count.
    fn wanted_log2(&self) -> u32 {
        let bits = (buckets_for(self.map.capacity()) * BITS_PER_BUCKET).max(1 << MIN_BITS_LOG2);
        bits.next_power_of_two().trailing_zeros()
    }

    /// Clears the filter, sized for the map's bucket count, and sets the bit of every key.
    fn rebuild(&mut self) {
        self.bits_log2 = self.wanted_log2();
        self.bits.clear();
        self.bits.resize(1 << (self.bits_log2 - 6), 0);
        self.bits.shrink_to_fit();
        for &block in self.map.keys() {
            mark(&mut self.bits, bit(block, self.bits_log2));
        }
        self.stale = 0;
    }

    pub fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// Heap bytes of the filter (the map's are counted by the caller, which knows `V`'s size).
    pub fn filter_bytes(&self) -> usize {
        self.bits.capacity() * 8
    }

    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, &V)> + '_ {
        self.map.iter()
    }

    /// Whether every key's bit is set (the filter's one invariant; for tests).
    #[cfg(test)]
    pub fn filter_is_sound(&self) -> bool {
        self.map.keys().all(|&b| self.may_hold(b))
    }
}

/// The filter bit of `block` in a filter of `2^log2` bits.
#[inline]
fn bit(block: BlockHash, log2: u32) -> usize {
    (block.0.wrapping_mul(SPREAD) >> (64 - log2)) as usize
}

#[inline]
fn mark(bits: &mut [u64], i: usize) {
    bits[i / 64] |= 1 << (i % 64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_never_hides_a_block_and_screens_out_most_absent_ones() {
        let mut m: OldMap<u32> = OldMap::default();
        // Pseudo-random keys, as block hashes are.
        let key = |i: u64| BlockHash(i.wrapping_mul(0xd6e8_feb8_6659_fd93).rotate_left(17) ^ i);
        for round in 0..8u64 {
            let mut young: FxHashMap<BlockHash, u32> = (round * 10_000..(round + 1) * 10_000)
                .map(|i| (key(i), i as u32))
                .collect();
            m.take_all(&mut young);
            assert!(young.is_empty());
            // Drop half of the round's blocks: removals, then rebuilds, happen along the way.
            for i in (round * 10_000..(round + 1) * 10_000).step_by(2) {
                if let Some(o) = m.occupied(key(i)) {
                    o.remove();
                    m.note_removed();
                }
            }
            assert!(m.filter_is_sound(), "round {round}");
        }
        assert_eq!(m.len(), 40_000);
        for i in (1..80_000).step_by(2) {
            assert_eq!(m.get_mut(key(i)).copied(), Some(i as u32));
            assert!(m.may_hold(key(i)));
        }
        let absent = (1_000_000..1_100_000u64)
            .filter(|&i| !m.may_hold(key(i)))
            .count();
        assert!(
            absent > 80_000,
            "the filter let {} of 100,000 absent blocks through",
            100_000 - absent
        );
        for i in (0..80_000).step_by(2) {
            assert!(m.get(key(i)).is_none() && m.get_mut(key(i)).is_none());
        }
    }
}
