//! Chaos: the control plane misbehaves under real processes (etcd, workers, gateway).
//!
//! - etcd frozen (SIGSTOP) for longer than the workers' lease TTL: when it thaws it revokes
//!   every lease; the workers re-register under new leases and the gateway serves again, with
//!   no request lost to a worker that stays gone.
//! - roles started while etcd is down wait for it (and log that they do) instead of exiting,
//!   and serve once it is up.
//!
//! Recovery times are printed (`--nocapture`) and recorded in docs/BENCHMARKS.md; the tests
//! assert what happens, never how long it took.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::{Api, Launch, chat, eventually};
use switchyard_testkit::EtcdServer;

/// The workers' lease TTL in these tests (etcd's minimum is about 2 s).
const TTL_SECS: u64 = 2;
/// Upper bound for any recovery the tests wait for.
const RECOVERY: Duration = Duration::from_secs(60);

async fn chat_succeeds(api: &Api) -> bool {
    let (status, _) = api
        .post("/v1/chat/completions", &chat("after the outage", 4))
        .await;
    status == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_stall_longer_than_the_lease_ttl_does_not_take_the_cluster_down() {
    let mut etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("stall-{}", std::process::id());
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", &TTL_SECS.to_string())
            .arg("--speedup", "20")
            .id(id)
            .start()
    };
    let _a = worker("stall-a").await;
    let _b = worker("stall-b").await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await, "gateway sees both workers");
    assert!(chat_succeeds(&api).await);

    etcd.pause().unwrap();
    tokio::time::sleep(Duration::from_secs(TTL_SECS * 4)).await;
    let thawed = Instant::now();
    etcd.resume().unwrap();

    // Thawed, etcd revokes the expired leases: the gateway may briefly see no worker. Then the
    // workers re-register and requests are served again.
    let recovered = eventually(RECOVERY, || async {
        api.lists_workers(2).await && chat_succeeds(&api).await
    })
    .await;
    assert!(
        recovered,
        "the cluster never recovered from an etcd stall past the lease TTL"
    );
    eprintln!(
        "recovery after an etcd stall of {} s (TTL {TTL_SECS} s): {:.1} s from SIGCONT to both workers listed and a chat served",
        TTL_SECS * 4,
        thawed.elapsed().as_secs_f64()
    );
    // And it stays up: the new leases are kept alive past their own TTL.
    tokio::time::sleep(Duration::from_secs(TTL_SECS * 2)).await;
    assert!(api.lists_workers(2).await);
    assert!(chat_succeeds(&api).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_started_while_etcd_is_down_wait_for_it_and_then_serve() {
    let mut etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("late-{}", std::process::id());
    etcd.stop();

    // Each waits for its ready line, which comes only once etcd is up: start them together and
    // bring etcd back a few seconds later.
    let started = Instant::now();
    let worker = Launch::worker(&endpoint, &cluster)
        .arg("--lease-ttl-secs", &TTL_SECS.to_string())
        .arg("--speedup", "20")
        .id("late-worker")
        .start();
    let gateway = Launch::gateway(&endpoint, &cluster).start();
    let revive = async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        tokio::task::block_in_place(|| etcd.restart()).expect("etcd restarts");
        Instant::now()
    };
    let (mut worker, gateway, etcd_up) = tokio::join!(worker, gateway, revive);
    assert!(
        etcd_up.duration_since(started) >= Duration::from_secs(4),
        "etcd came back before the roles started waiting"
    );
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await, "the late worker is listed");
    assert!(chat_succeeds(&api).await);
    eprintln!(
        "roles started {:.1} s before etcd: ready {:.1} s after it came up",
        etcd_up.duration_since(started).as_secs_f64(),
        etcd_up.elapsed().as_secs_f64()
    );
    let status = worker.terminate().await;
    assert!(status.success(), "a clean shutdown: {status}");
}
