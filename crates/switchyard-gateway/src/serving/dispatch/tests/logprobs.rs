//! Log probabilities through dispatch: one per token, across a migration's seam, and never
//! through the prefill pool.

use super::*;
use crate::serving::dispatch::stream::logprobs_of;

#[tokio::test]
async fn log_probabilities_stay_one_per_token_across_a_migration_and_skip_the_prefill_pool() {
    let script = Scripted::new(
        vec![
            Gen::Stream {
                tokens: vec![vec![7, 8]],
                end: End::Fail(tonic::Status::unavailable("worker went away")),
            },
            ok_stream(&[9, 10]),
        ],
        // Never asked: a request with log probabilities is served aggregated.
        vec![Pre::Ok { pipelined: false }],
    );
    let (pool, routes) = pool(&[both("a", 11), both("b", 12)], Arc::clone(&script));
    let mut job = job(&routes, disagg(Disaggregation::Enforce));
    job.sampling.logprobs = Some(2);
    let events = events(start(&pool, job)).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    let mut pairs = Vec::new();
    for event in &events {
        if let DispatchEvent::Tokens { ids, logprobs } = event {
            assert_eq!(ids.len(), logprobs.len(), "{event:?}");
            pairs.extend(
                ids.iter()
                    .zip(logprobs)
                    .map(|(id, lp)| (*id, lp.token, lp.logprob)),
            );
        }
    }
    assert_eq!(
        pairs,
        [7, 8, 9, 10].map(|t| (t, t, -(t as f32) / 100.0)),
        "continuous at the seam"
    );
    let calls = script.generate_calls();
    assert_eq!(calls.len(), 2);
    assert!(
        calls
            .iter()
            .all(|c| c.logprobs == Some(2) && c.kv_source.is_none())
    );
    assert!(script.prefill_calls().is_empty());
    pool.shutdown().await;
}

#[test]
fn a_message_must_carry_one_log_probability_per_token_when_they_were_asked_for() {
    let asked = switchyard_core::Sampling {
        max_tokens: 4,
        logprobs: Some(1),
        ..switchyard_core::Sampling::default()
    };
    let short = GenerateResponse {
        token_ids: vec![1, 2],
        logprobs: vec![scripted_logprob(1)],
        ..GenerateResponse::default()
    };
    let err = logprobs_of(&asked, &short).unwrap_err();
    assert!(err.contains("1 log probabilities for 2 tokens"), "{err}");
    let full = GenerateResponse {
        logprobs: vec![scripted_logprob(1), scripted_logprob(2)],
        ..short.clone()
    };
    assert_eq!(logprobs_of(&asked, &full).unwrap().len(), 2);
    // Not asked for: whatever the worker sent is not passed on.
    let unasked = switchyard_core::Sampling {
        logprobs: None,
        ..asked
    };
    assert!(logprobs_of(&unasked, &full).unwrap().is_empty());
}
