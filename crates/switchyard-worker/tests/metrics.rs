//! The worker's `/metrics`, scraped over HTTP from in-process workers while real gRPC calls run
//! against them: each family must move by exactly what the calls did.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::time::Duration;

use crate::support;

use futures::StreamExt;
use support::{InProcessWorker as Worker, spawn_worker};
use switchyard_core::{BlockSize, Role};
use switchyard_proto::v1::{
    self, ControlRequest, GenerateRequest, KvEventsRequest, KvHandle, KvSource, PrefillRequest,
    SamplingParams, control_request,
};
use switchyard_worker::WorkerConfig;

const BLOCK: u32 = 16;
const KV_BYTES_PER_TOKEN: u64 = 131_072;

async fn start(id: &str, role: Role, speedup: f64) -> Worker {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup,
        drain_timeout_secs: 5,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(BLOCK).unwrap();
    config.sim.num_device_blocks = 256;
    config.sim.max_context_tokens = 8192;
    spawn_worker(config, None).await
}

/// A scrape, read series by series.
struct Scrape(String);

impl Scrape {
    async fn of(worker: &Worker) -> Self {
        Self(worker.scrape().await)
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        switchyard_worker::metrics::sample(&self.0, name, labels)
            .unwrap_or_else(|| panic!("no {name}{labels:?} in\n{}", self.0))
    }

    fn requests(&self, kind: &str, code: &str) -> f64 {
        let name = "switchyard_worker_requests_total";
        switchyard_worker::metrics::sample(&self.0, name, &[("kind", kind), ("code", code)])
            .unwrap_or(0.0)
    }
}

/// Scrapes until `name{labels}` equals `want` (what the worker does after a call returns, such
/// as releasing a stream, lands a moment later).
async fn until(worker: &Worker, name: &str, labels: &[(&str, &str)], want: f64) -> Scrape {
    let mut last = 0.0;
    for _ in 0..200 {
        let scrape = Scrape::of(worker).await;
        last = scrape.get(name, labels);
        if last == want {
            return scrape;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{name}{labels:?} stayed at {last}, expected {want}");
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|i| salt + i * 7).collect()
}

fn generate(prompt: Vec<u32>, max_tokens: u32, source: Option<KvSource>) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "g".into(),
        prompt_token_ids: prompt,
        sampling: Some(SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source: source,
        identity: None,
        retention: None,
    }
}

fn prefill(prompt: Vec<u32>, hold_ms: u32) -> PrefillRequest {
    PrefillRequest {
        priority: None,
        request_id: "p".into(),
        prompt_token_ids: prompt,
        hold_ms,
        pipelined: false,
        identity: None,
        retention: None,
        sampling: None,
    }
}

async fn run(worker: &mut Worker, req: GenerateRequest) -> Result<usize, tonic::Status> {
    let mut stream = worker.client.generate(req).await?.into_inner();
    let mut tokens = 0;
    while let Some(message) = stream.next().await {
        tokens += message?.token_ids.len();
    }
    Ok(tokens)
}

#[tokio::test]
async fn generate_counts_requests_tokens_latencies_load_and_state() {
    let mut w = start("m-both", Role::Both, 100.0).await;
    let before = Scrape::of(&w).await;
    assert_eq!(
        before.get("switchyard_worker_role", &[("role", "both")]),
        1.0
    );
    assert_eq!(
        before.get("switchyard_worker_role", &[("role", "prefill")]),
        0.0
    );
    assert_eq!(before.get("switchyard_worker_draining", &[]), 0.0);
    assert_eq!(
        before.get("switchyard_worker_kv_capacity_blocks", &[]),
        256.0
    );
    // The worker id is on every series.
    assert_eq!(
        before.get(
            "switchyard_worker_requests_total",
            &[("worker", "m-both"), ("kind", "generate"), ("code", "ok")]
        ),
        0.0
    );

    assert_eq!(
        run(&mut w, generate(prompt(40, 3), 5, None)).await.unwrap(),
        5
    );
    let err = run(&mut w, generate(Vec::new(), 5, None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let after = Scrape::of(&w).await;
    let delta =
        |name: &str, labels: &[(&str, &str)]| after.get(name, labels) - before.get(name, labels);
    assert_eq!(
        after.requests("generate", "ok") - before.requests("generate", "ok"),
        1.0
    );
    assert_eq!(after.requests("generate", "invalid_argument"), 1.0);
    let kind = [("kind", "generate")];
    assert_eq!(
        after.get("switchyard_worker_prompt_tokens_total", &kind),
        40.0
    );
    assert_eq!(
        after.get("switchyard_worker_cached_prompt_tokens_total", &kind),
        0.0
    );
    assert_eq!(delta("switchyard_worker_completion_tokens_total", &[]), 5.0);
    // One first token, four gaps after it (the simulator sends one token per chunk).
    assert_eq!(
        delta("switchyard_worker_time_to_first_token_seconds_count", &[]),
        1.0
    );
    assert_eq!(
        delta("switchyard_worker_inter_token_latency_seconds_count", &[]),
        4.0
    );
    // The prompt's two full blocks were stored and published.
    assert!(delta("switchyard_worker_kv_events_published_total", &[]) >= 1.0);
    assert!(after.get("switchyard_worker_kv_used_blocks", &[]) >= 2.0);

    // The same prompt again hits the cache: its full blocks count as cached.
    assert_eq!(
        run(&mut w, generate(prompt(40, 3), 1, None)).await.unwrap(),
        1
    );
    let again = Scrape::of(&w).await;
    assert_eq!(
        again.get("switchyard_worker_cached_prompt_tokens_total", &kind),
        32.0
    );

    // Drain and a new role show at once.
    w.client
        .control(ControlRequest {
            command: Some(control_request::Command::SetRole(v1::SetRole {
                role: v1::Role::Decode.into(),
            })),
        })
        .await
        .unwrap();
    w.client
        .control(ControlRequest {
            command: Some(control_request::Command::Drain(v1::Drain { wait_ms: 0 })),
        })
        .await
        .unwrap();
    let drained = Scrape::of(&w).await;
    assert_eq!(drained.get("switchyard_worker_draining", &[]), 1.0);
    assert_eq!(
        drained.get("switchyard_worker_role", &[("role", "decode")]),
        1.0
    );
    assert_eq!(
        drained.get("switchyard_worker_role", &[("role", "both")]),
        0.0
    );
    let err = run(&mut w, generate(prompt(8, 1), 1, None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(
        Scrape::of(&w).await.requests("generate", "unavailable"),
        1.0
    );
    w.stop().await;
}

#[tokio::test]
async fn a_stream_in_flight_then_dropped_counts_as_cancelled() {
    // Real time: 4,000 tokens take seconds, so the stream is surely still running.
    let mut w = start("m-cancel", Role::Both, 1.0).await;
    let mut stream = w
        .client
        .generate(generate(prompt(16, 5), 4000, None))
        .await
        .unwrap()
        .into_inner();
    stream.next().await.unwrap().unwrap();
    let running = Scrape::of(&w).await;
    assert_eq!(
        running.get("switchyard_worker_requests_in_flight", &[]),
        1.0
    );
    assert_eq!(
        running.get("switchyard_worker_engine_running_requests", &[]),
        1.0
    );
    assert_eq!(running.requests("generate", "cancelled"), 0.0);
    drop(stream);
    until(&w, "switchyard_worker_requests_in_flight", &[], 0.0).await;
    let after = until(
        &w,
        "switchyard_worker_requests_total",
        &[("kind", "generate"), ("code", "cancelled")],
        1.0,
    )
    .await;
    assert_eq!(after.requests("generate", "ok"), 0.0);
    w.stop().await;
}

#[tokio::test]
async fn kv_event_subscribers_and_subscriptions() {
    let mut w = start("m-events", Role::Both, 100.0).await;
    let before = Scrape::of(&w).await;
    assert_eq!(
        before.get("switchyard_worker_kv_event_subscribers", &[]),
        0.0
    );
    let mut events = w
        .client
        .kv_events(KvEventsRequest {
            digest_interval_ms: 0,
            max_batch_events: 0,
            from_seq: None,
            incarnation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    // The first message is the snapshot: the subscription exists by now.
    events.next().await.unwrap().unwrap();
    let during = Scrape::of(&w).await;
    assert_eq!(
        during.get("switchyard_worker_kv_event_subscribers", &[]),
        1.0
    );
    let snapshots = [("start", "snapshot")];
    assert_eq!(
        during.get("switchyard_worker_kv_event_subscriptions_total", &snapshots)
            - before.get("switchyard_worker_kv_event_subscriptions_total", &snapshots),
        1.0
    );
    drop(events);
    until(&w, "switchyard_worker_kv_event_subscribers", &[], 0.0).await;
    w.stop().await;
}

#[tokio::test]
async fn prefill_pull_and_import_count_on_both_sides() {
    let mut p = start("m-prefill", Role::Prefill, 100.0).await;
    let mut d = start("m-decode", Role::Decode, 100.0).await;
    let (p0, d0) = (Scrape::of(&p).await, Scrape::of(&d).await);
    assert_eq!(p0.get("switchyard_worker_kv_handles_held", &[]), 0.0);

    let tokens = prompt(320, 11); // 20 full blocks
    let answer = p
        .client
        .prefill(prefill(tokens.clone(), 0))
        .await
        .unwrap()
        .into_inner();
    let p1 = Scrape::of(&p).await;
    assert_eq!(p1.requests("prefill", "ok"), 1.0);
    assert_eq!(
        p1.get(
            "switchyard_worker_prompt_tokens_total",
            &[("kind", "prefill")]
        ),
        320.0
    );
    assert_eq!(
        p1.get("switchyard_worker_prefill_duration_seconds_count", &[]),
        1.0
    );
    assert_eq!(p1.get("switchyard_worker_kv_handles_held", &[]), 1.0);

    let source = KvSource {
        address: p.addr.to_string(),
        handle: answer.handle.clone(),
        first_token_id: answer.first_token_id,
        cached_prompt_tokens: answer.cached_prompt_tokens,
        ..Default::default()
    };
    assert_eq!(
        run(&mut d, generate(tokens, 3, Some(source.clone())))
            .await
            .unwrap(),
        3
    );

    let blocks = 20.0;
    let bytes = blocks * f64::from(BLOCK) * KV_BYTES_PER_TOKEN as f64;
    let served = [("direction", "served")];
    let received = [("direction", "received")];
    let p2 = until(&p, "switchyard_worker_kv_handles_held", &[], 0.0).await;
    assert_eq!(p2.requests("pull", "ok"), 1.0);
    assert_eq!(p2.get("switchyard_worker_kv_pulls_total", &served), 1.0);
    assert_eq!(
        p2.get("switchyard_worker_kv_transfer_blocks_total", &served),
        blocks
    );
    assert_eq!(
        p2.get("switchyard_worker_kv_transfer_bytes_total", &served),
        bytes
    );
    assert_eq!(
        p2.get("switchyard_worker_kv_pulls_total", &received)
            - p0.get("switchyard_worker_kv_pulls_total", &received),
        0.0
    );

    let d1 = Scrape::of(&d).await;
    assert_eq!(d1.requests("generate", "ok"), 1.0);
    assert_eq!(d1.get("switchyard_worker_kv_pulls_total", &received), 1.0);
    assert_eq!(
        d1.get("switchyard_worker_kv_transfer_blocks_total", &received),
        blocks
    );
    assert_eq!(
        d1.get("switchyard_worker_kv_transfer_bytes_total", &received),
        bytes
    );
    assert_eq!(
        d1.get("switchyard_worker_kv_transfer_seconds_count", &[]),
        1.0
    );
    // Same layouts on both sides: one contiguous copy per block, nothing to coalesce.
    let planned = d1.get(
        "switchyard_worker_kv_transfer_descriptors_total",
        &[("stage", "planned")],
    );
    let issued = d1.get(
        "switchyard_worker_kv_transfer_descriptors_total",
        &[("stage", "issued")],
    );
    assert!(
        planned >= blocks && issued >= 1.0 && issued <= planned,
        "{planned} {issued}"
    );
    assert_eq!(
        d1.get("switchyard_worker_completion_tokens_total", &[])
            - d0.get("switchyard_worker_completion_tokens_total", &[]),
        3.0
    );

    // The handle is spent: a second pull is refused at the source, and counted on both sides.
    let err = run(&mut d, generate(prompt(320, 11), 3, Some(source)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    let d2 = Scrape::of(&d).await;
    assert_eq!(
        d2.get(
            "switchyard_worker_kv_pull_failures_total",
            &[("reason", "source_error")]
        ),
        1.0
    );
    assert_eq!(d2.requests("generate", "unavailable"), 1.0);
    assert_eq!(Scrape::of(&p).await.requests("pull", "not_found"), 1.0);

    // A prefill worker that is gone: the pull cannot connect.
    let gone = KvSource {
        address: "127.0.0.1:1".into(),
        handle: Some(KvHandle { id: "kv-x".into() }),
        ..Default::default()
    };
    run(&mut d, generate(prompt(32, 2), 2, Some(gone)))
        .await
        .unwrap_err();
    let d3 = Scrape::of(&d).await;
    assert_eq!(
        d3.get(
            "switchyard_worker_kv_pull_failures_total",
            &[("reason", "connect")]
        ),
        1.0
    );

    // A handle nobody pulls expires and releases its blocks.
    p.client.prefill(prefill(prompt(64, 99), 30)).await.unwrap();
    let expired = until(&p, "switchyard_worker_kv_handles_expired_total", &[], 1.0).await;
    assert_eq!(expired.get("switchyard_worker_kv_handles_held", &[]), 0.0);
    p.stop().await;
    d.stop().await;
}

#[tokio::test]
async fn a_retention_hint_reaches_the_simulator_and_is_counted() {
    let mut worker = start("sim-retain", Role::Both, 50.0).await;
    let hinted = GenerateRequest {
        retention: Some(v1::RetentionHint {
            ttl_ms: 600_000,
            priority: 1,
        }),
        ..generate(prompt(64, 1), 2, None)
    };
    run(&mut worker, hinted).await.unwrap();
    // The four full prompt blocks stay pinned, idle, after the request ended.
    let scrape = until(&worker, "switchyard_worker_kv_retained_blocks", &[], 4.0).await;
    let hints = "switchyard_worker_retention_hints_total";
    assert_eq!(scrape.get(hints, &[("outcome", "passed")]), 1.0);
    assert_eq!(scrape.get(hints, &[("outcome", "unhonoured")]), 0.0);
    // Without a hint nothing more is pinned.
    run(&mut worker, generate(prompt(64, 5000), 2, None))
        .await
        .unwrap();
    let scrape = Scrape::of(&worker).await;
    assert_eq!(scrape.get("switchyard_worker_kv_retained_blocks", &[]), 4.0);
    assert_eq!(scrape.get(hints, &[("outcome", "passed")]), 1.0);
    // A priority past the wire's range is the caller's error.
    let bad = GenerateRequest {
        retention: Some(v1::RetentionHint {
            ttl_ms: 1,
            priority: 256,
        }),
        ..generate(prompt(64, 9000), 2, None)
    };
    let err = run(&mut worker, bad).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("retention priority"), "{err}");
    // A hinted request the worker refuses is not counted.
    let mut prefill_only = start("sim-retain-p", Role::Prefill, 50.0).await;
    let refused = GenerateRequest {
        retention: Some(v1::RetentionHint {
            ttl_ms: 600_000,
            priority: 1,
        }),
        ..generate(prompt(64, 1), 2, None)
    };
    let err = run(&mut prefill_only, refused).await.unwrap_err();
    assert!(err.message().contains("does not generate"), "{err}");
    let scrape = Scrape::of(&prefill_only).await;
    assert_eq!(scrape.get(hints, &[("outcome", "passed")]), 0.0);
    assert_eq!(scrape.get(hints, &[("outcome", "unhonoured")]), 0.0);
}
