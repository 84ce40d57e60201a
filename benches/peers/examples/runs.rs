//! A prototype of the run layout (`docs/BENCHMARKS.md`, branch `idx7`): the blocks a worker
//! stored as one chain kept together in one vector, one record per run, found through maps of
//! runs' first and last blocks, and no map of every block. Measured against Switchyard's index
//! and Dynamo's radix tree on the same streams and queries, in one process, every answer checked
//! against the bench's reference.
//!
//! ```sh
//! cargo build --release --example runs
//! target/release/examples/runs 64 3         # synthetic 1M pairs: load, queries, churn
//! target/release/examples/runs agent 3      # the agent-session replay
//! target/release/examples/runs mooncake 3   # the Mooncake replay
//! target/release/examples/runs check 2000   # the exact layout against the reference model
//! ```
//!
//! **Runs.** A *run* is a worker's chain of blocks, head first, in one vector, with the parent
//! it was stored under. A `Stored` event whose parent is the tail of one of the worker's runs
//! extends that run (engines store a sequence's next blocks under its last one); any other
//! `Stored` starts a run. Maps keyed by block hash point at runs: `heads` (a run's first block)
//! and `tails` (its last). A `Removed` block that is a run's tail shortens the run, and the
//! event's next blocks that are the run's new tails go without a map access (an engine evicts a
//! sequence tail first): a store or a removal costs one or two map accesses per event or run
//! touched, not one per block.
//!
//! **The query.** Block hashes are chained, so a run whose head is prompt block `p` holds prompt
//! blocks `p..p+m` exactly when its `m`-th block equals prompt block `p+m-1`: a run is matched
//! against the prompt by comparing its last block (and bisecting when that differs), never
//! block by block. The query follows each worker from the prompt's first block: the worker's run
//! with that head is matched, and where the match stops (the run ends, or the prompt branches
//! off it) the worker's run starting at the next prompt block, if any, carries on; the lookups
//! of workers stopping at the same position are shared. A worker's count only grows along runs
//! reached from the prompt's first block, so a run stored under a parent the worker does not
//! hold is never counted. The answer is exact when no block is in two runs of one worker; then
//! the run holding prompt block `p` after the run that held `p - 1` must start at `p`.
//!
//! **Three layouts**, all with that query:
//! - `runs` (`Runs`): nothing more. A re-store of held blocks is skipped only where a run of
//!   the worker starts at its first block; one that starts inside a run makes a second copy
//!   (engines publish only blocks they newly cache, but vLLM can cache one block twice), which
//!   can leave the query short. A removed block that is no run's tail is looked for in the
//!   worker's runs one by one.
//! - `runs located` (`Located`): a map per worker from each block to its run and offset: exact,
//!   at one map access per block (the per-worker map of Dynamo's radix tree).
//! - `runs exact (signatures)` (`Exact`): exact, without a map of every block. Each run keeps a
//!   *signature*, a bit set over its blocks (two bits per block, sixteen bits of set per block),
//!   written as a block is appended, in the run's own small set. A block is looked for among the
//!   ends of stored chains and run tails (`ends`), the runs' heads, and only then in the runs
//!   whose signature admits it; the store knows where each block's parent is as it walks the
//!   chain (the previous block's run and offset), so the search is needed only for a store's
//!   parent that is no run's tail or head (a branch off the middle of a run) and for a removed
//!   block that is no tail (a split). A block whose parent was just added can be held already
//!   only as the head of a run stored before its parent, so it is looked for in `heads` only
//!   when the worker has such runs (`orphans`). `check` runs it against the bench's reference
//!   (set semantics) on random streams: branching chains, stores starting anywhere (blocks held
//!   already, parents not held), removals of any blocks in any order.
//!
//! What none of them has: tiers, gap detection, bounded memory (see `docs/BENCHMARKS.md` for
//! how each would sit on runs).

use std::time::{Duration, Instant};

use switchyard_peer_bench::contenders::{self, Contender};
use switchyard_peer_bench::measure::{median, percentile};
use switchyard_peer_bench::traces::{self, Replay};
use switchyard_peer_bench::workload::{self, Event, Op, Query, Scores, Synthetic};

type FxMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// The bench's interface for a layout with `apply(&Event)` and the shared query over its `runs`,
/// `heads` and `open` scratch.
macro_rules! layout_contender {
    ($layout:ty, $name:literal) => {
        impl Contender for $layout {
            fn name(&self) -> &'static str {
                $name
            }

            fn apply(&mut self, events: &[Event]) -> Duration {
                let t = Instant::now();
                for ev in events {
                    <$layout>::apply(self, ev);
                }
                t.elapsed()
            }

            fn overlap(&mut self, q: &Query) -> (Duration, Scores) {
                let seqs = q.seqs();
                let t = Instant::now();
                let got = overlap(&self.runs, &self.heads, &mut self.open, &seqs);
                (t.elapsed(), got)
            }

            fn errors(&self) -> u64 {
                0
            }
        }
    };
}

/// What a map entry points at (runs, or runs and offsets): almost always one.
#[derive(Debug, Clone)]
enum Ids<T = u32> {
    One(T),
    Many(Vec<T>),
}

impl<T: Copy + PartialEq> Ids<T> {
    fn as_slice(&self) -> &[T] {
        match self {
            Ids::One(id) => std::slice::from_ref(id),
            Ids::Many(v) => v,
        }
    }

    fn push(&mut self, id: T) {
        match self {
            Ids::One(first) => *self = Ids::Many(vec![*first, id]),
            Ids::Many(v) => v.push(id),
        }
    }

    /// Removes `id`; returns whether none are left.
    fn remove(&mut self, id: T) -> bool {
        match self {
            Ids::One(x) => *x == id,
            Ids::Many(v) => {
                if let Some(i) = v.iter().position(|&x| x == id) {
                    v.swap_remove(i);
                }
                match v.as_slice() {
                    [] => true,
                    [only] => {
                        *self = Ids::One(*only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

fn add<T: Copy + PartialEq>(map: &mut FxMap<u64, Ids<T>>, key: u64, id: T) {
    map.entry(key)
        .and_modify(|ids| ids.push(id))
        .or_insert(Ids::One(id));
}

fn drop_id<T: Copy + PartialEq>(map: &mut FxMap<u64, Ids<T>>, key: u64, id: T) {
    if let Some(ids) = map.get_mut(&key)
        && ids.remove(id)
    {
        map.remove(&key);
    }
}

#[derive(Debug, Default)]
struct Run {
    worker: u32,
    /// The block the run's head was stored under (0: the root).
    parent: u64,
    /// Head first; empty when the run is free.
    blocks: Vec<u64>,
    /// Per block, the tiers holding it (all device here; kept to charge what the index would).
    tiers: Vec<u8>,
    /// Where the run is in its worker's list (the exact layout only).
    at: u32,
    /// Offsets of the blocks that end a stored chain or the run (ascending; the last is the
    /// run's tail), each in the `ends` map (the exact layout only).
    ends: Vec<u32>,
}

impl Run {
    fn tail(&self) -> u64 {
        self.blocks[self.blocks.len() - 1]
    }

    /// How many leading blocks of `prompt` the run holds, given that its head is `prompt[0]`.
    #[inline]
    fn matched(&self, prompt: &[u64]) -> usize {
        self.matched_by(prompt.len(), |i| prompt[i])
    }

    /// [`Self::matched`] over a prompt of `len` blocks given by `at`.
    #[inline]
    fn matched_by(&self, len: usize, at: impl Fn(usize) -> u64) -> usize {
        let k = self.blocks.len().min(len);
        if self.blocks[k - 1] == at(k - 1) {
            return k;
        }
        // Chained hashes: equal up to some count, different after it.
        let (mut good, mut bad) = (1, k);
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if self.blocks[mid - 1] == at(mid - 1) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        good
    }
}

#[derive(Debug, Default)]
struct Runs {
    runs: Vec<Run>,
    free: Vec<u32>,
    heads: FxMap<u64, Ids>,
    tails: FxMap<u64, Ids>,
    /// Removed blocks that were no run's tail (see the module docs).
    slow: u64,
    pairs: usize,
    /// Scratch of the query: (position, worker) still open.
    open: Vec<(u32, u32)>,
    /// Per worker, its runs in the order they were made (the eviction queue the index would
    /// keep; freed runs are left in it).
    order: Vec<std::collections::VecDeque<u32>>,
}

impl Runs {
    fn run_of(&self, map: &FxMap<u64, Ids>, key: u64, worker: u32) -> Option<u32> {
        map.get(&key)?
            .as_slice()
            .iter()
            .copied()
            .find(|&id| self.runs[id as usize].worker == worker)
    }

    fn new_run(&mut self, worker: u32, parent: u64, blocks: impl Iterator<Item = u64>) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        };
        let run = &mut self.runs[id as usize];
        run.worker = worker;
        run.parent = parent;
        run.blocks.extend(blocks);
        run.tiers.resize(run.blocks.len(), 1);
        let (head, tail) = (run.blocks[0], run.tail());
        let w = worker as usize;
        if self.order.len() <= w {
            self.order.resize_with(w + 1, Default::default);
        }
        self.order[w].push_back(id);
        add(&mut self.heads, head, id);
        add(&mut self.tails, tail, id);
        id
    }

    fn apply(&mut self, ev: &Event) {
        let w = ev.worker;
        match &ev.op {
            Op::Store { parent, blocks } => {
                // Blocks the worker holds already (a run of its own starts at the first one)
                // are skipped, as far as they match.
                let (mut pos, mut under) = (0, *parent);
                while pos < blocks.len()
                    && let Some(id) = self.run_of(&self.heads, blocks[pos].seq, w)
                {
                    let rest = &blocks[pos..];
                    pos += self.runs[id as usize].matched_by(rest.len(), |i| rest[i].seq);
                    under = Some(blocks[pos - 1].seq);
                }
                let blocks = &blocks[pos..];
                if blocks.is_empty() {
                    return;
                }
                self.pairs += blocks.len();
                if let Some(p) = under
                    && let Some(id) = self.run_of(&self.tails, p, w)
                {
                    // The sequence goes on: extend the run.
                    drop_id(&mut self.tails, p, id);
                    let run = &mut self.runs[id as usize];
                    run.blocks.extend(blocks.iter().map(|b| b.seq));
                    run.tiers.resize(run.blocks.len(), 1);
                    let tail = run.tail();
                    add(&mut self.tails, tail, id);
                    return;
                }
                self.new_run(w, under.unwrap_or(0), blocks.iter().map(|b| b.seq));
            }
            Op::Remove { seqs } => {
                let mut i = 0;
                while i < seqs.len() {
                    let Some(id) = self.run_of(&self.tails, seqs[i], w) else {
                        self.remove_inside(w, seqs[i]);
                        i += 1;
                        continue;
                    };
                    drop_id(&mut self.tails, seqs[i], id);
                    let run = &mut self.runs[id as usize];
                    run.blocks.pop();
                    run.tiers.pop();
                    self.pairs -= 1;
                    i += 1;
                    // The event's next blocks, while they are this run's tails.
                    while i < seqs.len() && run.blocks.last() == Some(&seqs[i]) {
                        run.blocks.pop();
                        run.tiers.pop();
                        self.pairs -= 1;
                        i += 1;
                    }
                    match run.blocks.first() {
                        None => {
                            // The head was the last block: the run goes.
                            let head = seqs[i - 1];
                            drop_id(&mut self.heads, head, id);
                            self.free.push(id);
                        }
                        Some(_) => {
                            let tail = run.tail();
                            add(&mut self.tails, tail, id);
                        }
                    }
                }
            }
        }
    }

    /// The slow path: `block` is no tail of `worker`'s runs; split the run holding it.
    fn remove_inside(&mut self, worker: u32, block: u64) {
        self.slow += 1;
        let Some((id, at)) = self.runs.iter().enumerate().find_map(|(id, r)| {
            (r.worker == worker && !r.blocks.is_empty())
                .then(|| r.blocks.iter().position(|&b| b == block).map(|at| (id, at)))
                .flatten()
        }) else {
            return;
        };
        let id = id as u32;
        self.pairs -= 1;
        let run = &mut self.runs[id as usize];
        let after: Vec<u64> = run.blocks.split_off(at + 1);
        run.blocks.pop();
        run.tiers.truncate(run.blocks.len());
        let old_tail = after.last().copied().unwrap_or(block);
        drop_id(&mut self.tails, old_tail, id);
        if let Some(&tail) = self.runs[id as usize].blocks.last() {
            add(&mut self.tails, tail, id);
        } else {
            drop_id(&mut self.heads, block, id);
            self.free.push(id);
        }
        if !after.is_empty() {
            // Its parent is gone: an orphan, which no query reaches.
            self.new_run(worker, block, after.into_iter());
        }
    }

    /// Heap bytes: the runs' vectors, the run table and the two maps' buckets.
    fn heap_bytes(&self) -> usize {
        let blocks: usize = self
            .runs
            .iter()
            .map(|r| r.blocks.capacity() * 8 + r.tiers.capacity())
            .sum();
        let order: usize = self.order.iter().map(|q| q.capacity() * 4).sum();
        let many = |m: &FxMap<u64, Ids>| -> usize {
            m.values()
                .map(|ids| match ids {
                    Ids::One(_) => 0,
                    Ids::Many(v) => v.capacity() * 4,
                })
                .sum()
        };
        let bucket = std::mem::size_of::<(u64, Ids)>() + 1;
        blocks
            + order
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + (self.heads.capacity() + self.tails.capacity()) * bucket
            + many(&self.heads)
            + many(&self.tails)
    }
}

/// The query of both layouts: each worker followed from the prompt's first block along its
/// runs, one `heads` lookup per position where some worker's run ends or leaves the prompt.
fn overlap(
    runs: &[Run],
    heads: &FxMap<u64, Ids>,
    open: &mut Vec<(u32, u32)>,
    prompt: &[u64],
) -> Scores {
    let mut out: Scores = Vec::new();
    let Some(&first) = prompt.first() else {
        return out;
    };
    open.clear();
    if let Some(ids) = heads.get(&first) {
        for &id in ids.as_slice() {
            follow(&runs[id as usize], 0, prompt, open, &mut out);
        }
    }
    while !open.is_empty() {
        // The nearest position still open: one lookup for every worker stopped there.
        let pos = open.iter().map(|&(p, _)| p).min().unwrap_or(0);
        let ids = heads.get(&prompt[pos as usize]);
        let mut i = 0;
        while i < open.len() {
            let (p, w) = open[i];
            if p != pos {
                i += 1;
                continue;
            }
            open.swap_remove(i);
            let run = ids.and_then(|ids| {
                ids.as_slice()
                    .iter()
                    .map(|&id| &runs[id as usize])
                    .find(|r| r.worker == w)
            });
            match run {
                Some(run) => follow(run, pos as usize, prompt, open, &mut out),
                None => out.push((w, pos)),
            }
        }
    }
    // A worker holding a chain twice (stored again from inside a run) is met twice: its
    // longest match counts.
    out.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    out.dedup_by_key(|x| x.0);
    out
}

#[inline]
fn follow(run: &Run, pos: usize, prompt: &[u64], open: &mut Vec<(u32, u32)>, out: &mut Scores) {
    let end = pos + run.matched(&prompt[pos..]);
    if end == prompt.len() {
        out.push((run.worker, end as u32));
    } else {
        open.push((end as u32, run.worker));
    }
}

/// The exact variant: a map per worker from each block it holds to its run and offset, so a
/// block held already is never stored twice, a parent inside a run is found, and a block removed
/// from inside a run splits it. One map access per block (in a map the size of one worker's
/// share), where the plain layout has none.
#[derive(Debug, Default)]
struct Located {
    runs: Vec<Run>,
    free: Vec<u32>,
    heads: FxMap<u64, Ids>,
    /// Per worker: block -> (run, offset).
    loc: Vec<FxMap<u64, (u32, u32)>>,
    order: Vec<std::collections::VecDeque<u32>>,
    pairs: usize,
    /// Blocks removed from inside a run.
    splits: u64,
    open: Vec<(u32, u32)>,
}

impl Located {
    fn alloc(&mut self, worker: u32, parent: u64) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        };
        let run = &mut self.runs[id as usize];
        run.worker = worker;
        run.parent = parent;
        self.order[worker as usize].push_back(id);
        id
    }

    fn push(&mut self, id: u32, block: u64) {
        let run = &mut self.runs[id as usize];
        let at = run.blocks.len() as u32;
        run.blocks.push(block);
        run.tiers.push(1);
        if at == 0 {
            add(&mut self.heads, block, id);
        }
        self.loc[run.worker as usize].insert(block, (id, at));
    }

    fn apply(&mut self, ev: &Event) {
        let w = ev.worker as usize;
        if self.loc.len() <= w {
            self.loc.resize_with(w + 1, FxMap::default);
            self.order.resize_with(w + 1, Default::default);
        }
        match &ev.op {
            Op::Store { parent, blocks } => {
                // The run the event's new blocks go on, once known.
                let mut cur: Option<u32> = None;
                let mut prev = *parent;
                for b in blocks {
                    if self.loc[w].contains_key(&b.seq) {
                        cur = None;
                    } else {
                        let id = match cur {
                            Some(id) => id,
                            None => {
                                // Extend the parent's run when the parent is its tail.
                                let tail_run = prev
                                    .and_then(|p| self.loc[w].get(&p))
                                    .filter(|&&(r, k)| {
                                        k as usize + 1 == self.runs[r as usize].blocks.len()
                                    })
                                    .map(|&(r, _)| r);
                                match tail_run {
                                    Some(r) => r,
                                    None => self.alloc(ev.worker, prev.unwrap_or(0)),
                                }
                            }
                        };
                        self.push(id, b.seq);
                        self.pairs += 1;
                        cur = Some(id);
                    }
                    prev = Some(b.seq);
                }
            }
            Op::Remove { seqs } => {
                for s in seqs {
                    let Some((id, at)) = self.loc[w].remove(s) else {
                        continue;
                    };
                    self.pairs -= 1;
                    let run = &mut self.runs[id as usize];
                    if at as usize + 1 != run.blocks.len() {
                        // Inside the run: what follows becomes a run of its own (an orphan).
                        self.splits += 1;
                        let after = run.blocks.split_off(at as usize + 1);
                        run.tiers.truncate(at as usize + 1);
                        let orphan = self.alloc(ev.worker, *s);
                        for b in after {
                            self.loc[w].remove(&b);
                            self.push(orphan, b);
                        }
                    }
                    let run = &mut self.runs[id as usize];
                    run.blocks.pop();
                    run.tiers.pop();
                    if run.blocks.is_empty() {
                        drop_id(&mut self.heads, *s, id);
                        self.free.push(id);
                    }
                }
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        let blocks: usize = self
            .runs
            .iter()
            .map(|r| r.blocks.capacity() * 8 + r.tiers.capacity())
            .sum();
        let loc: usize = self.loc.iter().map(|m| m.capacity() * 17).sum();
        let order: usize = self.order.iter().map(|q| q.capacity() * 4).sum();
        blocks
            + loc
            + order
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.heads.capacity() * (std::mem::size_of::<(u64, Ids)>() + 1)
    }
}

layout_contender!(Located, "runs located");

/// A run's signature: a bit set over its blocks' hashes (two bits per block, sixteen bits per
/// block held), so "does this run hold block `h`?" is answered "no" without reading the run for
/// all but about one run in seventy. Bits are not cleared when blocks go (two blocks may share
/// one); the set is rebuilt from the run's blocks when the run outgrows it.
#[derive(Debug, Default)]
struct Signature {
    words: Vec<u64>,
    /// log2 of the number of bits (at least 6).
    bits: u32,
}

const SPREAD_A: u64 = 0x9e37_79b9_7f4a_7c15;
const SPREAD_B: u64 = 0xc2b2_ae3d_27d4_eb4f;

impl Signature {
    #[inline]
    fn positions(&self, h: u64) -> [usize; 2] {
        let shift = 64 - self.bits;
        [
            (h.wrapping_mul(SPREAD_A) >> shift) as usize,
            (h.wrapping_mul(SPREAD_B) >> shift) as usize,
        ]
    }

    #[inline]
    fn may_hold(&self, h: u64) -> bool {
        !self.words.is_empty()
            && self
                .positions(h)
                .iter()
                .all(|&i| self.words[i / 64] & (1 << (i % 64)) != 0)
    }

    #[inline]
    fn set(&mut self, h: u64) {
        for i in self.positions(h) {
            self.words[i / 64] |= 1 << (i % 64);
        }
    }

    /// Makes room for `len` blocks, rebuilding from `blocks` when the set grows.
    #[inline]
    fn reserve(&mut self, len: usize, blocks: &[u64]) {
        let want = (len * 16).next_power_of_two().max(64);
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

    fn clear(&mut self) {
        self.words.clear();
        self.bits = 6;
    }
}

#[derive(Debug, Default)]
struct WorkerRuns {
    /// The worker's live runs.
    runs: Vec<u32>,
    /// Some run of the worker may have a parent the worker does not hold (stored under a block
    /// it did not hold, or left behind by a removal inside a run): a new block's child may then
    /// be held already, as such a run's head.
    orphans: bool,
}

/// Where the previous block of a `Stored` chain is, as the store walks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prev {
    /// The root: the block is a prompt's first.
    Root,
    /// Not held by the worker.
    Unheld,
    /// Added by this event, as the tail of this run.
    New(u32),
    /// Held at this run and offset.
    At(u32, usize),
}

/// The exact run layout: the plain one, plus a signature per run, so that a block the worker
/// holds already is never stored twice, a parent inside a run is found, and a block removed
/// from inside a run splits it (see the module docs). The signature is written as a block is
/// appended (in the run's own, small, bit set) and read only when a store's parent or a
/// removed block is neither a run's tail nor a run's head.
#[derive(Debug, Default)]
struct Exact {
    runs: Vec<Run>,
    sigs: Vec<Signature>,
    free: Vec<u32>,
    heads: FxMap<u64, Ids>,
    /// The blocks that end a stored chain, and every run's tail -> (run << 32 | offset).
    ends: FxMap<u64, Ids<u64>>,
    workers: Vec<WorkerRuns>,
    pairs: usize,
    /// Runs whose blocks were read to find a block (signature hits).
    scans: u64,
    /// Searches through a worker's signatures.
    searches: u64,
    open: Vec<(u32, u32)>,
}

fn pack(id: u32, k: usize) -> u64 {
    (u64::from(id) << 32) | k as u64
}

impl Exact {
    fn run_of(&self, map: &FxMap<u64, Ids>, key: u64, worker: u32) -> Option<u32> {
        map.get(&key)?
            .as_slice()
            .iter()
            .copied()
            .find(|&id| self.runs[id as usize].worker == worker)
    }

    /// The run and offset where `block` ends a chain of `worker`'s (or is a run's tail).
    fn end_of(&self, block: u64, worker: u32) -> Option<(u32, usize)> {
        self.ends
            .get(&block)?
            .as_slice()
            .iter()
            .map(|&r| ((r >> 32) as u32, (r & 0xffff_ffff) as usize))
            .find(|&(id, _)| self.runs[id as usize].worker == worker)
    }

    /// Where `worker` holds `block`, if it does: the end of a stored chain, a run's head, or a
    /// run whose signature admits it and whose blocks hold it.
    fn find(&mut self, worker: u32, block: u64) -> Option<(u32, usize)> {
        if let Some(at) = self.end_of(block, worker) {
            return Some(at);
        }
        if let Some(id) = self.run_of(&self.heads, block, worker) {
            return Some((id, 0));
        }
        self.searches += 1;
        for &id in &self.workers[worker as usize].runs {
            if !self.sigs[id as usize].may_hold(block) {
                continue;
            }
            self.scans += 1;
            if let Some(k) = self.runs[id as usize]
                .blocks
                .iter()
                .position(|&b| b == block)
            {
                return Some((id, k));
            }
        }
        None
    }

    /// Records the run's tail as an end, if it is not one yet.
    fn mark_end(&mut self, id: u32) {
        let run = &mut self.runs[id as usize];
        let k = run.blocks.len() - 1;
        if run.ends.last() != Some(&(k as u32)) {
            run.ends.push(k as u32);
            add(&mut self.ends, run.blocks[k], pack(id, k));
        }
    }

    fn alloc(&mut self, worker: u32, parent: u64, first: u64) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                self.sigs.push(Signature::default());
                (self.runs.len() - 1) as u32
            }
        };
        let list = &mut self.workers[worker as usize].runs;
        let run = &mut self.runs[id as usize];
        run.worker = worker;
        run.parent = parent;
        run.at = list.len() as u32;
        list.push(id);
        add(&mut self.heads, first, id);
        id
    }

    fn release(&mut self, id: u32) {
        let (worker, at) = {
            let r = &self.runs[id as usize];
            (r.worker as usize, r.at as usize)
        };
        let list = &mut self.workers[worker].runs;
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            self.runs[moved as usize].at = at as u32;
        }
        self.sigs[id as usize].clear();
        self.free.push(id);
    }

    #[inline]
    fn append(&mut self, id: u32, block: u64) {
        let run = &mut self.runs[id as usize];
        run.blocks.push(block);
        run.tiers.push(1);
        let sig = &mut self.sigs[id as usize];
        sig.reserve(run.blocks.len(), &run.blocks);
        sig.set(block);
        self.pairs += 1;
    }

    /// Whether `block`, whose parent is `prev`, is held already, and where.
    #[inline]
    fn held(&self, worker: u32, prev: Prev, block: u64) -> Option<(u32, usize)> {
        let as_head = || self.run_of(&self.heads, block, worker).map(|id| (id, 0));
        match prev {
            // Inside a run: the run's next block, or a run stored under it (a branch).
            Prev::At(id, k) => match self.runs[id as usize].blocks.get(k + 1) {
                Some(&next) if next == block => Some((id, k + 1)),
                _ => as_head(),
            },
            // A root block can only be a run's head.
            Prev::Root => as_head(),
            // Its parent is not held or was just added: only an orphan's head.
            Prev::Unheld | Prev::New(_) if self.workers[worker as usize].orphans => as_head(),
            Prev::Unheld | Prev::New(_) => None,
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[workload::Block]) {
        let mut prev = match parent {
            None => Prev::Root,
            Some(p) => self
                .find(worker, p)
                .map_or(Prev::Unheld, |(id, k)| Prev::At(id, k)),
        };
        for (i, b) in blocks.iter().enumerate() {
            let h = b.seq;
            if let Some((id, k)) = self.held(worker, prev, h) {
                if let Prev::New(grown) = prev {
                    self.mark_end(grown);
                }
                prev = Prev::At(id, k);
                continue;
            }
            let id = match prev {
                Prev::New(id) => id,
                Prev::At(id, k) if k + 1 == self.runs[id as usize].blocks.len() => id,
                _ => {
                    if prev == Prev::Unheld {
                        self.workers[worker as usize].orphans = true;
                    }
                    let under = if i == 0 {
                        parent.unwrap_or(0)
                    } else {
                        blocks[i - 1].seq
                    };
                    self.alloc(worker, under, h)
                }
            };
            self.append(id, h);
            prev = Prev::New(id);
        }
        if let Prev::New(grown) = prev {
            self.mark_end(grown);
        }
    }

    fn remove(&mut self, worker: u32, seqs: &[u64]) {
        let mut i = 0;
        while i < seqs.len() {
            let s = seqs[i];
            i += 1;
            let Some((id, k)) = self.find(worker, s) else {
                continue;
            };
            if k + 1 != self.runs[id as usize].blocks.len() {
                self.split(worker, id, k);
            }
            self.pop(id);
            // The event's next blocks, while they are this run's tails.
            while i < seqs.len() && self.runs[id as usize].blocks.last() == Some(&seqs[i]) {
                self.pop(id);
                i += 1;
            }
            if self.runs[id as usize].blocks.is_empty() {
                let head = seqs[i - 1];
                drop_id(&mut self.heads, head, id);
                self.release(id);
            } else {
                self.mark_end(id);
            }
        }
    }

    /// Block `k` of run `id` goes from inside the run: the blocks after it become a run of
    /// their own, under it (an orphan once it goes), with their ends.
    fn split(&mut self, worker: u32, id: u32, k: usize) {
        self.workers[worker as usize].orphans = true;
        let run = &mut self.runs[id as usize];
        let after = run.blocks.split_off(k + 1);
        run.tiers.truncate(k + 1);
        let cut = run.ends.partition_point(|&e| e as usize <= k);
        let moved: Vec<u32> = run.ends.split_off(cut);
        for &e in &moved {
            let block = after[e as usize - k - 1];
            drop_id(&mut self.ends, block, pack(id, e as usize));
        }
        let orphan = self.alloc(worker, self.runs[id as usize].blocks[k], after[0]);
        for &b in &after {
            self.append(orphan, b);
            self.pairs -= 1;
        }
        for e in moved {
            let at = e as usize - k - 1;
            self.runs[orphan as usize].ends.push(at as u32);
            add(&mut self.ends, after[at], pack(orphan, at));
        }
    }

    fn pop(&mut self, id: u32) {
        let run = &mut self.runs[id as usize];
        let Some(b) = run.blocks.pop() else {
            return;
        };
        run.tiers.pop();
        self.pairs -= 1;
        let k = run.blocks.len();
        if run.ends.last() == Some(&(k as u32)) {
            run.ends.pop();
            drop_id(&mut self.ends, b, pack(id, k));
        }
    }

    fn apply(&mut self, ev: &Event) {
        let w = ev.worker as usize;
        if self.workers.len() <= w {
            self.workers.resize_with(w + 1, WorkerRuns::default);
        }
        match &ev.op {
            Op::Store { parent, blocks } => self.store(ev.worker, *parent, blocks),
            Op::Remove { seqs } => self.remove(ev.worker, seqs),
        }
    }

    fn heap_bytes(&self) -> usize {
        let blocks: usize = self
            .runs
            .iter()
            .map(|r| r.blocks.capacity() * 8 + r.tiers.capacity())
            .sum();
        let sigs: usize = self.sigs.iter().map(|s| s.words.capacity() * 8).sum();
        let workers: usize = self.workers.iter().map(|w| w.runs.capacity() * 4).sum();
        let bucket = std::mem::size_of::<(u64, Ids)>() + 1;
        blocks
            + sigs
            + workers
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.sigs.capacity() * std::mem::size_of::<Signature>()
            + self.heads.capacity() * bucket
            + self.ends.capacity() * (std::mem::size_of::<(u64, Ids<u64>)>() + 1)
            + self
                .runs
                .iter()
                .map(|r| r.ends.capacity() * 4)
                .sum::<usize>()
    }
}

layout_contender!(Exact, "runs exact (signatures)");

layout_contender!(Runs, "runs");

/// Both run layouts, Switchyard and Dynamo's radix tree, in that order.
fn line(workers: usize) -> Vec<Box<dyn Contender>> {
    let mut line: Vec<Box<dyn Contender>> = vec![
        Box::new(Runs::default()),
        Box::new(Located::default()),
        Box::new(Exact::default()),
    ];
    let mut others = contenders::lineup(workers, true, &["switchyard".into(), "radix_tree".into()]);
    // The concurrent radix tree's name contains "radix_tree" too.
    others.retain(|c| matches!(c.name(), "switchyard" | "dynamo radix_tree"));
    line.extend(others);
    line
}

fn us(s: &mut [Duration]) -> String {
    let p50 = percentile(s, 0.5).as_secs_f64() * 1e6;
    let p99 = percentile(s, 0.99).as_secs_f64() * 1e6;
    format!("{p50:.2} / {p99:.2}")
}

/// The trace replays of the bench: apply and per-request queries, every answer checked.
fn replay(r: &Replay, reps: usize) {
    let ops = r.block_ops() as f64;
    for _ in 0..reps {
        let mut parts = Vec::new();
        for c in &mut line(r.workers) {
            let (mut apply, mut queries) = (Duration::ZERO, Vec::new());
            for step in &r.steps {
                let (took, got) = c.overlap(&step.query);
                queries.push(took);
                assert_eq!(got, step.expected, "{} answer", c.name());
                if !step.events.is_empty() {
                    apply += c.apply(&step.events);
                }
            }
            parts.push(format!(
                "{} {:.2}, {}",
                c.name(),
                ops / apply.as_secs_f64() / 1e6,
                us(&mut queries)
            ));
        }
        println!(
            "{}: apply M/s, overlap p50 / p99 µs: {}",
            r.name,
            parts.join("; ")
        );
    }
}

fn synthetic(workers: usize, reps: usize) {
    let spec = Synthetic::of(workers, 1 << 20);
    let events: Vec<Event> = spec.population().collect();
    let ops: usize = events.iter().map(Event::block_ops).sum();
    let batch = spec.churn(1024);
    let batch_ops: usize = batch.iter().map(Event::block_ops).sum();
    let prompt = spec.prompt();
    let lens = [128usize, 1024, 8192];
    let queries: Vec<Query> = lens
        .iter()
        .map(|&n| Query {
            blocks: prompt.blocks[..n].to_vec(),
        })
        .collect();
    for _ in 0..reps {
        let mut line = line(workers);
        let load: Vec<String> = line
            .iter_mut()
            .map(|c| {
                let took: Duration = events.chunks(1024).map(|ch| c.apply(ch)).sum();
                format!("{} {:.2}", c.name(), ops as f64 / took.as_secs_f64() / 1e6)
            })
            .collect();
        println!("load M/s ({workers} workers): {}", load.join(", "));
        for (q, &n) in queries.iter().zip(&lens) {
            let want = spec.expected(n);
            let mut samples = vec![Vec::new(); line.len()];
            for _ in 0..2000 {
                for (i, c) in line.iter_mut().enumerate() {
                    let (took, got) = c.overlap(q);
                    samples[i].push(took);
                    assert_eq!(got, want, "{} answer, {n} blocks", c.name());
                }
            }
            let parts: Vec<String> = line
                .iter()
                .zip(&mut samples)
                .map(|(c, s)| format!("{} {}", c.name(), us(s)))
                .collect();
            println!("overlap {n} blocks p50 / p99 µs: {}", parts.join(", "));
        }
        // As the bench: 20 untimed rounds, the median of 100, contenders interleaved.
        let mut samples = vec![Vec::new(); line.len()];
        for round in 0..120 {
            for (i, c) in line.iter_mut().enumerate() {
                let took = c.apply(&batch);
                if round >= 20 {
                    samples[i].push(took);
                }
            }
        }
        let parts: Vec<String> = line
            .iter()
            .zip(&mut samples)
            .map(|(c, s)| {
                format!(
                    "{} {:.2}",
                    c.name(),
                    batch_ops as f64 / median(s).as_secs_f64() / 1e6
                )
            })
            .collect();
        println!("churn M/s: {}", parts.join(", "));
    }
    // Every holder of a 128-block prompt holds all of it.
    let all = workload::all_hold(
        workers,
        &Query {
            blocks: prompt.blocks[..128].to_vec(),
        },
    );
    let mut line = line(workers);
    for c in &mut line {
        c.apply(&events);
        c.apply(&all);
    }
    let want: Scores = (0..workers as u32).map(|w| (w, 128)).collect();
    let mut samples = vec![Vec::new(); line.len()];
    for _ in 0..2000 {
        for (i, c) in line.iter_mut().enumerate() {
            let (took, got) = c.overlap(&queries[0]);
            samples[i].push(took);
            assert_eq!(got, want, "{} answer, all hold", c.name());
        }
    }
    let parts: Vec<String> = line
        .iter()
        .zip(&mut samples)
        .map(|(c, s)| format!("{} {}", c.name(), us(s)))
        .collect();
    println!(
        "overlap 128 blocks, all hold, p50 / p99 µs: {}",
        parts.join(", ")
    );
    summary(&events);
}

/// Random streams against the bench's reference (set semantics): chains that branch, stores
/// that start anywhere (blocks held already, parents not held), removals of any blocks in any
/// order. After every event, every path and prefix is queried; the exact layout must answer as
/// the reference does and count the same pairs. Returns the events checked.
fn check(streams: u64) -> usize {
    let mut rng = workload::Rng::new(11);
    let c0 = workload::chain(None, &(0..8).map(|_| rng.next_u64()).collect::<Vec<_>>());
    let c2 = workload::chain(None, &(0..6).map(|_| rng.next_u64()).collect::<Vec<_>>());
    let branch = |base: &[workload::Block], at: usize, n: usize, rng: &mut workload::Rng| {
        let mut path = base[..at].to_vec();
        let locals: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
        path.extend(workload::chain(Some(base[at - 1].seq), &locals));
        path
    };
    let paths = [
        c0.clone(),
        branch(&c0, 3, 5, &mut rng),
        branch(&c0, 6, 3, &mut rng),
        c2.clone(),
        branch(&c2, 1, 4, &mut rng),
    ];
    let queries: Vec<Query> = paths
        .iter()
        .flat_map(|p| {
            (1..=p.len()).map(|n| Query {
                blocks: p[..n].to_vec(),
            })
        })
        .collect();
    let mut checked = 0;
    for stream in 0..streams {
        let mut rng = workload::Rng::new(stream);
        let mut exact = Exact::default();
        let mut reference = workload::Reference::default();
        for step in 0..200 {
            let worker = rng.below(3) as u32;
            let path = &paths[rng.below(paths.len() as u64) as usize];
            let op = if rng.below(10) < 6 {
                let a = rng.below(path.len() as u64) as usize;
                let b = a + 1 + rng.below((path.len() - a) as u64) as usize;
                Op::Store {
                    parent: a.checked_sub(1).map(|i| path[i].seq),
                    blocks: path[a..b].to_vec(),
                }
            } else {
                let n = 1 + rng.below(4) as usize;
                let seqs = (0..n)
                    .map(|_| path[rng.below(path.len() as u64) as usize].seq)
                    .collect();
                Op::Remove { seqs }
            };
            let ev = Event { worker, op };
            exact.apply(&ev);
            reference.apply(&ev);
            checked += 1;
            assert_eq!(
                exact.pairs, reference.pairs,
                "pairs, stream {stream} step {step}: {ev:?}"
            );
            for q in &queries {
                let got = overlap(&exact.runs, &exact.heads, &mut exact.open, &q.seqs());
                assert_eq!(
                    got,
                    reference.overlap(q),
                    "stream {stream} step {step} after {ev:?}, query of {} blocks",
                    q.blocks.len()
                );
            }
        }
    }
    checked
}

/// Both layouts after `events`: live runs, heap bytes per pair, slow-path removals.
fn summary(events: &[Event]) {
    let mut runs = Runs::default();
    let mut located = Located::default();
    let mut exact = Exact::default();
    for ev in events {
        runs.apply(ev);
        located.apply(ev);
        exact.apply(ev);
    }
    println!(
        "at the end: runs {} live of {} made, {:.1} heap bytes per pair, {} removals inside a \
         run; located {} live, {:.1} bytes per pair, {} splits; signatures {:.1} bytes per pair, \
         {} searches, {} runs read",
        runs.runs.len() - runs.free.len(),
        runs.runs.len(),
        runs.heap_bytes() as f64 / runs.pairs.max(1) as f64,
        runs.slow,
        located.runs.len() - located.free.len(),
        located.heap_bytes() as f64 / located.pairs.max(1) as f64,
        located.splits,
        exact.heap_bytes() as f64 / exact.pairs.max(1) as f64,
        exact.searches,
        exact.scans
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    if args.get(1).map(String::as_str) == Some("check") {
        let streams = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
        println!("exact layout = reference on {} events", check(streams));
        return;
    }
    let name = args.get(1).map_or("64", String::as_str);
    if let Some(trace) = traces::recorded(name) {
        match trace {
            Ok(r) => {
                replay(&r, reps);
                let events: Vec<Event> = r
                    .steps
                    .iter()
                    .flat_map(|s| s.events.iter().cloned())
                    .collect();
                summary(&events);
            }
            Err(e) => eprintln!("{name}: {e}"),
        }
        return;
    }
    let workers: usize = name.parse().unwrap_or(64);
    synthetic(workers, reps);
}
