//! A gateway sees a worker's load change within milliseconds when it asks for pushes: a real
//! worker agent over loopback gRPC, the gateway's worker pool subscribed to it, and a load
//! interval of a minute, so only a pushed report can show the change inside the test's bounds
//! (each wait is under the interval, counted from the report before).
//!
//! The request is sent to the worker directly, not through this gateway: the pool has no
//! bookkeeping of its own for it, as for a request another gateway replica routed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use switchyard_core::{WorkerId, WorkerInfo};
use switchyard_gateway::cluster::pool::follow::FollowContext;
use switchyard_gateway::cluster::pool::followers::Followers;
use switchyard_gateway::cluster::pool::{ModelRoutes, WorkerPool};
use switchyard_gateway::observe::Observers;
use switchyard_gateway::observe::metrics::Metrics;
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_proto::v1::{GenerateRequest, SamplingParams};
use switchyard_router::{PolicyConfig, PolicyKind};
use switchyard_worker::WorkerConfig;
use tokio_util::sync::CancellationToken;

/// The heartbeat: no test wait is this long, so no wait can be satisfied by it.
const LOAD_INTERVAL_MS: u32 = 60_000;
/// Each wait's bound, under the interval.
const WAIT: Duration = Duration::from_secs(30);

async fn start_worker(stop: &CancellationToken) -> WorkerInfo {
    let config = WorkerConfig {
        id: Some("pushing".into()),
        // Slow enough that the request is still generating when its report arrives.
        speedup: 1.0,
        ..WorkerConfig::default()
    };
    support::start_worker(config, stop).await
}

/// Waits until the pool's view of `worker` satisfies `ready`; panics after [`WAIT`].
async fn until_view(
    routes: &ModelRoutes,
    worker: &WorkerId,
    what: &str,
    ready: impl Fn(u64) -> bool,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let running = routes.lock().serving.load.get(worker).running_requests;
        if ready(running) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not seen within {WAIT:?} (running {running}), so not pushed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_change_is_pushed_well_before_the_interval() {
    let stop = CancellationToken::new();
    let info = start_worker(&stop).await;
    let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
    let observers = Observers::in_memory(8, Arc::new(Metrics::new()), pool.epoch());
    let followers = Followers::new(
        Arc::clone(&pool),
        Arc::new(
            FollowContext::new(&observers, LOAD_INTERVAL_MS)
                .with_unresponsive_after(Duration::from_secs(600))
                .with_load_push(5),
        ),
    );
    followers.upsert_worker(info.clone());
    let routes = pool.model(&info.model).expect("the worker's model");
    // The stream's first report goes out at once; it shows an idle worker.
    let deadline = tokio::time::Instant::now() + WAIT;
    while routes.lock().serving.load.get(&info.id).capacity_blocks == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no first load report"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut client = WorkerClient::connect(format!("http://{}", info.address))
        .await
        .unwrap();
    let mut tokens = client
        .generate(GenerateRequest {
            request_id: "elsewhere-routed".into(),
            prompt_token_ids: (0..64).collect(),
            sampling: Some(SamplingParams {
                max_tokens: 2_000,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    tokens.next().await.expect("a first token").unwrap();
    until_view(&routes, &info.id, "a request taken", |running| running == 1).await;

    // Its end (the caller goes away) is pushed too.
    drop(tokens);
    until_view(&routes, &info.id, "a request ended", |running| running == 0).await;
    // The first report and at least one push for each change are counted.
    assert!(observers.metrics.load_reports.get() >= 3);

    followers.shutdown().await;
    stop.cancel();
}

/// With the default settings (pushes on) an idle worker sends its heartbeat and nothing else:
/// no push or settle report while its load does not move. The heartbeat's default length (one
/// a second, not ten: at 1,000 idle workers ≈ 1,000 instead of ≈ 10,000 stream messages a
/// second into every gateway) is pinned by the config tests. The worker stays in routing all
/// the while: its heartbeats come inside `unresponsive_after`, over a window longer than it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_sends_only_its_heartbeat_and_stays_in_routing() {
    let stop = CancellationToken::new();
    let info = start_worker(&stop).await;
    let config = switchyard_gateway::config::GatewayConfig::default();
    let interval = Duration::from_millis(u64::from(config.load_interval_ms()));
    let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
    let observers = Observers::in_memory(8, Arc::new(Metrics::new()), pool.epoch());
    let followers = Followers::new(
        Arc::clone(&pool),
        Arc::new(
            FollowContext::new(&observers, config.load_interval_ms())
                .with_unresponsive_after(config.unresponsive_after())
                .with_load_push(config.load_push_min_ms),
        ),
    );
    followers.upsert_worker(info.clone());
    let deadline = tokio::time::Instant::now() + WAIT;
    while observers.metrics.load_reports.get() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no first report");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = observers.metrics.load_reports.get();
    let started = tokio::time::Instant::now();
    tokio::time::sleep(config.unresponsive_after() + interval).await;
    let reports = observers.metrics.load_reports.get() - before;
    let elapsed = started.elapsed();
    // One report per interval elapsed, plus one for a heartbeat already due at the start: a
    // slow machine only lowers the count (late heartbeats), so the bound cannot fail by load.
    let bound = (elapsed.as_millis() / interval.as_millis()) as u64 + 1;
    assert!(
        reports <= bound,
        "{reports} reports in {elapsed:?} from an idle worker, at most {bound} heartbeats of {interval:?}"
    );
    let worker = pool.worker(&info.id).expect("the worker");
    assert!(
        worker.health.is_answering(),
        "an idle worker fell out of routing between heartbeats"
    );
    followers.shutdown().await;
    stop.cancel();
}
