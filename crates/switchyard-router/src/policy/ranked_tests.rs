//! The ranked decision (`ranked`) is the shortlist's (`shortlist`), which is the full
//! breakdown's: over random fleets of several prefill rates, loads with many ties, holders in
//! every tier, pending prefixes, weights and sessions, the same workers are explained with the
//! same figures and the same worker is chosen.

use proptest::prelude::*;
use switchyard_core::rng::SplitMix64;
use switchyard_core::{KvTierCosts, LoadStats, SnapshotBlock, StorageTier, block_hashes};

use super::cost::{Pending, Scorer};
use super::tests::{bs, prompt, request, w};
use super::*;
use crate::index::IndexConfig;
use crate::load::pending::Incoming;
use crate::load::ranking::RankWeights;
use crate::load::{LoadConfig, LoadView};

/// One random fleet and request: the policy's settings, the candidates, index and load.
struct Fleet {
    cfg: KvConfig,
    candidates: Vec<Candidate>,
    index: PrefixIndex,
    load: LoadView,
    request: RouteRequest,
}

fn pick<T: Copy>(rng: &mut SplitMix64, from: &[T]) -> T {
    from[(rng.next_u64() % from.len() as u64) as usize]
}

fn fleet(seed: u64, workers: usize) -> Fleet {
    let mut rng = SplitMix64::new(seed);
    let (prefill_weight, decode_weight) =
        pick(&mut rng, &[(1.0, 0.1), (1.0, 0.0), (0.5, 2.0), (0.0, 0.0)]);
    let cfg = KvConfig {
        prefill_weight,
        decode_weight,
        ..KvConfig::default()
    };
    let rates = [None, Some(8_000), Some(32_000)];
    let rate_kinds = 1 + (rng.next_u64() % 3) as usize;
    let candidates: Vec<Candidate> = (0..workers)
        .map(|i| {
            let rate = pick(&mut rng, &rates[..rate_kinds]);
            Candidate {
                kv_tiers: rate.map(|r| KvTierCosts {
                    prefill_tokens_per_s: r,
                    ..KvTierCosts::typical(1 << 20)
                }),
                ..Candidate::from(w(&format!("w{i}")))
            }
        })
        .collect();
    let tokens = prompt(1, 40);
    let hashes = block_hashes(&tokens, bs());
    let mut index = PrefixIndex::new(IndexConfig::new(bs()));
    let holders = pick(&mut rng, &[0usize, 1, 2, 8, workers / 2]);
    for _ in 0..holders {
        let c = &candidates[(rng.next_u64() % workers as u64) as usize];
        let len = 1 + (rng.next_u64() % hashes.len() as u64) as usize;
        let tier = pick(
            &mut rng,
            &[
                StorageTier::Device,
                StorageTier::Host,
                StorageTier::Disk,
                StorageTier::Remote,
            ],
        );
        let chain: Vec<_> = SnapshotBlock::chain(&hashes[..len], tier).collect();
        index.apply_snapshot(&c.worker, 1, 0, &chain).unwrap();
    }
    let mut load = LoadView::new(LoadConfig::default());
    load.set_roster(
        RankWeights {
            prefill_weight,
            decode_weight,
            block_size: bs().get(),
        },
        candidates.iter().map(|c| roster_worker(c, bs().get())),
    );
    let busy = pick(&mut rng, &[0.0, 0.1, 0.5, 1.0]);
    for (i, c) in candidates.iter().enumerate() {
        if (rng.next_u64() % 1000) as f64 >= busy * 1000.0 {
            continue;
        }
        let stats = LoadStats {
            queued_prefill_tokens: pick(&mut rng, &[0, 512, 1024, 4096]),
            active_blocks: pick(&mut rng, &[0, 10, 100]),
            running_requests: pick(&mut rng, &[0, 1, 2]),
            // Small capacities too, so that the memory term prices some workers.
            capacity_blocks: pick(&mut rng, &[0, 40, 120, 10_000]),
            ..LoadStats::default()
        };
        load.report(&c.worker, stats, 0);
        if rng.next_u64().is_multiple_of(4) {
            let (prefill, blocks) = (pick(&mut rng, &[0, 64, 2048]), rng.next_u64() % 50);
            load.on_routed(&c.worker, i as u64, prefill, blocks, 1);
        }
    }
    for r in 0..pick(&mut rng, &[0u64, 1, 3]) {
        let c = &candidates[(rng.next_u64() % workers as u64) as usize];
        let blocks = 1 + (rng.next_u64() % hashes.len() as u64) as usize;
        let incoming = Incoming {
            request: 10_000 + r,
            worker: &c.worker,
            blocks: &hashes[..blocks],
            prompt_tokens: tokens.len() as u64,
            prefill_tokens: 0,
        };
        load.add_pending(incoming, 2);
        load.on_routed(&c.worker, 10_000 + r, 0, 1, 2);
        load.on_prefill_done(&c.worker, 10_000 + r);
    }
    let session = pick(&mut rng, &[None, Some("s1"), Some("s2")]);
    let request = request(&tokens, session, 3);
    Fleet {
        cfg,
        candidates,
        index,
        load,
        request,
    }
}

/// The shortlist's breakdowns, from the scorer over every candidate.
fn shortlisted(f: &Fleet) -> Vec<WorkerScore> {
    let overlap = kv::index_overlap(&f.request, &f.index);
    let scorer = Scorer::new(
        &f.request,
        &f.candidates,
        &f.load,
        &f.cfg,
        overlap,
        Pending::Counted,
    );
    shortlist::best_scores(&f.request, &scorer)
}

fn decide(f: &Fleet, ask: SharedAsk) -> Decision {
    KvPolicy::new(f.cfg.clone(), 0)
        .unwrap()
        .choose_shared(&f.request, &f.candidates, &f.index, &f.load, ask)
        .unwrap()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn the_ranked_decision_is_the_full_scans(seed in any::<u64>(), workers in 65usize..180) {
        let f = fleet(seed, workers);
        let ranked = ranked::best_scores(&f.request, &f.candidates, &f.index, &f.load, &f.cfg)
            .expect("the roster is ranked by the policy's weights");
        prop_assert_eq!(&ranked, &shortlisted(&f));
        let rostered = decide(&f, SharedAsk { explain_all: false, rostered: true });
        let scored = decide(&f, SharedAsk::default());
        prop_assert_eq!(&rostered, &scored);
        let full = decide(&f, SharedAsk { explain_all: true, rostered: true });
        prop_assert_eq!(&rostered.worker, &full.worker);
        prop_assert_eq!(rostered.explanation.workers.len(), shortlist::EXPLAINED);
    }
}

/// Settings the ranking was not built for, and peer copies, leave the decision to the scorer.
#[test]
fn another_weighting_or_peer_pricing_is_not_read_from_the_ranking() {
    let f = fleet(7, 100);
    let other = KvConfig {
        prefill_weight: f.cfg.prefill_weight + 1.0,
        ..f.cfg.clone()
    };
    let best =
        |cfg: &KvConfig| ranked::best_scores(&f.request, &f.candidates, &f.index, &f.load, cfg);
    assert!(best(&f.cfg).is_some());
    assert!(best(&other).is_none());
    let peer = KvConfig {
        peer_link: Some(switchyard_core::TierLink {
            bytes_per_s: 1 << 30,
            latency_us: 1,
        }),
        ..f.cfg.clone()
    };
    assert!(best(&peer).is_none());
}

/// Sets `f`'s weights and ranks its candidates, in their order, by them.
fn rank(f: &mut Fleet, prefill_weight: f64, decode_weight: f64) {
    f.cfg.prefill_weight = prefill_weight;
    f.cfg.decode_weight = decode_weight;
    f.load.set_roster(
        RankWeights {
            prefill_weight,
            decode_weight,
            block_size: bs().get(),
        },
        f.candidates.iter().map(|c| roster_worker(c, bs().get())),
    );
}

/// A decision keeps each holder's roster position on its index slot; it is never read for
/// another roster, nor for another worker given the slot.
#[test]
fn a_kept_position_follows_roster_and_slot_changes() {
    let mut f = fleet(11, 120);
    rank(&mut f, 1.0, 0.1);
    let hashes = f.request.block_hashes.clone();
    let hold = |f: &mut Fleet, i: usize, blocks: usize| {
        let chain: Vec<_> = SnapshotBlock::chain(&hashes[..blocks], StorageTier::Device).collect();
        let worker = f.candidates[i].worker.clone();
        f.index.apply_snapshot(&worker, 1, 0, &chain).unwrap();
    };
    hold(&mut f, 3, hashes.len());
    hold(&mut f, 50, hashes.len() / 2);
    let check = |f: &Fleet| {
        let ranked = ranked::best_scores(&f.request, &f.candidates, &f.index, &f.load, &f.cfg)
            .expect("ranked");
        assert_eq!(ranked, shortlisted(f));
        ranked
    };
    let first = check(&f);
    assert!(first.iter().any(|s| s.worker == f.candidates[3].worker));
    // The slot of w3 goes to w90: w90 holds the prompt, w3 nothing.
    let w3 = f.candidates[3].worker.clone();
    let slot = f.index.worker_key(&w3).unwrap();
    assert!(f.index.remove_worker(&w3));
    hold(&mut f, 90, hashes.len());
    assert_eq!(f.index.worker_key(&f.candidates[90].worker), Some(slot));
    let reused = check(&f);
    let full = |s: &[WorkerScore], i: usize| {
        s.iter()
            .find(|s| s.worker == f.candidates[i].worker)
            .map(|s| s.overlap.any_tier)
    };
    assert_eq!(full(&reused, 90), Some(hashes.len() as u32));
    assert_eq!(full(&reused, 3).unwrap_or(0), 0);
    // Another roster, the same workers in another order: positions read afresh.
    f.candidates.reverse();
    rank(&mut f, 1.0, 0.1);
    check(&f);
}

/// Half the fleet holds the prompt's prefix to every length (a shared system prompt), idle but
/// for a few loaded workers, one holder carried deeper by a pending prefix: the decision is the
/// full scan's, and the holders too shallow to enter the best kept are never read (a holder read
/// has its roster position kept on its index slot).
#[test]
fn holders_too_shallow_for_the_best_are_not_read() {
    let mut f = fleet(3, 160);
    // One prefill rate, so that the cut is plain to see.
    for c in &mut f.candidates {
        c.kv_tiers = None;
    }
    rank(&mut f, 1.0, 0.1);
    let hashes = f.request.block_hashes.clone();
    let mut index = PrefixIndex::new(IndexConfig::new(bs()));
    let depth = |i: usize| 1 + i * (hashes.len() - 1) / 79;
    for i in 0..80 {
        let chain: Vec<_> =
            SnapshotBlock::chain(&hashes[..depth(i)], StorageTier::Device).collect();
        index
            .apply_snapshot(&f.candidates[i].worker, 1, 0, &chain)
            .unwrap();
    }
    f.index = index;
    let mut load = LoadView::new(LoadConfig::default());
    load.set_roster(
        RankWeights {
            prefill_weight: 1.0,
            decode_weight: 0.1,
            block_size: bs().get(),
        },
        f.candidates.iter().map(|c| roster_worker(c, bs().get())),
    );
    // The deepest holder is busy; a shallow one (w2) has the whole prompt pending.
    let busy = LoadStats {
        queued_prefill_tokens: 4096,
        ..LoadStats::default()
    };
    load.report(&f.candidates[79].worker, busy, 0);
    let tokens = f.request.prompt_tokens;
    load.add_pending(
        Incoming {
            request: 1,
            worker: &f.candidates[2].worker,
            blocks: &hashes,
            prompt_tokens: tokens,
            prefill_tokens: 0,
        },
        2,
    );
    load.on_routed(&f.candidates[2].worker, 1, 0, 1, 2);
    load.on_prefill_done(&f.candidates[2].worker, 1);
    f.load = load;
    let ranked =
        ranked::best_scores(&f.request, &f.candidates, &f.index, &f.load, &f.cfg).expect("ranked");
    assert_eq!(ranked, shortlisted(&f));
    let explained = |i: usize| ranked.iter().any(|s| s.worker == f.candidates[i].worker);
    assert!(explained(2), "the pending prefix counts");
    let read = |i: usize| {
        let key = f.index.worker_key(&f.candidates[i].worker).unwrap();
        f.index.slot_tag(key) != 0
    };
    // The best are among the deepest: the holders far shallower are not read.
    assert!(read(78));
    for i in 3..40 {
        assert!(!read(i), "w{i}, holding {} blocks, was read", depth(i));
    }
    let decided = decide(
        &f,
        SharedAsk {
            explain_all: false,
            rostered: true,
        },
    );
    assert_eq!(decided, decide(&f, SharedAsk::default()));
}
