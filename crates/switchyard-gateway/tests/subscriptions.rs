//! A gateway follows many workers with a bounded number of stream opens in flight, and a worker
//! that never answers holds a permit for a bounded time only: real worker agents over loopback
//! gRPC, the gateway's worker pool subscribed to them (`docs/scaling.md`, "A new gateway").
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::WorkerInfo;
use switchyard_gateway::cluster::pool::WorkerPool;
use switchyard_gateway::cluster::pool::follow::FollowContext;
use switchyard_gateway::cluster::pool::followers::Followers;
use switchyard_gateway::observe::Observers;
use switchyard_gateway::observe::metrics::Metrics;
use switchyard_router::{PolicyConfig, PolicyKind};
use switchyard_worker::WorkerConfig;
use tokio_util::sync::CancellationToken;

/// The bound of every wait (none is a timing figure: a loaded machine only makes them slower).
const WAIT: Duration = Duration::from_secs(60);

async fn start_worker(stop: &CancellationToken, id: &str) -> WorkerInfo {
    let config = WorkerConfig {
        id: Some(id.into()),
        ..WorkerConfig::default()
    };
    support::start_worker(config, stop).await
}

/// A pool's followers, opening at most `concurrency` worker streams at once.
fn followers(concurrency: usize, unresponsive_after: Duration) -> Followers {
    let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
    let observers = Observers::in_memory(8, Arc::new(Metrics::new()), pool.epoch());
    Followers::new(
        pool,
        Arc::new(
            FollowContext::new(&observers, 100)
                .with_unresponsive_after(unresponsive_after)
                .with_subscribe_concurrency(concurrency),
        ),
    )
}

/// Waits until `count` workers are subscribed; panics after [`WAIT`].
async fn until_subscribed(followers: &Followers, count: usize) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let progress = followers.subscription_progress();
        if progress.subscribed >= count {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{count} workers not subscribed within {WAIT:?}: {progress:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_is_subscribed_with_at_most_the_bound_of_opens_in_flight() {
    let stop = CancellationToken::new();
    let mut infos = Vec::new();
    for i in 0..12 {
        infos.push(start_worker(&stop, &format!("w{i}")).await);
    }
    let followers = followers(3, Duration::from_secs(600));
    for info in &infos {
        followers.upsert_worker(info.clone());
    }
    until_subscribed(&followers, infos.len()).await;
    let progress = followers.subscription_progress();
    assert_eq!(progress.workers, 12);
    assert_eq!(progress.concurrency, 3);
    // 24 streams wanted at once: the bound held, and it was in use.
    assert!(
        (2..=3).contains(&progress.peak_opening),
        "opens in flight at once: {progress:?}"
    );
    assert_eq!(progress.opening, 0, "every open is done: {progress:?}");
    assert_eq!(followers.context().metrics.workers_subscribed.get(), 12);
    for info in &infos {
        let routes = followers.pool().model(&info.model).unwrap();
        assert!(
            routes.lock().serving.index.worker_key(&info.id).is_some(),
            "{} snapshot in the index",
            info.id
        );
    }
    // A worker that leaves no longer counts.
    followers.remove_worker(&infos[0].id);
    let progress = followers.subscription_progress();
    assert_eq!((progress.workers, progress.subscribed), (11, 11));
    followers.shutdown().await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_holds_its_permit_for_a_bounded_time_only() {
    let stop = CancellationToken::new();
    let live = start_worker(&stop, "live").await;
    // Accepts connections (the kernel's backlog) and never answers: no HTTP/2 handshake, no
    // snapshot, no load report.
    let frozen_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let frozen = WorkerInfo {
        id: switchyard_core::WorkerId::new("frozen").unwrap(),
        address: frozen_listener.local_addr().unwrap().to_string(),
        incarnation: 1,
        adapters: Vec::new(),
        ..live.clone()
    };
    // One permit, the frozen worker first: the live one is followed once the frozen one's
    // window (its `unresponsive_after`) has passed, not never.
    let followers = followers(1, Duration::from_millis(300));
    followers.upsert_worker(frozen.clone());
    followers.upsert_worker(live.clone());
    until_subscribed(&followers, 1).await;
    assert!(
        followers
            .pool()
            .worker(&live.id)
            .unwrap()
            .subscription
            .is_subscribed()
    );
    assert!(
        !followers
            .pool()
            .worker(&frozen.id)
            .unwrap()
            .subscription
            .is_subscribed()
    );
    let progress = followers.subscription_progress();
    assert_eq!((progress.workers, progress.subscribed), (2, 1));
    assert!(progress.peak_opening <= 1, "{progress:?}");
    followers.shutdown().await;
    stop.cancel();
}
