//! Sub-agent placement: a sub-agent sharing its parent's prefix goes where that prefix is
//! cheapest to reach; a saturated parent worker makes a copy to a less loaded worker cheaper
//! than recomputing; a fan-out spreads instead of piling onto the parent's worker.

use super::tests::{candidates, prompt, request, setup, w};
use super::*;
use switchyard_core::{EngineKind, KvEvent, StorageTier, StoredBlock, TierLink, block_hashes};

const PREFIX_BLOCKS: usize = 48;

/// 50 GB/s between workers, 10 µs per copy: an RDMA NIC of 400 Gbit/s.
fn nic() -> TierLink {
    TierLink {
        bytes_per_s: 50_000_000_000,
        latency_us: 10,
    }
}

fn placing(peer_link: Option<TierLink>) -> Box<dyn Policy> {
    let config = PolicyConfig {
        kv: KvConfig {
            peer_link,
            ..KvConfig::default()
        },
        ..PolicyConfig::default()
    };
    PolicyKind::Kv.build(&config).unwrap()
}

/// `worker` holds the first `blocks` blocks of `tokens` on device.
fn holds(index: &mut PrefixIndex, worker: &str, seq: u64, tokens: &[u32], blocks: usize) {
    let hashes = block_hashes(tokens, tests::bs());
    let b = tests::BS as usize;
    let ev = KvEvent::Stored {
        parent: None,
        blocks: (0..blocks)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: tokens[i * b..(i + 1) * b].to_vec(),
            })
            .collect(),
        tier: StorageTier::Device,
    };
    index.apply(&w(worker), 1, seq, &ev).unwrap();
}

/// A sub-agent's prompt: the parent's 48-block prefix, then 8 blocks of its own (`own`).
fn sub_agent(parent: &[u32], own: u32) -> Vec<u32> {
    let mut p = parent[..PREFIX_BLOCKS * tests::BS as usize].to_vec();
    p.extend(prompt(own, 8));
    p
}

#[test]
fn a_sub_agent_goes_to_its_parents_worker_when_it_is_not_saturated() {
    let (mut index, load) = setup();
    let parent = prompt(1, PREFIX_BLOCKS + 4);
    holds(&mut index, "parent", 0, &parent, PREFIX_BLOCKS + 4);
    let sub = sub_agent(&parent, 7);
    let d = placing(Some(nic()))
        .choose(
            &request(&sub, Some("s"), 0),
            &candidates(&["idle-a", "parent", "idle-b"]),
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(d.worker, w("parent"), "{}", d.explanation.why);
    let chosen = d.chosen().unwrap();
    assert_eq!(chosen.overlap.device, PREFIX_BLOCKS as u32);
    assert_eq!(chosen.onboarding.peer_blocks, 0);
    assert_eq!(
        d.peer_source(&candidates(&["idle-a", "parent", "idle-b"])),
        None
    );
    // The idle workers were priced with a copy, cheaper than recompute but dearer than a hit.
    let idle = &d.explanation.workers[0];
    assert_eq!(idle.onboarding.peer_blocks, PREFIX_BLOCKS as u32);
    assert!(idle.onboarding.peer_seconds < idle.onboarding.peer_recompute_seconds);
    assert_eq!(idle.uncached_prompt_tokens, 8 * u64::from(tests::BS));
}

#[test]
fn a_saturated_parent_worker_sends_the_sub_agent_elsewhere_with_a_copy() {
    let (mut index, mut load) = setup();
    let parent = prompt(1, PREFIX_BLOCKS);
    holds(&mut index, "parent", 0, &parent, PREFIX_BLOCKS);
    // Six seconds of prefill queued on the parent's worker (96k tokens at 16k tokens/s).
    load.on_routed(&w("parent"), 1, 96_000, 10, 0);
    let sub = sub_agent(&parent, 7);
    let req = request(&sub, Some("s"), 0);
    let cands = candidates(&["parent", "idle"]);

    let d = placing(Some(nic()))
        .choose(&req, &cands, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("idle"), "{}", d.explanation.why);
    assert_eq!(d.peer_source(&cands), Some(&w("parent")));
    let chosen = d.chosen().unwrap();
    assert_eq!(chosen.onboarding.peer_blocks, PREFIX_BLOCKS as u32);
    // It computes only its own 8 blocks; the prefix is copied: 48 blocks × 2 MiB at 50 GB/s.
    assert_eq!(chosen.uncached_prompt_tokens, 8 * u64::from(tests::BS));
    let copy = 10e-6 + (48u64 << 21) as f64 / 50e9;
    assert!((chosen.onboarding.peer_seconds - copy).abs() < 1e-9);
    assert!(
        d.explanation.why.contains("48 more copied from a peer"),
        "{}",
        d.explanation.why
    );
    // The booking the serving core makes counts only what the worker computes.
    let booking = crate::serve::Booking::aggregated(1, &d, &req, 16);
    assert_eq!(booking.prefill_tokens, 8 * u64::from(tests::BS));

    // Without a peer link the same choice recomputes the whole prefix.
    let d = placing(None).choose(&req, &cands, &index, &load).unwrap();
    assert_eq!(d.worker, w("idle"));
    assert_eq!(d.chosen().unwrap().onboarding.peer_blocks, 0);
    assert_eq!(d.chosen().unwrap().uncached_prompt_tokens, sub.len() as u64);
    assert_eq!(d.peer_source(&cands), None);
}

#[test]
fn a_copy_slower_than_recompute_is_not_priced() {
    let (mut index, mut load) = setup();
    let parent = prompt(1, PREFIX_BLOCKS);
    holds(&mut index, "parent", 0, &parent, PREFIX_BLOCKS);
    load.on_routed(&w("parent"), 1, 96_000, 10, 0);
    // 100 MB/s: 48 × 2 MiB takes 1 s against 0.048 s of recompute.
    let slow = TierLink {
        bytes_per_s: 100_000_000,
        latency_us: 0,
    };
    let d = placing(Some(slow))
        .choose(
            &request(&sub_agent(&parent, 7), Some("s"), 0),
            &candidates(&["parent", "idle"]),
            &index,
            &load,
        )
        .unwrap();
    assert_eq!(d.worker, w("idle"));
    assert_eq!(d.chosen().unwrap().onboarding.peer_blocks, 0);
    assert_eq!(d.peer_source(&candidates(&["parent", "idle"])), None);
}

#[test]
fn a_fan_out_spreads_over_workers_instead_of_taking_the_parents_over() {
    let (mut index, mut load) = setup();
    let parent = prompt(1, PREFIX_BLOCKS);
    holds(&mut index, "parent", 0, &parent, PREFIX_BLOCKS);
    let cands = candidates(&["parent", "a", "b"]);
    let mut policy = placing(Some(nic()));
    let mut placed = Vec::new();
    for k in 0..3u32 {
        let sub = sub_agent(&parent, 10 + k);
        let req = request(&sub, Some("s"), 0);
        let d = policy.choose(&req, &cands, &index, &load).unwrap();
        // Booked as the serving core books it: its uncached tokens queue on its worker.
        let booking = crate::serve::Booking::aggregated(u64::from(k), &d, &req, 100);
        load.on_routed(
            &booking.worker,
            booking.key,
            booking.prefill_tokens,
            booking.blocks,
            0,
        );
        placed.push((d.worker.clone(), d.peer_source(&cands).cloned()));
    }
    assert_eq!(
        placed[0],
        (w("parent"), None),
        "the first one takes the hit"
    );
    let mut workers: Vec<&WorkerId> = placed.iter().map(|(w, _)| w).collect();
    workers.sort();
    workers.dedup();
    assert_eq!(workers.len(), 3, "one sub-agent per worker: {placed:?}");
    for (worker, source) in &placed[1..] {
        assert_ne!(worker, &w("parent"));
        assert_eq!(
            source.as_ref(),
            Some(&w("parent")),
            "copied, not recomputed"
        );
    }
}

/// `names` as candidates that announced `nic()` as their peer link for `engine` (`None`:
/// announced none).
fn announcing(names: &[(&str, Option<EngineKind>)]) -> Vec<Candidate> {
    names
        .iter()
        .map(|&(n, engine)| Candidate {
            kv_peer: engine.map(|engine| PeerLink {
                engine,
                link: nic(),
            }),
            ..Candidate::from(w(n))
        })
        .collect()
}

#[test]
fn live_workers_are_priced_a_copy_only_from_a_peer_that_can_hand_them_its_kv() {
    use switchyard_core::EngineKind::{Sglang, Vllm};
    let (mut index, mut load) = setup();
    let parent = prompt(1, PREFIX_BLOCKS);
    holds(&mut index, "parent", 0, &parent, PREFIX_BLOCKS);
    load.on_routed(&w("parent"), 1, 96_000, 10, 0);
    let req = request(&sub_agent(&parent, 7), Some("s"), 0);
    // No configured link: what the workers announce is all the gateway prices.
    let mut policy = placing(None);

    let pair = announcing(&[("parent", Some(Vllm)), ("idle", Some(Vllm))]);
    let d = policy.choose(&req, &pair, &index, &load).unwrap();
    assert_eq!(d.worker, w("idle"), "{}", d.explanation.why);
    assert_eq!(d.peer_source(&pair), Some(&w("parent")));
    assert_eq!(
        d.chosen().unwrap().onboarding.peer_blocks,
        PREFIX_BLOCKS as u32
    );
    assert_eq!(
        d.chosen().unwrap().uncached_prompt_tokens,
        8 * u64::from(tests::BS)
    );

    // Two engine kinds, or a side that announced no link: no copy is priced, the idle worker
    // recomputes the prefix (it still wins on the parent's queue) and names no source.
    for cands in [
        announcing(&[("parent", Some(Sglang)), ("idle", Some(Vllm))]),
        announcing(&[("parent", None), ("idle", Some(Vllm))]),
        announcing(&[("parent", Some(Vllm)), ("idle", None)]),
        announcing(&[("parent", None), ("idle", None)]),
    ] {
        let d = policy.choose(&req, &cands, &index, &load).unwrap();
        assert_eq!(d.worker, w("idle"), "{}", d.explanation.why);
        let chosen = d.chosen().unwrap();
        assert_eq!(chosen.onboarding.peer_blocks, 0, "{cands:?}");
        assert_eq!(d.peer_source(&cands), None);
        assert_eq!(
            chosen.uncached_prompt_tokens,
            (PREFIX_BLOCKS as u64 + 8) * u64::from(tests::BS)
        );
    }

    // A third worker that can give the KV is the source even when an incompatible one holds
    // the same prefix first.
    holds(&mut index, "other", 0, &parent, PREFIX_BLOCKS);
    load.on_routed(&w("other"), 2, 96_000, 10, 0);
    let mixed = announcing(&[
        ("other", Some(Sglang)),
        ("parent", Some(Vllm)),
        ("idle", Some(Vllm)),
    ]);
    let d = policy.choose(&req, &mixed, &index, &load).unwrap();
    assert_eq!(d.worker, w("idle"));
    assert_eq!(d.peer_source(&mixed), Some(&w("parent")));
}
