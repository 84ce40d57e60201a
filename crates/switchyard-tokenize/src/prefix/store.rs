//! The segments held, bounded in bytes: a map from a prefix's chained hash to the last
//! segment of that prefix, in shards each with its own lock and CLOCK ring, under one byte
//! budget shared by all shards.
//!
//! A lock is held for a map look-up or insertion and a few ring steps, never while text is
//! compared or tokenized. Evicting a segment leaves the segments after it unreachable (a
//! look-up walks from the start); they are never referenced again, so the next sweep of the
//! clock takes them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use switchyard_core::TokenId;

/// Shards: enough that the blocking pool's threads rarely meet on one lock.
const SHARDS: usize = 16;
/// Bookkeeping per segment beyond its bytes, ids and starts (map slot, ring slot, Arc).
pub(crate) const SEGMENT_OVERHEAD_BYTES: usize = 96;

/// One segment of a cached prefix: its bytes and their tokens, starts relative to the
/// segment. `parent` is the hash of the prefix before it, checked with the bytes on a hit so
/// that a hit never rests on a hash alone.
#[derive(Debug)]
pub(crate) struct Segment {
    pub parent: u64,
    pub text: Box<[u8]>,
    pub ids: Box<[TokenId]>,
    pub starts: Box<[u32]>,
}

impl Segment {
    pub(crate) fn bytes(&self) -> usize {
        self.text.len()
            + self.ids.len() * size_of::<TokenId>()
            + self.starts.len() * size_of::<u32>()
            + SEGMENT_OVERHEAD_BYTES
    }
}

#[derive(Debug)]
struct Slot {
    segment: Arc<Segment>,
    /// The CLOCK bit: set by a hit, cleared when the hand passes.
    referenced: bool,
}

#[derive(Debug, Default)]
struct Shard {
    slots: HashMap<u64, Slot>,
    /// Every key of `slots` once, in CLOCK order (the hand is the front).
    ring: VecDeque<u64>,
}

impl Shard {
    /// Takes one unreferenced segment off the ring, giving referenced ones a second chance;
    /// `None` after one turn of the ring that found none (their bits are clear now, so the
    /// next turn finds one unless they are used again meanwhile).
    fn evict_one(&mut self) -> Option<usize> {
        for _ in 0..self.ring.len() {
            let key = self.ring.pop_front()?;
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if slot.referenced {
                slot.referenced = false;
                self.ring.push_back(key);
            } else {
                return self.slots.remove(&key).map(|s| s.segment.bytes());
            }
        }
        None
    }
}

#[derive(Debug)]
pub(crate) struct SegmentStore {
    shards: Box<[Mutex<Shard>]>,
    max_bytes: usize,
    bytes: AtomicUsize,
    segments: AtomicUsize,
    hand: AtomicUsize,
    evictions: AtomicU64,
}

impl SegmentStore {
    pub(crate) fn new(max_bytes: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            max_bytes,
            bytes: AtomicUsize::new(0),
            segments: AtomicUsize::new(0),
            hand: AtomicUsize::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: u64) -> &Mutex<Shard> {
        // The key is a hash already: its low bits spread evenly.
        &self.shards[(key as usize) % self.shards.len()]
    }

    /// The segment ending the prefix with hash `key`, marking it used.
    pub(crate) fn get(&self, key: u64) -> Option<Arc<Segment>> {
        let mut shard = self.shard(key).lock();
        let slot = shard.slots.get_mut(&key)?;
        slot.referenced = true;
        Some(Arc::clone(&slot.segment))
    }

    /// Whether a segment is held under `key` (without marking it used).
    pub(crate) fn contains(&self, key: u64) -> bool {
        self.shard(key).lock().slots.contains_key(&key)
    }

    /// Stores a segment unless its key is held already or it is larger than the whole budget,
    /// then evicts until the budget holds. Whether it was stored.
    pub(crate) fn insert(&self, key: u64, segment: Segment) -> bool {
        let size = segment.bytes();
        if size > self.max_bytes {
            return false;
        }
        {
            let mut shard = self.shard(key).lock();
            if shard.slots.contains_key(&key) {
                return false;
            }
            shard.slots.insert(
                key,
                Slot {
                    segment: Arc::new(segment),
                    referenced: false,
                },
            );
            shard.ring.push_back(key);
        }
        self.segments.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(size, Ordering::Relaxed);
        self.evict_to_budget();
        true
    }

    /// Sweeps the shards in turn until the bytes held fit the budget: two turns over the
    /// shards at most without an eviction (one to clear CLOCK bits, one to evict). Concurrent
    /// inserts can overshoot the budget by what they add between insertion and sweep.
    fn evict_to_budget(&self) {
        let mut idle = 0;
        while self.bytes.load(Ordering::Relaxed) > self.max_bytes && idle < 2 * SHARDS {
            let k = self.hand.fetch_add(1, Ordering::Relaxed) % self.shards.len();
            let freed = self.shards[k].lock().evict_one();
            match freed {
                Some(size) => {
                    idle = 0;
                    self.bytes.fetch_sub(size, Ordering::Relaxed);
                    self.segments.fetch_sub(1, Ordering::Relaxed);
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                }
                None => idle += 1,
            }
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn segments(&self) -> usize {
        self.segments.load(Ordering::Relaxed)
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(len: usize) -> Segment {
        Segment {
            parent: 0,
            text: vec![b'x'; len].into(),
            ids: vec![1; len / 4].into(),
            starts: (0..len as u32 / 4).map(|i| i * 4).collect(),
        }
    }

    #[test]
    fn the_byte_budget_holds_under_churn() {
        let size = segment(1000).bytes();
        let store = SegmentStore::new(size * 10 + size / 2);
        for key in 0..500u64 {
            assert!(store.insert(key, segment(1000)));
            assert!(store.bytes() <= size * 10 + size / 2);
            // Keep a few hot keys referenced: CLOCK keeps them over the cold ones.
            for hot in 0..3 {
                store.get(hot);
            }
        }
        assert_eq!(store.segments(), 10);
        assert_eq!(store.bytes(), size * 10);
        assert_eq!(store.evictions(), 490);
        for hot in 0..3 {
            assert!(store.get(hot).is_some(), "hot key {hot} was evicted");
        }
        assert!(
            !store.insert(1 << 40, segment(size * 20)),
            "over the budget"
        );
        assert!(!store.insert(499, segment(10)), "held already");
    }

    #[test]
    fn a_zero_budget_holds_nothing() {
        let store = SegmentStore::new(0);
        assert!(!store.insert(1, segment(10)));
        assert_eq!((store.bytes(), store.segments()), (0, 0));
    }
}
