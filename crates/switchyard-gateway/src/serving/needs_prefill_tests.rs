//! Workers that serve only with a prefill worker's KV (SGLang decode servers): the router never
//! gives them an aggregated request. Checked on a real pool whose workers listen nowhere: every
//! path here decides before a request would reach a decode worker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::{BlockSize, EngineKind, KvIdentity, Role, WorkerId, WorkerInfo};
use switchyard_router::serve::{DecodeFilter, ServeSettings};
use tokio::time::Instant;
use tracing::Span;

use crate::cluster::pool::ModelRoutes;
use crate::cluster::pool::test_pool::TestPool;
use crate::error::ApiError;
use crate::serving::disagg::{self, DisaggSettings, Disaggregation};
use crate::serving::dispatch::{self, DispatchEvent, GenerateJob};
use crate::serving::routing::{self, needs_prefill};

fn info(id: &str, role: Role, engine: EngineKind) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).unwrap(),
        // Nothing listens on port 1: a call fails at once with connection refused.
        address: "127.0.0.1:1".into(),
        model: "m".into(),
        role,
        block_size: BlockSize::new(4).unwrap(),
        kv_capacity_blocks: 100,
        max_context_tokens: 10_000,
        engine,
        incarnation: 1,
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    }
}

fn pool(workers: &[WorkerInfo]) -> (TestPool, Arc<ModelRoutes>) {
    let pool = TestPool::new(64, workers);
    let routes = pool.model("m").unwrap();
    (pool, routes)
}

fn auto() -> DisaggSettings {
    DisaggSettings {
        serve: ServeSettings {
            disaggregation: Disaggregation::Auto,
            min_uncached_tokens: 1000,
            ..ServeSettings::default()
        },
        prefill_timeout: Duration::from_secs(5),
        ..DisaggSettings::default()
    }
}

fn ids(c: &routing::Candidates) -> Vec<String> {
    let mut ids: Vec<String> = c.ids().iter().map(|c| c.worker.to_string()).collect();
    ids.sort();
    ids
}

#[test]
fn only_sglang_decode_workers_need_a_prefill() {
    assert!(needs_prefill(&info("d", Role::Decode, EngineKind::Sglang)));
    assert!(!needs_prefill(&info("b", Role::Both, EngineKind::Sglang)));
    assert!(!needs_prefill(&info("v", Role::Decode, EngineKind::Vllm)));
    assert!(!needs_prefill(&info("s", Role::Decode, EngineKind::Sim)));
}

#[tokio::test]
async fn aggregated_routes_leave_out_workers_that_need_a_prefill() {
    let (pool, routes) = pool(&[
        info("sglang-decode", Role::Decode, EngineKind::Sglang),
        info("sglang-both", Role::Both, EngineKind::Sglang),
        info("vllm-decode", Role::Decode, EngineKind::Vllm),
    ]);
    assert_eq!(
        ids(&routing::candidates(
            &pool,
            &routes,
            DecodeFilter::default()
        )),
        ["sglang-both", "sglang-decode", "vllm-decode"]
    );
    let aggregated = DecodeFilter {
        aggregated_only: true,
        ..DecodeFilter::default()
    };
    assert_eq!(
        ids(&routing::candidates(&pool, &routes, aggregated)),
        ["sglang-both", "vllm-decode"]
    );
    pool.shutdown().await;
}

/// Under `auto`, a short prompt on a decode worker that needs a prefill still tries the prefill
/// pool; when every prefill worker fails (nothing listens on its address) the request is
/// rerouted rather than sent bare to that worker, and `enforce` fails with the prefill
/// failures. Every booking of those attempts is released.
#[tokio::test]
async fn failing_prefill_workers_end_in_a_reroute_not_an_aggregated_request() {
    let (p, r) = pool(&[
        info("d", Role::Decode, EngineKind::Sglang),
        info("p", Role::Prefill, EngineKind::Sglang),
    ]);
    match failure(&p, job(&r, Disaggregation::Auto)).await {
        ApiError::Unavailable(message) => {
            assert!(
                message.contains("decode worker d (sglang, role decode)"),
                "{message}"
            );
            assert!(message.contains("prefill failed everywhere"), "{message}");
        }
        other => panic!("expected a 503, got {other:?}"),
    }
    match failure(&p, job(&r, Disaggregation::Enforce)).await {
        ApiError::Unavailable(message) => {
            assert!(message.contains("every prefill worker failed"), "{message}")
        }
        other => panic!("expected a 503, got {other:?}"),
    }
    // The decode decision and the prefill decision of each try are logged with their ends.
    let log: Vec<(String, crate::observe::audit::OutcomeStatus)> = p
        .observers
        .decisions
        .entries()
        .iter()
        .map(|d| (d.decision.worker.to_string(), d.outcome().status))
        .collect();
    use crate::observe::audit::OutcomeStatus::{Failed, Rerouted};
    assert_eq!(
        log,
        [
            ("d".to_owned(), Rerouted),
            ("p".to_owned(), Failed),
            ("d".to_owned(), Failed),
            ("p".to_owned(), Failed),
        ],
        "{log:?}"
    );
    assert!(r.lock().serving.load.bookings().is_empty());
    p.shutdown().await;
}

#[tokio::test]
async fn explain_shows_the_forced_prefill_and_the_reroute() {
    let d = WorkerId::new("d").unwrap();
    let tokens: Vec<u32> = (0..16).collect();
    let (p, r) = pool(&[info("d", Role::Decode, EngineKind::Sglang)]);
    let request = routing::route_request(&p, &r, &tokens, &KvIdentity::PLAIN, None);
    let explained = disagg::explain(&p, &r, &auto(), &d, &request, 16);
    assert_eq!(explained.mode, "rerouted");
    assert!(
        explained
            .why
            .contains("serves only requests whose KV comes from a prefill worker"),
        "{}",
        explained.why
    );
    p.upsert_worker(info("p", Role::Prefill, EngineKind::Sglang));
    let explained = disagg::explain(&p, &r, &auto(), &d, &request, 16);
    assert_eq!(explained.mode, "disaggregated");
    assert!(
        explained.why.contains("whatever the threshold"),
        "{}",
        explained.why
    );
    p.shutdown().await;
}

fn job(routes: &Arc<ModelRoutes>, mode: Disaggregation) -> GenerateJob {
    GenerateJob {
        prompt_hashes: None,
        request_id: "r".into(),
        tags: Arc::new(crate::observe::audit::RequestTags::new("r")),
        routes: Arc::clone(routes),
        prompt: (0..16).collect(),
        identity: switchyard_core::KvIdentity::PLAIN,
        sampling: switchyard_core::Sampling {
            max_tokens: 4,
            temperature: Some(0.0),
            ignore_eos: true,
            ..switchyard_core::Sampling::default()
        },
        session: None,
        deadline: Instant::now() + Duration::from_secs(30),
        max_retries: 1,
        max_migrations: 0,
        disagg: DisaggSettings {
            serve: ServeSettings {
                disaggregation: mode,
                ..auto().serve
            },
            ..auto()
        },
        span: Span::none(),
        retention: Default::default(),
        priority: None,
    }
}

async fn failure(pool: &TestPool, job: GenerateJob) -> ApiError {
    let transport: Arc<dyn crate::serving::transport::WorkerTransport> =
        Arc::new(crate::serving::transport::GrpcTransport::new(Arc::clone(
            &pool.followers.context().connections,
        )));
    let mut events = dispatch::start(
        &pool.pool,
        &pool.observers,
        &transport,
        &pool.followers.context().tasks,
        job,
    );
    loop {
        match events.recv().await.expect("an outcome") {
            DispatchEvent::Failed(err) => return err,
            DispatchEvent::Started { worker, .. } => panic!("started on {worker}"),
            _ => {}
        }
    }
}

/// The only decode worker needs a prefill and none can be had: a 503 that says why, never a
/// bare prompt sent to it (it listens nowhere here, which would show as a worker failure, 502).
#[tokio::test]
async fn without_a_prefill_or_an_aggregated_worker_the_request_fails_with_a_reason() {
    let (p, r) = pool(&[info("sglang-decode", Role::Decode, EngineKind::Sglang)]);
    match failure(&p, job(&r, Disaggregation::Auto)).await {
        ApiError::Unavailable(message) => {
            assert!(message.contains("decode worker sglang-decode"), "{message}");
            assert!(message.contains("no prefill worker"), "{message}");
            assert!(
                message.contains("no worker that serves without a prefill worker"),
                "{message}"
            );
        }
        other => panic!("expected a 503, got {other:?}"),
    }
    match failure(&p, job(&r, Disaggregation::Off)).await {
        ApiError::Unavailable(message) => {
            assert!(message.contains("disaggregation is off"), "{message}");
        }
        other => panic!("expected a 503, got {other:?}"),
    }
    // The decision log shows the decode worker was chosen under `auto` and then rerouted; no
    // route ever went to it with disaggregation off.
    let log: Vec<String> = p
        .observers
        .decisions
        .entries()
        .iter()
        .map(|d| d.decision.worker.to_string())
        .collect();
    assert_eq!(log, ["sglang-decode"], "{log:?}");
    p.shutdown().await;
}

/// A rerouted request's second decode decision goes to a worker that serves aggregated and
/// carries the reason in the decision log.
#[tokio::test]
async fn a_rerouted_request_lands_on_an_aggregated_worker_with_the_reason_logged() {
    let (p, r) = pool(&[
        info("sglang-decode", Role::Decode, EngineKind::Sglang),
        info("sglang-both", Role::Both, EngineKind::Sglang),
    ]);
    // Queued prefill work on the `both` worker makes the SGLang decode worker the policy's
    // choice, so the request needs a prefill, gets none, and is rerouted.
    r.lock().serving.load.on_routed(
        &WorkerId::new("sglang-both").unwrap(),
        u64::MAX,
        10_000,
        10,
        p.now_tick(),
    );
    // The `both` worker listens nowhere, so the request then fails as that worker's fault;
    // the decision log is what this checks.
    let _ = failure(&p, job(&r, Disaggregation::Auto)).await;
    let log: Vec<(String, Option<String>)> = p
        .observers
        .decisions
        .entries()
        .iter()
        .map(|d| (d.decision.worker.to_string(), d.note.clone()))
        .collect();
    assert_eq!(log[0], ("sglang-decode".to_owned(), None), "{log:?}");
    assert!(log.len() >= 2, "the request was routed again: {log:?}");
    for (worker, note) in &log[1..] {
        assert_eq!(worker, "sglang-both", "{log:?}");
        let note = note.as_deref().unwrap_or_default();
        assert!(
            note.contains("decode worker sglang-decode (sglang, role decode)")
                && note.contains("no prefill worker"),
            "{log:?}"
        );
    }
    p.shutdown().await;
}
