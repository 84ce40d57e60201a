//! The blocks each worker holds in each tier, kept as runs (see the module docs of `mod.rs`).
//!
//! A *set* is one worker's blocks in one tier ([`set_of`]). A set's blocks are kept in *runs*:
//! a run is a chain of blocks, head first, each block the parent of the next, in one vector. A
//! `Stored` chain under the tail of one of the set's runs extends that run; any other starts a
//! run. Two maps keyed by block hash point into runs: `heads` (a run's first block) and `ends` (a
//! run's tail, with its offset). No map holds every block: storing and removing a sequence costs
//! map accesses per event and per run touched, not per block.
//!
//! **Each block once per set.** The store walks the chain knowing where each block's parent is
//! (the run and offset of the previous block), so it knows where the block itself would be if
//! held: right after its parent in the same run, or at the head of a run stored under its parent.
//! A block held already is skipped, never stored twice. A chain's parent that is no run's tail
//! or head (a branch off the middle of a run) is looked for among the runs of the set: first in
//! a *summary* of each run (256 bits over its blocks, the set's summaries side by side, read in
//! a sweep), then, for the runs whose summary admits it, in the run's *signature* (two bits per
//! block, sixteen bits of set per block held, in the run's own small set), then in the run's
//! blocks. Both are written as each block is appended.
//! A block whose parent was just added can only be held as the head of a run stored before its
//! parent (an *orphan*), looked up only in sets that may have one; in a set that has none, the
//! rest of a chain after its first new block is appended in one go.
//!
//! **Families**: see `family.rs`.
//!
//! **Removal.** A removed block that is its run's tail shortens the run, and the event's next
//! blocks that are the run's new tails go without a map access (engines evict a sequence tail
//! first). A block removed from inside a run splits it: the blocks after it become a run of
//! their own, an orphan. A run remembers the offsets its branches were stored under, so a
//! removed block with branches makes them orphans too (engines may evict a block shared by
//! requests before another request's child of it: that child is found when the block returns).

use std::collections::VecDeque;

use switchyard_core::{BlockHash, StorageTier};

use crate::hasher::FxHashMap;

mod family;

pub use family::HeadRef;
#[cfg(test)]
pub use family::KEEP_FIGURES;

pub const DEVICE: u8 = 1;
pub const HOST: u8 = 2;
pub const DISK: u8 = 4;
pub const REMOTE: u8 = 8;

/// Tiers per worker: one set each.
pub const TIERS: u32 = 4;

/// Largest number of worker slots (set ids and packed run offsets must fit).
pub const MAX_SLOTS: usize = 1 << 23;

pub fn tier_bit(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => DEVICE,
        StorageTier::Host => HOST,
        StorageTier::Disk => DISK,
        StorageTier::Remote => REMOTE,
    }
}

fn tier_index(tier: StorageTier) -> u32 {
    match tier {
        StorageTier::Device => 0,
        StorageTier::Host => 1,
        StorageTier::Disk => 2,
        StorageTier::Remote => 3,
    }
}

/// The set of `slot`'s blocks in `tier`.
pub fn set_of(slot: u32, tier: StorageTier) -> u32 {
    slot * TIERS + tier_index(tier)
}

/// The tier bit of a set.
pub fn set_bit(set: u32) -> u8 {
    1 << (set % TIERS)
}

pub fn set_slot(set: u32) -> u32 {
    set / TIERS
}

/// What a map entry points at: almost always one.
#[derive(Debug, Clone)]
pub enum Refs<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Copy + PartialEq> Refs<T> {
    pub fn as_slice(&self) -> &[T] {
        match self {
            Refs::One(r) => std::slice::from_ref(r),
            Refs::Many(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Refs::One(r) => std::slice::from_mut(r),
            Refs::Many(v) => v,
        }
    }

    fn push(&mut self, r: T) {
        match self {
            Refs::One(first) => *self = Refs::Many(vec![*first, r]),
            Refs::Many(v) => v.push(r),
        }
    }

    /// Removes `r`; returns whether none are left.
    fn remove(&mut self, r: T) -> bool {
        match self {
            Refs::One(x) => return *x == r,
            Refs::Many(v) => {
                if let Some(i) = v.iter().position(|&x| x == r) {
                    v.swap_remove(i);
                }
            }
        }
        self.collapse()
    }

    /// Removes the `i`-th, keeping the others in order; returns whether none are left.
    fn remove_at(&mut self, i: usize) -> bool {
        match self {
            Refs::One(_) => return true,
            Refs::Many(v) => {
                v.remove(i);
            }
        }
        self.collapse()
    }

    /// After a removal: a single ref left goes back inline; returns whether none are left.
    fn collapse(&mut self) -> bool {
        let Refs::Many(v) = self else {
            return false;
        };
        match v.as_slice() {
            [] => true,
            [only] => {
                *self = Refs::One(*only);
                false
            }
            _ => false,
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Refs::One(_) => 0,
            Refs::Many(v) => v.capacity() * std::mem::size_of::<T>(),
        }
    }
}

fn add_ref<T: Copy + PartialEq>(map: &mut FxHashMap<BlockHash, Refs<T>>, key: BlockHash, r: T) {
    map.entry(key)
        .and_modify(|refs| refs.push(r))
        .or_insert(Refs::One(r));
}

fn drop_ref<T: Copy + PartialEq>(map: &mut FxHashMap<BlockHash, Refs<T>>, key: BlockHash, r: T) {
    if let Some(refs) = map.get_mut(&key)
        && refs.remove(r)
    {
        map.remove(&key);
    }
}

fn pack(run: u32, at: usize) -> u64 {
    (u64::from(run) << 32) | at as u64
}

fn unpack(r: u64) -> (u32, usize) {
    ((r >> 32) as u32, (r & 0xffff_ffff) as usize)
}

const SPREAD_A: u64 = 0x9e37_79b9_7f4a_7c15;
const SPREAD_B: u64 = 0xc2b2_ae3d_27d4_eb4f;

/// A run's bit set over its blocks (see the module docs). Bits are not cleared when blocks go
/// (two blocks may share one): a stale bit costs a read of the run, never an answer.
#[derive(Debug, Default)]
struct Signature {
    words: Vec<u64>,
    /// log2 of the number of bits.
    bits: u32,
}

impl Signature {
    #[inline]
    fn positions(&self, h: BlockHash) -> [usize; 2] {
        let shift = 64 - self.bits;
        [
            (h.0.wrapping_mul(SPREAD_A) >> shift) as usize,
            (h.0.wrapping_mul(SPREAD_B) >> shift) as usize,
        ]
    }

    #[inline]
    fn may_hold(&self, h: BlockHash) -> bool {
        !self.words.is_empty()
            && self
                .positions(h)
                .iter()
                .all(|&i| self.words[i / 64] & (1 << (i % 64)) != 0)
    }

    #[inline]
    fn set(&mut self, h: BlockHash) {
        for i in self.positions(h) {
            self.words[i / 64] |= 1 << (i % 64);
        }
    }

    /// Makes room for `total` blocks, rebuilding from `blocks` (those held) when the set grows.
    #[inline]
    fn reserve(&mut self, blocks: &[BlockHash], total: usize) {
        let want = (total * 16).next_power_of_two().max(64);
        if self.words.len() * 64 >= want {
            return;
        }
        self.bits = want.trailing_zeros();
        self.words.clear();
        self.words.resize(want / 64, 0);
        for &b in blocks {
            self.set(b);
        }
    }
}

const SUM_A: u64 = 0xd6e8_feb8_6659_fd93;
const SUM_B: u64 = 0xa076_1d64_78bd_642f;

/// 256 bits over a run's blocks, two per block, never cleared (see [`SetState::sums`]).
#[derive(Debug, Clone, Copy, Default)]
struct Summary([u64; 4]);

impl Summary {
    #[inline]
    fn positions(h: BlockHash) -> [u32; 2] {
        [
            (h.0.wrapping_mul(SUM_A) >> 56) as u32,
            (h.0.wrapping_mul(SUM_B) >> 56) as u32,
        ]
    }

    #[inline]
    fn add(&mut self, h: BlockHash) {
        for i in Self::positions(h) {
            self.0[(i / 64) as usize] |= 1 << (i % 64);
        }
    }

    #[inline]
    fn may_hold(&self, [a, b]: [u32; 2]) -> bool {
        self.0[(a / 64) as usize] & (1 << (a % 64)) != 0
            && self.0[(b / 64) as usize] & (1 << (b % 64)) != 0
    }
}

/// A run, as the query reads it (the rest is in [`RunMeta`], so runs pack densely).
#[derive(Debug, Default)]
pub struct Run {
    pub set: u32,
    /// Head first; empty when the run is free.
    pub blocks: Vec<BlockHash>,
}

/// What only changes read of a run.
#[derive(Debug, Default)]
struct RunMeta {
    /// The run's tail is in the `ends` map (which keeps runs' tails only).
    tail_marked: bool,
    /// Offsets of the run's blocks that runs of the set were stored under (branches): when one
    /// goes, its branches lose their parent (see [`RunStore::cut`]).
    branches: Vec<u32>,
    sig: Signature,
    /// Position in its set's list of runs.
    at: u32,
    /// Bumped whenever the run is made or extended, so the eviction queue can tell its entries
    /// for the run's latest change from older ones.
    stamp: u32,
    /// The run leads its head's family.
    leads: bool,
    /// A member's `shared` (as in its [`HeadRef`]); for a leader, at least its members' largest
    /// (so a change of either that cannot move a member's figures reads no map).
    shared: u32,
}

impl Run {
    /// How many leading blocks of `prompt` the run holds, given that its head is `prompt[0]`.
    #[inline]
    pub fn matched(&self, prompt: &[BlockHash]) -> usize {
        self.matched_near(prompt, 0)
    }

    /// [`Run::matched`], trying `guess` first (the count another run starting at the same
    /// block gave: runs of workers sharing a prefix stop at the same block, and two blocks next
    /// to each other settle it).
    #[inline]
    pub fn matched_near(&self, prompt: &[BlockHash], guess: usize) -> usize {
        let k = self.blocks.len().min(prompt.len());
        if k == 0 {
            return 0;
        }
        let (mut good, mut bad) = (1, k);
        if guess > 0 && guess < k {
            if self.blocks[guess - 1] != prompt[guess - 1] {
                bad = guess;
            } else if self.blocks[guess] != prompt[guess] {
                return guess;
            } else {
                good = guess + 1;
            }
        }
        if bad == k && self.blocks[k - 1] == prompt[k - 1] {
            return k;
        }
        // Chained hashes: equal up to some count, different after it. A short stretch is read
        // in order (a few cache lines, no unpredictable branch), a long one bisected.
        if bad - good <= 32 {
            return good
                + self.blocks[good..bad]
                    .iter()
                    .zip(&prompt[good..bad])
                    .take_while(|(a, b)| a == b)
                    .count();
        }
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if self.blocks[mid - 1] == prompt[mid - 1] {
                good = mid;
            } else {
                bad = mid;
            }
        }
        good
    }
}

#[derive(Debug, Default)]
struct SetState {
    runs: Vec<u32>,
    /// Beside each run of `runs`, a small bit set over its blocks ([`Summary`]): a search for a
    /// block inside the set's runs reads these side by side, and a run's own signature only
    /// where its summary admits the block.
    sums: Vec<Summary>,
    /// Blocks in the set.
    blocks: usize,
    /// Some run of the set may have been stored before its parent (see the module docs).
    orphans: bool,
}

/// Where the previous block of a stored chain is, as the store walks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prev {
    /// The chain starts at the root.
    Root,
    /// Not held.
    Unheld,
    /// Added by this event as the tail of this run.
    New(u32),
    /// Held at this run and offset.
    At(u32, usize),
}

#[derive(Debug, Default)]
pub struct RunStore {
    pub runs: Vec<Run>,
    meta: Vec<RunMeta>,
    free: Vec<u32>,
    pub heads: FxHashMap<BlockHash, Refs<HeadRef>>,
    ends: FxHashMap<BlockHash, Refs<u64>>,
    sets: Vec<SetState>,
    /// Per worker slot, the tier bits of its sets that hold blocks.
    slot_tiers: Vec<u8>,
    /// Worker slots holding blocks in more than one tier (walked by the query).
    mixed_slots: usize,
    /// Per worker slot: its runs, least recently made or extended first, as `(run, stamp)`;
    /// entries whose stamp is not the run's are stale and skipped.
    queues: Vec<VecDeque<(u32, u32)>>,
}

impl RunStore {
    /// Makes room for the sets of `slot`.
    pub fn ensure_slot(&mut self, slot: u32) {
        let sets = (slot as usize + 1) * TIERS as usize;
        if self.sets.len() < sets {
            self.sets.resize_with(sets, SetState::default);
            self.queues.resize_with(slot as usize + 1, VecDeque::new);
            self.slot_tiers.resize(slot as usize + 1, 0);
        }
    }

    /// Blocks in `set`.
    pub fn len(&self, set: u32) -> usize {
        self.sets.get(set as usize).map_or(0, |s| s.blocks)
    }

    /// Marks `set` as possibly holding blocks stored before their parents: from now on every
    /// stored block is looked up among the set's run heads before it is added.
    pub fn mark_orphans(&mut self, set: u32) {
        if let Some(state) = self.sets.get_mut(set as usize) {
            state.orphans = true;
        }
    }

    /// Runs of `set` (tests look at the layout).
    #[cfg(test)]
    pub fn runs_in(&self, set: u32) -> usize {
        self.sets.get(set as usize).map_or(0, |s| s.runs.len())
    }

    /// Entries of `slot`'s eviction queue, stale ones included.
    #[cfg(test)]
    pub fn queue_len(&self, slot: u32) -> usize {
        self.queues.get(slot as usize).map_or(0, VecDeque::len)
    }

    /// Tier bits of `slot`'s sets that hold blocks.
    #[inline]
    pub fn tiers(&self, slot: u32) -> u8 {
        self.slot_tiers.get(slot as usize).copied().unwrap_or(0)
    }

    /// Whether some worker holds blocks in more than one tier.
    #[inline]
    pub fn any_mixed(&self) -> bool {
        self.mixed_slots > 0
    }

    /// Keeps `slot_tiers` and `mixed_slots` right after `set`'s block count changed.
    fn note_count(&mut self, set: u32) {
        let bit = set_bit(set);
        let tiers = &mut self.slot_tiers[set_slot(set) as usize];
        let was_mixed = tiers.count_ones() > 1;
        if self.sets[set as usize].blocks > 0 {
            *tiers |= bit;
        } else {
            *tiers &= !bit;
        }
        match (was_mixed, tiers.count_ones() > 1) {
            (false, true) => self.mixed_slots += 1,
            (true, false) => self.mixed_slots -= 1,
            _ => {}
        }
    }

    /// The run of `set` starting at `key`.
    fn head_of(&self, key: BlockHash, set: u32) -> Option<u32> {
        self.heads
            .get(&key)?
            .as_slice()
            .iter()
            .find(|r| r.set == set)
            .map(|r| r.run)
    }

    fn end_at(&self, key: BlockHash, set: u32) -> Option<(u32, usize)> {
        self.ends
            .get(&key)?
            .as_slice()
            .iter()
            .map(|&r| unpack(r))
            .find(|&(id, _)| self.runs[id as usize].set == set)
    }

    /// Where `set` holds `block`, if it does: a run's tail, a run's head, or a run whose summary
    /// and signature admit it and whose blocks hold it (the latest runs first).
    pub fn find(&self, set: u32, block: BlockHash) -> Option<(u32, usize)> {
        if let Some(at) = self.end_at(block, set) {
            return Some(at);
        }
        if let Some(id) = self.head_of(block, set) {
            return Some((id, 0));
        }
        let state = self.sets.get(set as usize)?;
        let bits = Summary::positions(block);
        state
            .sums
            .iter()
            .zip(&state.runs)
            .rev()
            .find_map(|(sum, &id)| {
                if !sum.may_hold(bits) || !self.meta[id as usize].sig.may_hold(block) {
                    return None;
                }
                self.runs[id as usize]
                    .blocks
                    .iter()
                    .position(|&b| b == block)
                    .map(|k| (id, k))
            })
    }

    /// Whether `set` holds `block`.
    pub fn holds(&self, set: u32, block: BlockHash) -> bool {
        self.find(set, block).is_some()
    }

    /// Whether `block`, whose parent is `prev`, is held in `set` already, and where.
    #[inline]
    fn held(&self, set: u32, prev: Prev, block: BlockHash) -> Option<(u32, usize)> {
        let as_head = || self.head_of(block, set).map(|id| (id, 0));
        match prev {
            // Inside a run: the run's next block, or a run stored under it (a branch).
            Prev::At(id, k) => match self.runs[id as usize].blocks.get(k + 1) {
                Some(&next) if next == block => Some((id, k + 1)),
                _ => as_head(),
            },
            // A first block can only be a run's head.
            Prev::Root => as_head(),
            // Its parent is not held or was just added: only an orphan's head.
            Prev::Unheld | Prev::New(_) if self.sets[set as usize].orphans => as_head(),
            Prev::Unheld | Prev::New(_) => None,
        }
    }

    fn alloc(&mut self, set: u32, first: BlockHash) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                self.meta.push(RunMeta::default());
                (self.runs.len() - 1) as u32
            }
        };
        let state = &mut self.sets[set as usize];
        self.runs[id as usize].set = set;
        self.meta[id as usize].at = state.runs.len() as u32;
        state.runs.push(id);
        state.sums.push(Summary::default());
        self.join(first, id, set);
        self.touch(id);
        id
    }

    /// Queues the run as the worker's most recently changed.
    fn touch(&mut self, id: u32) {
        let meta = &mut self.meta[id as usize];
        meta.stamp = meta.stamp.wrapping_add(1);
        let (stamp, slot) = (meta.stamp, set_slot(self.runs[id as usize].set) as usize);
        let queue = &mut self.queues[slot];
        queue.push_back((id, stamp));
        // Stale entries beyond the worker's live runs are dropped in one pass now and then.
        let live: usize = (0..TIERS as usize)
            .map(|t| self.sets[slot * TIERS as usize + t].runs.len())
            .sum();
        if queue.len() > 2 * live + 64 {
            let (runs, meta) = (&self.runs, &self.meta);
            queue.retain(|&(id, stamp)| {
                let r = &runs[id as usize];
                meta[id as usize].stamp == stamp
                    && !r.blocks.is_empty()
                    && set_slot(r.set) as usize == slot
            });
        }
    }

    fn release(&mut self, id: u32) {
        let set = self.runs[id as usize].set as usize;
        let meta = &mut self.meta[id as usize];
        let at = meta.at as usize;
        meta.tail_marked = false;
        meta.branches.clear();
        meta.sig.words.clear();
        meta.stamp = meta.stamp.wrapping_add(1);
        let state = &mut self.sets[set];
        state.sums.swap_remove(at);
        let list = &mut state.runs;
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            self.meta[moved as usize].at = at as u32;
        }
        self.free.push(id);
    }

    #[inline]
    fn append(&mut self, id: u32, block: BlockHash) {
        let run = &mut self.runs[id as usize];
        let meta = &mut self.meta[id as usize];
        meta.sig.reserve(&run.blocks, run.blocks.len() + 1);
        meta.sig.set(block);
        run.blocks.push(block);
        let set = run.set;
        let state = &mut self.sets[set as usize];
        state.sums[meta.at as usize].add(block);
        state.blocks += 1;
        if state.blocks == 1 {
            self.note_count(set);
        }
    }

    /// Appends `blocks` to run `id` at once: the rest of a chain none of whose blocks the set
    /// can hold (each is new, as [`Self::held`] would find, one block at a time).
    fn append_all(&mut self, id: u32, blocks: &[BlockHash]) {
        let run = &mut self.runs[id as usize];
        let meta = &mut self.meta[id as usize];
        meta.sig
            .reserve(&run.blocks, run.blocks.len() + blocks.len());
        let set = run.set;
        let state = &mut self.sets[set as usize];
        let sum = &mut state.sums[meta.at as usize];
        for &b in blocks {
            meta.sig.set(b);
            sum.add(b);
        }
        run.blocks.extend_from_slice(blocks);
        let was_empty = state.blocks == 0;
        state.blocks += blocks.len();
        if was_empty && !blocks.is_empty() {
            self.note_count(set);
        }
    }

    /// Makes room in run `id` for `more` blocks at once (a chain's blocks are appended one by
    /// one; growing the run and its signature for each would allocate again and again).
    fn make_room(&mut self, id: u32, more: usize) {
        let blocks = &mut self.runs[id as usize].blocks;
        blocks.reserve(more);
        let sig = &mut self.meta[id as usize].sig;
        sig.reserve(blocks, blocks.len() + more);
    }

    /// Forgets the run's tail as an end (it is about to be extended).
    fn unmark_tail(&mut self, id: u32) {
        let run = &self.runs[id as usize];
        let meta = &mut self.meta[id as usize];
        if meta.tail_marked {
            meta.tail_marked = false;
            let k = run.blocks.len() - 1;
            drop_ref(&mut self.ends, run.blocks[k], pack(id, k));
        }
    }

    /// Records the run's tail as an end, if it is not one yet.
    fn mark_end(&mut self, id: u32) {
        let run = &self.runs[id as usize];
        let meta = &mut self.meta[id as usize];
        if !meta.tail_marked {
            meta.tail_marked = true;
            let k = run.blocks.len() - 1;
            add_ref(&mut self.ends, run.blocks[k], pack(id, k));
        }
    }

    /// Stores the chain `blocks` under `parent` (`None`: at the root) in `set`; the blocks the
    /// set did not hold are pushed to `added`.
    pub fn store(
        &mut self,
        set: u32,
        parent: Option<BlockHash>,
        blocks: &[BlockHash],
        added: &mut Vec<BlockHash>,
    ) {
        let mut prev = match parent {
            None => Prev::Root,
            Some(p) => self
                .find(set, p)
                .map_or(Prev::Unheld, |(id, k)| Prev::At(id, k)),
        };
        // Where the run being appended to had its tail before this event's blocks.
        let mut from = 0;
        for (i, &h) in blocks.iter().enumerate() {
            if let Some((id, k)) = self.held(set, prev, h) {
                if let Prev::New(grown) = prev {
                    self.mark_end(grown);
                    self.grown(grown, from);
                }
                prev = Prev::At(id, k);
                continue;
            }
            let id = match prev {
                Prev::New(id) => id,
                Prev::At(id, k) if k + 1 == self.runs[id as usize].blocks.len() => {
                    // Its tail moves: the map keeps runs' tails only (one entry per run, not
                    // one per event, when a sequence grows a block at a time).
                    self.unmark_tail(id);
                    self.touch(id);
                    self.make_room(id, blocks.len() - i);
                    from = k + 1;
                    id
                }
                _ => {
                    match prev {
                        Prev::Unheld => self.sets[set as usize].orphans = true,
                        Prev::At(parent, k) => {
                            let branches = &mut self.meta[parent as usize].branches;
                            if !branches.contains(&(k as u32)) {
                                branches.push(k as u32);
                            }
                        }
                        Prev::Root | Prev::New(_) => {}
                    }
                    let id = self.alloc(set, h);
                    self.make_room(id, blocks.len() - i);
                    from = 0;
                    id
                }
            };
            self.append(id, h);
            added.push(h);
            prev = Prev::New(id);
            if !self.sets[set as usize].orphans {
                // After a new block only an orphan's head could be held (see `held`): with no
                // orphans in the set, the rest of the chain is new.
                let rest = &blocks[i + 1..];
                self.append_all(id, rest);
                added.extend_from_slice(rest);
                break;
            }
        }
        if let Prev::New(grown) = prev {
            self.mark_end(grown);
            self.grown(grown, from);
        }
    }

    /// Removes `blocks` from `set`; the blocks it held are pushed to `gone`. The event's blocks
    /// that are next to each other in a run (tail first, as engines evict, or head first) go as
    /// one range, found with one lookup.
    pub fn remove(&mut self, set: u32, blocks: &[BlockHash], gone: &mut Vec<BlockHash>) {
        let mut i = 0;
        while i < blocks.len() {
            let Some((id, k)) = self.find(set, blocks[i]) else {
                i += 1;
                continue;
            };
            i += 1;
            let (mut lo, mut hi) = (k, k + 1);
            let run = &self.runs[id as usize].blocks;
            while i < blocks.len() {
                if run.get(hi) == Some(&blocks[i]) {
                    hi += 1;
                } else if lo > 0 && run[lo - 1] == blocks[i] {
                    lo -= 1;
                } else {
                    break;
                }
                i += 1;
            }
            self.cut(id, lo, hi, gone);
        }
    }

    /// Removes blocks `lo..hi` of run `id`: the blocks after them become a run of their own (an
    /// orphan: its parent is gone), and a run left empty goes. Runs stored under a removed block
    /// become orphans too, so the set is marked as possibly holding some: a chain storing that
    /// block again then finds them (a store only looks for a block among run heads where one
    /// may be).
    fn cut(&mut self, id: u32, lo: usize, hi: usize, gone: &mut Vec<BlockHash>) {
        self.shrinking(id, lo);
        if hi < self.runs[id as usize].blocks.len() {
            self.split(id, hi - 1);
        }
        let branches = &mut self.meta[id as usize].branches;
        if branches.iter().any(|&k| k as usize >= lo) {
            branches.retain(|&k| (k as usize) < lo);
            let set = self.runs[id as usize].set;
            self.sets[set as usize].orphans = true;
        }
        let head = self.runs[id as usize].blocks[0];
        for _ in lo..hi {
            self.pop(id, gone);
        }
        if self.runs[id as usize].blocks.is_empty() {
            self.leave(head, id);
            self.release(id);
        } else {
            self.mark_end(id);
        }
    }

    /// The blocks of run `id` after block `k` become a run of their own, under block `k`; the
    /// tail's end entry, if any, moves with them.
    fn split(&mut self, id: u32, k: usize) {
        let set = self.runs[id as usize].set;
        self.sets[set as usize].orphans = true;
        let marked = self.meta[id as usize].tail_marked;
        self.unmark_tail(id);
        // The set holds an orphan from now on: the branch offsets after `k` need not move.
        self.meta[id as usize].branches.retain(|&b| b as usize <= k);
        let after = self.runs[id as usize].blocks.split_off(k + 1);
        self.sets[set as usize].blocks -= after.len();
        let orphan = self.alloc(set, after[0]);
        for &b in &after {
            self.append(orphan, b);
        }
        self.grown(orphan, 0);
        if marked {
            self.mark_end(orphan);
        }
    }

    fn pop(&mut self, id: u32, gone: &mut Vec<BlockHash>) {
        let run = &mut self.runs[id as usize];
        let Some(b) = run.blocks.pop() else {
            return;
        };
        let (set, k) = (run.set, run.blocks.len());
        self.sets[set as usize].blocks -= 1;
        if self.sets[set as usize].blocks == 0 {
            self.note_count(set);
        }
        let meta = &mut self.meta[id as usize];
        if meta.tail_marked {
            meta.tail_marked = false;
            drop_ref(&mut self.ends, b, pack(id, k));
        }
        gone.push(b);
    }

    /// Drops every block of `set`.
    pub fn clear_set(&mut self, set: u32) {
        let Some(state) = self.sets.get_mut(set as usize) else {
            return;
        };
        let runs = std::mem::take(&mut state.runs);
        state.sums = Vec::new();
        state.blocks = 0;
        state.orphans = false;
        for id in runs {
            self.leave(self.runs[id as usize].blocks[0], id);
            let run = &mut self.runs[id as usize];
            let meta = &mut self.meta[id as usize];
            if meta.tail_marked {
                let k = run.blocks.len() - 1;
                drop_ref(&mut self.ends, run.blocks[k], pack(id, k));
            }
            run.blocks.clear();
            meta.tail_marked = false;
            meta.branches.clear();
            meta.sig.words.clear();
            meta.stamp = meta.stamp.wrapping_add(1);
            self.free.push(id);
        }
        self.note_count(set);
    }

    /// Drops every block of every set of `slot`, and its eviction queue.
    pub fn clear_slot(&mut self, slot: u32) {
        for t in 0..TIERS {
            self.clear_set(slot * TIERS + t);
        }
        if let Some(q) = self.queues.get_mut(slot as usize) {
            *q = VecDeque::new();
        }
    }

    /// The tail of `slot`'s least recently made or extended run and its set: the block the
    /// memory bound evicts next (see the module docs of `mod.rs`).
    pub fn eviction_candidate(&mut self, slot: u32) -> Option<(u32, BlockHash)> {
        let queue = self.queues.get_mut(slot as usize)?;
        while let Some(&(id, stamp)) = queue.front() {
            let run = &self.runs[id as usize];
            if self.meta[id as usize].stamp == stamp
                && set_slot(run.set) == slot
                && !run.blocks.is_empty()
            {
                return Some((run.set, run.blocks[run.blocks.len() - 1]));
            }
            queue.pop_front();
        }
        None
    }

    /// The blocks of `set`, in no particular order.
    pub fn blocks_of(&self, set: u32) -> impl Iterator<Item = BlockHash> + '_ {
        self.sets
            .get(set as usize)
            .map_or(&[][..], |s| &s.runs[..])
            .iter()
            .flat_map(|&id| self.runs[id as usize].blocks.iter().copied())
    }

    /// Every block held anywhere, with repeats (one per set holding it).
    /// Every block of every set (a block held in several sets, several times), copied run by
    /// run.
    pub fn all_blocks(&self) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.sets.iter().map(|s| s.blocks).sum());
        for run in &self.runs {
            out.extend_from_slice(&run.blocks);
        }
        out
    }

    pub fn heap_bytes(&self) -> usize {
        let runs: usize = self.runs.iter().map(|r| r.blocks.capacity() * 8).sum();
        let meta: usize = self
            .meta
            .iter()
            .map(|m| m.sig.words.capacity() * 8 + m.branches.capacity() * 4)
            .sum();
        let head_refs: usize = self.heads.values().map(Refs::heap_bytes).sum();
        let end_refs: usize = self.ends.values().map(Refs::heap_bytes).sum();
        let sets: usize = self
            .sets
            .iter()
            .map(|s| s.runs.capacity() * 4 + s.sums.capacity() * std::mem::size_of::<Summary>())
            .sum();
        let queues: usize = self.queues.iter().map(|q| q.capacity() * 8).sum();
        runs + self.runs.capacity() * std::mem::size_of::<Run>()
            + meta
            + self.meta.capacity() * std::mem::size_of::<RunMeta>()
            + self.free.capacity() * 4
            + self.slot_tiers.capacity()
            + super::map_bytes(&self.heads)
            + head_refs
            + super::map_bytes(&self.ends)
            + end_refs
            + sets
            + self.sets.capacity() * std::mem::size_of::<SetState>()
            + queues
            + self.queues.capacity() * std::mem::size_of::<VecDeque<(u32, u32)>>()
    }
}
