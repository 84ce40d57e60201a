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

    // Disaggregation is refused, not faked.
    let prefill = engine
        .prefill(PrefillParams {
            request_id: "p".into(),
            prompt: seq(1, 8),
            hold: Duration::from_secs(1),
            pipelined: false,
            identity: Default::default(),
            retention: Default::default(),
        })
        .await;
    assert!(matches!(prefill, Err(EngineError::Unsupported(_))));
    assert!(engine.engine_transfer().is_none());

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
/// `Generate` over gRPC, and refuses a prefill or decode role (disaggregation is not wired).
#[tokio::test]
async fn a_trtllm_worker_registers_serves_grpc_and_refuses_a_disaggregated_role() {
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

    let refused = worker
        .client
        .control(ControlRequest {
            command: Some(v1::control_request::Command::SetRole(v1::SetRole {
                role: v1::Role::Prefill as i32,
            })),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused}");
    assert!(refused.message().contains("TensorRT-LLM"), "{refused}");
    worker.stop().await;
}
