//! The holder lists of blocks held by more than one worker, all in one flat slab.
//!
//! A list lives in a chunk of `1 << class` holders at some offset of one `Vec<Holder>`; a freed
//! chunk is kept on its class's free list and reused by the next list of that class. The block
//! map's entry carries the list's offset, length and class (see `holders.rs`), so a query reads
//! a shared block's holders with one memory access after the map's: a `Vec` per list, as
//! before, cost two dependent cache misses on a cold query (the `Vec` header in an arena, then
//! its data).

use super::holders::Holder;

/// Smallest chunk class: a shared list has at least two holders.
pub const MIN_CLASS: u8 = 1;
#[inline]
pub fn chunk_len(class: u8) -> usize {
    1 << class
}

#[derive(Debug, Default)]
pub struct Slab {
    data: Vec<Holder>,
    /// Offsets of free chunks, per class.
    free: Vec<Vec<u32>>,
}

impl Slab {
    #[inline]
    pub fn get(&self, at: u32, len: u32) -> &[Holder] {
        &self.data[at as usize..at as usize + len as usize]
    }

    #[inline]
    pub fn get_mut(&mut self, at: u32, len: u32) -> &mut [Holder] {
        &mut self.data[at as usize..at as usize + len as usize]
    }

    /// A chunk of `class`; `None` once the slab's offsets (`u32`) are used up, some four
    /// billion holders, far beyond the machine's memory at any realistic `max_entries`.
    pub fn alloc(&mut self, class: u8) -> Option<u32> {
        if let Some(at) = self.free.get_mut(usize::from(class)).and_then(Vec::pop) {
            return Some(at);
        }
        let at = u32::try_from(self.data.len()).ok()?;
        let end = self.data.len().checked_add(chunk_len(class))?;
        u32::try_from(end).ok()?;
        self.data.resize(end, Holder::EMPTY);
        Some(at)
    }

    /// Returns a chunk of `class` to its free list.
    pub fn release(&mut self, at: u32, class: u8) {
        let class = usize::from(class);
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(at);
    }

    /// Moves the list at `at` (of `class`, `len` holders) to a chunk of `to`; returns its new
    /// offset, or `None` (the list left where it was) when no chunk can be had.
    pub fn grow_or_shrink(&mut self, at: u32, class: u8, len: u32, to: u8) -> Option<u32> {
        let new = self.alloc(to)?;
        let (src, dst) = (at as usize, new as usize);
        self.data.copy_within(src..src + len as usize, dst);
        self.release(at, class);
        Some(new)
    }

    pub fn heap_bytes(&self) -> usize {
        self.data.capacity() * std::mem::size_of::<Holder>()
            + self.free.iter().map(|f| f.capacity() * 4).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_reused_per_class_and_moves_keep_the_holders() {
        let mut s = Slab::default();
        let a = s.alloc(1).unwrap();
        s.get_mut(a, 2)
            .copy_from_slice(&[Holder::new(1, 1), Holder::new(2, 1)]);
        let b = s.grow_or_shrink(a, 1, 2, 2).unwrap();
        assert_eq!(b, 2, "a class-2 chunk after the class-1 one");
        assert_eq!(s.get(b, 2), &[Holder::new(1, 1), Holder::new(2, 1)]);
        // The freed class-1 chunk is the next one of its class.
        assert_eq!(s.alloc(1), Some(a));
        assert_eq!(s.alloc(1), Some(6));
    }
}
