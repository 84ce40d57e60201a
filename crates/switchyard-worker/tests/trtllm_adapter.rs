//! The TensorRT-LLM adapter against the protocol-faithful `trtllm-serve` stand-in
//! (`tests/python/fake_trtllm.py`): generation over `/v1/completions`, load from the iteration
//! stats, and the KV events polled from `/kv_cache_events` mirrored exactly, with lost events
//! (a wrapped queue) and a restarted engine detected, resynchronised and counted.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use switchyard_core::{Role, block_hashes};
use switchyard_worker::engine::vllm::VllmEngine;
use switchyard_worker::engine::{Engine, EngineError, FinishReason, GenerateParams, PrefillParams};
use switchyard_worker::metrics::{WorkerMetrics, sample};
use switchyard_worker::state::WorkerState;

use crate::support;

use support::fake_trtllm::{FakeTrtllm, start_trtllm};
use support::fake_vllm::{logged, seq};

fn params(prompt: Vec<u32>, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        request_id: "r1".into(),
        prompt,
        sampling: switchyard_core::Sampling {
            max_tokens,
            temperature: Some(0.0),
            top_k: Some(5),
            ignore_eos: true,
            ..switchyard_core::Sampling::default()
        },
        identity: Default::default(),
        retention: Default::default(),
        priority: None,
    }
}

/// Waits until the adapter's view equals `want`.
async fn assert_view(engine: &VllmEngine, want: &BTreeSet<switchyard_core::BlockHash>) {
    for _ in 0..200 {
        if logged(engine) == *want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "adapter view {:?} != {want:?} (stats {:?})",
        logged(engine),
        engine.stats()
    );
}

#[tokio::test]
async fn trtllm_generation_and_polled_kv_events_through_a_wrap_and_a_restart() {
    let mut fake = FakeTrtllm::start(&["--block-size", "4", "--num-blocks", "64"]).await;
    let engine = start_trtllm(&fake.config()).await.unwrap();
    let bs = engine.spec().block_size;
    assert_eq!(engine.spec().kind, switchyard_core::EngineKind::Trtllm);

    // Generation streams token ids; the repeat hits the cache (two full prompt blocks).
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
    // The engine was asked in its own names, and for token ids instead of text.
    let sent = fake.admin("requests", json!({})).await["requests"][0].clone();
    assert_eq!(sent["detokenize"], false, "{sent}");
    assert_eq!(
        (&sent["top_k"], &sent["ignore_eos"]),
        (&json!(5), &json!(true))
    );
    // Partial blocks (the engine stores them) are not in the view; full ones all are.
    assert_view(&engine, &fake.held(bs).await).await;
    assert!(engine.stats().partial_blocks > 0);

    // Load comes from the iteration stats: capacity and blocks in use.
    let load = engine.load();
    assert_eq!(load.capacity_blocks, 64);
    assert!(load.used_blocks > 0, "{load:?}");

    // Lost events: the next one never reaches the queue. The adapter sees the ids skip at the
    // start of its next poll (the queue wrapped), drops the rank's blocks and rebuilds from
    // what follows; the blocks stored in the lost event stay unknown, as they must.
    fake.admin("drop_next", json!({"count": 1})).await;
    fake.store(seq(100, 8)).await;
    fake.store(seq(200, 8)).await;
    let after: BTreeSet<_> = block_hashes(&seq(200, 8), bs).into_iter().collect();
    assert_view(&engine, &after).await;
    let stats = engine.stats();
    assert_eq!(
        (
            stats.gaps,
            stats.buffer_wraps,
            stats.resyncs,
            stats.restarts
        ),
        (1, 1, 1, 0)
    );

    // A restarted engine: event ids from 0 again, a new cache with new hashes.
    fake.admin("restart", json!({})).await;
    fake.store(seq(300, 12)).await;
    assert_view(&engine, &fake.held(bs).await).await;
    assert_eq!(engine.stats().restarts, 1);
    assert_eq!(
        logged(&engine),
        block_hashes(&seq(300, 12), bs).into_iter().collect()
    );

    // The counters reach /metrics per rank; an engine that went away is counted.
    let engine: Arc<dyn Engine> = Arc::new(engine);
    let metrics = WorkerMetrics::new("w", Arc::clone(&engine), WorkerState::new(Role::Both));
    let value = |name: &str| {
        sample(
            &metrics.encode(),
            &format!("switchyard_worker_{name}"),
            &[("rank", "0")],
        )
        .unwrap_or_else(|| panic!("no {name}"))
    };
    assert_eq!(value("engine_kv_buffer_wraps_total"), 1.0);
    assert_eq!(value("engine_kv_replay_failures_total"), 1.0);
    assert_eq!(value("engine_restarts_total"), 1.0);
    assert_eq!(value("engine_kv_poll_failures_total"), 0.0);
    fake.kill().await;
    let mut failures = 0.0;
    for _ in 0..200 {
        failures = value("engine_kv_poll_failures_total");
        if failures > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(failures > 0.0, "a poll of a dead engine is counted");
    engine.shutdown();
}

#[tokio::test]
async fn facts_come_from_iteration_stats_and_what_is_missing_is_named() {
    let fake = FakeTrtllm::start(&["--block-size", "8", "--num-blocks", "32"]).await;
    // Idle: no iteration ran, so no stats tell the block size or capacity.
    let bare = switchyard_worker::config::EngineConfig {
        block_size: None,
        kv_blocks: None,
        ..fake.config()
    };
    let err = start_trtllm(&bare).await.unwrap_err().to_string();
    assert!(
        err.contains("--engine-block-size") && err.contains("--engine-kv-blocks"),
        "{err}"
    );
    assert!(!err.contains("--engine-max-context"), "{err}");
    // After one request the stats carry them.
    let body = json!({"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": true});
    let response = fake
        .client
        .post(format!("{}/v1/completions", fake.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap();
    let engine = start_trtllm(&bare).await.unwrap();
    assert_eq!(
        (
            engine.spec().block_size.get(),
            engine.spec().kv_capacity_blocks
        ),
        (8, 32)
    );
    engine.shutdown();
    // A model the engine does not serve is named.
    let other = switchyard_worker::config::EngineConfig {
        served_model_name: Some("llama".into()),
        ..fake.config()
    };
    let err = start_trtllm(&other).await.unwrap_err().to_string();
    assert!(err.contains("fake-model") && err.contains("llama"), "{err}");
}

/// A whole worker agent in front of the stand-in: it registers as a TensorRT-LLM worker, serves
/// `Generate` over gRPC, and takes a prefill role from a planner.
#[tokio::test]
async fn a_trtllm_worker_registers_serves_grpc_and_takes_a_prefill_role() {
    use switchyard_proto::v1::{self, ControlRequest, GenerateRequest, SamplingParams};
    use switchyard_registry::{MemoryRegistry, Registry};

    let fake = FakeTrtllm::start(&["--block-size", "4", "--num-blocks", "64"]).await;
    let config = switchyard_worker::WorkerConfig {
        id: Some("trt-w".into()),
        model: "fake-model".into(),
        engine: fake.config(),
        ..switchyard_worker::WorkerConfig::default()
    };
    let registry = Arc::new(MemoryRegistry::new());
    let mut worker =
        support::spawn_worker(config, Some(registry.clone() as Arc<dyn Registry>)).await;
    let listed = registry.list_workers().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].engine, switchyard_core::EngineKind::Trtllm);
    assert_eq!(
        (listed[0].block_size.get(), listed[0].kv_capacity_blocks),
        (4, 64)
    );

    let mut stream = worker
        .client
        .generate(GenerateRequest {
            priority: None,
            request_id: "g".into(),
            prompt_token_ids: seq(1, 9),
            sampling: Some(SamplingParams {
                max_tokens: 3,
                ignore_eos: true,
                ..Default::default()
            }),
            kv_source: None,
            identity: None,
            retention: None,
        })
        .await
        .expect("generate")
        .into_inner();
    let mut tokens = 0;
    while let Some(chunk) = stream.next().await {
        tokens += chunk.expect("chunk").token_ids.len();
    }
    assert_eq!(tokens, 3);

    worker
        .client
        .control(ControlRequest {
            command: Some(v1::control_request::Command::SetRole(v1::SetRole {
                role: v1::Role::Prefill as i32,
            })),
        })
        .await
        .expect("a trtllm worker takes a prefill role");
    // As a prefill worker it answers Prefill with the context engine's disaggregated_params.
    let answer = worker
        .client
        .prefill(v1::PrefillRequest {
            request_id: "p".into(),
            prompt_token_ids: seq(1, 9),
            ..Default::default()
        })
        .await
        .expect("prefill")
        .into_inner();
    let params: serde_json::Value = serde_json::from_str(&answer.engine_transfer_params).unwrap();
    assert_eq!(params["request_type"], "context_only", "{params}");
    assert_eq!(params["first_gen_tokens"], json!([answer.first_token_id]));
    assert_eq!(answer.prompt_tokens, 9);
    assert_eq!(answer.block_hashes.len(), 2);
    let held = fake.admin("transfers", json!({})).await["held"].clone();
    assert_eq!(held, json!([params["ctx_request_id"]]));
    worker.stop().await;
}

fn object(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match value {
        serde_json::Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
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

/// Prefill on one stand-in as a context-only request, decode on another as a generation-only
/// one with the parameters the first handed out: the KV moves between the engines (the
/// generation engine counts the prompt's blocks as transferred, computes none), the answer is
/// the one an aggregated run gives, and parameters nobody holds fail inside the stream.
#[tokio::test]
async fn trtllm_context_phase_hands_its_disaggregated_params_to_the_generation_engine() {
    let flags = ["--block-size", "4", "--num-blocks", "64"];
    let mut ctx_fake = FakeTrtllm::start(&flags).await;
    let gen_fake = FakeTrtllm::start(&flags).await;
    let ctx = start_trtllm(&ctx_fake.config()).await.unwrap();
    let generator = start_trtllm(&gen_fake.config()).await.unwrap();
    let prompt = seq(1, 10);
    let prefill = |prompt: Vec<u32>| PrefillParams {
        request_id: "pd-1".into(),
        prompt,
        hold: Duration::from_secs(30),
        pipelined: false,
        identity: Default::default(),
        retention: Default::default(),
        priority: None,
        sampling: None,
    };

    let outcome = ctx.prefill(prefill(prompt.clone())).await.unwrap();
    // The context server was asked as TensorRT-LLM's own proxy asks it.
    let sent = ctx_fake.admin("requests", json!({})).await["requests"][0].clone();
    assert_eq!(
        sent["disaggregated_params"],
        json!({"request_type": "context_only"})
    );
    assert_eq!(
        (&sent["max_tokens"], &sent["stream"]),
        (&json!(1), &json!(false))
    );
    assert_eq!(sent["prompt"], json!(prompt));
    let transfer =
        object(serde_json::from_str(outcome.engine_transfer_params.as_deref().unwrap()).unwrap());
    assert_eq!(transfer["request_type"], "context_only");
    assert_eq!(transfer["first_gen_tokens"], json!([outcome.first_token]));
    assert!(transfer["encoded_opaque_state"].is_string(), "{transfer:?}");
    let ctx_request_id = transfer["ctx_request_id"].as_u64().unwrap();
    assert_eq!(outcome.handle, format!("trtllm:{ctx_request_id}"));
    assert_eq!(
        outcome.block_hashes,
        block_hashes(&prompt, ctx.spec().block_size)
    );
    assert_eq!(
        (outcome.prompt_tokens, outcome.cached_prompt_tokens),
        (10, 0)
    );
    let held = ctx_fake.admin("transfers", json!({})).await;
    assert_eq!(held["held"], json!([ctx_request_id]));
    assert_eq!(held["computed_tokens"], 10);

    // The generation engine gets the original request with those parameters as a
    // generation-only request and generates the whole completion from the first token on.
    let transferring = generator
        .engine_transfer()
        .expect("a trtllm engine takes transfer params");
    let (tokens, finish) = collect(
        transferring
            .generate_with_transfer(params(prompt.clone(), 4), transfer.clone())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((tokens.len(), finish), (4, FinishReason::Length));
    assert_eq!(tokens[0], outcome.first_token);
    let sent = gen_fake.admin("requests", json!({})).await["requests"][0].clone();
    let mut generation = transfer.clone();
    generation.insert("request_type".into(), json!("generation_only"));
    assert_eq!(
        sent["disaggregated_params"],
        serde_json::Value::Object(generation)
    );
    assert_eq!(sent["stream"], true);
    // The KV moved engine to engine: received, not recomputed, and handed over once.
    let received = gen_fake.admin("transfers", json!({})).await;
    assert_eq!(
        received["received"][0]["outcome"], "transferred",
        "{received}"
    );
    assert_eq!(received["transferred_blocks"], 10 / 4);
    assert_eq!(received["computed_tokens"], 0);
    let handed = ctx_fake.admin("transfers", json!({})).await;
    assert_eq!(
        (&handed["handed_over"], &handed["held"]),
        (&json!(1), &json!([]))
    );
    // The received blocks are in the generation engine's cache, and so in its events.
    let bs = generator.spec().block_size;
    let view = gen_fake.held(bs).await;
    assert!(block_hashes(&prompt, bs).iter().all(|h| view.contains(h)));
    assert_view(&generator, &view).await;

    // Aggregated, the same prompt gives the same completion.
    let (aggregated, _) = collect(ctx.generate(params(prompt.clone(), 4)).await.unwrap()).await;
    assert_eq!(aggregated, tokens);

    // The context engine samples the first token as the request asks (here: its seed), so a
    // seeded request's disaggregated answer is its aggregated one too.
    let seeded = |prompt: Vec<u32>| {
        let mut p = params(prompt, 4);
        p.sampling.seed = Some(11);
        p
    };
    let other = seq(60, 12);
    let outcome = ctx
        .prefill(PrefillParams {
            sampling: Some(seeded(other.clone()).sampling),
            ..prefill(other.clone())
        })
        .await
        .unwrap();
    let sent = ctx_fake.admin("requests", json!({})).await["requests"][2].clone();
    assert_eq!(
        (&sent["seed"], &sent["max_tokens"]),
        (&json!(11), &json!(1))
    );
    let transfer_seeded =
        object(serde_json::from_str(outcome.engine_transfer_params.as_deref().unwrap()).unwrap());
    let (split, _) = collect(
        transferring
            .generate_with_transfer(seeded(other.clone()), transfer_seeded)
            .await
            .unwrap(),
    )
    .await;
    let (whole, _) = collect(ctx.generate(seeded(other)).await.unwrap()).await;
    assert_eq!(split, whole);

    // The same parameters again: the context server no longer holds that request, so the
    // transfer fails, reported inside the stream before any token.
    let mut stream = transferring
        .generate_with_transfer(params(prompt.clone(), 4), transfer.clone())
        .await
        .unwrap();
    match stream.next().await {
        Some(Err(EngineError::Failed(why))) => assert!(why.contains("KV cache transfer"), "{why}"),
        other => panic!("expected the engine's failure, got {other:?}"),
    }
    assert_eq!(
        gen_fake.admin("transfers", json!({})).await["received"][2]["outcome"],
        "failed"
    );

    // vLLM's and SGLang's parameters are not TensorRT-LLM's: refused before the engine.
    for other in [
        r#"{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[0]}"#,
        r#"{"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}"#,
    ] {
        let err = transferring
            .generate_with_transfer(
                params(prompt.clone(), 4),
                object(serde_json::from_str(other).unwrap()),
            )
            .await
            .unwrap_err();
        assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);
    }
    assert_eq!(
        gen_fake.admin("requests", json!({})).await["requests"]
            .as_array()
            .unwrap()
            .len(),
        3,
        "refused parameters never reach the engine"
    );

    // A context engine that went away fails the prefill at once, as the engine's fault.
    ctx_fake.kill().await;
    let err = ctx.prefill(prefill(seq(50, 8))).await.unwrap_err();
    assert!(matches!(err, EngineError::Unavailable(_)), "{err}");
    ctx.shutdown();
    generator.shutdown();
}
