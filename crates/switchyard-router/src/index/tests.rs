use super::*;
use switchyard_core::{StoredBlock, block_hashes};

fn bs() -> BlockSize {
    BlockSize::new(4).unwrap()
}

fn w(name: &str) -> WorkerId {
    WorkerId::new(name).unwrap()
}

/// Tokens of a prompt whose blocks are `0..n` of family `f`.
fn tokens(f: u32, n: usize) -> Vec<u32> {
    (0..n as u32 * 4).map(|t| f * 10_000 + t).collect()
}

fn stored(f: u32, from: usize, to: usize, tier: StorageTier) -> KvEvent {
    stored_tokens(&tokens(f, to), from, tier)
}

/// Blocks `from..` of the prompt `toks` (whole blocks), stored under block `from - 1`.
fn stored_tokens(toks: &[u32], from: usize, tier: StorageTier) -> KvEvent {
    let hashes = block_hashes(toks, bs());
    let to = toks.len() / 4;
    KvEvent::Stored {
        parent: from.checked_sub(1).map(|i| hashes[i]),
        blocks: (from..to)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: toks[i * 4..i * 4 + 4].to_vec(),
            })
            .collect(),
        tier,
    }
}

fn hashes(f: u32, n: usize) -> Vec<BlockHash> {
    block_hashes(&tokens(f, n), bs())
}

fn index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig::new(bs()))
}

fn device(idx: &PrefixIndex, worker: &str, prompt: &[BlockHash]) -> u32 {
    let scores = idx.overlap(prompt);
    idx.worker_key(&w(worker))
        .map_or(0, |k| scores.get(k).device)
}

#[test]
fn overlap_counts_leading_blocks_only() {
    let mut idx = index();
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 6, StorageTier::Device))
        .unwrap();
    idx.apply(&w("b"), 1, 0, &stored(1, 0, 3, StorageTier::Device))
        .unwrap();
    let h = hashes(1, 6);
    idx.apply(
        &w("a"),
        1,
        1,
        &KvEvent::Removed {
            blocks: vec![h[2]],
            tier: StorageTier::Device,
        },
    )
    .unwrap();
    assert_eq!(device(&idx, "a", &h), 2, "stops at the first missing block");
    assert_eq!(device(&idx, "b", &h), 3);
    // A prompt from another family shares nothing.
    assert!(idx.overlap(&hashes(2, 6)).is_empty());
    assert!(idx.overlap(&[]).is_empty());
}

#[test]
fn tier_levels_are_nested() {
    let mut idx = index();
    let a = w("a");
    idx.apply(&a, 1, 0, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    idx.apply(&a, 1, 1, &stored(1, 2, 4, StorageTier::Host))
        .unwrap();
    idx.apply(&a, 1, 2, &stored(1, 4, 5, StorageTier::Disk))
        .unwrap();
    idx.apply(&a, 1, 3, &stored(1, 5, 6, StorageTier::Remote))
        .unwrap();
    idx.apply(&a, 1, 4, &stored(1, 6, 7, StorageTier::Device))
        .unwrap();
    let got = idx.overlap(&hashes(1, 7)).get(idx.worker_key(&a).unwrap());
    assert_eq!(
        got,
        TierOverlap {
            device: 2,
            device_or_host: 4,
            device_host_or_disk: 5,
            any_tier: 7
        }
    );
    // A block in two tiers counts at the faster one.
    idx.apply(&a, 1, 5, &stored(1, 2, 3, StorageTier::Device))
        .unwrap();
    let got = idx.overlap(&hashes(1, 7)).get(idx.worker_key(&a).unwrap());
    assert_eq!(got.device, 3);
    assert_eq!(
        idx.tiers_of(&a, hashes(1, 3)[2]),
        vec![StorageTier::Device, StorageTier::Host]
    );
    assert_eq!(idx.stats().entries, 7, "tiers do not multiply entries");
}

#[test]
fn gap_requests_resync_and_does_not_apply() {
    let mut idx = index();
    let a = w("a");
    assert_eq!(
        idx.apply(&a, 1, 0, &stored(1, 0, 2, StorageTier::Device)),
        Ok(ApplyOutcome::Applied)
    );
    let out = idx
        .apply(&a, 1, 2, &stored(1, 2, 4, StorageTier::Device))
        .unwrap();
    assert_eq!(
        out,
        ApplyOutcome::ResyncNeeded {
            expected: Some(1),
            got: 2
        }
    );
    assert!(idx.awaiting_snapshot(&a));
    assert_eq!(
        device(&idx, "a", &hashes(1, 4)),
        2,
        "old blocks kept, gap event not applied"
    );
    // Even the missing seq is refused until a snapshot arrives.
    let out = idx
        .apply(&a, 1, 1, &stored(1, 2, 3, StorageTier::Device))
        .unwrap();
    assert_eq!(
        out,
        ApplyOutcome::ResyncNeeded {
            expected: None,
            got: 1
        }
    );
    assert_eq!(device(&idx, "a", &hashes(1, 4)), 2);

    let snap: Vec<SnapshotBlock> = hashes(1, 4)
        .iter()
        .enumerate()
        .map(|(i, &hash)| SnapshotBlock {
            hash,
            parent: i.checked_sub(1).map(|p| hashes(1, 4)[p]),
            tier: StorageTier::Device,
        })
        .collect();
    idx.apply_snapshot(&a, 1, 3, &snap).unwrap();
    assert!(!idx.awaiting_snapshot(&a));
    assert_eq!(device(&idx, "a", &hashes(1, 4)), 4);
    assert_eq!(
        idx.apply(&a, 1, 3, &KvEvent::Cleared),
        Ok(ApplyOutcome::Applied)
    );
    assert_eq!(device(&idx, "a", &hashes(1, 4)), 0);
    assert_eq!(idx.stats().resyncs_requested, 2);
}

#[test]
fn first_event_must_start_at_zero() {
    let mut idx = index();
    let out = idx
        .apply(&w("a"), 1, 5, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    assert_eq!(
        out,
        ApplyOutcome::ResyncNeeded {
            expected: Some(0),
            got: 5
        }
    );
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn stale_and_duplicate_events_are_ignored() {
    let mut idx = index();
    let a = w("a");
    idx.apply(&a, 1, 0, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    idx.apply(&a, 1, 1, &KvEvent::Cleared).unwrap();
    let out = idx
        .apply(&a, 1, 0, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    assert_eq!(
        out,
        ApplyOutcome::Stale {
            expected: 2,
            got: 0
        }
    );
    assert_eq!(idx.stats().entries, 0);
    assert_eq!(idx.stats().stale_events, 1);
}

#[test]
fn new_incarnation_drops_what_was_known() {
    let mut idx = index();
    let a = w("a");
    idx.apply(&a, 1, 0, &stored(1, 0, 3, StorageTier::Device))
        .unwrap();
    idx.apply(&a, 1, 1, &stored(2, 0, 3, StorageTier::Device))
        .unwrap();
    // Restarted engine, first event seq 0: old blocks gone, new one applied.
    assert_eq!(
        idx.apply(&a, 2, 0, &stored(3, 0, 1, StorageTier::Device)),
        Ok(ApplyOutcome::Applied)
    );
    assert_eq!(device(&idx, "a", &hashes(1, 3)), 0);
    assert_eq!(device(&idx, "a", &hashes(3, 1)), 1);
    assert_eq!(idx.stats().entries, 1);
    // Restarted again but we missed its first events: dropped and resync requested.
    let out = idx.apply(&a, 3, 4, &KvEvent::Cleared).unwrap();
    assert!(matches!(out, ApplyOutcome::ResyncNeeded { .. }));
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn remove_worker_drops_everything_and_reuses_its_slot() {
    let mut idx = index();
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 4, StorageTier::Device))
        .unwrap();
    idx.apply(&w("b"), 1, 0, &stored(1, 0, 4, StorageTier::Host))
        .unwrap();
    assert!(idx.remove_worker(&w("a")));
    assert!(!idx.remove_worker(&w("a")));
    assert_eq!(idx.stats().entries, 4);
    assert_eq!(idx.workers(), vec![&w("b")]);
    idx.apply(&w("c"), 7, 0, &stored(2, 0, 1, StorageTier::Device))
        .unwrap();
    // "c" took "a"'s slot; it must not inherit "a"'s blocks.
    assert_eq!(device(&idx, "c", &hashes(1, 4)), 0);
    assert_eq!(device(&idx, "c", &hashes(2, 1)), 1);
    // Re-adding "a" starts from nothing, at seq 0.
    idx.apply(&w("a"), 1, 0, &KvEvent::Cleared).unwrap();
    assert_eq!(idx.worker_entries(&w("a")), 0);
}

#[test]
fn alternating_workers_and_a_removed_last_worker_each_find_their_own_slot() {
    let mut idx = index();
    for (seq, id, f) in [(0, "a", 1), (0, "b", 2), (1, "a", 1), (1, "b", 2)] {
        let ev = stored(f, seq as usize, seq as usize + 1, StorageTier::Device);
        assert_eq!(
            idx.apply(&w(id), 1, seq, &ev).unwrap(),
            ApplyOutcome::Applied
        );
    }
    assert_eq!(device(&idx, "a", &hashes(1, 2)), 2);
    assert_eq!(device(&idx, "b", &hashes(2, 2)), 2);
    assert_eq!(device(&idx, "b", &hashes(1, 2)), 0);
    // The last event's worker goes: its id comes back as a new worker, from seq 0.
    assert!(idx.remove_worker(&w("b")));
    let out = idx.apply(&w("b"), 1, 0, &KvEvent::Cleared).unwrap();
    assert_eq!(out, ApplyOutcome::Applied);
    assert_eq!(idx.worker_entries(&w("b")), 0);
    assert_eq!(idx.worker_entries(&w("a")), 2);
}

#[test]
fn invalid_events_are_refused_and_change_nothing() {
    let mut idx = index();
    let a = w("a");
    idx.apply(&a, 1, 0, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    let before = idx.dump();
    let KvEvent::Stored {
        parent,
        mut blocks,
        tier,
    } = stored(1, 2, 4, StorageTier::Device)
    else {
        unreachable!()
    };
    blocks[1].tokens[0] ^= 1;
    let forged = KvEvent::Stored {
        parent,
        blocks: blocks.clone(),
        tier,
    };
    assert!(matches!(
        idx.apply(&a, 1, 1, &forged),
        Err(IndexError::InvalidEvent(_))
    ));
    blocks[1].tokens.pop();
    let partial = KvEvent::Stored {
        parent,
        blocks,
        tier,
    };
    assert!(matches!(
        idx.apply(&a, 1, 1, &partial),
        Err(IndexError::InvalidEvent(_))
    ));
    // A new worker is not even registered by an invalid event.
    assert!(idx.apply(&w("z"), 1, 0, &partial).is_err());
    assert_eq!(idx.dump(), before);
    // Seq 1 is still the one expected.
    assert_eq!(
        idx.apply(&a, 1, 1, &KvEvent::Cleared),
        Ok(ApplyOutcome::Applied)
    );
}

#[test]
fn partial_blocks_are_refused_without_hash_verification() {
    let mut cfg = IndexConfig::new(bs());
    cfg.verify_hashes = false;
    let mut idx = PrefixIndex::new(cfg);
    let ev = KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            hash: BlockHash(9),
            tokens: vec![1, 2, 3],
        }],
        tier: StorageTier::Device,
    };
    assert!(idx.apply(&w("a"), 1, 0, &ev).is_err());
}

#[test]
fn memory_is_bounded_by_evicting_the_oldest_pairs() {
    let mut cfg = IndexConfig::new(bs());
    cfg.max_entries = 10;
    let mut idx = PrefixIndex::new(cfg);
    let (a, b) = (w("a"), w("b"));
    idx.apply(&b, 1, 0, &stored(9, 0, 3, StorageTier::Device))
        .unwrap();
    idx.apply(&a, 1, 0, &stored(1, 0, 7, StorageTier::Device))
        .unwrap();
    assert_eq!(idx.stats().entries, 10);
    // "a" holds more than its fair share (5): its own oldest blocks go, "b" keeps its 3.
    idx.apply(&a, 1, 1, &stored(2, 0, 4, StorageTier::Device))
        .unwrap();
    let stats = idx.stats();
    assert_eq!(stats.entries, 10);
    assert_eq!(stats.evicted_entries, 4);
    assert_eq!(idx.worker_entries(&b), 3);
    assert_eq!(idx.worker_entries(&a), 7);
    // Oldest first, and a chain's tail before its head: blocks 6..3 of family 1 went, so its
    // first 3 blocks still count, as one run...
    assert_eq!(device(&idx, "a", &hashes(1, 7)), 3);
    assert_eq!(runs(&idx, "a"), 2);
    // ...while the newest blocks are intact.
    assert_eq!(device(&idx, "a", &hashes(2, 4)), 4);
    // "b" storing under its fair share evicts from the largest worker, "a".
    idx.apply(&b, 1, 1, &stored(8, 0, 2, StorageTier::Device))
        .unwrap();
    assert_eq!(idx.worker_entries(&b), 5);
    assert_eq!(idx.worker_entries(&a), 5);
    assert_eq!(idx.stats().entries, 10);
}

#[test]
fn removal_churn_keeps_the_eviction_queue_bounded() {
    let mut idx = index();
    let a = w("a");
    let mut seq = 0;
    for round in 0..200u32 {
        idx.apply(&a, 1, seq, &stored(round, 0, 8, StorageTier::Device))
            .unwrap();
        seq += 1;
        let blocks = hashes(round, 8);
        idx.apply(
            &a,
            1,
            seq,
            &KvEvent::Removed {
                blocks,
                tier: StorageTier::Device,
            },
        )
        .unwrap();
        seq += 1;
    }
    let state = idx.workers[0].as_ref().unwrap();
    assert_eq!(state.live, 0);
    assert_eq!(runs(&idx, "a"), 0);
    let queued = idx.runs.queue_len(0);
    assert!(queued <= 64 + 8, "eviction queue len {queued}");
}

#[test]
fn dump_is_sorted_and_readable() {
    let mut idx = index();
    idx.apply(&w("b"), 1, 0, &stored(1, 0, 1, StorageTier::Host))
        .unwrap();
    idx.apply(&w("a"), 2, 0, &stored(1, 0, 1, StorageTier::Device))
        .unwrap();
    let h = hashes(1, 1)[0];
    let expected = format!(
        "worker a incarnation=2 next_seq=1 blocks=1\n  {h} device\nworker b incarnation=1 next_seq=1 blocks=1\n  {h} host\n"
    );
    assert_eq!(idx.dump(), expected);
}

/// The worker's runs, all tiers.
fn runs(idx: &PrefixIndex, worker: &str) -> usize {
    idx.worker_key(&w(worker)).map_or(0, |k| {
        StorageTier::ALL
            .into_iter()
            .map(|t| idx.runs.runs_in(super::set_of(k.0, t)))
            .sum()
    })
}

fn removed(blocks: Vec<BlockHash>) -> KvEvent {
    KvEvent::Removed {
        blocks,
        tier: StorageTier::Device,
    }
}

fn snapshot(h: &[BlockHash], picks: &[usize]) -> Vec<SnapshotBlock> {
    picks
        .iter()
        .map(|&i| SnapshotBlock {
            hash: h[i],
            parent: i.checked_sub(1).map(|p| h[p]),
            tier: StorageTier::Device,
        })
        .collect()
}

#[test]
fn a_sequence_is_one_run_extended_and_shortened_in_place() {
    let mut idx = index();
    let h = hashes(1, 8);
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 4, StorageTier::Device))
        .unwrap();
    // The next blocks, under the last one: the same run, longer.
    idx.apply(&w("a"), 1, 1, &stored(1, 4, 8, StorageTier::Device))
        .unwrap();
    assert_eq!(runs(&idx, "a"), 1);
    assert_eq!(device(&idx, "a", &h), 8);
    // Head first or tail first, a suffix removed in one event shortens the run.
    idx.apply(&w("a"), 1, 2, &removed(h[6..].to_vec())).unwrap();
    assert_eq!((runs(&idx, "a"), device(&idx, "a", &h)), (1, 6));
    let mut tail_first = h[4..6].to_vec();
    tail_first.reverse();
    idx.apply(&w("a"), 1, 3, &removed(tail_first)).unwrap();
    assert_eq!((runs(&idx, "a"), device(&idx, "a", &h)), (1, 4));
    // Stored again from the start: the held blocks are not stored twice.
    idx.apply(&w("a"), 1, 4, &stored(1, 0, 8, StorageTier::Device))
        .unwrap();
    assert_eq!(runs(&idx, "a"), 1);
    assert_eq!(idx.worker_entries(&w("a")), 8);
    assert_eq!(device(&idx, "a", &h), 8);
}

#[test]
fn removals_in_any_order_leave_exactly_what_is_held() {
    // 80 blocks; the last `len` removed in a scrambled order; then `len` blocks from one before
    // them, the last block left behind (a hole), and the hole filled again.
    let h = hashes(2, 80);
    for (len, stride) in [(8usize, 3usize), (20, 7), (60, 7), (79, 13)] {
        let mut idx = index();
        idx.apply(&w("a"), 1, 0, &stored(2, 0, 80, StorageTier::Device))
            .unwrap();
        let tail = &h[80 - len..];
        let scrambled: Vec<BlockHash> = (0..len).map(|i| tail[(i * stride) % len]).collect();
        assert_eq!(
            scrambled
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            len
        );
        idx.apply(&w("a"), 1, 1, &removed(scrambled)).unwrap();
        assert_eq!(device(&idx, "a", &h), (80 - len) as u32);
        assert_eq!(idx.worker_entries(&w("a")), 80 - len);
        assert_eq!(runs(&idx, "a"), 1, "suffix of {len} removed");
        // A hole: the blocks after it are still held, but not as a prefix.
        let mut idx = index();
        idx.apply(&w("a"), 1, 0, &stored(2, 0, 80, StorageTier::Device))
            .unwrap();
        let holed: Vec<BlockHash> = (0..len)
            .map(|i| h[80 - len - 1 + (i * stride) % len])
            .collect();
        idx.apply(&w("a"), 1, 1, &removed(holed)).unwrap();
        assert_eq!(device(&idx, "a", &h), (80 - len - 1) as u32);
        assert_eq!(idx.worker_entries(&w("a")), 80 - len);
        // The hole filled again: the whole prompt is held.
        idx.apply(
            &w("a"),
            1,
            2,
            &stored(2, 80 - len - 1, 80 - len, StorageTier::Device),
        )
        .unwrap();
        assert_eq!(device(&idx, "a", &h), (80 - len) as u32);
    }
}

#[test]
fn a_hole_and_an_orphan_are_answered_exactly() {
    let mut idx = index();
    let h = hashes(1, 8);
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 8, StorageTier::Device))
        .unwrap();
    idx.apply(&w("a"), 1, 1, &removed(vec![h[3]])).unwrap();
    assert_eq!(device(&idx, "a", &h), 3);
    assert_eq!(runs(&idx, "a"), 2);
    // The hole filled: the blocks after it count again.
    idx.apply(&w("a"), 1, 2, &stored(1, 3, 4, StorageTier::Device))
        .unwrap();
    assert_eq!(device(&idx, "a", &h), 8);
    idx.apply(&w("a"), 1, 3, &KvEvent::Cleared).unwrap();
    assert_eq!(runs(&idx, "a"), 0);
    // A chain stored under a parent the worker does not hold is not reached...
    idx.apply(&w("a"), 1, 4, &stored(1, 4, 8, StorageTier::Device))
        .unwrap();
    assert_eq!(device(&idx, "a", &h), 0);
    // ...until the parent's chain arrives.
    idx.apply(&w("a"), 1, 5, &stored(1, 0, 4, StorageTier::Device))
        .unwrap();
    assert_eq!(device(&idx, "a", &h), 8);
    // Stored again from the middle, past what is held: nothing twice, the rest appended.
    idx.apply(&w("a"), 1, 6, &stored(1, 2, 8, StorageTier::Device))
        .unwrap();
    assert_eq!(idx.worker_entries(&w("a")), 8);
    assert_eq!(device(&idx, "a", &h), 8);
}

#[test]
fn snapshots_in_any_order_become_runs() {
    let mut idx = index();
    let h = hashes(1, 8);
    // Children before parents: one run all the same.
    idx.apply_snapshot(&w("a"), 1, 0, &snapshot(&h, &[5, 4, 3, 2, 1, 0]))
        .unwrap();
    assert_eq!(device(&idx, "a", &h), 6);
    assert_eq!(runs(&idx, "a"), 1);
    // A hole: exact.
    idx.apply_snapshot(&w("b"), 1, 0, &snapshot(&h, &[0, 1, 3, 4]))
        .unwrap();
    assert_eq!(device(&idx, "b", &h), 2);
    assert_eq!(device(&idx, "a", &h), 6);
    // A snapshot replaces what was there.
    idx.apply_snapshot(&w("b"), 1, 0, &snapshot(&h, &[0, 1, 2]))
        .unwrap();
    assert_eq!(device(&idx, "b", &h), 3);
    assert_eq!(idx.worker_entries(&w("b")), 3);
    // Without parents (engines that do not know them): every block alone, still exact.
    let orphans: Vec<SnapshotBlock> = h[..5]
        .iter()
        .rev()
        .map(|&hash| SnapshotBlock {
            hash,
            parent: None,
            tier: StorageTier::Device,
        })
        .collect();
    idx.apply_snapshot(&w("c"), 1, 0, &orphans).unwrap();
    assert_eq!(device(&idx, "c", &h), 5);
}

#[test]
fn copies_in_other_tiers_count_once_and_are_walked() {
    let mut idx = index();
    let h = hashes(1, 6);
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 4, StorageTier::Device))
        .unwrap();
    // Host holds the first three and the continuation the device lacks.
    idx.apply(&w("a"), 1, 1, &stored(1, 0, 6, StorageTier::Host))
        .unwrap();
    assert_eq!(idx.worker_entries(&w("a")), 6);
    let key = idx.worker_key(&w("a")).unwrap();
    let o = idx.overlap(&h).get(key);
    assert_eq!((o.device, o.device_or_host, o.any_tier), (4, 6, 6));
    // The device copy of block 1 goes: the device prefix stops at 1, host still holds all.
    idx.apply(&w("a"), 1, 2, &removed(vec![h[1]])).unwrap();
    let o = idx.overlap(&h).get(key);
    assert_eq!((o.device, o.device_or_host), (1, 6));
    assert_eq!(idx.worker_entries(&w("a")), 6);
    // The host copies go: the pairs go with their last tier.
    idx.apply(
        &w("a"),
        1,
        3,
        &KvEvent::Removed {
            blocks: h.to_vec(),
            tier: StorageTier::Host,
        },
    )
    .unwrap();
    assert_eq!(idx.worker_entries(&w("a")), 3);
    assert_eq!(idx.overlap(&h).get(key), TierOverlap::uniform(1));
}

#[test]
fn many_workers_at_many_depths() {
    let n = 40;
    let h = hashes(1, n);
    let mut idx = index();
    for i in 1..=n {
        idx.apply(
            &w(&format!("w{i:02}")),
            1,
            0,
            &stored(1, 0, i, StorageTier::Device),
        )
        .unwrap();
    }
    for i in 1..=n {
        assert_eq!(device(&idx, &format!("w{i:02}"), &h), i as u32);
    }
    // One worker branching off the prompt: the others' answers stand.
    idx.apply(&w("w07"), 1, 1, &stored(2, 3, 5, StorageTier::Device))
        .unwrap();
    for p in [1usize, 2, 3, 17, 39] {
        let short = &h[..p];
        let scores = idx.overlap(short);
        for i in 1..=n {
            let key = idx.worker_key(&w(&format!("w{i:02}"))).unwrap();
            assert_eq!(scores.get(key).any_tier, i.min(p) as u32);
        }
    }
}

/// Found while seeding the `proto_conversions` fuzz target (fuzz/regressions/proto_conversions/):
/// a worker announcing the last sequence number made the index overflow; now the event applies
/// and the worker's blocks come from a snapshot after it.
#[test]
fn the_last_sequence_number_applies_then_needs_a_snapshot() {
    let mut idx = index();
    let a = w("a");
    idx.apply_snapshot(&a, 1, u64::MAX, &[]).unwrap();
    let outcome = idx
        .apply(&a, 1, u64::MAX, &stored(1, 0, 2, StorageTier::Device))
        .unwrap();
    assert_eq!(outcome, ApplyOutcome::Applied);
    assert_eq!(device(&idx, "a", &hashes(1, 2)), 2);
    let next = idx.apply(&a, 1, 0, &KvEvent::Cleared).unwrap();
    assert!(
        matches!(next, ApplyOutcome::ResyncNeeded { expected: None, .. }),
        "{next:?}"
    );
}

/// A branch whose parent goes before it (engines may evict a shared parent before a child of
/// another request), then the parent and the branch are stored again as one chain: the branch's
/// block is held once, counted once, and goes with one removal.
#[test]
fn a_branch_outliving_its_parent_is_found_when_the_parent_returns() {
    let mut idx = index();
    let a = w("a");
    let main = hashes(1, 3);
    let toks: Vec<u32> = tokens(1, 2).into_iter().chain(500..504).collect();
    let branch = block_hashes(&toks, bs());
    assert_eq!(branch[..2], main[..2]);
    let h = branch[2];
    let store = |parent: Option<BlockHash>, blocks: &[(BlockHash, &[u32])]| KvEvent::Stored {
        parent,
        blocks: blocks
            .iter()
            .map(|(hash, t)| StoredBlock {
                hash: *hash,
                tokens: t.to_vec(),
            })
            .collect(),
        tier: StorageTier::Device,
    };
    let removed = |b: BlockHash| KvEvent::Removed {
        blocks: vec![b],
        tier: StorageTier::Device,
    };
    idx.apply(&a, 1, 0, &stored(1, 0, 3, StorageTier::Device))
        .unwrap();
    idx.apply(&a, 1, 1, &store(Some(main[1]), &[(h, &toks[8..12])]))
        .unwrap();
    idx.apply(&a, 1, 2, &removed(main[2])).unwrap();
    idx.apply(&a, 1, 3, &removed(main[1])).unwrap();
    assert_eq!(idx.worker_entries(&a), 2);
    assert_eq!(device(&idx, "a", &branch), 1);
    idx.apply(
        &a,
        1,
        4,
        &store(Some(main[0]), &[(main[1], &toks[4..8]), (h, &toks[8..12])]),
    )
    .unwrap();
    assert_eq!(idx.worker_entries(&a), 3, "the branch's block is held once");
    assert_eq!(device(&idx, "a", &branch), 3);
    idx.apply(&a, 1, 5, &removed(h)).unwrap();
    assert_eq!(idx.worker_entries(&a), 2);
    assert_eq!(device(&idx, "a", &branch), 2, "one removal drops the block");
}

/// Many workers stop where the prompt leaves their first run and many runs start at the next
/// block (the query sorts the stopped workers once instead of reading them for each run): each
/// worker carries on only along its own run.
#[test]
fn many_workers_carry_on_from_the_same_position() {
    let mut idx = index();
    let h = hashes(1, 8);
    for i in 0..12 {
        let name = format!("w{i}");
        // The second half first (its parent not held yet: a run of its own), for most workers.
        let mut seq = 0;
        if i % 4 != 0 {
            idx.apply(&w(&name), 1, seq, &stored(1, 4, 8, StorageTier::Device))
                .unwrap();
            seq += 1;
        }
        idx.apply(&w(&name), 1, seq, &stored(1, 0, 4, StorageTier::Device))
            .unwrap();
    }
    // And a worker holding only the second half.
    idx.apply(&w("tail"), 1, 0, &stored(1, 4, 8, StorageTier::Device))
        .unwrap();
    for i in 0..12 {
        let want = if i % 4 != 0 { 8 } else { 4 };
        assert_eq!(device(&idx, &format!("w{i}"), &h), want, "worker {i}");
    }
    assert_eq!(device(&idx, "tail", &h), 0);
}

#[test]
fn a_run_is_matched_exactly_whatever_the_guess() {
    // Runs and prompts sharing 0..n leading blocks (chained: equal up to a count, then
    // different), short and long enough to be bisected; every guess, right or wrong, in range
    // or not, gives the count read block by block.
    for run_len in [1, 2, 3, 31, 33, 34, 70, 200] {
        for prompt_len in [1, 2, 5, 33, 40, 120, 300] {
            for shared in [1, 2, 3, 17, 32, 33, 34, 69, 150, 300] {
                let mut prompt = hashes(1, prompt_len);
                let mut blocks = prompt.clone();
                blocks.truncate(shared.min(prompt_len));
                blocks.extend(hashes(2, run_len + prompt_len)[blocks.len()..].iter());
                blocks.truncate(run_len);
                prompt.truncate(prompt_len);
                let run = runs::Run { set: 0, blocks };
                let want = run
                    .blocks
                    .iter()
                    .zip(&prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                assert_eq!(run.matched(&prompt), want);
                for guess in 0..run_len.max(prompt_len) + 3 {
                    assert_eq!(
                        run.matched_near(&prompt, guess),
                        want,
                        "run {run_len}, prompt {prompt_len}, shared {shared}, guess {guess}"
                    );
                }
            }
        }
    }
}

/// Tokens of block `i` of chain `c`: the chains share their first blocks (chain 3 only its
/// first three, the others six) and part after them.
fn chain_tokens(c: u32, n: usize) -> Vec<u32> {
    let shared = if c == 3 { 3 } else { 6 };
    (0..n)
        .flat_map(|i| {
            let f = if i < shared { 0 } else { c + 1 };
            (0..4).map(move |t| f * 10_000 + i as u32 * 4 + t)
        })
        .collect()
}

#[derive(Debug, Clone)]
enum FamilyStep {
    Store {
        worker: usize,
        chain: u32,
        from: usize,
        to: usize,
    },
    Remove {
        worker: usize,
        chain: u32,
        from: usize,
        to: usize,
        tail_first: bool,
    },
    Drop {
        worker: usize,
    },
}

/// Workers in `families_follow_their_runs`: more than a family needs to keep figures.
const WORKERS: usize = runs::KEEP_FIGURES + 2;

fn family_step() -> impl proptest::strategy::Strategy<Value = FamilyStep> {
    use proptest::prelude::*;
    prop_oneof![
        // From the first block half the time: the family there reaches the size at which it
        // keeps figures.
        5 => (0..WORKERS, 0..4u32, prop_oneof![Just(0usize), 0..14usize], 1..8usize).prop_map(
            |(worker, chain, from, n)| FamilyStep::Store {
                worker,
                chain,
                from,
                to: (from + n).min(16),
            }
        ),
        3 => (0..WORKERS, 0..4u32, 0..16usize, 1..6usize, any::<bool>()).prop_map(
            |(worker, chain, from, n, tail_first)| FamilyStep::Remove {
                worker,
                chain,
                from,
                to: (from + n).min(16),
                tail_first,
            }
        ),
        1 => (0..WORKERS).prop_map(|worker| FamilyStep::Drop { worker }),
    ]
}

proptest::proptest! {
    /// Workers storing, evicting and dropping chains that share their first blocks: after
    /// every step each family keeping figures has the right ones (how far each member runs
    /// along its leader, and its next block), and every worker's overlap with every chain and its
    /// prefixes is the leading blocks it holds.
    #[test]
    fn families_follow_their_runs(steps in proptest::collection::vec(family_step(), 1..80)) {
        let chains: Vec<Vec<BlockHash>> =
            (0..4).map(|c| block_hashes(&chain_tokens(c, 16), bs())).collect();
        let mut idx = index();
        let mut held: Vec<std::collections::BTreeSet<BlockHash>> =
            vec![Default::default(); WORKERS];
        let mut seqs = [0u64; WORKERS];
        let mut incs = [1u64; WORKERS];
        for step in steps {
            match step {
                FamilyStep::Store { worker, chain, from, to } => {
                    let h = &chains[chain as usize];
                    let ev = stored_tokens(&chain_tokens(chain, to), from, StorageTier::Device);
                    idx.apply(&w(&format!("w{worker}")), incs[worker], seqs[worker], &ev)
                        .unwrap();
                    seqs[worker] += 1;
                    held[worker].extend(&h[from..to]);
                }
                FamilyStep::Remove { worker, chain, from, to, tail_first } => {
                    let mut blocks = chains[chain as usize][from..to].to_vec();
                    if tail_first {
                        blocks.reverse();
                    }
                    for b in &blocks {
                        held[worker].remove(b);
                    }
                    idx.apply(&w(&format!("w{worker}")), incs[worker], seqs[worker], &removed(blocks))
                        .unwrap();
                    seqs[worker] += 1;
                }
                FamilyStep::Drop { worker } => {
                    idx.remove_worker(&w(&format!("w{worker}")));
                    held[worker].clear();
                    seqs[worker] = 0;
                    incs[worker] += 1;
                }
            }
            idx.runs.check_families();
            for h in &chains {
                for len in [1, 4, 6, 7, 16] {
                    let prompt = &h[..len];
                    for (i, blocks) in held.iter().enumerate() {
                        let want = prompt.iter().take_while(|b| blocks.contains(b)).count();
                        proptest::prop_assert_eq!(
                            device(&idx, &format!("w{i}"), prompt) as usize,
                            want,
                            "worker {} prompt {:?}",
                            i,
                            len
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stats_count_each_block_once_however_many_workers_and_tiers_hold_it() {
    let mut idx = index();
    // a: blocks 0..6 of family 1 on the device, 0..3 again in host memory; b: 0..4 of family 1
    // and 0..2 of family 2; c: nothing left after its blocks are removed.
    idx.apply(&w("a"), 1, 0, &stored(1, 0, 6, StorageTier::Device))
        .unwrap();
    idx.apply(&w("a"), 1, 1, &stored(1, 0, 3, StorageTier::Host))
        .unwrap();
    idx.apply(&w("b"), 1, 0, &stored(1, 0, 4, StorageTier::Device))
        .unwrap();
    idx.apply(&w("b"), 1, 1, &stored(2, 0, 2, StorageTier::Device))
        .unwrap();
    idx.apply(&w("c"), 1, 0, &stored(3, 0, 5, StorageTier::Device))
        .unwrap();
    idx.apply(
        &w("c"),
        1,
        1,
        &KvEvent::Removed {
            blocks: hashes(3, 5),
            tier: StorageTier::Device,
        },
    )
    .unwrap();
    let draft = idx.stats_draft();
    let stats = draft.clone().finish();
    assert_eq!(stats.blocks, 6 + 2, "distinct blocks");
    assert_eq!(stats.entries, 6 + 4 + 2, "(block, worker) pairs");
    assert_eq!(stats.workers, 3);
    assert_eq!(stats, idx.stats());
    // The draft is a copy: the index changing afterwards leaves its count alone.
    idx.apply(&w("b"), 1, 2, &stored(4, 0, 3, StorageTier::Device))
        .unwrap();
    assert_eq!(draft.finish().blocks, 8);
    assert_eq!(idx.stats().blocks, 11);
}

/// Many workers holding one prompt's prefix to different lengths, some carried on by a run
/// starting where their prefix stops, some with a gap there: every count exact, whether the
/// stops are counted into order (many workers) or sorted (a few), and the deepest-first answer
/// is the ordered one, deepest first.
#[test]
fn many_holders_stopping_at_many_places_are_each_counted() {
    for workers in [300usize, 20] {
        let mut idx = index();
        let h = hashes(1, 12);
        let mut expected = Vec::new();
        for i in 0..workers {
            let name = format!("w{i}");
            let first = 1 + (i * 7) % 11;
            let prefix = stored(1, 0, first, StorageTier::Device);
            let reach = match i % 3 {
                // Its continuation stored first (under a block it did not hold yet): a run of
                // its own, starting where the prefix stops, that carries the worker on.
                0 => {
                    let to = (first + 1 + i % 5).min(12);
                    let rest = stored(1, first, to, StorageTier::Device);
                    idx.apply(&w(&name), 1, 0, &rest).unwrap();
                    idx.apply(&w(&name), 1, 1, &prefix).unwrap();
                    to
                }
                // A gap of one block: the run after it does not count.
                1 if first + 2 < 12 => {
                    idx.apply(&w(&name), 1, 0, &prefix).unwrap();
                    let rest = stored(1, first + 1, 12, StorageTier::Device);
                    idx.apply(&w(&name), 1, 1, &rest).unwrap();
                    first
                }
                _ => {
                    idx.apply(&w(&name), 1, 0, &prefix).unwrap();
                    first
                }
            };
            expected.push((name, reach as u32));
        }
        let scores = idx.overlap(&h);
        assert_eq!(scores.len(), workers);
        for (name, reach) in &expected {
            assert_eq!(device(&idx, name, &h), *reach, "{name} of {workers}");
        }
        let mut deepest_first = idx.overlap_deepest_first(&h);
        assert!(
            (deepest_first.windows(2)).all(|p| p[0].1.any_tier >= p[1].1.any_tier),
            "deepest first"
        );
        deepest_first.sort_unstable_by_key(|(k, _)| *k);
        assert_eq!(deepest_first, scores.iter().collect::<Vec<_>>());
    }
}

/// Forty workers holding one prompt's prefix to forty lengths (a family keeping figures, its
/// members listed by how much they share), one more stopping shallow along the family but
/// carried on by a run of its own past all of them, and, in a second round, one holding a
/// longer prefix in two tiers (walked): a caller stopping early is handed the deepest, deepest
/// first, and the whole answer is deepest first.
#[test]
fn a_caller_stopping_early_is_handed_the_deepest() {
    use std::ops::ControlFlow;
    let h = hashes(1, 48);
    for mixed in [false, true] {
        let mut idx = index();
        for d in 1..=40 {
            idx.apply(
                &w(&format!("w{d}")),
                1,
                0,
                &stored(1, 0, d, StorageTier::Device),
            )
            .unwrap();
        }
        // Blocks 3..45 first (a run of their own, its parent not held), then 0..3.
        idx.apply(&w("carried"), 1, 0, &stored(1, 3, 45, StorageTier::Device))
            .unwrap();
        idx.apply(&w("carried"), 1, 1, &stored(1, 0, 3, StorageTier::Device))
            .unwrap();
        if mixed {
            idx.apply(&w("mixed"), 1, 0, &stored(1, 0, 42, StorageTier::Device))
                .unwrap();
            idx.apply(&w("mixed"), 1, 1, &stored(1, 0, 10, StorageTier::Host))
                .unwrap();
        }
        idx.runs.check_families();
        let key = |name: &str| idx.worker_key(&w(name)).unwrap();
        let mut want = vec![(key("carried"), 45)];
        if mixed {
            want.push((key("mixed"), 42));
        }
        want.extend([(key("w40"), 40), (key("w39"), 39), (key("w38"), 38)]);
        want.truncate(4);
        let mut handed = Vec::new();
        let flow = idx.overlap_deepest_first_while(&h, |k, o| {
            handed.push((k, o.any_tier));
            if handed.len() == 4 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(flow, ControlFlow::Break(()));
        assert_eq!(handed, want, "mixed: {mixed}");
        let all = idx.overlap_deepest_first(&h);
        assert_eq!(all.len(), 41 + usize::from(mixed));
        assert!(
            (all.windows(2)).all(|p| p[0].1.any_tier >= p[1].1.any_tier),
            "deepest first"
        );
        assert_eq!(device(&idx, "w3", &h), 3);
    }
}

/// The length of the run leading the family at `head`.
fn leader(idx: &PrefixIndex, head: BlockHash) -> usize {
    let list = idx.runs.heads.get(&head).expect("a family").as_slice();
    idx.runs.runs[list[0].run as usize].blocks.len()
}

/// Workers holding one chain's prefix to many lengths, joining in any order and growing: once
/// the family keeps figures, the longest leads (a query matching it settles every other from
/// its figures); when the leader goes, the member reaching furthest takes over.
#[test]
fn the_member_reaching_furthest_leads() {
    let h = hashes(1, 16);
    let mut idx = index();
    let lengths = [3usize, 1, 7, 2, 5, 4, 6, 9, 8, 12, 10];
    for (i, &n) in lengths.iter().enumerate() {
        idx.apply(
            &w(&format!("w{i}")),
            1,
            0,
            &stored(1, 0, n, StorageTier::Device),
        )
        .unwrap();
        idx.runs.check_families();
        if i + 1 >= runs::KEEP_FIGURES {
            assert_eq!(
                leader(&idx, h[0]),
                lengths[..=i].iter().copied().max().unwrap()
            );
        }
    }
    // A member grows past the leader, then the leader goes.
    idx.apply(&w("w1"), 1, 1, &stored(1, 1, 14, StorageTier::Device))
        .unwrap();
    assert_eq!(leader(&idx, h[0]), 14);
    assert!(idx.remove_worker(&w("w1")));
    idx.runs.check_families();
    assert_eq!(leader(&idx, h[0]), 12);
    for (i, &n) in lengths.iter().enumerate().filter(|&(i, _)| i != 1) {
        assert_eq!(device(&idx, &format!("w{i}"), &h) as usize, n);
    }
}

/// A leader that goes hands the family to a member sharing most with it; a member sharing as
/// much and holding all the new leader's blocks and more then leads in turn, in either order of
/// the two in the family.
#[test]
fn a_hand_over_ends_with_the_member_reaching_furthest() {
    for a_first in [false, true] {
        let x = block_hashes(&chain_tokens(0, 16), bs());
        let mut idx = index();
        let store = |idx: &mut PrefixIndex, name: &str, chain: u32, n: usize| {
            let ev = stored_tokens(&chain_tokens(chain, n), 0, StorageTier::Device);
            idx.apply(&w(name), 1, 0, &ev).unwrap();
        };
        store(&mut idx, "lead", 0, 10);
        // N and A part from the leader after 6 blocks, the same way; A goes further.
        let (first, second) = if a_first {
            (("a", 12), ("n", 9))
        } else {
            (("n", 9), ("a", 12))
        };
        store(&mut idx, first.0, 1, first.1);
        store(&mut idx, second.0, 1, second.1);
        for k in 1..=6 {
            store(&mut idx, &format!("f{k}"), 0, k);
        }
        idx.runs.check_families();
        assert_eq!(leader(&idx, x[0]), 10);
        assert!(idx.remove_worker(&w("lead")));
        idx.runs.check_families();
        assert_eq!(leader(&idx, x[0]), 12, "a first: {a_first}");
    }
}
