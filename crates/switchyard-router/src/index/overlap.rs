//! The overlap query: for a prompt's blocks, how many leading blocks each worker holds.
//!
//! Prefix semantics: a worker's count stops at its first missing block, because an engine can
//! only reuse a cached prefix. Counts are given at four nested tier levels:
//! - `device`: leading blocks all held in device memory (free to reuse);
//! - `device_or_host`: leading blocks each held on the device or in host memory (reusable after
//!   a host-to-device copy);
//! - `device_host_or_disk`: leading blocks each held on the worker's node (device, host or
//!   local disk);
//! - `any_tier`: leading blocks each held in some tier, the remote one included.
//!
//! so `device <= device_or_host <= device_host_or_disk <= any_tier`. A block held in several
//! tiers counts at the fastest one.
//!
//! Two ways to answer, both exact (see `runs.rs` for how blocks are kept):
//! - **Along runs**, for a worker whose blocks are all in one tier (the common case: engines
//!   without offloading). Block hashes are chained, so a run starting at prompt block `p` holds
//!   blocks `p..p+m` exactly when its `m`-th block equals prompt block `p+m-1`: one comparison,
//!   and a bisection when it differs. The query follows each such worker from the prompt's first
//!   block: its run starting there is matched, and where the match stops (the run ends, or the
//!   prompt leaves it) the worker's run starting at the next prompt block, if any, carries on.
//!   No block is in two runs of one worker's tier, so the run holding prompt block `p` after the
//!   run that held `p - 1` must start at `p`: one `heads` lookup per position where some worker
//!   stops, shared by every worker stopping there. A 128k-token prompt (8,192 blocks) held as one
//!   run costs one lookup and one comparison per worker. The runs starting at the prompt's first
//!   block are a family (see `runs.rs`): only the leader's run is matched when the family keeps
//!   figures; a member parting from the leader `s` blocks in holds `min(s, t)` prompt blocks
//!   when the leader holds `t`, and, when `s = t`, `t` unless its block after those is the
//!   prompt's next (then its run is read on). Such a family lists its members by `shared`,
//!   largest first: those parting from the leader before the prompt does stop where they part
//!   and are handed to a caller reading the deepest first only as far as it goes
//!   ([`PrefixIndex::overlap_deepest_first_while`]), at the cost of one `heads` lookup per
//!   position where some stop (a run starting there may carry them on: those are followed
//!   first), none per member left unread. The runs of a batch otherwise start at one
//!   position, and each is tried first at the count the one before it gave (workers sharing a
//!   prefix stop at the same block).
//! - **Walk**, for a worker holding blocks in several tiers: the tiers' runs interleave (a
//!   prefix on the device, its continuation only in host memory), so every prompt position up to
//!   the worker's reach is looked up in `heads`, and each of the worker's runs starting there
//!   extends the reach of the tier levels it counts for. One lookup per position, shared by all
//!   such workers, bounded by the longest reach.

use serde::Serialize;
use switchyard_core::BlockHash;

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::ControlFlow;

use super::runs::{DEVICE, DISK, HOST, HeadRef, REMOTE, RunStore, set_bit, set_slot};
use super::{PrefixIndex, WorkerKey};

/// Leading blocks a worker holds, at four nested tier levels (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TierOverlap {
    pub device: u32,
    pub device_or_host: u32,
    pub device_host_or_disk: u32,
    pub any_tier: u32,
}

impl TierOverlap {
    /// `n` leading blocks, all on the device.
    pub fn uniform(n: u32) -> Self {
        TierOverlap {
            device: n,
            device_or_host: n,
            device_host_or_disk: n,
            any_tier: n,
        }
    }
}

/// Per-worker overlap for one prompt. Workers that hold not even the first block are absent
/// (their overlap is zero).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Sorted by key.
    scores: Vec<(WorkerKey, TierOverlap)>,
}

impl OverlapScores {
    /// The worker's overlap; zero when it holds none of the prompt's leading blocks.
    pub fn get(&self, key: WorkerKey) -> TierOverlap {
        match self.scores.binary_search_by_key(&key, |(k, _)| *k) {
            Ok(i) => self.scores[i].1,
            Err(_) => TierOverlap::default(),
        }
    }

    /// Workers with a non-zero overlap, by key.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, TierOverlap)> + '_ {
        self.scores.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.scores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }
}

/// Tiers counted at each level, fastest first.
const LEVELS: [u8; 4] = [
    DEVICE,
    DEVICE | HOST,
    DEVICE | HOST | DISK,
    DEVICE | HOST | DISK | REMOTE,
];

/// The overlap of a worker holding `n` leading blocks, all in the tier `bit`.
fn levels(bit: u8, n: u32) -> TierOverlap {
    let at = |level: u8| if level & bit != 0 { n } else { 0 };
    TierOverlap {
        device: at(LEVELS[0]),
        device_or_host: at(LEVELS[1]),
        device_host_or_disk: at(LEVELS[2]),
        any_tier: at(LEVELS[3]),
    }
}

/// The query's buffers, kept per thread between queries (a query allocates only its answer).
#[derive(Debug, Default)]
struct Scratch {
    /// (position, set) where the first block's family stops, by position (counting-sorted:
    /// thousands of workers holding one system prompt to different lengths cost no heap).
    staged: Vec<(u32, u32)>,
    /// Sets per position, for the counting sort of `staged`, and its output.
    counts: Vec<u32>,
    sorted: Vec<(u32, u32)>,
    /// (position, set) still followed after a later run carried them on, nearest position
    /// first. With `staged`, each position is taken off once, however many sets stop at
    /// different positions (a shared prefix held to many lengths).
    open: BinaryHeap<Reverse<(u32, u32)>>,
    /// (set, leading blocks) settled.
    done: Vec<(u32, u32)>,
    /// The runs to match next, each at its prompt position.
    batch: Vec<(u32, u32)>,
    /// The sets stopped at the position being looked up, sorted, and which of them carry on.
    here: Vec<u32>,
    carried: Vec<bool>,
    /// (first, end, position): members `first..end` of the first block's family, all stopping
    /// at `position`, where no run starts (settled there, read only if the caller gets there).
    stopped: Vec<(u32, u32, u32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A worker holding blocks in several tiers, walked: the leading blocks held at each level.
#[derive(Debug, Clone, Copy)]
struct Walked {
    slot: u32,
    reach: [u32; 4],
}

impl PrefixIndex {
    /// Leading blocks of `blocks` held by each worker; see the module docs.
    ///
    /// `blocks` is a prompt's chained block hashes (block `i`'s parent is block `i - 1`), as
    /// `switchyard_core::block_hashes` computes them. A list that is not a chain (hashes of
    /// different prompts spliced together) may be answered as if the worker held the prompt the
    /// later hashes belong to.
    pub fn overlap(&self, blocks: &[BlockHash]) -> OverlapScores {
        let mut scores = self.overlap_deepest_first(blocks);
        scores.sort_unstable_by_key(|(k, _)| *k);
        OverlapScores { scores }
    }

    /// [`PrefixIndex::overlap`]'s workers with a non-zero overlap, by `any_tier`, largest first.
    pub fn overlap_deepest_first(&self, blocks: &[BlockHash]) -> Vec<(WorkerKey, TierOverlap)> {
        let mut scores = Vec::new();
        let _ = self.overlap_deepest_first_while(blocks, |key, overlap| {
            scores.push((key, overlap));
            ControlFlow::Continue(())
        });
        scores
    }

    /// [`PrefixIndex::overlap_deepest_first`]'s workers handed to `visit` one at a time, the
    /// deepest first, until it breaks, for a caller that stops once the rest are too shallow to
    /// compete (a decision among thousands of holders of one system prompt): the members of the
    /// first block's family parting from its leader before the prompt does are listed by where
    /// they part (`runs/family.rs`), and those the caller does not reach are never read.
    pub fn overlap_deepest_first_while(
        &self,
        blocks: &[BlockHash],
        visit: impl FnMut(WorkerKey, TierOverlap) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let store = &self.runs;
        let Some(first) = blocks.first().and_then(|b| store.heads.get(b)) else {
            return ControlFlow::Continue(());
        };
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            self.overlap_from(blocks, first.as_slice(), &mut scratch, visit)
        })
    }

    fn overlap_from(
        &self,
        blocks: &[BlockHash],
        first: &[HeadRef],
        scratch: &mut Scratch,
        mut visit: impl FnMut(WorkerKey, TierOverlap) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let store = &self.runs;
        let Scratch {
            staged,
            counts,
            sorted,
            open,
            done,
            batch,
            here,
            carried,
            stopped,
        } = scratch;
        staged.clear();
        open.clear();
        done.clear();
        batch.clear();
        stopped.clear();
        let mut walked: Vec<Walked> = Vec::new();
        // The runs starting at the first block are a family: the leader's run is matched, and
        // in a family keeping figures each member's count follows from where it parts from the
        // leader (see `runs/family.rs`); in a small one, members are matched trying the leader's
        // count first.
        let len = blocks.len() as u32;
        let t = store.runs[first[0].run as usize].matched(blocks) as u32;
        let kept = first[0].kept;
        // A family keeping figures lists its members by where they part from the leader,
        // furthest first: those parting before the prompt does (at `shared < t`) stop there,
        // and are read below only as far as the caller goes, unless a run starts where they
        // stop (then its worker may carry on). Not when some worker is walked (its sets'
        // counts are not their runs').
        let ordered = kept && !store.any_mixed();
        let front = if ordered {
            1 + first[1..].partition_point(|r| r.shared >= t)
        } else {
            first.len()
        };
        let mut at = front;
        while at < first.len() {
            let pos = first[at].shared;
            let end = at + first[at..].partition_point(|r| r.shared >= pos);
            if store.heads.contains_key(&blocks[pos as usize]) {
                staged.extend(first[at..end].iter().map(|r| (pos, r.set)));
            } else {
                stopped.push((at as u32, end as u32, pos));
            }
            at = end;
        }
        for (i, r) in first[..front].iter().enumerate() {
            let slot = set_slot(r.set);
            if store.tiers(slot).count_ones() > 1 {
                if !walked.iter().any(|w| w.slot == slot) {
                    walked.push(Walked {
                        slot,
                        reach: [0; 4],
                    });
                }
                continue;
            }
            let m = if i == 0 {
                t
            } else if !kept {
                store.runs[r.run as usize].matched_near(blocks, t as usize) as u32
            } else if r.shared != t {
                // Parting from the leader before the prompt does, it parts from the prompt
                // there; parting later, where the prompt parts from the leader.
                r.shared.min(t)
            } else if t < len && r.forks && r.fork == blocks[t as usize] {
                // Leaving the leader where the prompt does, the same way: read on.
                store.runs[r.run as usize].matched_near(blocks, t as usize + 1) as u32
            } else {
                t
            };
            if m == len {
                done.push((r.set, m));
            } else {
                staged.push((m, r.set));
            }
        }
        let staged = by_position(staged, len, counts, sorted);
        let mut next = 0;
        loop {
            // The nearest position still open: one lookup for every set stopped there.
            let pos = match (staged.get(next), open.peek()) {
                (None, None) => break,
                (Some(&(a, _)), None) => a,
                (None, Some(&Reverse((b, _)))) => b,
                (Some(&(a, _)), Some(&Reverse((b, _)))) => a.min(b),
            };
            let Some(refs) = store.heads.get(&blocks[pos as usize]) else {
                // No run starts here: every set stopped here is settled.
                stopped_at(pos, staged, &mut next, open, |set| done.push((set, pos)));
                continue;
            };
            here.clear();
            stopped_at(pos, staged, &mut next, open, |set| here.push(set));
            // A few sets are searched in turn; many sorted first and bisected.
            let few = here.len() <= 32;
            if !few {
                here.sort_unstable();
            }
            carried.clear();
            carried.resize(here.len(), false);
            batch.clear();
            for r in refs.as_slice() {
                let at = if few {
                    here.iter().position(|&s| s == r.set)
                } else {
                    here.binary_search(&r.set).ok()
                };
                if let Some(i) = at {
                    carried[i] = true;
                    batch.push((r.run, pos));
                }
            }
            follow(store, batch, blocks, open, done);
            done.extend(
                here.iter()
                    .zip(carried.iter())
                    .filter(|&(_, &c)| !c)
                    .map(|(&set, _)| (set, pos)),
            );
        }
        // Sets are settled at each position in turn, nearest first, except those holding the
        // whole prompt, settled whenever their match reaches its end: those first, then the
        // others from the last settled.
        let score = |&(set, n): &(u32, u32)| (WorkerKey(set_slot(set)), levels(set_bit(set), n));
        let settled = (done.iter().filter(|&&(_, n)| n == len))
            .chain(done.iter().rev().filter(|&&(_, n)| n != len))
            .map(score);
        if walked.is_empty() {
            // Merged with the members stopped where no run starts, deepest first.
            let mut settled = settled.peekable();
            for &(at, end, pos) in stopped.iter() {
                while let Some(&(key, overlap)) = settled.peek()
                    && overlap.any_tier >= pos
                {
                    visit(key, overlap)?;
                    settled.next();
                }
                for r in &first[at as usize..end as usize] {
                    visit(WorkerKey(set_slot(r.set)), levels(set_bit(r.set), pos))?;
                }
            }
            for (key, overlap) in settled {
                visit(key, overlap)?;
            }
            return ControlFlow::Continue(());
        }
        // A walked worker makes the family unordered: every member was settled above.
        debug_assert!(stopped.is_empty());
        let mut scores: Vec<(WorkerKey, TierOverlap)> = settled.collect();
        self.walk(blocks, &mut walked);
        scores.extend(walked.iter().map(|w| {
            let [device, device_or_host, device_host_or_disk, any_tier] = w.reach;
            (
                WorkerKey(w.slot),
                TierOverlap {
                    device,
                    device_or_host,
                    device_host_or_disk,
                    any_tier,
                },
            )
        }));
        scores.sort_by_key(|(_, o)| Reverse(o.any_tier));
        for (key, overlap) in scores {
            visit(key, overlap)?;
        }
        ControlFlow::Continue(())
    }

    /// The walk (see the module docs): every position up to the longest reach is looked up, and
    /// each run of a walked worker starting there extends the levels counting its tier, when
    /// the blocks before it are held at that level.
    fn walk(&self, blocks: &[BlockHash], walked: &mut [Walked]) {
        let store = &self.runs;
        for (j, block) in blocks.iter().enumerate() {
            let j32 = j as u32;
            if walked.iter().all(|w| w.reach[3] < j32) {
                break;
            }
            let Some(refs) = store.heads.get(block) else {
                continue;
            };
            for r in refs.as_slice() {
                let slot = set_slot(r.set);
                let Some(w) = walked.iter_mut().find(|w| w.slot == slot) else {
                    continue;
                };
                let run = &store.runs[r.run as usize];
                let bit = set_bit(r.set);
                let mut matched = None;
                for (level, &tiers) in LEVELS.iter().enumerate() {
                    if tiers & bit != 0 && j32 <= w.reach[level] {
                        let m = *matched.get_or_insert_with(|| run.matched(&blocks[j..]) as u32);
                        w.reach[level] = w.reach[level].max(j32 + m);
                    }
                }
            }
        }
    }
}

/// Takes off every set stopped at `pos`: the next of `staged` (from `next` on) and of `open`.
fn stopped_at(
    pos: u32,
    staged: &[(u32, u32)],
    next: &mut usize,
    open: &mut BinaryHeap<Reverse<(u32, u32)>>,
    mut take: impl FnMut(u32),
) {
    while let Some(&(p, set)) = staged.get(*next) {
        if p != pos {
            break;
        }
        *next += 1;
        take(set);
    }
    while let Some(&Reverse((p, set))) = open.peek() {
        if p != pos {
            break;
        }
        open.pop();
        take(set);
    }
}

/// `staged` (position, set) pairs ordered by position: counted into `sorted` when there are
/// many of them for the positions they can take (a counting sort, linear), sorted in place
/// otherwise. Positions are below `len`.
fn by_position<'a>(
    staged: &'a mut [(u32, u32)],
    len: u32,
    counts: &mut Vec<u32>,
    sorted: &'a mut Vec<(u32, u32)>,
) -> &'a [(u32, u32)] {
    if staged.len() < 64 || staged.len() * 4 < len as usize {
        staged.sort_unstable();
        return staged;
    }
    // Pairs next to each other are counted in different tallies: many sets stopping at one
    // position (a family's members, listed as they joined) would otherwise each wait for the
    // previous one's count to be stored.
    let stride = len as usize;
    counts.clear();
    counts.resize(TALLIES * stride, 0);
    for (i, &(pos, _)) in staged.iter().enumerate() {
        counts[i % TALLIES * stride + pos as usize] += 1;
    }
    // Each tally's count at a position becomes where its pairs go: after every pair of the
    // positions before, and of the tallies before at this position.
    let mut start = 0;
    for pos in 0..stride {
        for tally in 0..TALLIES {
            let count = &mut counts[tally * stride + pos];
            let n = *count;
            *count = start;
            start += n;
        }
    }
    sorted.clear();
    sorted.resize(staged.len(), (0, 0));
    for (i, &(pos, set)) in staged.iter().enumerate() {
        let at = &mut counts[i % TALLIES * stride + pos as usize];
        sorted[*at as usize] = (pos, set);
        *at += 1;
    }
    sorted
}

/// Tallies [`by_position`] counts in turn.
const TALLIES: usize = 4;

/// Matches each run of `batch` (starting at its prompt position) and either settles its set or
/// leaves it open at the position where the match stopped.
fn follow(
    store: &RunStore,
    batch: &[(u32, u32)],
    prompt: &[BlockHash],
    open: &mut BinaryHeap<Reverse<(u32, u32)>>,
    done: &mut Vec<(u32, u32)>,
) {
    // The runs of a batch start at one position; a run's count is the guess for the next.
    let mut guess = 0;
    for &(id, pos) in batch {
        let run = &store.runs[id as usize];
        let rest = &prompt[pos as usize..];
        let m = run.matched_near(rest, guess);
        guess = m;
        let end = pos + m as u32;
        if end as usize == prompt.len() {
            done.push((run.set, end));
        } else {
            open.push(Reverse((end, run.set)));
        }
    }
}
