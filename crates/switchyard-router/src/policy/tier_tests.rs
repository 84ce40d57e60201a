//! The cost model's tier pricing: hits outside device memory cost their load time from the
//! figures workers announce, against recomputing.

use super::tests::{BS, bs, candidates, kv, prompt, request, setup, w};
use super::*;
use crate::index::TierOverlap;
use switchyard_core::{KvEvent, KvTierCosts, StorageTier, StoredBlock, TierLink, block_hashes};

/// `worker` stores blocks `from..to` of `tokens` in `tier`.
fn store_in(
    index: &mut PrefixIndex,
    worker: &str,
    seq: u64,
    tokens: &[u32],
    (from, to): (usize, usize),
    tier: StorageTier,
) {
    let hashes = block_hashes(tokens, bs());
    let b = BS as usize;
    let ev = KvEvent::Stored {
        parent: from.checked_sub(1).map(|p| hashes[p]),
        blocks: (from..to)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: tokens[i * b..(i + 1) * b].to_vec(),
            })
            .collect(),
        tier,
    };
    index.apply(&w(worker), 1, seq, &ev).unwrap();
}

/// Tier costs with every link at `bytes_per_s` and no latency, 1 MiB blocks, 10,000 prefill
/// tokens/s.
fn costs(bytes_per_s: u64) -> KvTierCosts {
    let link = TierLink {
        bytes_per_s,
        latency_us: 0,
    };
    KvTierCosts {
        bytes_per_block: 1 << 20,
        prefill_tokens_per_s: 10_000,
        host: link,
        disk: link,
        remote: link,
    }
}

fn announced(name: &str, c: KvTierCosts) -> Candidate {
    Candidate {
        worker: w(name),
        kv_tiers: Some(c),
        kv_peer: None,
    }
}

/// "tiered" holds the whole 64-block prompt in `tier`, "cold" holds nothing; both announce
/// `c`. Returns the decision.
fn tiered_vs_cold(tier: StorageTier, c: KvTierCosts) -> Decision {
    let (mut index, load) = setup();
    let p = prompt(1, 64);
    store_in(&mut index, "tiered", 0, &p, (0, 64), tier);
    let cands = [announced("tiered", c), announced("cold", c)];
    kv().choose(&request(&p, None, 0), &cands, &index, &load)
        .unwrap()
}

#[test]
fn a_host_hit_beats_recompute_when_bandwidth_is_high_and_loses_when_low() {
    // Recomputing 1,024 tokens at 10,000 tokens/s: 0.1024 s. Loading 64 MiB at 10 GB/s:
    // 0.0067 s; at 100 MB/s: 0.67 s.
    let fast = tiered_vs_cold(StorageTier::Host, costs(10_000_000_000));
    assert_eq!(fast.worker, w("tiered"));
    let t = fast.chosen().unwrap();
    assert_eq!(t.onboarding.host_blocks, 64);
    assert_eq!(t.onboarding.bytes, 64 << 20);
    assert!((t.onboarding.seconds - (64u64 << 20) as f64 / 1e10).abs() < 1e-9);
    assert!((t.onboarding.recompute_seconds - 0.1024).abs() < 1e-9);
    assert!(t.onboarding.announced);

    let slow = tiered_vs_cold(StorageTier::Host, costs(100_000_000));
    assert_eq!(slow.worker, w("cold"), "{}", slow.explanation.why);
    let t = &slow.explanation.workers[0];
    assert!(t.onboarding.seconds > t.onboarding.recompute_seconds);
    assert!((slow.chosen().unwrap().prefill_term - 0.1024).abs() < 1e-9);
}

#[test]
fn each_tier_is_priced_with_its_own_link_and_latency() {
    let mut c = costs(10_000_000_000);
    c.remote = TierLink {
        bytes_per_s: 10_000_000_000,
        latency_us: 500_000,
    };
    // The same bandwidth, but half a second per remote lookup: recompute wins.
    assert_eq!(tiered_vs_cold(StorageTier::Remote, c).worker, w("cold"));
    // The disk link is fast, so a disk hit still wins.
    let d = tiered_vs_cold(StorageTier::Disk, c);
    assert_eq!(d.worker, w("tiered"));
    assert_eq!(d.chosen().unwrap().onboarding.disk_blocks, 64);
}

#[test]
fn the_nested_levels_split_a_prefix_over_its_tiers() {
    let (mut index, load) = setup();
    let p = prompt(2, 10);
    store_in(&mut index, "a", 0, &p, (0, 2), StorageTier::Device);
    store_in(&mut index, "a", 1, &p, (2, 5), StorageTier::Host);
    store_in(&mut index, "a", 2, &p, (5, 6), StorageTier::Disk);
    store_in(&mut index, "a", 3, &p, (6, 9), StorageTier::Remote);
    let c = costs(1 << 30);
    let d = kv()
        .choose(&request(&p, None, 0), &[announced("a", c)], &index, &load)
        .unwrap();
    let a = d.chosen().unwrap();
    assert_eq!(
        a.overlap,
        TierOverlap {
            device: 2,
            device_or_host: 5,
            device_host_or_disk: 6,
            any_tier: 9
        }
    );
    let o = a.onboarding;
    assert_eq!((o.host_blocks, o.disk_blocks, o.remote_blocks), (3, 1, 3));
    assert_eq!(a.uncached_prompt_tokens, u64::from(BS));
    // Three links with no latency at 1 GiB/s: 7 MiB take 7/1024 s.
    assert!((o.seconds - 7.0 / 1024.0).abs() < 1e-12);
}

#[test]
fn a_busy_transfer_path_delays_a_tier_hit() {
    let c = costs(1_000_000_000);
    let p = prompt(3, 64);
    let run = |queued: u64| {
        let (mut index, mut load) = setup();
        store_in(&mut index, "tiered", 0, &p, (0, 64), StorageTier::Host);
        load.report_transfer_queue(&w("tiered"), queued);
        let cands = [announced("tiered", c), announced("cold", c)];
        kv().choose(&request(&p, None, 0), &cands, &index, &load)
            .unwrap()
    };
    // 64 MiB at 1 GB/s: 0.067 s, under the 0.1024 s of recompute.
    assert_eq!(run(0).worker, w("tiered"));
    // 100 MB already queued ahead: 0.1 s more, and recompute wins.
    let busy = run(100_000_000);
    assert_eq!(busy.worker, w("cold"));
    assert_eq!(
        busy.explanation.workers[0].onboarding.queued_bytes,
        100_000_000
    );
}

#[test]
fn a_faster_worker_wins_the_same_cold_prompt() {
    let (index, load) = setup();
    let p = prompt(4, 8);
    let slow = costs(1 << 30);
    let fast = KvTierCosts {
        prefill_tokens_per_s: 40_000,
        ..slow
    };
    let d = kv()
        .choose(
            &request(&p, None, 0),
            &[announced("slow", slow), announced("fast", fast)],
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(d.worker, w("fast"));
    assert!((d.chosen().unwrap().score - 128.0 / 40_000.0).abs() < 1e-12);
}

#[test]
fn the_explanation_shows_load_and_recompute_times() {
    let d = tiered_vs_cold(StorageTier::Host, costs(100_000_000));
    let why = &d.explanation.why;
    assert!(
        why.starts_with("cold: lowest predicted cost 0.102 s"),
        "{why}"
    );
    assert!(
        why.contains("64 more loaded (64 host, 0 disk, 0 remote) in 0.671 s (recompute 0.102 s)"),
        "{why}"
    );
    let json = serde_json::to_value(&d.explanation).unwrap();
    let o = &json["workers"][0]["onboarding"];
    assert_eq!(o["host_blocks"], 64);
    assert_eq!(o["costs"]["host"]["bytes_per_s"], 100_000_000);
    assert_eq!(o["announced"], true);
    assert_eq!(json["workers"][0]["overlap"]["device_host_or_disk"], 64);

    // A worker that announced nothing is priced with typical figures, and the reason says so.
    let (mut index, load) = setup();
    let p = prompt(5, 4);
    store_in(&mut index, "old", 0, &p, (0, 4), StorageTier::Host);
    let d = kv()
        .choose(&request(&p, None, 0), &candidates(&["old"]), &index, &load)
        .unwrap();
    assert!(
        d.explanation.why.contains("assumed tier costs"),
        "{}",
        d.explanation.why
    );
    let o = d.chosen().unwrap().onboarding;
    assert_eq!(
        o.costs.bytes_per_block,
        ASSUMED_KV_BYTES_PER_TOKEN * u64::from(BS)
    );
}

#[test]
fn the_retired_hit_factors_are_refused_naming_their_replacement() {
    for key in ["host_hit_factor", "disk_hit_factor"] {
        let cfg: KvConfig = serde_json::from_str(&format!("{{\"{key}\": 0.5}}")).unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(key) && err.contains("tier costs"), "{err}");
        let policy = PolicyConfig {
            kv: cfg,
            ..PolicyConfig::default()
        };
        assert!(PolicyKind::Kv.build(&policy).is_err());
    }
    assert!(serde_json::from_str::<KvConfig>("{\"hit_factor\": 1}").is_err());
}

#[test]
fn least_loaded_compares_queues_in_each_workers_seconds() {
    let (index, mut load) = setup();
    let slow = costs(1 << 30);
    let fast = KvTierCosts {
        prefill_tokens_per_s: 100_000,
        ..slow
    };
    let stats = switchyard_core::LoadStats {
        queued_prefill_tokens: 5_000,
        ..Default::default()
    };
    load.report(&w("fast"), stats, 0);
    load.report(
        &w("slow"),
        switchyard_core::LoadStats {
            queued_prefill_tokens: 1_000,
            ..Default::default()
        },
        0,
    );
    let p = prompt(6, 2);
    let d = PolicyKind::LeastLoaded
        .build(&PolicyConfig::default())
        .unwrap()
        .choose(
            &request(&p, None, 0),
            &[announced("slow", slow), announced("fast", fast)],
            &index,
            &load,
        )
        .unwrap();
    // 5,000 tokens at 100,000/s (0.05 s) wait less than 1,000 at 10,000/s (0.1 s).
    assert_eq!(d.worker, w("fast"));
}

/// The memory term counts the device blocks a tier hit takes when it is loaded: a worker
/// holding the whole prompt on host with its device memory full is priced those blocks as
/// recomputation, as a worker computing the prompt is priced its own.
#[test]
fn a_tier_hit_needs_device_blocks_the_memory_term_counts() {
    let c = costs(10_000_000_000);
    let p = prompt(7, 64);
    let run = |active_blocks: u64| {
        let (mut index, mut load) = setup();
        store_in(&mut index, "tiered", 0, &p, (0, 64), StorageTier::Host);
        let stats = switchyard_core::LoadStats {
            active_blocks,
            capacity_blocks: 1_000,
            ..Default::default()
        };
        load.report(&w("tiered"), stats, 0);
        load.report(&w("cold"), stats, 0);
        let cands = [announced("tiered", c), announced("cold", c)];
        kv().choose(&request(&p, None, 0), &cands, &index, &load)
            .unwrap()
    };
    let roomy = run(0);
    assert_eq!(roomy.worker, w("tiered"));
    assert_eq!(roomy.chosen().unwrap().overflow_blocks, 0);
    // Both full: the 64 host blocks overflow as the cold worker's 64 computed ones do.
    let full = run(1_000);
    let tiered = &full.explanation.workers[0];
    assert_eq!(tiered.overflow_blocks, 64, "{}", full.explanation.why);
    assert_eq!(full.explanation.workers[1].overflow_blocks, 64);
    // 1,024 overflow tokens at 10,000 tokens/s, plus 64 MiB at 10 GB/s.
    let load_s = (64u64 << 20) as f64 / 1e10;
    assert!((tiered.prefill_term - (0.1024 + load_s)).abs() < 1e-9);
    // Recomputing instead costs the cold worker its 1,024 tokens on top of the same overflow.
    assert_eq!(full.worker, w("tiered"));
    assert!((full.explanation.workers[1].prefill_term - 0.2048).abs() < 1e-9);
}

/// A worker that announces no tier costs is priced the configured host link (the replay
/// lab's simulators' own) instead of the typical one.
#[test]
fn the_configured_host_link_prices_workers_that_announce_none() {
    let (mut index, load) = setup();
    let p = prompt(8, 4);
    store_in(&mut index, "old", 0, &p, (0, 4), StorageTier::Host);
    let link = TierLink {
        bytes_per_s: 50_000_000_000,
        latency_us: 0,
    };
    let policy = PolicyConfig {
        kv: KvConfig {
            host_link: Some(link),
            ..KvConfig::default()
        },
        ..PolicyConfig::default()
    };
    let d = PolicyKind::Kv
        .build(&policy)
        .unwrap()
        .choose(&request(&p, None, 0), &candidates(&["old"]), &index, &load)
        .unwrap();
    let o = d.chosen().unwrap().onboarding;
    assert!(!o.announced);
    assert_eq!(o.costs.host, link);
    let bytes = 4 * ASSUMED_KV_BYTES_PER_TOKEN * u64::from(BS);
    assert!((o.seconds - bytes as f64 / 5e10).abs() < 1e-12);
    let bad = KvConfig {
        host_link: Some(TierLink {
            bytes_per_s: 0,
            latency_us: 0,
        }),
        ..KvConfig::default()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("host link")
    );
}
