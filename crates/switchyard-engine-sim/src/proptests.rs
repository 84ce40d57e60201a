//! Random workloads against invariants: every event validates and replays onto a naive model
//! equal to the cache, every request that was not aborted finishes with the right token count,
//! and the engine never stalls or leaks a block.

use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::testutil::{Driver, bs};
use crate::{FinishReason, SimConfig, SimRequest};

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: u32,
        prefix_len: u32,
        tail: Vec<u32>,
        max_tokens: u32,
        ignore_eos: bool,
        hold: bool,
    },
    Step,
    Abort(u64),
    Release(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..3, 0u32..14, proptest::collection::vec(0u32..50, 0..10), 1u32..12, any::<bool>(), proptest::bool::weighted(0.2))
            .prop_map(|(prefix, prefix_len, tail, max_tokens, ignore_eos, hold)| Op::Add {
                prefix, prefix_len, tail, max_tokens, ignore_eos, hold,
            }),
        6 => Just(Op::Step),
        1 => (0u64..30).prop_map(Op::Abort),
        1 => (0u64..30).prop_map(Op::Release),
    ]
}

fn config() -> impl Strategy<Value = SimConfig> {
    (
        2u32..5,
        6u64..24,
        0u64..10,
        1usize..5,
        1usize..40,
        8u32..40,
        any::<u64>(),
    )
        .prop_map(
            |(block, device, host, seqs, budget, vocab, seed)| SimConfig {
                block_size: bs(block),
                num_device_blocks: device,
                num_host_blocks: host,
                max_num_seqs: seqs,
                max_batched_tokens: budget,
                vocab_size: vocab,
                eos_token_id: 1,
                seed,
                ..SimConfig::default()
            },
        )
}

/// What the test knows about an accepted request.
struct Expect {
    max_tokens: u32,
    hold: bool,
    aborted: bool,
}

fn check_outputs(d: &Driver, expect: &BTreeMap<u64, Expect>) -> Result<(), TestCaseError> {
    for (id, e) in expect {
        let outs = d.outputs.get(id).map(Vec::as_slice).unwrap_or_default();
        for (n, (_, o)) in outs.iter().enumerate() {
            prop_assert_eq!(o.completion_tokens as usize, n + 1);
            prop_assert!(o.finish.is_none() || n + 1 == outs.len());
        }
        if e.aborted {
            continue;
        }
        let last = outs.last().map(|(_, o)| o);
        prop_assert!(
            last.is_some_and(|o| o.finish.is_some()),
            "request {} unfinished",
            id
        );
        if let Some(o) = last {
            let limit = if e.hold { 1 } else { e.max_tokens };
            prop_assert!(o.completion_tokens <= limit);
            if o.finish == Some(FinishReason::Length) {
                prop_assert_eq!(o.completion_tokens, limit);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_workloads_keep_every_invariant(
        config in config(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let block_size = config.block_size;
        let mut d = Driver::new(config);
        let mut expect = BTreeMap::new();
        let mut next_id = 0u64;
        // Pipelined holds and the hashes of their full prompt blocks.
        let mut pipelined: BTreeMap<u64, Vec<switchyard_core::BlockHash>> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Add { prefix, prefix_len, tail, max_tokens, ignore_eos, hold } => {
                    let mut prompt: Vec<u32> = (0..prefix_len).map(|t| 1000 * (prefix + 1) + t).collect();
                    prompt.extend(tail);
                    let pipeline = hold && prefix % 2 == 0;
                    let hashes = switchyard_core::block_hashes(&prompt, block_size);
                    let r = SimRequest {
                        ignore_eos,
                        hold_blocks: hold,
                        pipeline,
                        ..SimRequest::new(next_id, prompt, max_tokens)
                    };
                    // Refusals (empty, too big for the cache) must be errors, never panics.
                    if d.sim.add_request(r).is_ok() {
                        if pipeline {
                            pipelined.insert(next_id, hashes);
                        }
                        expect.insert(next_id, Expect { max_tokens, hold, aborted: false });
                    }
                    next_id += 1;
                }
                Op::Step => {
                    d.step();
                    d.check_model();
                    let load = d.sim.load();
                    prop_assert!(load.active_blocks <= load.used_blocks);
                    prop_assert!(load.used_blocks <= load.capacity_blocks);
                }
                Op::Abort(id) => {
                    if d.sim.abort(id)
                        && let Some(e) = expect.get_mut(&id)
                        && d.outputs.get(&id).and_then(|o| o.last()).is_none_or(|(_, o)| o.finish.is_none())
                    {
                        e.aborted = true;
                    }
                }
                Op::Release(id) => {
                    d.sim.release_hold(id);
                }
            }
        }
        // Drain: holds can pin the cache, so release them whenever nothing can move.
        for _ in 0..10_000 {
            if !d.sim.has_work() {
                break;
            }
            if d.step().is_idle() {
                let held: Vec<u64> = expect.keys().copied().collect();
                let mut released = false;
                for id in held {
                    released |= d.sim.release_hold(id);
                }
                prop_assert!(released, "stalled with no hold to release");
            }
            d.check_model();
        }
        prop_assert!(!d.sim.has_work());
        for id in expect.keys() {
            d.sim.release_hold(*id);
        }
        d.check_model();
        prop_assert_eq!(d.sim.load().active_blocks, 0);
        check_outputs(&d, &expect)?;
        // Pipelined prefills export their prompt blocks once each, in order, across preemptions;
        // a finished one has exported all of them.
        let mut exported: BTreeMap<u64, Vec<switchyard_core::BlockHash>> = BTreeMap::new();
        for step in &d.steps {
            for e in &step.exports {
                let want = pipelined.get(&e.id);
                prop_assert!(want.is_some(), "export of a request that is not pipelined");
                let got = exported.entry(e.id).or_default();
                prop_assert_eq!(e.first_block, got.len());
                got.extend(e.blocks.iter().map(|(h, _)| *h));
            }
        }
        for (id, want) in &pipelined {
            let got = exported.get(id).map_or(&[][..], Vec::as_slice);
            prop_assert!(got.len() <= want.len());
            prop_assert_eq!(got, &want[..got.len()]);
            let finished = d.outputs.get(id).and_then(|o| o.last()).is_some_and(|(_, o)| o.finish.is_some());
            if finished {
                prop_assert_eq!(got.len(), want.len());
            }
        }
    }
}
