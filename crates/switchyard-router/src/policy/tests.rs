use super::*;
use crate::index::IndexConfig;
use crate::load::LoadConfig;
use switchyard_core::{KvEvent, LoadStats, StorageTier, StoredBlock, block_hashes};

pub(super) const BS: u32 = 16;

pub(super) fn bs() -> BlockSize {
    BlockSize::new(BS).unwrap()
}

pub(super) fn w(n: &str) -> WorkerId {
    WorkerId::new(n).unwrap()
}

pub(super) fn prompt(family: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BS)
        .map(|t| family * 1_000_000 + t)
        .collect()
}

pub(super) fn request(tokens: &[u32], session: Option<&str>, now: Tick) -> RouteRequest {
    RouteRequest {
        block_hashes: block_hashes(tokens, bs()),
        prompt_tokens: tokens.len() as u64,
        block_size: bs(),
        session: session.map(str::to_owned),
        now,
        adapter: None,
    }
}

pub(super) fn store(
    index: &mut PrefixIndex,
    worker: &str,
    seq: u64,
    tokens: &[u32],
    blocks: usize,
) {
    let hashes = block_hashes(tokens, bs());
    let ev = KvEvent::Stored {
        parent: None,
        blocks: (0..blocks)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: tokens[i * BS as usize..(i + 1) * BS as usize].to_vec(),
            })
            .collect(),
        tier: StorageTier::Device,
    };
    index.apply(&w(worker), 1, seq, &ev).unwrap();
}

pub(super) fn candidates(names: &[&str]) -> Vec<Candidate> {
    names.iter().map(|n| Candidate::from(w(n))).collect()
}

pub(super) fn setup() -> (PrefixIndex, LoadView) {
    (
        PrefixIndex::new(IndexConfig::new(bs())),
        LoadView::new(LoadConfig::default()),
    )
}

pub(super) fn kv() -> Box<dyn Policy> {
    PolicyKind::Kv.build(&PolicyConfig::default()).unwrap()
}

#[test]
fn kv_prefers_the_longest_prefix_when_loads_are_equal() {
    let (mut index, load) = setup();
    let p = prompt(1, 8);
    store(&mut index, "w1", 0, &p, 2);
    store(&mut index, "w2", 0, &p, 6);
    store(&mut index, "w3", 0, &prompt(2, 8), 8);
    let d = kv()
        .choose(
            &request(&p, None, 0),
            &candidates(&["w1", "w2", "w3"]),
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(d.worker, w("w2"));
    let e = &d.explanation;
    assert_eq!(e.policy, "kv");
    assert_eq!(e.workers.len(), 3, "every candidate is explained");
    assert_eq!(e.workers[1].overlap.device, 6);
    assert_eq!(e.workers[1].uncached_prompt_tokens, 2 * 16);
    assert_eq!(e.workers[0].uncached_prompt_tokens, 6 * 16);
    assert_eq!(e.workers[2].uncached_prompt_tokens, 8 * 16);
    assert!(e.why.starts_with("w2: lowest predicted cost"), "{}", e.why);
    assert!(e.why.contains("runner-up w1"), "{}", e.why);
    // The explanation serialises for the admin API.
    let json = serde_json::to_value(e).unwrap();
    assert_eq!(json["chosen"], "w2");
    assert_eq!(json["workers"][1]["overlap"]["device"], 6);
}

#[test]
fn kv_prefers_an_idle_worker_when_the_queue_outweighs_the_prefix() {
    let (mut index, mut load) = setup();
    let p = prompt(1, 64); // 1,024 tokens
    store(&mut index, "busy", 0, &p, 32); // saves 512 tokens
    let queued = LoadStats {
        queued_prefill_tokens: 4096,
        ..Default::default()
    };
    load.report(&w("busy"), queued, 0);
    load.report(&w("idle"), LoadStats::default(), 0);
    let c = candidates(&["busy", "idle"]);
    let d = kv()
        .choose(&request(&p, None, 1), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("idle"));
    // With a short queue the prefix wins again.
    load.report(
        &w("busy"),
        LoadStats {
            queued_prefill_tokens: 256,
            ..Default::default()
        },
        1,
    );
    let d = kv()
        .choose(&request(&p, None, 2), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("busy"));
}

/// The memory term: a worker holding part of the prompt whose device memory is full is priced
/// the blocks the request would take past its capacity, as recomputation; the same worker with
/// room wins on its prefix.
#[test]
fn kv_prices_the_memory_a_full_worker_lacks() {
    let (mut index, mut load) = setup();
    let p = prompt(1, 64); // 1,024 tokens
    store(&mut index, "full", 0, &p, 16); // 768 tokens (48 blocks) left to compute
    let at = |active_blocks, capacity_blocks| LoadStats {
        active_blocks,
        capacity_blocks,
        ..Default::default()
    };
    // Equal active blocks (equal decode terms); "full" has no free block: 48 over.
    load.report(&w("full"), at(1_000, 1_000), 0);
    load.report(&w("roomy"), at(1_000, 2_000), 0);
    let c = candidates(&["full", "roomy"]);
    let d = kv()
        .choose(&request(&p, None, 1), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("roomy"), "{}", d.explanation.why);
    let full = &d.explanation.workers[0];
    assert_eq!(full.overflow_blocks, 48);
    assert_eq!(d.explanation.workers[1].overflow_blocks, 0);
    // (768 + 768 overflow tokens) against roomy's 1,024: the same prefill rate divides both.
    let ratio = full.prefill_term / d.explanation.workers[1].prefill_term;
    assert!((ratio - 1_536.0 / 1_024.0).abs() < 1e-9, "{ratio}");
    // With 16 blocks free it is 32 over: 768 + 512 = 1,280, still behind 1,024.
    load.report(&w("full"), at(984, 1_000), 1);
    load.report(&w("roomy"), at(984, 2_000), 1);
    let d = kv()
        .choose(&request(&p, None, 2), &c, &index, &load)
        .unwrap();
    assert_eq!(d.explanation.workers[0].overflow_blocks, 32);
    assert_eq!(d.worker, w("roomy"));
    // With room for the whole prompt its prefix wins; a worker reporting no capacity is
    // priced no overflow.
    load.report(&w("full"), at(900, 1_000), 2);
    load.report(&w("roomy"), at(900, 0), 2);
    let d = kv()
        .choose(&request(&p, None, 3), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("full"));
    assert!(d.explanation.workers.iter().all(|s| s.overflow_blocks == 0));
    let json = serde_json::to_value(&d.explanation).unwrap();
    assert!(json["workers"][0].get("overflow_blocks").is_none());
}

#[test]
fn in_flight_bookkeeping_spreads_a_burst() {
    // Eight copies of the same cold prompt arrive before any load report or KV event. The
    // rendezvous tie-break alone would send them all to one worker; the in-flight bookkeeping
    // must spread them.
    let burst = |record: bool| {
        let (index, mut load) = setup();
        let names = ["a", "b", "c", "d"];
        for n in names {
            load.report(&w(n), LoadStats::default(), 0);
        }
        let mut policy = kv();
        let p = prompt(7, 32);
        let mut counts = std::collections::BTreeMap::new();
        for i in 0..8u64 {
            let d = policy
                .choose(
                    &request(&p, None, 10 + i),
                    &candidates(&names),
                    &index,
                    &load,
                )
                .unwrap();
            if record {
                let uncached = d.chosen().unwrap().uncached_prompt_tokens;
                load.on_routed(&d.worker, i, uncached, 32, 10 + i);
            }
            *counts.entry(d.worker.to_string()).or_insert(0) += 1;
        }
        counts
    };
    assert_eq!(
        burst(false).len(),
        1,
        "without bookkeeping the burst piles up"
    );
    let spread = burst(true);
    assert_eq!(spread.len(), 4, "{spread:?}");
    assert!(spread.values().all(|&n| n == 2), "{spread:?}");
}

#[test]
fn kv_tie_break_is_deterministic_and_same_prompt_same_worker() {
    let (index, load) = setup();
    let c = candidates(&["a", "b", "c", "d", "e"]);
    let mut seen = std::collections::BTreeSet::new();
    for f in 0..40 {
        let p = prompt(f, 4);
        let first = kv()
            .choose(&request(&p, None, 0), &c, &index, &load)
            .unwrap();
        let again = kv()
            .choose(&request(&p, None, 99), &c, &index, &load)
            .unwrap();
        assert_eq!(first.worker, again.worker);
        assert!(
            first.explanation.why.contains("tie broken"),
            "{}",
            first.explanation.why
        );
        seen.insert(first.worker);
    }
    assert!(
        seen.len() >= 4,
        "rendezvous tie-break spreads cold prompts: {seen:?}"
    );
}

#[test]
fn kv_with_temperature_samples_reproducibly() {
    let (mut index, load) = setup();
    let p = prompt(1, 8);
    store(&mut index, "a", 0, &p, 8);
    let cfg = PolicyConfig {
        seed: 7,
        kv: KvConfig {
            temperature: 1.0,
            ..KvConfig::default()
        },
        ..PolicyConfig::default()
    };
    let c = candidates(&["a", "b", "c"]);
    let run = || {
        let mut pol = PolicyKind::Kv.build(&cfg).unwrap();
        (0..50)
            .map(|i| {
                pol.choose(&request(&p, None, i), &c, &index, &load)
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (x, y) = (run(), run());
    let xs: Vec<_> = x.iter().map(|d| d.worker.clone()).collect();
    let ys: Vec<_> = y.iter().map(|d| d.worker.clone()).collect();
    assert_eq!(xs, ys);
    let a = xs.iter().filter(|n| **n == w("a")).count();
    assert!(
        a > 20 && a < 50,
        "the cheapest is most likely but not certain: {a}"
    );
    let probs: f64 = x[0]
        .explanation
        .workers
        .iter()
        .filter_map(|s| s.probability)
        .sum();
    assert!((probs - 1.0).abs() < 1e-9);
    assert!(x[0].explanation.sampled);
}

#[test]
fn host_hits_are_priced_as_loads_from_the_host() {
    let (mut index, load) = setup();
    let p = prompt(1, 8);
    store(&mut index, "dev", 0, &p, 4);
    let hashes = block_hashes(&p, bs());
    let ev = KvEvent::Stored {
        parent: None,
        blocks: (0..8)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: p[i * 16..(i + 1) * 16].to_vec(),
            })
            .collect(),
        tier: StorageTier::Host,
    };
    index.apply(&w("host"), 1, 0, &ev).unwrap();
    let d = kv()
        .choose(
            &request(&p, None, 0),
            &candidates(&["dev", "host"]),
            &index,
            &load,
        )
        .unwrap();
    let host = &d.explanation.workers[1];
    assert_eq!(host.overlap.device, 0);
    assert_eq!(host.overlap.device_or_host, 8);
    assert_eq!(host.uncached_prompt_tokens, 0);
    assert_eq!(host.onboarding.host_blocks, 8);
    // Typical figures: 8 × 2 MiB over 25 GB/s is well under recomputing 4 blocks.
    assert!(host.onboarding.seconds < host.onboarding.recompute_seconds);
    assert!(!host.onboarding.announced);
    assert_eq!(d.worker, w("host"));
}

#[test]
fn errors_are_clear() {
    let (index, load) = setup();
    let p = prompt(1, 2);
    for kind in PolicyKind::ALL {
        let mut pol = kind.build(&PolicyConfig::default()).unwrap();
        assert_eq!(pol.name(), kind.as_str());
        assert_eq!(
            pol.choose(&request(&p, None, 0), &[], &index, &load)
                .unwrap_err(),
            RouteError::NoCandidates
        );
    }
    let mut r = request(&p, None, 0);
    r.block_size = BlockSize::new(32).unwrap();
    assert!(matches!(
        kv().choose(&r, &candidates(&["a"]), &index, &load),
        Err(RouteError::BlockSizeMismatch { .. })
    ));
    assert_eq!(RouteError::NoCandidates.to_string(), "no candidate workers");
    let bad = PolicyConfig {
        kv: KvConfig {
            temperature: -1.0,
            ..KvConfig::default()
        },
        ..PolicyConfig::default()
    };
    assert!(matches!(
        PolicyKind::Kv.build(&bad),
        Err(RouteError::InvalidConfig(_))
    ));
}

#[test]
fn policy_kinds_parse() {
    for kind in PolicyKind::ALL {
        assert_eq!(kind.as_str().parse::<PolicyKind>().unwrap(), kind);
        assert_eq!(PolicyKind::named(kind.as_str()), Some(kind));
        // Explanations carry the built policy's name, which the counterfactual reads back.
        let built = kind.build(&PolicyConfig::default()).unwrap();
        assert_eq!(PolicyKind::named(built.name()), Some(kind));
        assert_eq!(kind.to_string(), kind.as_str());
    }
    // `named` takes an explanation's name as written; the parse normalises what users type.
    assert_eq!(PolicyKind::named("Round_Robin"), None);
    assert_eq!(PolicyKind::named("fastest"), None);
    assert_eq!(
        "Round_Robin".parse::<PolicyKind>().unwrap(),
        PolicyKind::RoundRobin
    );
    assert!(matches!(
        "fastest".parse::<PolicyKind>(),
        Err(RouteError::UnknownPolicy(_))
    ));
    assert_eq!(PolicyKind::default(), PolicyKind::Kv);
    let cfg: PolicyConfig =
        serde_json::from_str(r#"{"seed": 3, "kv": {"temperature": 0.5}}"#).unwrap();
    assert_eq!(cfg.kv.temperature, 0.5);
    assert_eq!(cfg.kv.prefill_weight, 1.0);
    assert!(serde_json::from_str::<PolicyConfig>(r#"{"sead": 3}"#).is_err());
}

#[test]
fn round_robin_random_and_least_loaded() {
    let (index, mut load) = setup();
    let c = candidates(&["a", "b", "c"]);
    let p = prompt(1, 2);
    let mut rr = PolicyKind::RoundRobin
        .build(&PolicyConfig::default())
        .unwrap();
    let order: Vec<_> = (0..6)
        .map(|_| {
            rr.choose(&request(&p, None, 0), &c, &index, &load)
                .unwrap()
                .worker
        })
        .collect();
    assert_eq!(order, ["a", "b", "c", "a", "b", "c"].map(w));

    let draw = |seed| {
        let mut pol = PolicyKind::Random
            .build(&PolicyConfig {
                seed,
                ..PolicyConfig::default()
            })
            .unwrap();
        (0..30)
            .map(|_| {
                pol.choose(&request(&p, None, 0), &c, &index, &load)
                    .unwrap()
                    .worker
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(1), draw(1));
    assert_ne!(draw(1), draw(2));
    assert!(["a", "b", "c"].iter().all(|n| draw(1).contains(&w(n))));

    load.report(
        &w("a"),
        LoadStats {
            queued_prefill_tokens: 500,
            ..Default::default()
        },
        0,
    );
    load.report(
        &w("b"),
        LoadStats {
            queued_prefill_tokens: 100,
            ..Default::default()
        },
        0,
    );
    load.report(
        &w("c"),
        LoadStats {
            queued_prefill_tokens: 300,
            ..Default::default()
        },
        0,
    );
    let mut ll = PolicyKind::LeastLoaded
        .build(&PolicyConfig::default())
        .unwrap();
    let d = ll.choose(&request(&p, None, 0), &c, &index, &load).unwrap();
    assert_eq!(d.worker, w("b"));
    assert!(
        d.explanation.why.starts_with("b: least loaded (100 queued"),
        "{}",
        d.explanation.why
    );
}

#[test]
fn session_sticks_until_gone_overloaded_or_expired() {
    let (mut index, mut load) = setup();
    let cfg = PolicyConfig {
        session: SessionConfig {
            ttl: 1_000,
            max_sessions: 2,
            ..SessionConfig::default()
        },
        ..PolicyConfig::default()
    };
    let mut pol = PolicyKind::Session.build(&cfg).unwrap();
    let c = candidates(&["a", "b"]);
    let turn1 = prompt(1, 4);
    let first = pol
        .choose(&request(&turn1, Some("s1"), 0), &c, &index, &load)
        .unwrap()
        .worker;
    assert!(
        pol.choose(&request(&turn1, Some("s1"), 0), &c, &index, &load)
            .unwrap()
            .explanation
            .why
            .contains("pinned")
    );
    let other = if first == w("a") { w("b") } else { w("a") };
    // The other worker now holds the prompt: kv alone would move, the session stays.
    store(&mut index, other.as_str(), 0, &turn1, 4);
    let d = pol
        .choose(&request(&turn1, Some("s1"), 500), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, first);
    assert!(
        d.explanation
            .why
            .contains(&format!("kv alone would pick {other}")),
        "{}",
        d.explanation.why
    );
    // Overloaded pinned worker: fall back to kv and re-pin.
    load.report(
        &first,
        LoadStats {
            queued_prefill_tokens: 1 << 20,
            ..Default::default()
        },
        600,
    );
    let d = pol
        .choose(&request(&turn1, Some("s1"), 700), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, other);
    assert!(
        d.explanation.why.contains("overloaded"),
        "{}",
        d.explanation.why
    );
    load.report(&first, LoadStats::default(), 800);
    // Now pinned to `other`; gone from the candidates → fallback.
    let d = pol
        .choose(
            &request(&turn1, Some("s1"), 900),
            &candidates(&[first.as_str()]),
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(d.worker, first);
    assert!(
        d.explanation.why.contains("not a candidate"),
        "{}",
        d.explanation.why
    );
    // Expired after the TTL.
    let d = pol
        .choose(&request(&turn1, Some("s1"), 5_000), &c, &index, &load)
        .unwrap();
    assert!(
        d.explanation.why.contains("expired"),
        "{}",
        d.explanation.why
    );
    // No session id: plain kv.
    let d = pol
        .choose(&request(&turn1, None, 5_000), &c, &index, &load)
        .unwrap();
    assert!(d.explanation.why.starts_with("no session id"));
}

#[test]
fn session_pins_are_bounded() {
    let (index, load) = setup();
    let cfg = SessionConfig {
        max_sessions: 3,
        ..SessionConfig::default()
    };
    let mut pol = SessionPolicy::new(cfg, KvPolicy::new(KvConfig::default(), 0).unwrap()).unwrap();
    let c = candidates(&["a", "b"]);
    for i in 0..10u64 {
        let s = format!("s{i}");
        pol.choose(&request(&prompt(1, 1), Some(&s), i), &c, &index, &load)
            .unwrap();
    }
    assert_eq!(pol.pinned(), 3);
    pol.worker_removed(&w("a"));
    pol.worker_removed(&w("b"));
    assert_eq!(pol.pinned(), 0);
}

#[test]
fn approx_kv_learns_from_its_decisions_and_forgets_after_ttl() {
    let (index, mut load) = setup();
    let cfg = PolicyConfig {
        approx: ApproxConfig {
            ttl: 1_000,
            max_entries: 1_000,
        },
        ..PolicyConfig::default()
    };
    let mut pol = PolicyKind::ApproxKv.build(&cfg).unwrap();
    let c = candidates(&["a", "b", "c"]);
    let p = prompt(1, 8);
    let first = pol
        .choose(&request(&p, None, 0), &c, &index, &load)
        .unwrap();
    assert!(
        first
            .explanation
            .workers
            .iter()
            .all(|s| s.overlap.device == 0)
    );
    // Make the first choice a bit busier than the others: the predicted cache still wins.
    load.on_routed(&first.worker, 1, 64, 8, 0);
    let mut longer = p.clone();
    longer.extend(prompt(9, 2));
    let d = pol
        .choose(&request(&longer, None, 500), &c, &index, &load)
        .unwrap();
    assert_eq!(d.worker, first.worker);
    let s = d.chosen().unwrap();
    assert_eq!(s.overlap.device, 8);
    assert!(d.explanation.why.contains("predicted from past decisions"));
    // Recorded at 0 and 500; at 1,600 both recordings are older than the 1,000 µs TTL.
    let d = pol
        .choose(&request(&p, None, 1_600), &c, &index, &load)
        .unwrap();
    assert!(
        d.explanation.workers.iter().all(|s| s.overlap.device == 0),
        "{:?}",
        d.explanation.workers
    );
}

#[test]
fn approx_kv_is_bounded() {
    let mut cache = approx::PredictedCache::default();
    for i in 0..100u64 {
        cache.record(&w("a"), &[BlockHash(i), BlockHash(i + 1000)], i, 50);
    }
    assert_eq!(cache.entries(), 50);
    assert_eq!(cache.overlap(&w("a"), &[BlockHash(99)]), 1);
    assert_eq!(cache.overlap(&w("a"), &[BlockHash(0)]), 0);
    cache.remove_worker(&w("a"));
    assert_eq!(cache.entries(), 0);
}

#[test]
fn a_cloned_policy_previews_without_moving_the_live_one() {
    let (index, load) = setup();
    let cands = candidates(&["a", "b", "c"]);
    let tokens = prompt(9, 2);
    let mut live = PolicyKind::RoundRobin
        .build(&PolicyConfig::default())
        .unwrap();
    let first = live
        .choose(&request(&tokens, None, 0), &cands, &index, &load)
        .unwrap();
    // Previewing twice on clones sees the same next turn and leaves it in place.
    let preview = live
        .clone_box()
        .choose(&request(&tokens, None, 1), &cands, &index, &load)
        .unwrap();
    let again = live
        .clone_box()
        .choose(&request(&tokens, None, 1), &cands, &index, &load)
        .unwrap();
    assert_eq!(preview.worker, again.worker);
    assert_ne!(preview.worker, first.worker);
    let next = live
        .choose(&request(&tokens, None, 2), &cands, &index, &load)
        .unwrap();
    assert_eq!(next.worker, preview.worker);

    // A session pin made by the live policy shows in a preview, and previews pin nothing.
    let mut session = PolicyKind::Session.build(&PolicyConfig::default()).unwrap();
    let pinned = session
        .choose(&request(&tokens, Some("s1"), 0), &cands, &index, &load)
        .unwrap();
    let seen = session
        .clone_box()
        .choose(
            &request(&prompt(10, 2), Some("s1"), 1),
            &cands,
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(seen.worker, pinned.worker);
}
