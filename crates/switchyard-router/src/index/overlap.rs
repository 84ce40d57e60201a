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
//! Two ways to answer, with the same result:
//! - **Jump search**, when every worker holding the first block is prefix-closed and holds its
//!   blocks on the device only (see the module docs of `mod.rs`). Holding block `j` then means
//!   holding blocks `0..=j`, so "every worker still followed holds block `j`" is monotone in
//!   `j`. The query first probes the last block (when all hold it, one lookup answers), then
//!   bisects to the first block where the predicate fails; the workers missing there leave with
//!   that count. Each probe also reads, for every worker holding the block, how many of the
//!   block's children it holds (exact for such a worker): one holding none ends its prefix at
//!   that block and leaves without the next block being probed. After a drop the query probes
//!   the last block the same spacing predicts the next worker holds, so drops at a steady
//!   spacing (turns of a conversation, prompts sharing a template) cost one lookup each; it
//!   gallops (steps doubling) while the predicate holds. A query on a cold cache is bound by
//!   its dependent cache misses, not by its lookups' count, so a bisection looks up the three
//!   quartiles of its range at once before each two of its levels, and steady drops look up the
//!   next eight predicted probes at once: their misses overlap. Its cost is at
//!   most about `2·log2(gap)` lookups per point where some worker leaves instead of one lookup
//!   per block: a 128k-token prompt (8,192 blocks) that 32 workers hold to evenly spaced depths
//!   costs about 45 lookups.
//! - **Walk**, otherwise: the prompt's blocks are visited once, intersecting the set of workers
//!   still matching (sorted by slot) with each block's holders (also sorted), stopping as soon
//!   as that set is empty. Its cost is bounded by the blocks walked times the workers still
//!   matching, never by the number of workers in the index.

use serde::Serialize;
use switchyard_core::BlockHash;

use super::holders::{DEVICE, DISK, HOST, Holder};
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

/// A worker still matching the prompt. Counts are not incremented per block: the walk only
/// records the block index at which a worker leaves a tier level, which keeps the common case
/// (block held on the device) to one test per worker per block.
#[derive(Debug, Clone, Copy)]
struct Active {
    slot: u32,
    /// Bit 0: still matching at device level; bit 1: at device-or-host level; bit 2: at
    /// device-host-or-disk level.
    alive: u8,
    device_end: u32,
    host_end: u32,
    disk_end: u32,
}

impl Active {
    fn new(slot: u32, tiers: u8) -> Self {
        let mut a = Active {
            slot,
            alive: 0b111,
            device_end: 0,
            host_end: 0,
            disk_end: 0,
        };
        a.step(0, tiers);
        a
    }

    /// Block `i` is held in `tiers`.
    #[inline(always)]
    fn step(&mut self, i: u32, tiers: u8) {
        if tiers & DEVICE == 0 {
            if self.alive & 1 != 0 {
                self.alive &= !1;
                self.device_end = i;
            }
            if self.alive & 2 != 0 && tiers & HOST == 0 {
                self.alive &= !2;
                self.host_end = i;
            }
            if self.alive & 4 != 0 && tiers & (HOST | DISK) == 0 {
                self.alive &= !4;
                self.disk_end = i;
            }
        }
    }

    /// The worker's overlap when its run ends before block `end`.
    fn finish(&self, end: u32) -> (WorkerKey, TierOverlap) {
        let counts = TierOverlap {
            device: if self.alive & 1 != 0 {
                end
            } else {
                self.device_end
            },
            device_or_host: if self.alive & 2 != 0 {
                end
            } else {
                self.host_end
            },
            device_host_or_disk: if self.alive & 4 != 0 {
                end
            } else {
                self.disk_end
            },
            any_tier: end,
        };
        (WorkerKey(self.slot), counts)
    }
}

impl PrefixIndex {
    /// Leading blocks of `blocks` held by each worker; see the module docs.
    ///
    /// `blocks` is a prompt's chained block hashes (block `i`'s parent is block `i - 1`), as
    /// `switchyard_core::block_hashes` computes them; the jump search relies on it. A list that
    /// is not a chain (hashes of different prompts spliced together) may be answered as if the
    /// worker held the prompt the later hashes belong to.
    pub fn overlap(&self, blocks: &[BlockHash]) -> OverlapScores {
        let Some((&first, rest)) = blocks.split_first() else {
            return OverlapScores::default();
        };
        let holders = self.holders.get(first);
        let every_worker_jumpable = self.unjumpable == 0;
        if blocks.len() > 2
            && (every_worker_jumpable || holders.iter().all(|h| self.jumpable(h.slot())))
        {
            return self.jump_overlap(blocks, holders, every_worker_jumpable);
        }
        let mut active: Vec<Active> = self
            .holders
            .get(first)
            .iter()
            .map(|h| Active::new(h.slot(), h.tiers()))
            .collect();
        let mut done: Vec<(WorkerKey, TierOverlap)> = Vec::with_capacity(active.len());
        let mut walked = 1u32;
        for &block in rest {
            if active.is_empty() {
                break;
            }
            let holders = self.holders.get(block);
            intersect_step(&mut active, holders, walked, &mut done);
            walked += 1;
        }
        done.extend(active.iter().map(|a| a.finish(walked)));
        done.sort_unstable_by_key(|(k, _)| *k);
        OverlapScores { scores: done }
    }
}

impl PrefixIndex {
    /// The jump search (see the module docs); every worker in `first` is jumpable, so each
    /// count holds at all four tier levels.
    ///
    /// When every worker of the index is jumpable, a block's holders are a subset of the
    /// workers still followed (a closed worker holding block `j` holds every block before it),
    /// so "all hold" is a comparison of counts.
    fn jump_overlap(
        &self,
        blocks: &[BlockHash],
        first: &[Holder],
        every_worker_jumpable: bool,
    ) -> OverlapScores {
        let hold = |active: &[u32], holders: &[Holder]| {
            if every_worker_jumpable {
                holders.len() == active.len()
            } else {
                all_hold(active, holders)
            }
        };
        let mut active: Vec<u32> = first.iter().map(|h| h.slot()).collect();
        let mut done: Vec<(WorkerKey, TierOverlap)> = Vec::with_capacity(active.len());
        let mut last_drain = 0usize;
        if leave_childless(&mut active, first, 1, &mut done) {
            last_drain = 1;
        }
        let last = blocks.len() - 1;
        // Every active worker holds blocks[0..=lo].
        let mut lo = 0usize;
        // The first probe is the last block: often every worker holding the first block holds
        // the whole prompt (a shared system prompt, a resent conversation).
        let mut step = last;
        // The next probe tests the block where the spacing of earlier drops predicts one.
        let mut predicted = false;
        // The spacing of the last two drops, and the last block looked up ahead at that spacing.
        let (mut spacing, mut warmed_to) = (0usize, 0usize);
        while !active.is_empty() && lo < last {
            let hi = (lo + step).min(last);
            if predicted && hi > warmed_to && spacing > 1 {
                // Drops at a steady spacing: look up the next eight predicted probes at once, so
                // their cache misses overlap (a wrong prediction only wastes the lookups).
                warmed_to = hi + 7 * spacing;
                self.holders.warm_holders(
                    (hi..=warmed_to.min(last))
                        .step_by(spacing)
                        .map(|p| blocks[p]),
                );
            }
            let at_hi = self.holders.get(blocks[hi]);
            if hold(&active, at_hi) {
                lo = hi;
                if leave_childless(&mut active, at_hi, hi as u32 + 1, &mut done) {
                    // Settled from the held side: the next drop is predicted one spacing on.
                    let gap = hi + 1 - last_drain;
                    last_drain = hi + 1;
                    step = gap;
                    spacing = gap;
                    predicted = true;
                } else {
                    step = if predicted { 1 } else { step.saturating_mul(2) };
                    predicted = false;
                }
                continue;
            }
            // All hold blocks[a], not all hold blocks[b]: find the first failing block.
            let (mut a, mut b, mut at_b) = (lo, hi, at_hi);
            let mut level = 0u32;
            while b - a > 1 {
                // The next two levels probe among the range's quartiles: look the three up at
                // once, so their cache misses overlap instead of following one another (one of
                // the three goes unused, cheap next to a miss).
                if level.is_multiple_of(2) && b - a >= 8 {
                    let span = b - a;
                    self.holders
                        .warm_holders((1..4).map(|k| blocks[a + span * k / 4]));
                }
                level += 1;
                let mid = a + (b - a) / 2;
                let at_mid = self.holders.get(blocks[mid]);
                if hold(&active, at_mid) {
                    a = mid;
                } else {
                    (b, at_b) = (mid, at_mid);
                }
            }
            let count = b as u32;
            active.retain(|&slot| {
                let stays = at_b.binary_search_by_key(&slot, |h| h.slot()).is_ok();
                if !stays {
                    done.push((WorkerKey(slot), TierOverlap::uniform(count)));
                }
                stays
            });
            leave_childless(&mut active, at_b, count + 1, &mut done);
            // Workers often drop out at a steady spacing (turns of a conversation, prompts
            // sharing a template): probe the last block the next one is predicted to hold, where
            // a worker holding none of its children is settled by that one probe.
            let gap = b - last_drain;
            last_drain = b;
            lo = b;
            step = gap.saturating_sub(1).max(1);
            spacing = gap;
            predicted = gap > 1;
        }
        let end = if active.is_empty() { 0 } else { lo as u32 + 1 };
        done.extend(
            active
                .iter()
                .map(|&slot| (WorkerKey(slot), TierOverlap::uniform(end))),
        );
        done.sort_unstable_by_key(|(k, _)| *k);
        OverlapScores { scores: done }
    }
}

/// Moves to `done`, with `count` leading blocks, the workers of `active` (sorted, all among
/// `holders`) whose pair holds none of the block's children: a jumpable worker's child counts
/// are exact, so such a worker cannot hold the prompt's next block, and its overlap is settled
/// without probing that block. Returns whether any left.
#[inline]
fn leave_childless(
    active: &mut Vec<u32>,
    holders: &[Holder],
    count: u32,
    done: &mut Vec<(WorkerKey, TierOverlap)>,
) -> bool {
    if holders.iter().all(|h| h.children() != 0) {
        return false;
    }
    let before = done.len();
    let mut j = 0;
    active.retain(|&slot| {
        let stays = loop {
            match holders.get(j) {
                Some(h) if h.slot() < slot => j += 1,
                Some(h) if h.slot() == slot => break h.children() != 0,
                _ => break true,
            }
        };
        if !stays {
            done.push((WorkerKey(slot), TierOverlap::uniform(count)));
        }
        stays
    });
    done.len() > before
}

/// Whether every slot of `active` (sorted) is among `holders` (sorted by slot).
#[inline]
fn all_hold(active: &[u32], holders: &[Holder]) -> bool {
    if holders.len() < active.len() {
        return false;
    }
    if holders.len() > 8 * active.len() {
        return active
            .iter()
            .all(|&s| holders.binary_search_by_key(&s, |h| h.slot()).is_ok());
    }
    let mut j = 0;
    for &slot in active {
        while j < holders.len() && holders[j].slot() < slot {
            j += 1;
        }
        if j == holders.len() || holders[j].slot() != slot {
            return false;
        }
        j += 1;
    }
    true
}

/// Advances every active worker that holds the block; moves the others to `done`.
#[inline]
fn intersect_step(
    active: &mut Vec<Active>,
    holders: &[Holder],
    block: u32,
    done: &mut Vec<(WorkerKey, TierOverlap)>,
) {
    let mut kept = 0;
    if holders.len() > 8 * active.len() {
        // Few workers still matching, a widely shared block: binary search each one.
        for n in 0..active.len() {
            let mut a = active[n];
            match holders.binary_search_by_key(&a.slot, |h| h.slot()) {
                Ok(j) => {
                    a.step(block, holders[j].tiers());
                    active[kept] = a;
                    kept += 1;
                }
                Err(_) => done.push(a.finish(block)),
            }
        }
    } else {
        // Sorted merge.
        let mut j = 0;
        for n in 0..active.len() {
            let mut a = active[n];
            while j < holders.len() && holders[j].slot() < a.slot {
                j += 1;
            }
            if j < holders.len() && holders[j].slot() == a.slot {
                a.step(block, holders[j].tiers());
                active[kept] = a;
                kept += 1;
            } else {
                done.push(a.finish(block));
            }
        }
    }
    active.truncate(kept);
}
