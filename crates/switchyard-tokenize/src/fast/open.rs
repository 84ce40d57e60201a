//! The open-addressing table under the encoder's cache-sized lookups ([`super::whole`]'s hot
//! pieces, [`super::bpe`]'s merge pairs): slots that carry their key inline, linear probing from
//! a multiplicative hash, at most half full, so a probe usually reads one cache line and no
//! control bytes. The tables are built once at load and never shrink.

/// Slots of type `S`, one of which (`empty`) marks a free slot.
#[derive(Debug)]
pub(super) struct OpenTable<S> {
    slots: Box<[S]>,
    /// `64 - log2(slots.len())`: the hash's top bits pick a slot.
    shift: u32,
    empty: S,
}

impl<S: Copy + PartialEq> OpenTable<S> {
    /// A table with room for `entries` at most half full.
    pub(super) fn with_room_for(entries: usize, empty: S) -> Self {
        let len = (entries.max(1) * 2).next_power_of_two();
        Self {
            slots: vec![empty; len].into_boxed_slice(),
            shift: 64 - len.trailing_zeros(),
            empty,
        }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// The slot for `key` that `matches`, probing from `key`'s home to the first free slot.
    #[inline]
    pub(super) fn find(&self, key: u64, matches: impl Fn(S) -> bool) -> Option<S> {
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            let slot = self.slots[at];
            if matches(slot) {
                return Some(slot);
            }
            if slot == self.empty {
                return None;
            }
            at = (at + 1) & mask;
        }
    }

    /// Puts `slot` in the first free slot from `key`'s home; `false` (and nothing changed) when
    /// a slot on the way is `same` as it. Never more than [`with_room_for`](Self::with_room_for)'s
    /// entries, so a free slot is always found.
    pub(super) fn insert(&mut self, key: u64, slot: S, same: impl Fn(S) -> bool) -> bool {
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            let here = self.slots[at];
            if here == self.empty {
                self.slots[at] = slot;
                return true;
            }
            if same(here) {
                return false;
            }
            at = (at + 1) & mask;
        }
    }

    /// The slots in use.
    #[cfg(test)]
    pub(super) fn used(&self) -> impl Iterator<Item = S> + '_ {
        self.slots.iter().copied().filter(move |s| *s != self.empty)
    }
}
