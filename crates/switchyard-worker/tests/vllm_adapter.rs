//! The vLLM/SGLang adapter against the protocol-faithful stand-in engine
//! (`tests/python/fake_vllm.py`: OpenAI HTTP, ZMQ PUB + ROUTER replay, its own block hashes).
//!
//! The stand-in reports the blocks it holds as token prefixes; the adapter's event log must end
//! up holding exactly Switchyard's chained hashes of those, through gaps, replays and restarts.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard_core::{BlockSize, EngineKind, Role, block_hashes};
use switchyard_worker::engine::{
    Engine, EngineError, EngineTransfer, FinishReason, GenerateParams, PrefillParams,
};
use switchyard_worker::metrics::{WorkerMetrics, sample};
use switchyard_worker::state::WorkerState;

use crate::support;

use support::fake_vllm::{Fake, assert_mirrors, logged, seq, start};

fn params(prompt: Vec<u32>, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        request_id: "r1".into(),
        prompt,
        sampling: switchyard_core::Sampling {
            max_tokens,
            temperature: Some(0.0),
            ignore_eos: true,
            ..switchyard_core::Sampling::default()
        },
        identity: Default::default(),
        retention: Default::default(),
        priority: None,
    }
}

#[tokio::test]
async fn vllm_generation_and_kv_events_through_gap_replay_and_restart() {
    let fake = Fake::start(&["--block-size", "4", "--num-blocks", "64"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, true)).await;
    assert_eq!(engine.spec().block_size.get(), 4);
    assert_eq!(engine.spec().kv_capacity_blocks, 64);
    assert_eq!(engine.spec().max_context_tokens, 4096);

    // Generation streams token ids; the repeat hits the cache.
    for round in 0..2 {
        let mut stream = engine.generate(params(seq(1, 10), 5)).await.unwrap();
        let mut tokens = Vec::new();
        let mut last = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            tokens.extend(chunk.tokens.clone());
            last = Some(chunk);
        }
        let last = last.unwrap();
        assert_eq!(tokens.len(), 5);
        assert_eq!(last.finish, Some(FinishReason::Length));
        assert_eq!((last.prompt_tokens, last.completion_tokens), (10, 5));
        assert_eq!(last.cached_prompt_tokens, if round == 0 { 0 } else { 8 });
    }
    assert_mirrors(&fake, &engine).await;

    // A gap replay can repair: the next two batches reach only the replay buffer.
    fake.admin("drop_next", json!({"count": 2})).await;
    fake.store(seq(100, 8), 0).await;
    fake.store(seq(200, 8), 0).await;
    fake.store(seq(300, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    let stats = engine.stats();
    assert_eq!(
        (stats.gaps, stats.replays, stats.replayed_batches),
        (1, 1, 2)
    );

    // Malformed messages are counted and skipped; the stream goes on.
    fake.admin("malformed", json!({})).await;
    fake.store(seq(400, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().malformed, 3);
    assert_eq!(engine.stats().gaps, 1);

    // An engine restart: everything known is dropped, then rebuilt from the new events.
    fake.admin("restart", json!({})).await;
    fake.store(seq(500, 12), 0).await;
    fake.store(seq(1, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().restarts, 1);

    // A prefix-cache reset.
    fake.admin("clear", json!({})).await;
    fake.store(seq(600, 4), 0).await;
    assert_mirrors(&fake, &engine).await;

    // Load comes from /metrics.
    let load = engine.load();
    assert_eq!(load.capacity_blocks, 64);
    engine.shutdown();
}

#[tokio::test]
async fn a_gap_replay_cannot_cover_clears_the_rank_and_rebuilds() {
    let fake = Fake::start(&["--block-size", "4", "--buffer-steps", "2"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, true)).await;
    fake.store(seq(1, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    // Lost for good: not even in the replay buffer.
    fake.admin("drop_next", json!({"count": 1, "forget": true}))
        .await;
    fake.store(seq(50, 8), 0).await;
    fake.store(seq(80, 8), 0).await;
    let bs = engine.spec().block_size;
    let fresh: BTreeSet<_> = block_hashes(&seq(80, 8), bs).into_iter().collect();
    for _ in 0..100 {
        if logged(&engine) == fresh {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The stale view was dropped and rebuilt from what followed the gap.
    assert_eq!(logged(&engine), fresh);
    let stats = engine.stats();
    assert_eq!((stats.gaps, stats.resyncs, stats.replays), (1, 1, 0));
    let engine: Arc<dyn Engine> = Arc::new(engine);
    let scrape =
        WorkerMetrics::new("w", Arc::clone(&engine), WorkerState::new(Role::Both)).encode();
    let rank0 = [("rank", "0")];
    assert_eq!(
        sample(
            &scrape,
            "switchyard_worker_engine_kv_replay_failures_total",
            &rank0
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "switchyard_worker_engine_kv_replays_total", &rank0),
        Some(0.0)
    );
    engine.shutdown();
}

/// The relay counters that were only logged reach `/metrics`, per rank: a gap replayed on rank
/// 1, bad frames on rank 0, a restart seen by both, and the engine's own `/metrics` going away.
#[tokio::test]
async fn relay_counters_and_engine_scrapes_reach_the_metrics_per_rank() {
    let fake = Fake::start(&["--dp-ranks", "2", "--block-size", "4"]).await;
    let vllm = Arc::new(start(fake.config(EngineKind::Vllm, 2, true)).await);
    let engine: Arc<dyn Engine> = vllm.clone();
    let metrics = WorkerMetrics::new("w", Arc::clone(&engine), WorkerState::new(Role::Both));
    let value = |name: &str, rank: &str| {
        let name = format!("switchyard_worker_{name}");
        sample(&metrics.encode(), &name, &[("rank", rank)]).unwrap_or_else(|| panic!("no {name}"))
    };
    assert_eq!(engine.telemetry().relay_ranks.len(), 2);
    assert_eq!(value("engine_kv_gaps_total", "0"), 0.0);

    fake.store(seq(1, 8), 0).await;
    fake.store(seq(50, 8), 1).await;
    // Rank 1 misses one batch, which its replay buffer still has.
    fake.admin("drop_next", json!({"count": 1})).await;
    fake.store(seq(100, 8), 1).await;
    fake.store(seq(200, 8), 1).await;
    fake.admin("drop_next", json!({"count": 0})).await;
    // Three bad messages on rank 0 (frame count, sequence frame, payload).
    fake.admin("malformed", json!({"rank": 0})).await;
    fake.store(seq(300, 8), 0).await;
    assert_mirrors(&fake, &vllm).await;
    fake.admin("restart", json!({})).await;
    fake.store(seq(500, 8), 0).await;
    fake.store(seq(600, 8), 1).await;
    assert_mirrors(&fake, &vllm).await;

    assert_eq!(
        (
            value("engine_kv_gaps_total", "0"),
            value("engine_kv_gaps_total", "1")
        ),
        (0.0, 1.0)
    );
    assert_eq!(value("engine_kv_replays_total", "1"), 1.0);
    assert_eq!(value("engine_kv_replayed_batches_total", "1"), 1.0);
    assert_eq!(value("engine_kv_replay_failures_total", "1"), 0.0);
    assert_eq!(value("engine_kv_malformed_frames_total", "0"), 3.0);
    assert_eq!(value("engine_kv_malformed_frames_total", "1"), 0.0);
    assert_eq!(
        (
            value("engine_restarts_total", "0"),
            value("engine_restarts_total", "1")
        ),
        (1.0, 1.0)
    );
    // Rank 0: two stores, the unreadable payload is not a batch, the restart's store.
    assert_eq!(value("engine_kv_batches_total", "0"), 3.0);
    assert!(value("engine_kv_events_relayed_total", "0") >= 3.0);
    assert_eq!(value("engine_kv_batches_total", "1"), 4.0);

    // The engine's own /metrics answers, then stops answering when the engine is gone.
    let scrapes = |outcome: &str| {
        sample(
            &metrics.encode(),
            "switchyard_worker_engine_metrics_scrapes_total",
            &[("outcome", outcome)],
        )
        .unwrap()
    };
    let up = || {
        sample(
            &metrics.encode(),
            "switchyard_worker_engine_metrics_up",
            &[],
        )
        .unwrap()
    };
    assert!(scrapes("ok") >= 1.0);
    assert_eq!(up(), 1.0);
    drop(fake);
    for _ in 0..200 {
        if up() == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(up(), 0.0);
    assert!(scrapes("error") >= 1.0);
    engine.shutdown();
}

#[tokio::test]
async fn map_encoding_byte_hashes_and_dp_ranks() {
    let fake = Fake::start(&[
        "--encoding",
        "map",
        "--hash-bytes",
        "--dp-ranks",
        "2",
        "--block-size",
        "8",
    ])
    .await;
    let engine = start(fake.config(EngineKind::Vllm, 2, true)).await;
    fake.store(seq(1, 24), 0).await;
    // Rank 1 shares the first block with rank 0 and has one of its own.
    fake.store(seq(1, 8).into_iter().chain(seq(900, 8)).collect(), 1)
        .await;
    assert_mirrors(&fake, &engine).await;
    // A prefix-cache reset on every rank, then new blocks on one.
    fake.admin("clear", json!({})).await;
    fake.store(seq(1, 16), 1).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().malformed, 0);
    engine.shutdown();
}

#[tokio::test]
async fn sglang_generate_and_facts_from_server_info() {
    let fake = Fake::start(&["--flavor", "sglang", "--encoding", "map"]).await;
    let engine = start(fake.config(EngineKind::Sglang, 1, false)).await;
    assert_eq!(engine.spec().block_size.get(), 4);
    let mut stream = engine.generate(params(seq(1, 9), 4)).await.unwrap();
    let mut tokens = Vec::new();
    let mut finish = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        tokens.extend(chunk.tokens);
        finish = chunk.finish;
    }
    assert_eq!(tokens.len(), 4);
    assert_eq!(finish, Some(FinishReason::Length));
    assert_mirrors(&fake, &engine).await;
    engine.shutdown();
}

#[tokio::test]
async fn errors_map_to_whose_fault_and_dropping_a_stream_aborts() {
    let fake = Fake::start(&["--token-delay-ms", "20", "--max-model-len", "64"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, false)).await;
    let err = engine.generate(params(seq(1, 60), 10)).await.unwrap_err();
    assert!(
        matches!(err, EngineError::InvalidRequest(ref m) if m.contains("context")),
        "{err}"
    );
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::InvalidArgument
    );
    let err = engine
        .prefill(PrefillParams {
            request_id: "p".into(),
            prompt: seq(1, 4),
            hold: Duration::from_secs(1),
            pipelined: false,
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
            sampling: None,
        })
        .await
        .unwrap_err();
    // Without a KV connector vLLM answers no kv_transfer_params: not a prefill worker's engine.
    assert!(err.to_string().contains("kv-transfer-config"), "{err}");
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);

    // Dropping the stream closes the HTTP request; the engine stops running it.
    let mut stream = engine.generate(params(seq(1, 8), 40)).await.unwrap();
    stream.next().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.load().running_requests, 1);
    drop(stream);
    let mut stopped = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if engine.load().running_requests == 0 {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "the engine kept running a dropped request");

    // An unreachable engine is retryable.
    drop(fake);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = engine.generate(params(seq(1, 8), 4)).await.unwrap_err();
    assert!(matches!(err, EngineError::Unavailable(_)), "{err}");
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unavailable);
    engine.shutdown();
}

async fn collect(
    mut stream: switchyard_worker::engine::GenerationStream,
) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        tokens.extend(chunk.tokens);
        if let Some(finish) = chunk.finish {
            return (tokens, finish);
        }
    }
    panic!("stream ended without a finish");
}

fn prefill_params(prompt: Vec<u32>, hold: Duration) -> PrefillParams {
    PrefillParams {
        request_id: "pd-1".into(),
        prompt,
        hold,
        pipelined: false,
        identity: Default::default(),
        retention: Default::default(),
        priority: None,
        sampling: None,
    }
}

fn object(json: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(json).unwrap() {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

#[tokio::test]
async fn vllm_prefill_hands_its_kv_transfer_params_to_the_decode_engine() {
    let prefill_fake = Fake::start(&[
        "--block-size",
        "4",
        "--kv-transfer",
        "--scheduling-policy",
        "priority",
    ])
    .await;
    let decode_fake = Fake::start(&["--block-size", "4", "--kv-transfer"]).await;
    let prefill = start(prefill_fake.config(EngineKind::Vllm, 1, false)).await;
    let decode = start(decode_fake.config(EngineKind::Vllm, 1, true)).await;
    let prompt = seq(1, 10);

    // A priority (set by the service only for an engine scheduling by it) reaches the prefill.
    let outcome = prefill
        .prefill(PrefillParams {
            priority: Some(3),
            ..prefill_params(prompt.clone(), Duration::from_secs(30))
        })
        .await
        .unwrap();
    assert_eq!(last_request(&prefill_fake).await["priority"], json!(3));
    let transfer = object(outcome.engine_transfer_params.as_deref().unwrap());
    let prefill_id = prefill_fake.admin("transfers", json!({})).await["engine_id"].clone();
    assert_eq!(transfer["do_remote_prefill"], true);
    assert_eq!(transfer["remote_engine_id"], prefill_id);
    assert_eq!(transfer["remote_block_ids"].as_array().unwrap().len(), 2);
    assert_eq!(
        outcome.block_hashes,
        block_hashes(&prompt, BlockSize::new(4).unwrap())
    );
    assert_eq!(
        (outcome.prompt_tokens, outcome.cached_prompt_tokens),
        (10, 0)
    );

    // The decode engine gets the original prompt with those parameters and generates the whole
    // completion, starting with the token the prefill sampled.
    let (tokens, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 4), transfer.clone())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((tokens.len(), finish), (4, FinishReason::Length));
    assert_eq!(tokens[0], outcome.first_token);
    let seen = decode_fake.admin("transfers", json!({})).await;
    assert_eq!(
        seen["received"][0]["params"],
        Value::Object(transfer.clone())
    );
    assert_eq!(seen["received"][0]["outcome"], "pulled");
    assert_eq!(
        prefill_fake.admin("transfers", json!({})).await["handed_over"],
        1
    );
    // The received blocks are in the decode engine's cache and its events.
    assert_mirrors(&decode_fake, &decode).await;
    let mirrored = logged(&decode);
    assert!(
        block_hashes(&prompt, decode.spec().block_size)
            .iter()
            .all(|h| mirrored.contains(h))
    );

    // SGLang's bootstrap parameters are not vLLM's: refused before the engine sees them.
    let err = decode
        .generate_with_transfer(
            params(prompt, 4),
            object(r#"{"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}"#),
        )
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);
    prefill.shutdown();
    decode.shutdown();
}

#[tokio::test]
async fn sglang_prefill_answers_at_once_and_the_decode_engine_takes_the_room() {
    let prefill_fake = Fake::start(&[
        "--flavor",
        "sglang",
        "--disaggregation-mode",
        "prefill",
        "--transfer-timeout",
        "20",
        "--enable-priority-scheduling",
    ])
    .await;
    let decode_fake = Fake::start(&["--flavor", "sglang", "--disaggregation-mode", "decode"]).await;
    let mut config = prefill_fake.config(EngineKind::Sglang, 1, false);
    config.bootstrap_port = prefill_fake.bootstrap;
    let prefill = start(config).await;
    let decode = start(decode_fake.config(EngineKind::Sglang, 1, false)).await;
    let prompt = seq(1, 9);

    // The stand-in's prefill does not finish until a decode engine takes the room: the answer
    // comes before that, or this would wait for ever.
    let outcome = prefill
        .prefill(PrefillParams {
            priority: Some(-1),
            ..prefill_params(prompt.clone(), Duration::from_secs(20))
        })
        .await
        .unwrap();
    assert_eq!(last_request(&prefill_fake).await["priority"], json!(-1));
    let transfer = object(outcome.engine_transfer_params.as_deref().unwrap());
    assert_eq!(transfer["bootstrap_host"], "127.0.0.1");
    assert_eq!(transfer["bootstrap_port"], prefill_fake.bootstrap);
    let room = transfer["bootstrap_room"].as_u64().unwrap();
    assert!(room <= i64::MAX as u64);
    assert_eq!(
        prefill_fake.admin("transfers", json!({})).await["handed_over"],
        0
    );

    let (tokens, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 3), transfer.clone())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((tokens.len(), finish), (3, FinishReason::Length));
    let seen = decode_fake.admin("transfers", json!({})).await;
    assert_eq!(seen["received"][0]["params"], Value::Object(transfer));
    assert_eq!(seen["received"][0]["outcome"], "pulled");
    let mut handed = false;
    for _ in 0..100 {
        if prefill_fake.admin("transfers", json!({})).await["handed_over"] == 1 {
            handed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(handed, "the prefill engine never saw its room taken");
    assert_mirrors(&decode_fake, &decode).await;

    // A room nobody serves: the decode engine aborts, the adapter reports it.
    let mut bad = object(outcome.engine_transfer_params.as_deref().unwrap());
    bad.insert("bootstrap_port".into(), json!(1));
    let (_, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 3), bad)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(finish, FinishReason::Aborted);
    // vLLM's parameters are not SGLang's.
    let err = decode
        .generate_with_transfer(
            params(prompt.clone(), 3),
            object(r#"{"do_remote_prefill":true}"#),
        )
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);

    // A dead prefill engine fails the prefill at once, retryably.
    drop(prefill_fake);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = prefill
        .prefill(prefill_params(prompt, Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unavailable);
    prefill.shutdown();
    decode.shutdown();
}

/// Every sampling field set, and the engine's own field name each must arrive under (vLLM's
/// OpenAI completions body; SGLang's `sampling_params`).
fn full_sampling() -> switchyard_core::Sampling {
    switchyard_core::Sampling {
        max_tokens: 6,
        temperature: Some(0.7),
        top_p: Some(0.9),
        top_k: Some(40),
        min_p: Some(0.05),
        presence_penalty: Some(0.5),
        frequency_penalty: Some(-0.5),
        repetition_penalty: Some(1.1),
        logit_bias: std::collections::BTreeMap::from([(11, -100.0), (12, 2.5)]),
        seed: Some(1234),
        stop: vec!["END".into()],
        stop_token_ids: vec![99],
        min_tokens: Some(2),
        ignore_eos: true,
        skip_special_tokens: Some(true),
        include_stop_str_in_output: Some(true),
        logprobs: Some(3),
        guided: Some(switchyard_core::Guided::JsonSchema(
            r#"{"type":"object"}"#.into(),
        )),
    }
}

async fn last_request(fake: &Fake) -> Value {
    let requests = fake.admin("requests", json!({})).await;
    requests["requests"]
        .as_array()
        .and_then(|r| r.last())
        .cloned()
        .expect("the engine received a request")
}

async fn run(
    engine: &switchyard_worker::engine::vllm::VllmEngine,
    sampling: switchyard_core::Sampling,
) {
    let mut stream = engine
        .generate(GenerateParams {
            request_id: "sampled".into(),
            prompt: seq(1, 10),
            sampling,
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        })
        .await
        .unwrap();
    while let Some(chunk) = stream.next().await {
        chunk.unwrap();
    }
}

#[tokio::test]
async fn every_sampling_field_reaches_vllm_in_its_own_name_and_unset_ones_stay_unset() {
    let fake = Fake::start(&["--block-size", "4"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, false)).await;
    run(&engine, full_sampling()).await;
    let body = last_request(&fake).await;
    for (field, want) in [
        ("max_tokens", json!(6)),
        ("temperature", json!(0.7)),
        ("top_p", json!(0.9)),
        ("top_k", json!(40)),
        ("min_p", json!(0.05)),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-0.5)),
        ("repetition_penalty", json!(1.1)),
        ("logit_bias", json!({"11": -100.0, "12": 2.5})),
        ("seed", json!(1234)),
        ("stop", json!(["END"])),
        ("stop_token_ids", json!([99])),
        ("min_tokens", json!(2)),
        ("ignore_eos", json!(true)),
        // Alternatives keyed by token id, read back per token (`run` fails otherwise).
        ("logprobs", json!(3)),
        ("return_tokens_as_token_ids", json!(true)),
        ("structured_outputs", json!({"json": {"type": "object"}})),
    ] {
        let got = &body[field];
        let close = match (got.as_f64(), want.as_f64()) {
            (Some(a), Some(b)) => (a - b).abs() < 1e-6,
            _ => *got == want,
        };
        assert!(close, "{field}: sent {got}, want {want} in {body}");
    }
    // Only the base case: a bare request leaves every sampling field to the engine's defaults.
    run(
        &engine,
        switchyard_core::Sampling {
            max_tokens: 3,
            ..switchyard_core::Sampling::default()
        },
    )
    .await;
    let body = last_request(&fake).await;
    for field in [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "seed",
        "stop",
        "min_tokens",
        "ignore_eos",
        "structured_outputs",
    ] {
        assert!(body.get(field).is_none(), "{field} sent unset: {body}");
    }
    assert_eq!(body["max_tokens"], 3);
}

#[tokio::test]
async fn every_sampling_field_reaches_sglang_in_its_own_name_and_unset_ones_stay_unset() {
    let fake = Fake::start(&["--flavor", "sglang", "--encoding", "map"]).await;
    let engine = start(fake.config(EngineKind::Sglang, 1, false)).await;
    run(&engine, full_sampling()).await;
    let body = last_request(&fake).await;
    assert_eq!(body["return_logprob"], true, "{body}");
    assert_eq!(body["top_logprobs_num"], 3, "{body}");
    let params = body["sampling_params"].clone();
    for (field, want) in [
        ("max_new_tokens", json!(6)),
        ("temperature", json!(0.7)),
        ("top_p", json!(0.9)),
        ("top_k", json!(40)),
        ("min_p", json!(0.05)),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-0.5)),
        ("repetition_penalty", json!(1.1)),
        ("logit_bias", json!({"11": -100.0, "12": 2.5})),
        ("sampling_seed", json!(1234)),
        ("stop", json!(["END"])),
        ("stop_token_ids", json!([99])),
        ("min_new_tokens", json!(2)),
        ("ignore_eos", json!(true)),
        ("json_schema", json!(r#"{"type":"object"}"#)),
    ] {
        let got = &params[field];
        let close = match (got.as_f64(), want.as_f64()) {
            (Some(a), Some(b)) => (a - b).abs() < 1e-6,
            _ => *got == want,
        };
        assert!(close, "{field}: sent {got}, want {want} in {params}");
    }
    run(
        &engine,
        switchyard_core::Sampling {
            max_tokens: 3,
            ..switchyard_core::Sampling::default()
        },
    )
    .await;
    let params = last_request(&fake).await["sampling_params"].clone();
    for field in [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "sampling_seed",
        "stop",
        "min_new_tokens",
        "ignore_eos",
    ] {
        assert!(params.get(field).is_none(), "{field} sent unset: {params}");
    }
}
