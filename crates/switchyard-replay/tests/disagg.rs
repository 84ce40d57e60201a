//! The aggregated-vs-disaggregated comparison's mechanics on a small synthetic mix: the same
//! seed gives the same report, every request is served with all its tokens, decode workers
//! never compute a long prompt when the prefill pool serves them, and the KV moved is exactly
//! the prompts' full blocks at the workers' bytes per token. No figure of the comparison
//! itself is asserted: those are what the benchmark measures.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_engine_sim::SimConfig;
use switchyard_replay::disagg_bench::{Row, Setup, Targets, run_setup, setups};
use switchyard_replay::workload::mix::{MixConfig, MixWorkload};
use switchyard_replay::{ClusterConfig, ClusterRun, DisaggMode};

fn mix() -> MixConfig {
    MixConfig {
        seconds: 20.0,
        chat_rate: 4.0,
        long_rate: 0.3,
        ..MixConfig::default()
    }
}

fn base() -> ClusterConfig {
    ClusterConfig {
        sim: SimConfig {
            seed: 3,
            ..SimConfig::default()
        },
        token_gaps: true,
        ..ClusterConfig::default()
    }
}

fn serve(setup: &Setup) -> (Row, ClusterRun) {
    let mut workload = MixWorkload::new(&mix()).unwrap();
    run_setup(&mut workload, &base(), setup, &Targets::default()).unwrap()
}

#[test]
fn same_seed_same_report() {
    for setup in setups(4, &[1], 2048) {
        let (a, run_a) = serve(&setup);
        let (b, run_b) = serve(&setup);
        assert_eq!(a, b, "{}", setup.label);
        assert_eq!(run_a, run_b, "{}", setup.label);
    }
}

#[test]
fn every_request_is_served_and_decode_workers_never_prefill_a_long_prompt() {
    let requests = MixWorkload::new(&mix()).unwrap().requests().to_vec();
    let long = requests
        .iter()
        .filter(|(_, r)| r.prompt.input_tokens >= 2048)
        .count() as u64;
    assert!(long > 0 && long < requests.len() as u64);
    let all = setups(4, &[1, 2], 2048);
    assert_eq!(all.len(), 5);
    for setup in &all {
        let (row, run) = serve(setup);
        let label = &setup.label;
        // Counts add up: every request finished with exactly the tokens it asked for, and
        // every gap between two of its tokens was recorded.
        assert_eq!(row.requests, requests.len() as u64, "{label}");
        assert_eq!(row.failed, 0, "{label}");
        assert_eq!(row.short.requests + row.long.requests, row.requests);
        for (record, (_, spec)) in run.records.iter().zip(&requests) {
            assert_eq!(record.id, spec.id);
            assert!(record.ok, "{label}: request {}", record.id);
            assert_eq!(record.output_tokens, u64::from(spec.max_tokens), "{label}");
            assert!(record.first_token.unwrap() > record.arrival);
        }
        let gaps: u64 = run.records.iter().map(|r| r.output_tokens - 1).sum();
        assert_eq!(run.token_gaps.len() as u64, gaps, "{label}");
        let stats = &run.disagg;
        assert_eq!(stats.blocks_not_placed, 0, "{label}");
        let decoding_prefill = row.decode_longest_prefill;
        match setup.disagg.as_ref().map(|d| d.mode) {
            None => {
                // Aggregated: some worker prefilled a long prompt while serving decodes.
                assert!(decoding_prefill >= 16_384, "{label}: {decoding_prefill}");
                assert_eq!(stats.disaggregated, 0);
                assert_eq!(stats.bytes, 0);
            }
            Some(mode) => {
                let disaggregated: Vec<_> = requests
                    .iter()
                    .filter(|(_, r)| mode == DisaggMode::Enforce || r.prompt.input_tokens >= 2048)
                    .collect();
                assert_eq!(stats.disaggregated, disaggregated.len() as u64, "{label}");
                // A decode worker computes only the tail past the last full block (plus the
                // first token) of a disaggregated prompt, and short prompts under `auto`.
                let limit = match mode {
                    DisaggMode::Enforce => 16,
                    DisaggMode::Auto => 2047,
                };
                assert!(decoding_prefill <= limit, "{label}: {decoding_prefill}");
                // The KV moved is every full block of those prompts, at 128 KiB per token.
                let tokens: u64 = disaggregated
                    .iter()
                    .map(|(_, r)| r.prompt.input_tokens / 16 * 16)
                    .sum();
                assert_eq!(stats.bytes, tokens * 131_072, "{label}");
                assert!(stats.descriptors >= stats.chunks && stats.transfer_s > 0.0);
                // The prefill workers computed every disaggregated prompt.
                let prefill_tokens: u64 = run
                    .workers
                    .iter()
                    .filter(|w| w.role == "prefill")
                    .map(|w| w.prefill_tokens)
                    .sum();
                assert!(prefill_tokens > 0, "{label}");
            }
        }
    }
}
