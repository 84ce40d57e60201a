//! Families: the runs starting at one block (at most one per set) are listed in `heads` under
//! it, the first listed the family's *leader*. Once a family has [`KEEP_FIGURES`] runs, each
//! member's entry keeps its *figures*: how many leading blocks it has in common with the leader
//! (`shared`), and its block after those, if any (`fork`: it differs from the leader's block
//! there, or the leader has none). The query then matches the leader alone and derives every
//! member's count (see `overlap.rs`): sixteen workers holding one system prompt cost one run's
//! reads, not sixteen. The figures are exact, compared block by block, and kept through every
//! change at the cost of a map access only where one can move them: a member grown while it
//! ended where it parts from the leader (`grown`), a leader grown while a member shares all its
//! blocks (it keeps an upper bound of its members' `shared`), a run cut down to `shared` blocks
//! or fewer (`shrinking`: a leader then hands the family to the member sharing most, whose
//! figures for the others follow from those for the old leader, see `relead`). Each run's
//! `RunMeta` mirrors its `shared`, so most changes decide without the map. A member that grows
//! to hold all the leader's blocks and more takes the lead (as does, at each hand-over, the
//! member reaching furthest past a new leader): workers holding one prompt's prefix to many
//! lengths are then all settled from the longest one's match, none read past a short leader
//! (a leader cut short keeps the lead until the family next changes hands). A family keeping
//! figures goes on keeping them when it shrinks below [`KEEP_FIGURES`] runs again (a family
//! whose size hovers at the threshold does not read every member's run at each crossing).
//!
//! **Order.** A family keeping figures lists its members by `shared`, largest first, after the
//! leader. The query reads the members sharing at least as much with the leader as the prompt
//! does one by one, and the others by `shared`, the deepest first, so a caller can stop where
//! no shallower holder can matter and never read them (`overlap.rs`). The order costs the
//! write path little: a member whose `shared` changes moves past the members sharing what it
//! passes with one swap per distinct `shared` found by bisection (`reorder`), a hand-over reads
//! only the members sharing all the new leader has in common with the old one, the first
//! listed, and the member sharing most, wanted when the lead changes hands, is the first.

use std::cmp::Reverse;

use switchyard_core::BlockHash;

use super::{Refs, Run, RunStore};

/// A run starting at a block, with its set (so a lookup for one set reads no run), and how it
/// compares with the first run of the block's list, the family's *leader* (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadRef {
    pub run: u32,
    pub set: u32,
    /// For a member (not the leader): how many leading blocks it has in common with the leader.
    pub shared: u32,
    /// Whether the member has a block after those (then it is `fork`, and differs from the
    /// leader's block there, or the leader has none).
    pub forks: bool,
    /// For the leader: whether the family keeps its members' figures (from [`KEEP_FIGURES`]
    /// runs on); until then a member's `shared` is [`UNKEPT`].
    pub kept: bool,
    pub fork: BlockHash,
}

/// A family keeps its members' figures from this many runs on: a query reads a smaller
/// family's runs one by one (a few cache lines), and every member joining a family that keeps
/// figures reads the leader's run.
pub const KEEP_FIGURES: usize = 8;

/// A member's `shared` in a family not keeping figures.
pub const UNKEPT: u32 = u32::MAX;

impl HeadRef {
    /// Sets a member's figures: it shares `n` blocks with the leader, and its `blocks` tell
    /// whether and how it goes on.
    fn part(&mut self, blocks: &[BlockHash], n: usize) {
        self.shared = n as u32;
        self.forks = n < blocks.len();
        if self.forks {
            self.fork = blocks[n];
        }
    }

    fn new(run: u32, set: u32, shared: u32) -> Self {
        HeadRef {
            run,
            set,
            shared,
            forks: false,
            kept: false,
            fork: BlockHash(0),
        }
    }
}

/// How many leading blocks `a` and `b` have in common (read in order: exact whatever the
/// hashes).
fn common(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The member of a family keeping figures that holds all its leader's blocks and reaches
/// furthest past them, if any: it should lead, so that a query matching the leader to its end
/// settles the others from their figures instead of reading their runs on (`overlap.rs`).
fn furthest_past_leader(list: &[HeadRef], runs: &[Run]) -> Option<usize> {
    let len = |r: &HeadRef| runs[r.run as usize].blocks.len();
    let covers = len(&list[0]) as u32;
    // No member shares more than the leader holds: those sharing all of it are listed first.
    (1..list.len())
        .take_while(|&i| list[i].shared >= covers)
        .filter(|&i| list[i].shared == covers && list[i].forks)
        .max_by_key(|&i| len(&list[i]))
}

/// Where member `run`, sharing `shared` blocks with its leader, is listed in its family: in a
/// family keeping figures, among the members sharing as many, found by bisection.
fn member_at(list: &[HeadRef], run: u32, shared: u32) -> Option<usize> {
    if !list[0].kept {
        return list.iter().position(|r| r.run == run);
    }
    let from = 1 + list[1..].partition_point(|r| r.shared > shared);
    (list[from..].iter())
        .take_while(|r| r.shared == shared)
        .position(|r| r.run == run)
        .map(|i| from + i)
}

/// Moves the member at `i` of a family keeping figures, whose `shared` just changed, to its
/// place in the order (see the module docs): one swap per distinct `shared` it passes, so a
/// member growing past thousands that share one length costs a bisection, not a shift of
/// thousands. Returns its new place.
fn reorder(list: &mut [HeadRef], mut i: usize) -> usize {
    let s = list[i].shared;
    while i > 1 && list[i - 1].shared < s {
        let passed = list[i - 1].shared;
        let first = 1 + list[1..i].partition_point(|r| r.shared > passed);
        list.swap(first, i);
        i = first;
    }
    while i + 1 < list.len() && list[i + 1].shared > s {
        let passed = list[i + 1].shared;
        let last = i + list[i + 1..].partition_point(|r| r.shared >= passed);
        list.swap(i, last);
        i = last;
    }
    i
}

/// Puts the members `list[1..end]` of a family keeping figures back in order after some of
/// them, all sharing at least `s` blocks with the leader, came to share more: those first,
/// largest first (the members after `end` share fewer than `s`).
fn raise(list: &mut [HeadRef], end: usize, s: u32) {
    let mut raised = 1;
    for i in 1..end {
        if list[i].shared > s {
            list.swap(raised, i);
            raised += 1;
        }
    }
    list[1..raised].sort_unstable_by_key(|r| Reverse(r.shared));
}

impl RunStore {
    /// Checks every family's figures against the runs (tests).
    #[cfg(test)]
    pub fn check_families(&self) {
        for (head, refs) in &self.heads {
            let list = refs.as_slice();
            let lead = &self.runs[list[0].run as usize].blocks;
            let lead_meta = &self.meta[list[0].run as usize];
            assert!(lead_meta.leads, "leader of {head:?} marked as leading");
            assert!(
                list[0].kept || list.len() < KEEP_FIGURES,
                "a family of {} keeps figures",
                list.len()
            );
            if !list[0].kept {
                assert_eq!(
                    lead_meta.shared, 0,
                    "the leader of a family without figures"
                );
            } else {
                assert!(
                    list[1..].windows(2).all(|p| p[0].shared >= p[1].shared),
                    "the members of {head:?} listed by shared, largest first"
                );
            }
            for (i, r) in list.iter().enumerate() {
                let run = &self.runs[r.run as usize];
                assert_eq!(
                    run.blocks.first(),
                    Some(head),
                    "run {} starts at {head:?}",
                    r.run
                );
                assert_eq!(run.set, r.set);
                if i == 0 {
                    continue;
                }
                let meta = &self.meta[r.run as usize];
                assert!(!meta.leads, "member {} not leading", r.run);
                assert!(!r.kept, "member {} keeps no family", r.run);
                assert_eq!(meta.shared, r.shared, "member {}'s mirror", r.run);
                if !list[0].kept {
                    assert_eq!(
                        r.shared, UNKEPT,
                        "member {} of a family without figures",
                        r.run
                    );
                    continue;
                }
                let n = common(&run.blocks, lead);
                assert_eq!(r.shared as usize, n, "member {} of {head:?} shares", r.run);
                assert_eq!(meta.shared, r.shared, "member {}'s mirror", r.run);
                assert_eq!(r.forks, n < run.blocks.len(), "member {} forks", r.run);
                if r.forks {
                    assert_eq!(r.fork, run.blocks[n], "member {}'s fork", r.run);
                }
                assert!(
                    lead_meta.shared >= r.shared,
                    "leader's reach covers {}",
                    r.run
                );
            }
        }
    }

    /// Enters run `id` (no blocks yet) in the family of `head`: its leader if it is the first.
    pub(super) fn join(&mut self, head: BlockHash, id: u32, set: u32) {
        let (leads, shared, keep) = match self.heads.entry(head) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let refs = e.get_mut();
                let kept = refs.as_slice()[0].kept;
                let shared = if kept { 0 } else { UNKEPT };
                refs.push(HeadRef::new(id, set, shared));
                (
                    false,
                    shared,
                    !kept && refs.as_slice().len() >= KEEP_FIGURES,
                )
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Refs::One(HeadRef::new(id, set, 0)));
                (true, 0, false)
            }
        };
        let meta = &mut self.meta[id as usize];
        meta.leads = leads;
        meta.shared = shared;
        if keep {
            self.keep_figures(head);
        }
    }

    /// The family of `head` starts keeping figures: each member's are read from its run.
    fn keep_figures(&mut self, head: BlockHash) {
        let Some(refs) = self.heads.get_mut(&head) else {
            return;
        };
        let list = refs.as_mut_slice();
        let runs = &self.runs;
        let lead = &runs[list[0].run as usize].blocks;
        let mut reach = 0;
        for r in &mut list[1..] {
            let blocks = &runs[r.run as usize].blocks;
            let n = common(blocks, lead);
            r.part(blocks, n);
            self.meta[r.run as usize].shared = n as u32;
            reach = reach.max(n as u32);
        }
        list[1..].sort_unstable_by_key(|r| Reverse(r.shared));
        list[0].kept = true;
        self.meta[list[0].run as usize].shared = reach;
        self.settle_lead(head);
    }

    /// Takes run `id` (its blocks still there) out of the family of `head`; a leader leaving
    /// hands the family to a member first.
    pub(super) fn leave(&mut self, head: BlockHash, id: u32) {
        let Some(refs) = self.heads.get(&head) else {
            return;
        };
        let list = refs.as_slice();
        let leader_leaves = list.len() > 1 && list[0].run == id;
        if leader_leaves {
            if list[0].kept {
                // The member sharing most is listed first.
                self.relead(head, 1);
            } else {
                // No figures to derive: the next run leads.
                let next = list[1].run;
                if let Some(refs) = self.heads.get_mut(&head) {
                    let list = refs.as_mut_slice();
                    list.swap(0, 1);
                    list[0].shared = 0;
                }
                let meta = &mut self.meta[next as usize];
                meta.leads = true;
                meta.shared = 0;
            }
        }
        if let Some(refs) = self.heads.get_mut(&head) {
            let list = refs.as_slice();
            let at = if list[0].run == id {
                Some(0)
            } else {
                member_at(list, id, self.meta[id as usize].shared)
            };
            let Some(i) = at else {
                return;
            };
            if refs.remove_at(i) {
                self.heads.remove(&head);
            }
        }
        let meta = &mut self.meta[id as usize];
        meta.leads = false;
        meta.shared = 0;
        // A member leaving changes no other member's figures for the leader: only a new
        // leader may leave a member reaching past it.
        if leader_leaves {
            self.settle_lead(head);
        }
    }

    /// Makes member `next` of the family of `head` its leader, the leader a member, and
    /// derives every member's figures for the new leader from those for the old one: a member
    /// parting from the old leader before the new one does parts from the new one there too;
    /// one parting after it parts from it where the new one does; only members parting where
    /// the new one does, with the same block, are read further.
    fn relead(&mut self, head: BlockHash, next: usize) {
        let Some(refs) = self.heads.get_mut(&head) else {
            return;
        };
        let list = refs.as_mut_slice();
        let new = list[next];
        let (s, runs) = (new.shared, &self.runs);
        // The members sharing fewer than `s` blocks with the old leader, listed after `end`,
        // part from the new one where they did: neither their figures nor their place move.
        let end = 1 + list[1..].partition_point(|r| r.shared >= s);
        for (i, r) in list[..end].iter_mut().enumerate() {
            if i == next {
                continue;
            }
            let blocks = &runs[r.run as usize].blocks;
            if i == 0 {
                // The old leader holds all `s` blocks the new one shares with it.
                r.part(blocks, s as usize);
            } else if r.shared > s {
                r.shared = s;
                r.forks = true;
                r.fork = blocks[s as usize];
            } else if r.shared == s && r.forks && new.forks && r.fork == new.fork {
                let lead = &runs[new.run as usize].blocks;
                let n = s as usize + 1 + common(&blocks[s as usize + 1..], &lead[s as usize + 1..]);
                r.part(blocks, n);
            }
        }
        list.swap(0, next);
        list[0].shared = 0;
        list[0].forks = false;
        list[0].kept = true;
        list[next].kept = false;
        raise(list, end, s);
        for r in &list[1..end] {
            let meta = &mut self.meta[r.run as usize];
            meta.leads = false;
            meta.shared = r.shared;
        }
        let reach = list.get(1).map_or(0, |r| r.shared);
        let meta = &mut self.meta[list[0].run as usize];
        meta.leads = true;
        meta.shared = reach;
    }

    /// Hands the family of `head` to the member holding all its leader's blocks and reaching
    /// furthest past them, as long as there is one (each hand-over lengthens the leader, so
    /// this ends). Not while a run whose blocks are about to go is in the family: it could
    /// take the lead back.
    fn settle_lead(&mut self, head: BlockHash) {
        while let Some(i) = (self.heads.get(&head))
            .filter(|refs| refs.as_slice()[0].kept)
            .and_then(|refs| furthest_past_leader(refs.as_slice(), &self.runs))
        {
            self.relead(head, i);
        }
    }

    /// Keeps the family figures right after blocks were appended to run `id` from offset `n0`
    /// on: a member that had no block after those it shares with the leader may share more
    /// now, or fork; a leader's members sharing all its `n0` blocks may share more.
    pub(super) fn grown(&mut self, id: u32, n0: usize) {
        let meta = &self.meta[id as usize];
        let (leads, shared) = (meta.leads, meta.shared as usize);
        // A leader's members share at least its head: a new leader has none to move.
        if leads && (shared < n0 || n0 == 0) || !leads && shared != n0 {
            return;
        }
        let runs = &self.runs;
        let blocks = &runs[id as usize].blocks;
        let head = blocks[0];
        let Some(refs) = self.heads.get_mut(&head) else {
            return;
        };
        let list = refs.as_mut_slice();
        let mut reach = 0;
        if leads {
            let next = blocks[n0];
            // No member shares more than the `n0` blocks the leader held: those sharing all
            // of them are listed first.
            let end = 1 + list[1..].partition_point(|r| r.shared as usize >= n0);
            for r in &mut list[1..end] {
                if r.shared as usize == n0 && r.forks && r.fork == next {
                    let theirs = &runs[r.run as usize].blocks;
                    let n = n0 + 1 + common(&theirs[n0 + 1..], &blocks[n0 + 1..]);
                    r.part(theirs, n);
                    self.meta[r.run as usize].shared = n as u32;
                    reach = reach.max(n as u32);
                }
            }
            raise(list, end, n0 as u32);
            let meta = &mut self.meta[id as usize];
            meta.shared = meta.shared.max(reach);
        } else {
            let lead = &runs[list[0].run as usize].blocks;
            let covers = lead.len();
            let n = n0 + common(&blocks[n0..], lead.get(n0..).unwrap_or(&[]));
            let Some(i) = member_at(list, id, n0 as u32) else {
                return;
            };
            list[i].part(blocks, n);
            let i = reorder(list, i);
            self.meta[id as usize].shared = n as u32;
            let lead = &mut self.meta[list[0].run as usize];
            lead.shared = lead.shared.max(n as u32);
            if n == covers && n < blocks.len() {
                // It holds all the leader's blocks and more: it leads.
                self.relead(head, i);
                self.settle_lead(head);
            }
        }
    }

    /// Keeps the family figures right before run `id` is cut down to its first `keep` blocks:
    /// a leader whose members share more than that hands the family to the member sharing
    /// most (and becomes a member); a member sharing `keep` blocks or more shares `keep` and
    /// forks no more.
    pub(super) fn shrinking(&mut self, id: u32, keep: usize) {
        let meta = &self.meta[id as usize];
        let unmoved = if meta.leads {
            // No member shares more than `keep` blocks.
            meta.shared as usize <= keep
        } else {
            // No figures, or the member keeps its block after those it shares.
            meta.shared == UNKEPT || (meta.shared as usize) < keep
        };
        if unmoved {
            return;
        }
        let head = self.runs[id as usize].blocks[0];
        if self.meta[id as usize].leads {
            let Some(refs) = self.heads.get(&head) else {
                return;
            };
            // The member sharing most is listed first.
            let best = refs.as_slice().get(1).map(|r| (1, r.shared));
            match best {
                Some((i, shared)) if shared as usize > keep => self.relead(head, i),
                best => {
                    self.meta[id as usize].shared = best.map_or(0, |(_, shared)| shared);
                    return;
                }
            }
        }
        if keep > self.meta[id as usize].shared as usize {
            return;
        }
        let Some(refs) = self.heads.get_mut(&head) else {
            return;
        };
        let list = refs.as_mut_slice();
        if let Some(i) = member_at(list, id, self.meta[id as usize].shared) {
            list[i].shared = keep as u32;
            list[i].forks = false;
            reorder(list, i);
        }
        self.meta[id as usize].shared = keep as u32;
    }
}
