//! The prefix index against a naive reference model (proptest).
//!
//! Simulated engines publish events; the stream to the index loses some (gaps), repeats some
//! (stale duplicates), engines restart (new incarnations), the consumer resyncs from snapshots
//! of the engines' true state and drops workers. A reference model written the obvious way
//! (`BTreeMap`s, linear overlap) applies the same rules; after every step both must give the
//! same apply outcomes and the same overlap for every query, and replaying the same inputs into
//! a fresh index gives a byte-identical dump.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use switchyard_core::{
    BlockHash, BlockSize, KvEvent, SnapshotBlock, StorageTier, StoredBlock, WorkerId, block_hashes,
};
use switchyard_router::{ApplyOutcome, IndexConfig, PrefixIndex, TierOverlap};

const BS: u32 = 2;
const FAMILIES: u32 = 3;
const CHAIN: usize = 6;
const WORKERS: usize = 4;

fn bs() -> BlockSize {
    BlockSize::new(BS).unwrap()
}

fn worker(i: usize) -> WorkerId {
    WorkerId::new(format!("w{i}")).unwrap()
}

fn family_tokens(f: u32) -> Vec<u32> {
    (0..CHAIN as u32 * BS).map(|t| f * 1000 + t).collect()
}

fn family_hashes(f: u32) -> Vec<BlockHash> {
    block_hashes(&family_tokens(f), bs())
}

/// The parent of a family block (`None` for a family's first block).
fn parent_of(hash: BlockHash) -> Option<BlockHash> {
    (0..FAMILIES).find_map(|f| {
        let hashes = family_hashes(f);
        let i = hashes.iter().position(|&h| h == hash)?;
        Some(i.checked_sub(1).map(|p| hashes[p]))
    })?
}

fn mask(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => 1,
        StorageTier::Host => 2,
        StorageTier::Disk => 4,
        StorageTier::Remote => 8,
    }
}

#[derive(Debug, Clone)]
enum Change {
    Stored {
        family: u32,
        from: usize,
        to: usize,
        tier: StorageTier,
    },
    Removed {
        family: u32,
        blocks: Vec<usize>,
        tier: StorageTier,
    },
    Cleared,
}

impl Change {
    fn event(&self) -> KvEvent {
        match self {
            Change::Stored {
                family,
                from,
                to,
                tier,
            } => {
                let toks = family_tokens(*family);
                let hashes = family_hashes(*family);
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
            Change::Removed {
                family,
                blocks,
                tier,
            } => {
                let hashes = family_hashes(*family);
                KvEvent::Removed {
                    blocks: blocks.iter().map(|&i| hashes[i]).collect(),
                    tier: *tier,
                }
            }
            Change::Cleared => KvEvent::Cleared,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// The engine publishes a change; the index receives it unless `lost`.
    Publish {
        w: usize,
        change: Change,
        lost: bool,
    },
    /// The last delivered event of the worker arrives again.
    Duplicate { w: usize },
    /// The consumer resyncs the worker from a snapshot of its true state.
    Resync { w: usize },
    /// The engine restarts: new incarnation, empty cache, sequence from 0.
    Restart { w: usize },
    /// The worker leaves the index.
    Remove { w: usize },
}

fn tier() -> impl Strategy<Value = StorageTier> {
    prop_oneof![
        3 => Just(StorageTier::Device),
        1 => Just(StorageTier::Host),
        1 => Just(StorageTier::Disk),
        1 => Just(StorageTier::Remote),
    ]
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        6 => (0..FAMILIES, 0..CHAIN, 1..=CHAIN, tier()).prop_map(|(family, a, b, tier)| {
            let (from, to) = if a < b { (a, b) } else { (b.saturating_sub(1), a.max(b)) };
            let to = to.max(from + 1).min(CHAIN);
            Change::Stored { family, from, to, tier }
        }),
        3 => (0..FAMILIES, proptest::collection::vec(0..CHAIN, 1..4), tier())
            .prop_map(|(family, blocks, tier)| Change::Removed { family, blocks, tier }),
        1 => Just(Change::Cleared),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    prop_oneof![
        20 => (w.clone(), change(), proptest::bool::weighted(0.08))
            .prop_map(|(w, change, lost)| Op::Publish { w, change, lost }),
        2 => w.clone().prop_map(|w| Op::Duplicate { w }),
        3 => w.clone().prop_map(|w| Op::Resync { w }),
        1 => w.clone().prop_map(|w| Op::Restart { w }),
        1 => w.prop_map(|w| Op::Remove { w }),
    ]
}

/// A simulated engine: its true cache and its stream position.
#[derive(Debug, Default, Clone)]
struct Engine {
    incarnation: u64,
    next_seq: u64,
    blocks: BTreeMap<BlockHash, u8>,
    last_delivered: Option<(u64, u64, KvEvent)>,
}

fn apply_to_blocks(blocks: &mut BTreeMap<BlockHash, u8>, ev: &KvEvent) {
    match ev {
        KvEvent::Stored {
            blocks: bs, tier, ..
        } => {
            for b in bs {
                *blocks.entry(b.hash).or_default() |= mask(*tier);
            }
        }
        KvEvent::Removed { blocks: bs, tier } => {
            for h in bs {
                if let Some(m) = blocks.get_mut(h) {
                    *m &= !mask(*tier);
                    if *m == 0 {
                        blocks.remove(h);
                    }
                }
            }
        }
        KvEvent::Cleared => blocks.clear(),
    }
}

/// The reference index: the documented rules, written the obvious way.
#[derive(Debug, Default)]
struct Reference {
    workers: BTreeMap<WorkerId, RefWorker>,
}

#[derive(Debug)]
struct RefWorker {
    incarnation: u64,
    expecting: Option<u64>,
    blocks: BTreeMap<BlockHash, u8>,
}

impl Reference {
    fn apply(&mut self, w: &WorkerId, inc: u64, seq: u64, ev: &KvEvent) -> ApplyOutcome {
        let rw = self.workers.entry(w.clone()).or_insert(RefWorker {
            incarnation: inc,
            expecting: Some(0),
            blocks: BTreeMap::new(),
        });
        if rw.incarnation != inc {
            *rw = RefWorker {
                incarnation: inc,
                expecting: Some(0),
                blocks: BTreeMap::new(),
            };
        }
        match rw.expecting {
            None => ApplyOutcome::ResyncNeeded {
                expected: None,
                got: seq,
            },
            Some(e) if seq < e => ApplyOutcome::Stale {
                expected: e,
                got: seq,
            },
            Some(e) if seq > e => {
                rw.expecting = None;
                ApplyOutcome::ResyncNeeded {
                    expected: Some(e),
                    got: seq,
                }
            }
            Some(e) => {
                rw.expecting = Some(e + 1);
                apply_to_blocks(&mut rw.blocks, ev);
                ApplyOutcome::Applied
            }
        }
    }

    fn overlap(&self, prompt: &[BlockHash]) -> BTreeMap<WorkerId, TierOverlap> {
        let mut out = BTreeMap::new();
        for (id, rw) in &self.workers {
            let lead = |level: u8| {
                prompt
                    .iter()
                    .take_while(|h| rw.blocks.get(h).is_some_and(|m| m & level != 0))
                    .count() as u32
            };
            let o = TierOverlap {
                device: lead(1),
                device_or_host: lead(3),
                device_host_or_disk: lead(7),
                any_tier: lead(15),
            };
            if o.any_tier > 0 {
                out.insert(id.clone(), o);
            }
        }
        out
    }

    fn entries(&self) -> usize {
        self.workers.values().map(|w| w.blocks.len()).sum()
    }
}

fn index_overlap(index: &PrefixIndex, prompt: &[BlockHash]) -> BTreeMap<WorkerId, TierOverlap> {
    let scores = index.overlap(prompt);
    scores
        .iter()
        .map(|(k, o)| (index.worker_id(k).cloned().unwrap(), o))
        .collect()
}

/// Prompts to query: every family's chain, plus prompts that share a family's first two blocks
/// of tokens and then go on with another family's tokens (so, being chained, their later block
/// hashes are new: a prompt is always a chain, which the overlap query relies on).
fn queries() -> Vec<Vec<BlockHash>> {
    let mut qs = Vec::new();
    for f in 0..FAMILIES {
        let h = family_hashes(f);
        qs.push(h.clone());
        qs.push(h[..3].to_vec());
        let split = 2 * BS as usize;
        let mut tokens = family_tokens(f)[..split].to_vec();
        tokens.extend_from_slice(&family_tokens((f + 1) % FAMILIES)[split..]);
        let diverging = block_hashes(&tokens, bs());
        assert_eq!(diverging[..2], h[..2]);
        qs.push(diverging);
    }
    qs
}

/// Drives the index (and, when given, the reference) through `ops`; returns the index.
fn run(
    ops: &[Op],
    config: IndexConfig,
    mut reference: Option<&mut Reference>,
) -> Result<PrefixIndex, TestCaseError> {
    let mut index = PrefixIndex::new(config);
    let mut engines = vec![Engine::default(); WORKERS];
    let qs = queries();
    for op in ops {
        match op {
            Op::Publish { w, change, lost } => {
                let e = &mut engines[*w];
                let ev = change.event();
                apply_to_blocks(&mut e.blocks, &ev);
                let seq = e.next_seq;
                e.next_seq += 1;
                if !lost {
                    let got = index.apply(&worker(*w), e.incarnation, seq, &ev).unwrap();
                    if let Some(r) = reference.as_deref_mut() {
                        let want = r.apply(&worker(*w), e.incarnation, seq, &ev);
                        prop_assert_eq!(got, want, "outcome of {:?}", op);
                    }
                    e.last_delivered = Some((e.incarnation, seq, ev));
                }
            }
            Op::Duplicate { w } => {
                if let Some((inc, seq, ev)) = engines[*w].last_delivered.clone() {
                    let got = index.apply(&worker(*w), inc, seq, &ev).unwrap();
                    if let Some(r) = reference.as_deref_mut() {
                        prop_assert_eq!(got, r.apply(&worker(*w), inc, seq, &ev));
                    }
                }
            }
            Op::Resync { w } => {
                let e = &engines[*w];
                // Snapshots name each block's parent, as engines' snapshots do.
                let snapshot: Vec<SnapshotBlock> = e
                    .blocks
                    .iter()
                    .flat_map(|(&hash, &m)| {
                        let parent = parent_of(hash);
                        StorageTier::ALL
                            .into_iter()
                            .filter(move |t| m & mask(*t) != 0)
                            .map(move |tier| SnapshotBlock { hash, parent, tier })
                    })
                    .collect();
                index
                    .apply_snapshot(&worker(*w), e.incarnation, e.next_seq, &snapshot)
                    .unwrap();
                if let Some(r) = reference.as_deref_mut() {
                    r.workers.insert(
                        worker(*w),
                        RefWorker {
                            incarnation: e.incarnation,
                            expecting: Some(e.next_seq),
                            blocks: e.blocks.clone(),
                        },
                    );
                }
            }
            Op::Restart { w } => {
                let e = &mut engines[*w];
                e.incarnation += 1;
                e.next_seq = 0;
                e.blocks.clear();
            }
            Op::Remove { w } => {
                let known = index.remove_worker(&worker(*w));
                if let Some(r) = reference.as_deref_mut() {
                    prop_assert_eq!(known, r.workers.remove(&worker(*w)).is_some());
                }
            }
        }
        if let Some(r) = reference.as_deref_mut() {
            for q in &qs {
                prop_assert_eq!(
                    index_overlap(&index, q),
                    r.overlap(q),
                    "query {:?} after {:?}",
                    q,
                    op
                );
            }
            prop_assert_eq!(index.stats().entries, r.entries());
        }
    }
    Ok(index)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_the_reference_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut config = IndexConfig::new(bs());
        config.max_entries = usize::MAX;
        let mut reference = Reference::default();
        let index = run(&ops, config, Some(&mut reference))?;
        // Same inputs, same order: byte-identical dump.
        let again = run(&ops, config, None)?;
        prop_assert_eq!(index.dump(), again.dump());
    }

    /// With a cap, the index never exceeds it and only ever forgets: every worker's overlap is
    /// at most the reference's.
    #[test]
    fn capped_index_stays_bounded_and_never_invents_blocks(
        ops in proptest::collection::vec(op(), 1..120),
        cap in 1usize..12,
    ) {
        let mut capped = IndexConfig::new(bs());
        capped.max_entries = cap;
        let index = run(&ops, capped, None)?;
        let mut full = IndexConfig::new(bs());
        full.max_entries = usize::MAX;
        let mut reference = Reference::default();
        run(&ops, full, Some(&mut reference))?;
        prop_assert!(index.stats().entries <= cap);
        for q in queries() {
            let got = index_overlap(&index, &q);
            let want = reference.overlap(&q);
            for (w, o) in got {
                let r = want.get(&w).copied().unwrap_or_default();
                prop_assert!(o.any_tier <= r.any_tier, "{} has {:?} > reference {:?}", w, o, r);
            }
        }
    }
}
