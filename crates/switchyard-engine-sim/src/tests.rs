//! Behaviour of the whole simulator, checked through its public API.

use switchyard_core::{BlockHash, KvEvent, StorageTier, block_hashes};

use crate::testutil::{Driver, bs, req, tiny};
use crate::{FinishReason, SimConfig, SimError, SimRequest, Simulator};

fn range(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

#[test]
fn a_repeated_prefix_is_a_cache_hit() {
    let mut d = Driver::new(tiny(16, 1024));
    d.add(req(1, range(0, 256), 4));
    d.run(100);
    assert_eq!(d.outputs[&1][0].1.cached_prompt_tokens, 0);
    let cold_ttft = d.ttft(1);
    let cold_prefill: usize = d.steps.iter().map(|s| s.prefill_tokens).sum();
    assert_eq!(cold_prefill, 256);

    // Same first 15 blocks, different last block.
    let mut prompt = range(0, 240);
    prompt.extend(range(5000, 16));
    let start = d.now;
    let first_step = d.steps.len();
    d.add(req(2, prompt, 4));
    d.run(100);
    let first = &d.outputs[&2][0].1;
    assert_eq!(first.cached_prompt_tokens, 240);
    assert_eq!(first.prompt_tokens, 256);
    let warm_prefill: usize = d.steps[first_step..].iter().map(|s| s.prefill_tokens).sum();
    assert_eq!(warm_prefill, 16);
    assert!(d.ttft(2) - start < cold_ttft);

    // The hit took a reference: no Stored for the 15 shared blocks, one for the new block.
    let stored: usize = d.steps[first_step..]
        .iter()
        .flat_map(|s| &s.events)
        .filter(|e| matches!(e, KvEvent::Stored { .. }))
        .map(KvEvent::block_count)
        .sum();
    assert_eq!(stored, 1);

    let load = d.sim.load();
    assert_eq!(load.cached_prompt_tokens_total, 240);
    assert_eq!(load.prompt_tokens_total, 512);
}

#[test]
fn a_fully_cached_prompt_recomputes_its_last_block() {
    // As vLLM: logits need at least one computed token and computation is block aligned.
    let mut d = Driver::new(tiny(16, 64));
    d.add(req(1, range(0, 64), 1));
    d.run(10);
    d.add(req(2, range(0, 64), 1));
    let out = d.step().clone();
    assert_eq!(out.prefill_tokens, 16);
    assert_eq!(out.outputs[0].cached_prompt_tokens, 48);
    // The recomputed block is a twin of the cached one: not announced again.
    assert!(out.events.is_empty());
    d.run(10);
}

#[test]
fn eviction_removes_exactly_the_lru_victims() {
    let size = bs(4);
    let mut d = Driver::new(tiny(4, 4));
    let (a, b, c) = (range(0, 8), range(100, 8), range(200, 8));
    let (ha, hb, hc) = (
        block_hashes(&a, size),
        block_hashes(&b, size),
        block_hashes(&c, size),
    );
    d.add(req(1, a, 1));
    d.run(10);
    d.add(req(2, b, 1));
    d.run(10);
    assert_eq!(d.sim.load().used_blocks, 4);
    assert_eq!(d.sim.load().active_blocks, 0);
    d.add(req(3, c, 1));
    d.step();
    let removed: Vec<&KvEvent> = d.steps[2]
        .events
        .iter()
        .filter(|e| matches!(e, KvEvent::Removed { .. }))
        .collect();
    // A finished first, so its blocks are the oldest; its tail goes before its head.
    assert_eq!(
        removed,
        vec![&KvEvent::Removed {
            blocks: vec![ha[1], ha[0]],
            tier: StorageTier::Device
        }]
    );
    let cached: Vec<BlockHash> = d.sim.cached_blocks().iter().map(|b| b.hash).collect();
    assert!(!cached.contains(&ha[0]) && !cached.contains(&ha[1]));
    for h in hb.iter().chain(&hc) {
        assert!(cached.contains(h));
    }
    d.run(10);
}

/// Twelve requests, with their prompt hashes computed by the caller when `hashed`.
fn workload_with(d: &mut Driver, hashed: bool) {
    let size = d.sim.config().block_size;
    for i in 0..12u32 {
        let mut prompt = range(1000 * (i % 3), 40 + 7 * i);
        prompt.push(i);
        d.add(SimRequest {
            max_tokens: 5 + i,
            seed: (i % 2 == 0).then_some(u64::from(i)),
            prompt_hashes: hashed.then(|| block_hashes(&prompt, size)),
            ..SimRequest::new(u64::from(i), prompt, 5 + i)
        });
    }
}

fn workload(d: &mut Driver) {
    workload_with(d, false);
}

#[test]
fn prompt_hashes_from_the_caller_change_nothing_and_a_wrong_count_is_refused() {
    let config = SimConfig {
        max_batched_tokens: 64,
        ..tiny(4, 48)
    };
    let run = |hashed| {
        let mut d = Driver::new(config.clone());
        workload_with(&mut d, hashed);
        d.run(1000);
        d.steps
    };
    assert_eq!(run(true), run(false));
    let mut sim = Simulator::new(config).unwrap();
    let short = SimRequest {
        prompt_hashes: Some(vec![BlockHash(1)]),
        ..req(1, range(0, 9), 2)
    };
    let err = sim.add_request(short).unwrap_err();
    assert_eq!(
        err,
        SimError::PromptHashCount {
            id: 1,
            got: 1,
            expected: 2
        }
    );
    assert!(!sim.has_work(), "a refused request is not queued");
}

#[test]
fn a_seed_makes_runs_identical() {
    let config = SimConfig {
        max_batched_tokens: 64,
        ..tiny(4, 48)
    };
    let run = |config: SimConfig| {
        let mut d = Driver::new(config);
        workload(&mut d);
        d.run(1000);
        d
    };
    let one = run(config.clone());
    let two = run(config.clone());
    assert_eq!(one.steps, two.steps);
    assert!(one.sim.load().preemptions_total > 0, "workload too easy");
    let other = run(SimConfig { seed: 7, ..config });
    assert_ne!(one.tokens_of(3), other.tokens_of(3));
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_others_decode() {
    let mut d = Driver::new(SimConfig {
        max_batched_tokens: 64,
        ..tiny(16, 256)
    });
    d.add(req(1, range(0, 16), 50));
    d.step();
    d.add(req(2, range(500, 300), 3));
    let mut steps_to_first = 0;
    while !d.outputs.contains_key(&2) {
        let out = d.step();
        // The decoding sequence gets its token every step; the prefill takes the rest.
        assert!(out.outputs.iter().any(|o| o.id == 1));
        assert!(out.prefill_tokens <= 63);
        assert_eq!(out.decode_sequences, 1);
        steps_to_first += 1;
    }
    assert_eq!(steps_to_first, 300usize.div_ceil(63));
    // Chunk-completed blocks were announced as they filled, not all at the end.
    let stored_steps = d.steps[1..]
        .iter()
        .filter(|s| s.events.iter().any(|e| matches!(e, KvEvent::Stored { .. })))
        .count();
    assert!(stored_steps >= 4);
    d.run(100);
    assert_eq!(d.tokens_of(1).len(), 50);
}

#[test]
fn preemption_under_a_tiny_cache_still_completes_every_request() {
    let workload = |d: &mut Driver| {
        for i in 0..6u64 {
            d.add(req(i, range(10 * i as u32, 6), 10));
        }
    };
    let mut small = Driver::new(tiny(4, 8));
    workload(&mut small);
    small.run(1000);
    assert!(small.sim.load().preemptions_total > 0);
    let mut big = Driver::new(tiny(4, 1024));
    workload(&mut big);
    big.run(1000);
    assert_eq!(big.sim.load().preemptions_total, 0);
    for i in 0..6u64 {
        let outs = &small.outputs[&i];
        assert_eq!(outs.len(), 10);
        for (n, (_, o)) in outs.iter().enumerate() {
            assert_eq!(o.completion_tokens as usize, n + 1);
            let last = n == 9;
            assert_eq!(o.finish, last.then_some(FinishReason::Length));
        }
        // Recompute resumes where it was: the tokens are those of an unpreempted run.
        assert_eq!(small.tokens_of(i), big.tokens_of(i));
    }
    assert_eq!(small.sim.load().active_blocks, 0);
}

#[test]
fn host_tier_keeps_evicted_blocks_and_copies_hits_back() {
    let size = bs(4);
    let mut d = Driver::new(SimConfig {
        num_host_blocks: 8,
        ..tiny(4, 4)
    });
    let (a, b, c) = (range(0, 8), range(100, 8), range(200, 8));
    let (ha, hb) = (block_hashes(&a, size), block_hashes(&b, size));
    for (id, p) in [(1, a.clone()), (2, b), (3, c)] {
        d.add(req(id, p, 1));
        d.run(10);
    }
    // C evicted A from the device; A fell to host, parent first.
    let events = &d.steps[2].events;
    assert_eq!(
        events[0],
        KvEvent::Removed {
            blocks: vec![ha[1], ha[0]],
            tier: StorageTier::Device
        }
    );
    assert!(
        matches!(&events[1], KvEvent::Stored { parent: None, blocks, tier: StorageTier::Host }
        if blocks.iter().map(|b| b.hash).collect::<Vec<_>>() == vec![ha[0], ha[1]])
    );

    // A again: its first block (the most a full-prompt hit can use) comes back from host.
    let before = d.steps.len();
    d.add(req(4, a, 1));
    d.run(10);
    let out = &d.steps[before];
    assert_eq!(out.outputs[0].cached_prompt_tokens, 4);
    assert_eq!(out.prefill_tokens, 4);
    let device_stored: Vec<(Option<BlockHash>, Vec<BlockHash>)> = out
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored {
                parent,
                blocks,
                tier: StorageTier::Device,
            } => Some((*parent, blocks.iter().map(|b| b.hash).collect())),
            _ => None,
        })
        .collect();
    // The copied block, then the recomputed one, chained in one event.
    assert_eq!(device_stored, vec![(None, vec![ha[0], ha[1]])]);
    // Copy, not move: the host keeps A.
    assert!(!out.events.iter().any(
        |e| matches!(e, KvEvent::Removed { tier: StorageTier::Host, blocks } if blocks.contains(&ha[0]))
    ));
    // B made room and fell to host too.
    assert!(d.model.contains(&(StorageTier::Host, hb[0])));
    assert!(d.model.contains(&(StorageTier::Host, ha[0])));
    assert!(d.model.contains(&(StorageTier::Device, ha[0])));

    // The copy is charged: the same step without the host hit is cheaper per computed token.
    let timing = d.sim.config().timing;
    let cold = timing.prefill_time(8, 0);
    assert!(out.duration < cold);
    assert!(out.duration > timing.prefill_time(8, 4));
}

#[test]
fn host_tier_evicts_its_own_lru() {
    let mut d = Driver::new(SimConfig {
        num_host_blocks: 2,
        ..tiny(4, 2)
    });
    for i in 0..5u32 {
        d.add(req(u64::from(i), range(100 * i, 8), 1));
        d.run(10);
    }
    assert!(d.steps.iter().flat_map(|s| &s.events).any(|e| matches!(
        e,
        KvEvent::Removed {
            tier: StorageTier::Host,
            ..
        }
    )));
    let host = d
        .sim
        .cached_blocks()
        .iter()
        .filter(|b| b.tier == StorageTier::Host)
        .count();
    assert_eq!(host, 2);
}

#[test]
fn invalid_requests_get_distinct_errors() {
    let mut sim = Simulator::new(SimConfig {
        max_context_tokens: 100,
        ..tiny(4, 10)
    })
    .unwrap();
    let e = |sim: &mut Simulator, r| sim.add_request(r).unwrap_err();
    assert_eq!(
        e(&mut sim, req(1, vec![], 5)),
        SimError::EmptyPrompt { id: 1 }
    );
    assert_eq!(
        e(&mut sim, req(1, vec![1], 0)),
        SimError::ZeroMaxTokens { id: 1 }
    );
    assert!(matches!(
        e(&mut sim, req(1, range(0, 90), 11)),
        SimError::ContextTooLong {
            id: 1,
            prompt_tokens: 90,
            max_tokens: 11,
            max_context_tokens: 100
        }
    ));
    assert!(matches!(
        e(&mut sim, req(1, range(0, 41), 1)),
        SimError::ExceedsKvCapacity {
            needed_blocks: 11,
            capacity_blocks: 10,
            ..
        }
    ));
    // Prompt fits, but not with its output: it would preempt itself forever.
    assert!(matches!(
        e(&mut sim, req(1, range(0, 30), 20)),
        SimError::ExceedsKvCapacity { .. }
    ));
    sim.add_request(req(1, range(0, 8), 2)).unwrap();
    assert_eq!(
        e(&mut sim, req(1, range(0, 8), 2)),
        SimError::DuplicateId { id: 1 }
    );
    assert!(
        e(&mut sim, req(1, vec![], 0))
            .to_string()
            .contains("empty prompt")
    );
    // Refused requests left no trace.
    assert_eq!(sim.load().waiting_requests, 1);
    while sim.has_work() {
        sim.step();
    }
    // A finished id can be reused.
    sim.add_request(req(1, range(0, 8), 2)).unwrap();
}

#[test]
fn eos_and_stop_tokens_end_sequences() {
    let config = SimConfig {
        vocab_size: 4,
        eos_token_id: 2,
        ..tiny(4, 64)
    };
    let mut d = Driver::new(config);
    d.add(SimRequest::new(1, range(0, 5), 200));
    d.add(req(2, range(0, 5), 40));
    d.add(SimRequest {
        stop_token_ids: vec![3],
        ignore_eos: true,
        ..SimRequest::new(3, range(0, 5), 200)
    });
    d.run(500);
    let last = |id| d.outputs[&id].last().unwrap().1.clone();
    assert_eq!(last(1).finish, Some(FinishReason::Stop));
    assert_eq!(last(1).token, 2);
    assert!(
        d.tokens_of(1)[..d.tokens_of(1).len() - 1]
            .iter()
            .all(|&t| t != 2)
    );
    assert_eq!(last(2).finish, Some(FinishReason::Length));
    assert_eq!(last(2).completion_tokens, 40);
    assert_eq!(last(3).finish, Some(FinishReason::Stop));
    assert_eq!(last(3).token, 3);
}

#[test]
fn answers_end_like_a_models_at_the_mean_length_with_the_requests_stop_token() {
    let config = SimConfig {
        vocab_size: 32_000,
        mean_output_tokens: 20,
        ..tiny(16, 4096)
    };
    let mut d = Driver::new(config);
    let n = 60u64;
    for id in 0..n {
        d.add(SimRequest {
            stop_token_ids: vec![31_999],
            ..SimRequest::new(id, range(id as u32 * 7, id as u32 * 7 + 5), 400)
        });
    }
    // Ignoring EOS runs to max_tokens whatever the ending rate.
    d.add(SimRequest {
        ignore_eos: true,
        ..SimRequest::new(n, range(0, 5), 50)
    });
    d.run(20_000);
    let mut total = 0;
    for id in 0..n {
        let last = d.outputs[&id].last().unwrap().1.clone();
        assert_eq!(last.finish, Some(FinishReason::Stop), "request {id}");
        assert_eq!(last.token, 31_999, "ended with the request's stop token");
        total += last.completion_tokens;
    }
    let mean = f64::from(total) / n as f64;
    assert!((10.0..40.0).contains(&mean), "mean length {mean}");
    let ignored = d.outputs[&n].last().unwrap().1.clone();
    assert_eq!(ignored.finish, Some(FinishReason::Length));
    assert_eq!(ignored.completion_tokens, 50);
}

#[test]
fn a_scripted_answer_is_generated_exactly_and_ends_with_stop_or_at_max_tokens() {
    let mut d = Driver::new(tiny(4, 64));
    let script = vec![7, 3, 9, 1, 1, 5];
    d.add(SimRequest {
        script: script.clone(),
        ..SimRequest::new(1, range(0, 9), 200)
    });
    d.add(SimRequest {
        script: script.clone(),
        ..SimRequest::new(2, range(0, 9), 4)
    });
    d.run(500);
    assert_eq!(d.tokens_of(1), script, "every token as written");
    assert_eq!(
        d.outputs[&1].last().unwrap().1.finish,
        Some(FinishReason::Stop)
    );
    assert_eq!(d.tokens_of(2), script[..4].to_vec(), "cut at max_tokens");
    assert_eq!(
        d.outputs[&2].last().unwrap().1.finish,
        Some(FinishReason::Length)
    );
}

#[test]
fn held_prefill_keeps_its_blocks_until_released() {
    let size = bs(4);
    let mut d = Driver::new(tiny(4, 6));
    let prompt = range(0, 10);
    let hashes = block_hashes(&prompt, size);
    d.add(SimRequest {
        hold_blocks: true,
        ..SimRequest::new(7, prompt.clone(), 100)
    });
    d.run(10);
    let outs = &d.outputs[&7];
    assert_eq!(outs.len(), 1);
    assert_eq!(outs[0].1.finish, Some(FinishReason::Length));
    let held = d.sim.held_blocks(7).unwrap();
    assert_eq!(held.iter().map(|(h, _)| *h).collect::<Vec<_>>(), hashes);
    assert_eq!(held[1].1, prompt[4..8].to_vec());
    assert_eq!(d.sim.load().active_blocks, 2);
    // The id stays taken while held.
    assert!(d.sim.add_request(req(7, range(0, 4), 1)).is_err());

    // Pressure the cache: the held blocks survive.
    for i in 0..4u32 {
        d.add(req(u64::from(i), range(1000 + 100 * i, 12), 4));
    }
    d.run(100);
    let cached: Vec<BlockHash> = d.sim.cached_blocks().iter().map(|b| b.hash).collect();
    assert!(hashes.iter().all(|h| cached.contains(h)));

    assert!(d.sim.release_hold(7));
    assert!(!d.sim.release_hold(7));
    assert_eq!(d.sim.held_blocks(7), None);
    assert_eq!(d.sim.load().active_blocks, 0);
}

#[test]
fn abort_frees_blocks_but_keeps_them_cached() {
    let mut d = Driver::new(tiny(4, 16));
    d.add(req(1, range(0, 12), 20));
    d.add(req(2, range(50, 12), 20));
    d.step();
    d.step();
    assert!(d.sim.load().active_blocks > 0);
    assert!(d.sim.abort(1));
    assert!(d.sim.abort(2));
    assert!(!d.sim.abort(2));
    assert!(!d.sim.has_work());
    let load = d.sim.load();
    assert_eq!(load.active_blocks, 0);
    // The three full prompt blocks of each stay cached; the partial decode blocks are free.
    assert_eq!(load.used_blocks, 6);
    assert_eq!(d.sim.cached_blocks().len(), 6);
    assert!(d.sim.step().is_idle());
    d.check_model();
}

#[test]
fn load_reports_queues_and_blocks() {
    let mut d = Driver::new(SimConfig {
        max_batched_tokens: 32,
        max_num_seqs: 2,
        ..tiny(4, 100)
    });
    d.add(req(1, range(0, 40), 3));
    d.add(req(2, range(100, 10), 3));
    d.add(req(3, range(200, 10), 3));
    let load = d.sim.load();
    assert_eq!(load.queued_prefill_tokens, 60);
    assert_eq!(load.waiting_requests, 3);
    assert_eq!(load.capacity_blocks, 100);
    d.step(); // 32 tokens of request 1; no budget left for the others
    let load = d.sim.load();
    assert_eq!(load.running_requests, 1);
    assert_eq!(load.waiting_requests, 2);
    assert_eq!(load.queued_prefill_tokens, 8 + 10 + 10);
    assert_eq!(load.active_blocks, 8);
    d.step(); // rest of 1 (sampled), and 2 admitted; 3 waits for max_num_seqs
    let load = d.sim.load();
    assert_eq!(load.running_requests, 2);
    assert_eq!(load.active_decode_sequences, 2);
    assert_eq!(load.waiting_requests, 1);
    assert_eq!(load.queued_prefill_tokens, 10);
    d.run(100);
    let load = d.sim.load();
    assert_eq!(load.prompt_tokens_total, 60);
    assert_eq!(load.active_blocks, 0);
    assert!(load.used_blocks > 0);
}

#[test]
fn a_cache_pinned_by_holds_idles_instead_of_thrashing() {
    let mut d = Driver::new(SimConfig {
        max_batched_tokens: 2,
        ..tiny(3, 7)
    });
    let hold = |id, p: Vec<u32>| SimRequest {
        hold_blocks: true,
        ..SimRequest::new(id, p, 1)
    };
    d.add(hold(0, range(0, 9)));
    d.add(hold(1, range(100, 9)));
    d.add(req(2, range(200, 4), 1));
    // The holds pin 6 of 7 blocks; request 2 gets one block, then needs a second.
    let mut idle_at = None;
    for n in 0..40 {
        if d.step().is_idle() {
            idle_at = Some(n);
            break;
        }
    }
    assert!(idle_at.is_some(), "never settled");
    assert_eq!(d.sim.load().preemptions_total, 0);
    assert!(d.sim.has_work());
    assert!(d.sim.step().is_idle());
    assert!(d.sim.release_hold(0));
    d.run(20);
    assert_eq!(d.outputs[&2].len(), 1);
}

#[test]
fn a_pipelined_prefill_exports_each_chunk_once_and_only_that_chunk() {
    // 128 chunks of 4 blocks: a per-chunk rebuild of the block list would export
    // 4 + 8 + … + 512 blocks; exporting each chunk's own blocks exports 512.
    let mut d = Driver::new(SimConfig {
        max_batched_tokens: 64,
        ..tiny(16, 1024)
    });
    let prompt = range(0, 128 * 64);
    // A cached prefix is exported at admission, with the first computed chunk.
    d.add(req(9, prompt[..48].to_vec(), 1));
    d.run(10);
    d.add(SimRequest {
        hold_blocks: true,
        pipeline: true,
        ..SimRequest::new(1, prompt.clone(), 1)
    });
    d.run(200);
    let exports: Vec<_> = d
        .steps
        .iter()
        .flat_map(|s| s.exports.iter())
        .filter(|e| e.id == 1)
        .collect();
    let exported: usize = exports.iter().map(|e| e.blocks.len()).sum();
    assert_eq!(exported, 512);
    // 3 cached blocks + the first chunk in the admission step, then one export per chunk.
    assert_eq!(exports[0].blocks.len(), 3 + 4);
    // (8192 - 48) computed tokens in 64-token steps.
    assert_eq!(exports.len(), 128);
    let mut next = 0;
    for e in &exports {
        assert_eq!(e.first_block, next, "exports are contiguous and in order");
        next += e.blocks.len();
    }
    // The concatenation is exactly what the hold keeps at the end.
    let all: Vec<_> = exports.iter().flat_map(|e| e.blocks.clone()).collect();
    assert_eq!(Some(all), d.sim.held_blocks(1));
    // A prefill that is not pipelined exports nothing.
    let plain = d
        .steps
        .iter()
        .flat_map(|s| &s.exports)
        .filter(|e| e.id == 9);
    assert_eq!(plain.count(), 0);
}
