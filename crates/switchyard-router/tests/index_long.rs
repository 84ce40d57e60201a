//! The overlap query on long prompts, against a naive model (proptest).
//!
//! `index_model.rs` checks every rule of the index on short chains; this suite aims at the runs
//! (chains kept together, matched against the prompt one comparison at a time, split and
//! extended), which only pay off (and only have room to go wrong) on long ones: workers hold
//! prefixes of a 96-block prompt to random depths, stored in random chunks, with branches that
//! leave the prompt at random points (a block holding children that are not the prompt's next
//! block, including at the end of a worker's prefix), tails evicted, holes punched in the middle
//! (the worker is no longer prefix-closed), copies in host memory and on disk (tiers), and
//! workers cleared. Events are lost (the index asks for a resync and keeps its stale view until
//! the snapshot), workers are resynced from snapshots of their true state (in either order, with
//! or without the blocks' parents, as engines that do not know them send), and the whole index is
//! rebuilt from snapshots, then carries on with later events. After every step each worker's
//! pair count, and its overlap for prefixes of the prompt and for every branch stored so far,
//! equal the model's view of what the index was told.
//!
//! Those streams soon leave some block stored before its parent, which turns on the index's
//! careful path (every stored block looked up among run heads). A second suite plays *tidy*
//! engines, as vLLM and SGLang are: chains stored under held parents, tails evicted, a parent
//! sometimes evicted before another chain's child (blocks shared by requests), snapshots naming
//! parents; the index answers those through its fast paths only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use switchyard_core::{
    BlockHash, BlockSize, KvEvent, SnapshotBlock, StorageTier, StoredBlock, WorkerId, block_hashes,
};
use switchyard_router::{ApplyOutcome, IndexConfig, PrefixIndex, TierOverlap};

const BS: u32 = 2;
const LEN: usize = 96;
const WORKERS: usize = 6;

fn bs() -> BlockSize {
    BlockSize::new(BS).unwrap()
}

/// Tokens of the prompt (`branch` 0) or of a branch leaving it after block `from`.
fn tokens(branch: u32, from: usize) -> Vec<u32> {
    (0..(LEN as u32) * BS)
        .map(|t| {
            if branch == 0 || (t / BS) < from as u32 {
                t
            } else {
                branch * 100_000 + t
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Step {
    /// Blocks `from..to` of a chain (the prompt or a branch leaving it after `leave`).
    Store {
        w: usize,
        branch: u32,
        leave: usize,
        from: usize,
        to: usize,
        tier: StorageTier,
    },
    /// Blocks `from..to` of a chain (the prompt or a branch), tail first, from one tier.
    Remove {
        w: usize,
        branch: u32,
        leave: usize,
        from: usize,
        to: usize,
        tier: StorageTier,
    },
    Clear {
        w: usize,
    },
    /// The worker's next change (`Store`, `Remove` or `Clear`) never reaches the index.
    Lose {
        w: usize,
    },
    /// The worker is resynced from a snapshot of its true state.
    Resync {
        w: usize,
        shape: Shape,
    },
    /// A fresh index is loaded from every worker's snapshot and replaces the old one.
    Rebuild {
        shape: Shape,
    },
}

/// How a snapshot lists its blocks.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Each block names its parent (engines that track it), or none does (engines that do not).
    parents: bool,
    /// Blocks by descending hash instead of ascending (the index must not depend on the order).
    reverse: bool,
}

fn tier() -> impl Strategy<Value = StorageTier> {
    prop_oneof![
        8 => Just(StorageTier::Device),
        1 => Just(StorageTier::Host),
        1 => Just(StorageTier::Disk),
        1 => Just(StorageTier::Remote),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    let w = 0..WORKERS;
    prop_oneof![
        // Extend the prompt from where a worker may already be (prefix-closed when `from` is
        // at or below its depth), in chunks of up to 40 blocks.
        10 => (w.clone(), prop_oneof![2 => Just(0), 1 => 0..LEN], 1..40usize, tier())
            .prop_map(|(w, from, n, tier)| Step::Store {
                w, branch: 0, leave: 0, from, to: (from + n).min(LEN), tier,
            }),
        // A branch leaving the prompt after block `leave`, stored from its first block of its
        // own or from a few of the prompt's blocks before it (one chain: a parent and its
        // branch in one event).
        3 => (w.clone(), 1u32..4, 1..LEN, prop_oneof![2 => Just(0), 1 => 1..4usize], 1..12usize, tier())
            .prop_map(|(w, branch, leave, back, n, tier)| Step::Store {
                w, branch, leave, from: leave.saturating_sub(back), to: (leave + n).min(LEN), tier,
            }),
        // Evict a tail (closed) or punch a hole (not closed).
        4 => (w.clone(), chain(), 0..LEN, 1..20usize, tier()).prop_map(|(w, (branch, leave), from, n, tier)| {
            Step::Remove { w, branch, leave, from, to: (from + n).min(LEN), tier }
        }),
        1 => w.clone().prop_map(|w| Step::Clear { w }),
        1 => w.clone().prop_map(|w| Step::Lose { w }),
        2 => (w, shape()).prop_map(|(w, shape)| Step::Resync { w, shape }),
        1 => shape().prop_map(|shape| Step::Rebuild { shape }),
    ]
}

/// The prompt (mostly) or a branch leaving it: `(branch, leave)`.
fn chain() -> impl Strategy<Value = (u32, usize)> {
    prop_oneof![3 => Just((0, 0)), 1 => (1u32..4, 1..LEN)]
}

fn shape() -> impl Strategy<Value = Shape> {
    (proptest::bool::weighted(0.75), proptest::bool::ANY)
        .prop_map(|(parents, reverse)| Shape { parents, reverse })
}

fn mask(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => 1,
        StorageTier::Host => 2,
        StorageTier::Disk => 4,
        StorageTier::Remote => 8,
    }
}

fn event(step: &Step) -> KvEvent {
    match step {
        Step::Store {
            branch,
            leave,
            from,
            to,
            tier,
            ..
        } => {
            let toks = tokens(*branch, *leave);
            let hashes = block_hashes(&toks, bs());
            let b = BS as usize;
            KvEvent::Stored {
                parent: from.checked_sub(1).map(|i| hashes[i]),
                blocks: (*from..*to)
                    .map(|i| StoredBlock {
                        hash: hashes[i],
                        tokens: toks[i * b..(i + 1) * b].to_vec(),
                    })
                    .collect(),
                tier: *tier,
            }
        }
        Step::Remove {
            branch,
            leave,
            from,
            to,
            tier,
            ..
        } => {
            let hashes = block_hashes(&tokens(*branch, *leave), bs());
            KvEvent::Removed {
                blocks: (*from..*to).rev().map(|i| hashes[i]).collect(),
                tier: *tier,
            }
        }
        Step::Clear { .. } => KvEvent::Cleared,
        Step::Lose { .. } | Step::Resync { .. } | Step::Rebuild { .. } => {
            unreachable!("{step:?} is not an event")
        }
    }
}

/// Records the parent of every block `ev` stores (a block hash names its parent).
fn note_parents(parents: &mut BTreeMap<BlockHash, Option<BlockHash>>, ev: &KvEvent) {
    if let KvEvent::Stored { parent, blocks, .. } = ev {
        let mut up = *parent;
        for b in blocks {
            parents.insert(b.hash, up);
            up = Some(b.hash);
        }
    }
}

/// A snapshot of `held`: one entry per (block, tier), as engines send them.
fn snapshot(
    held: &BTreeMap<BlockHash, u8>,
    parents: &BTreeMap<BlockHash, Option<BlockHash>>,
    shape: Shape,
) -> Vec<SnapshotBlock> {
    let mut out: Vec<SnapshotBlock> = held
        .iter()
        .flat_map(|(&hash, &m)| {
            let parent = if shape.parents { parents[&hash] } else { None };
            StorageTier::ALL
                .into_iter()
                .filter(move |t| m & mask(*t) != 0)
                .map(move |tier| SnapshotBlock { hash, parent, tier })
        })
        .collect();
    if shape.reverse {
        out.reverse();
    }
    out
}

/// Per worker, each block's tier mask, changed the obvious way.
fn model_apply(held: &mut BTreeMap<BlockHash, u8>, ev: &KvEvent) {
    match ev {
        KvEvent::Stored { blocks, tier, .. } => {
            for b in blocks {
                *held.entry(b.hash).or_default() |= mask(*tier);
            }
        }
        KvEvent::Removed { blocks, tier } => {
            for h in blocks {
                if let Some(m) = held.get_mut(h) {
                    *m &= !mask(*tier);
                    if *m == 0 {
                        held.remove(h);
                    }
                }
            }
        }
        KvEvent::Cleared => held.clear(),
    }
}

fn model_overlap(held: &BTreeMap<BlockHash, u8>, prompt: &[BlockHash]) -> TierOverlap {
    let lead = |level: u8| {
        prompt
            .iter()
            .take_while(|h| held.get(h).is_some_and(|m| m & level != 0))
            .count() as u32
    };
    TierOverlap {
        device: lead(1),
        device_or_host: lead(3),
        device_host_or_disk: lead(7),
        any_tier: lead(15),
    }
}

/// One simulated engine: what it truly holds, the view the index was given, its sequence.
#[derive(Debug, Clone, Default)]
struct Engine {
    held: BTreeMap<BlockHash, u8>,
    known: BTreeMap<BlockHash, u8>,
    seq: u64,
    lose_next: bool,
    /// The index has seen a gap and refuses events until a snapshot.
    awaiting: bool,
}

fn load_snapshot(
    index: &mut PrefixIndex,
    id: &WorkerId,
    e: &mut Engine,
    parents: &BTreeMap<BlockHash, Option<BlockHash>>,
    shape: Shape,
) {
    index
        .apply_snapshot(id, 1, e.seq, &snapshot(&e.held, parents, shape))
        .unwrap();
    e.known = e.held.clone();
    e.awaiting = false;
}

/// Applies `step` to the engines and the index, checking the outcome of each event it delivers.
fn run_step(
    index: &mut PrefixIndex,
    ids: &[WorkerId],
    engines: &mut [Engine],
    parents: &mut BTreeMap<BlockHash, Option<BlockHash>>,
    step: &Step,
) -> Result<(), TestCaseError> {
    match *step {
        Step::Store { w, .. } | Step::Remove { w, .. } | Step::Clear { w } => {
            let ev = event(step);
            note_parents(parents, &ev);
            let e = &mut engines[w];
            model_apply(&mut e.held, &ev);
            let seq = e.seq;
            e.seq += 1;
            if std::mem::take(&mut e.lose_next) {
                return Ok(());
            }
            let outcome = index.apply(&ids[w], 1, seq, &ev).unwrap();
            if outcome == ApplyOutcome::Applied {
                prop_assert!(!e.awaiting);
                model_apply(&mut e.known, &ev);
            } else {
                prop_assert!(
                    matches!(outcome, ApplyOutcome::ResyncNeeded { .. }),
                    "{:?}",
                    outcome
                );
                e.awaiting = true;
            }
        }
        Step::Lose { w } => engines[w].lose_next = true,
        Step::Resync { w, shape } => load_snapshot(index, &ids[w], &mut engines[w], parents, shape),
        Step::Rebuild { shape } => {
            *index = PrefixIndex::new(IndexConfig::new(bs()));
            for (id, e) in ids.iter().zip(engines.iter_mut()) {
                load_snapshot(index, id, e, parents, shape);
            }
        }
    }
    Ok(())
}

/// After a step: every worker's pair count and its overlap for the prompt's prefixes and for
/// every branch stored so far equal the model's view of what the index was told.
fn check(
    index: &PrefixIndex,
    ids: &[WorkerId],
    engines: &[Engine],
    prefixes: &[usize],
    branches: &[Vec<BlockHash>],
    step: &Step,
) -> Result<(), TestCaseError> {
    for (i, id) in ids.iter().enumerate() {
        prop_assert_eq!(
            index.worker_entries(id),
            engines[i].known.len(),
            "worker {}'s pairs after {:?}",
            i,
            step
        );
    }
    let prompt = block_hashes(&tokens(0, 0), bs());
    let queries = prefixes
        .iter()
        .map(|&len| &prompt[..len])
        .chain(branches.iter().map(Vec::as_slice));
    for q in queries {
        let scores = index.overlap(q);
        for (i, id) in ids.iter().enumerate() {
            let got = index
                .worker_key(id)
                .map(|k| scores.get(k))
                .unwrap_or_default();
            prop_assert_eq!(
                got,
                model_overlap(&engines[i].known, q),
                "worker {} on a {}-block query after {:?}",
                i,
                q.len(),
                step
            );
        }
    }
    Ok(())
}

/// Notes the branch a step stored, if any, among the chains `check` queries.
fn note_branch(branches: &mut Vec<Vec<BlockHash>>, step: &Step) {
    if let Step::Store { branch, leave, .. } = *step
        && branch > 0
    {
        let hashes = block_hashes(&tokens(branch, leave), bs());
        if !branches.contains(&hashes) {
            branches.push(hashes);
        }
    }
}

/// A step of a tidy engine, resolved against what it holds (see [`tidy`]).
#[derive(Debug, Clone)]
enum Tidy {
    /// Extends a chain from its deepest held block (re-storing `back` held blocks before it).
    Store {
        w: usize,
        chain: (u32, usize),
        back: usize,
        n: usize,
    },
    /// Evicts the last `n` held blocks of a chain, tail first.
    Evict {
        w: usize,
        chain: (u32, usize),
        n: usize,
    },
    Clear {
        w: usize,
    },
    /// The worker's next change never reaches the index (which then waits for a resync).
    Lose {
        w: usize,
    },
    /// The worker is resynced from a snapshot naming parents.
    Resync {
        w: usize,
    },
}

fn tidy_step() -> impl Strategy<Value = Tidy> {
    // Two workers and short branches, so chains meet often: a branch under a block the
    // worker later evicts, then stores again.
    let w = 0..2usize;
    let chain = || prop_oneof![Just((0, 0)), (1u32..4, 1..16usize)];
    prop_oneof![
        10 => (w.clone(), chain(), 0..4usize, 1..12usize)
            .prop_map(|(w, chain, back, n)| Tidy::Store { w, chain, back, n }),
        5 => (w.clone(), chain(), 1..12usize).prop_map(|(w, chain, n)| Tidy::Evict { w, chain, n }),
        1 => w.clone().prop_map(|w| Tidy::Clear { w }),
        1 => w.clone().prop_map(|w| Tidy::Lose { w }),
        1 => w.prop_map(|w| Tidy::Resync { w }),
    ]
}

/// Device blocks of a chain the engine holds from its start.
fn depth(e: &Engine, (branch, leave): (u32, usize)) -> usize {
    block_hashes(&tokens(branch, leave), bs())
        .iter()
        .take_while(|h| e.held.get(h).is_some_and(|m| m & 1 != 0))
        .count()
}

/// The concrete step a tidy one makes on the engines' current state: stores always hang under a
/// held parent and evictions take chain tails, so the index never sees a block before its parent
/// (but may see a parent go before another chain's child: engines evict a block whose children
/// belong to other requests).
fn tidy(engines: &[Engine], t: &Tidy) -> Step {
    let device = StorageTier::Device;
    match *t {
        Tidy::Store {
            w,
            chain: (branch, leave),
            back,
            n,
        } => {
            let d = depth(&engines[w], (branch, leave));
            let from = d.saturating_sub(back);
            Step::Store {
                w,
                branch,
                leave,
                from,
                to: (d + n).min(LEN),
                tier: device,
            }
        }
        Tidy::Evict {
            w,
            chain: (branch, leave),
            n,
        } => {
            let d = depth(&engines[w], (branch, leave));
            Step::Remove {
                w,
                branch,
                leave,
                from: d.saturating_sub(n),
                to: d,
                tier: device,
            }
        }
        Tidy::Clear { w } => Step::Clear { w },
        Tidy::Lose { w } => Step::Lose { w },
        Tidy::Resync { w } => Step::Resync {
            w,
            shape: Shape {
                parents: true,
                reverse: false,
            },
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn long_prompts_are_answered_as_the_model(
        steps in proptest::collection::vec(step(), 1..60),
        lens in proptest::collection::vec(3..=LEN, 3),
    ) {
        let mut index = PrefixIndex::new(IndexConfig::new(bs()));
        let ids: Vec<WorkerId> = (0..WORKERS)
            .map(|i| WorkerId::new(format!("w{i}")).unwrap())
            .collect();
        let mut engines = vec![Engine::default(); WORKERS];
        let mut parents = BTreeMap::new();
        let prefixes: Vec<usize> = lens.iter().copied().chain([LEN]).collect();
        let mut branches: Vec<Vec<BlockHash>> = Vec::new();
        for step in &steps {
            run_step(&mut index, &ids, &mut engines, &mut parents, step)?;
            note_branch(&mut branches, step);
            check(&index, &ids, &engines, &prefixes, &branches, step)?;
        }
    }

    /// Engines that store under held parents and evict tails (vLLM, SGLang): the index keeps no
    /// orphan runs, and answers through its fast paths only.
    #[test]
    fn tidy_engines_are_answered_as_the_model(
        steps in proptest::collection::vec(tidy_step(), 1..80),
    ) {
        let mut index = PrefixIndex::new(IndexConfig::new(bs()));
        let ids: Vec<WorkerId> = (0..WORKERS)
            .map(|i| WorkerId::new(format!("w{i}")).unwrap())
            .collect();
        let mut engines = vec![Engine::default(); WORKERS];
        let mut parents = BTreeMap::new();
        let mut branches: Vec<Vec<BlockHash>> = Vec::new();
        for t in &steps {
            let step = tidy(&engines, t);
            run_step(&mut index, &ids, &mut engines, &mut parents, &step)?;
            note_branch(&mut branches, &step);
            check(&index, &ids, &engines, &[LEN], &branches, &step)?;
        }
    }
}
