//! Chaos: the control plane misbehaves under real processes (etcd, workers, gateway).
//!
//! - etcd frozen (SIGSTOP) for longer than the workers' lease TTL: when it thaws it revokes
//!   every lease; the workers re-register under new leases and the gateway serves again, with
//!   no request lost to a worker that stays gone.
//! - roles started while etcd is down wait for it (and log that they do) instead of exiting,
//!   and serve once it is up.
//! - etcd SIGKILLed under load and restarted on its data and ports after more than a TTL:
//!   requests keep flowing (none lost, no 5xx), the leases are kept alive again, and the
//!   gateway's watch resumes (a worker registered after the restart is routed to).
//! - etcd restarted with an empty data directory (keys, leases and revisions all lost): the
//!   workers register again, the gateway follows the new etcd, and no request is lost.
//!
//! `SWITCHYARD_CHAOS_FULL=1` runs longer outages and more load.
//!
//! Recovery times are printed (`--nocapture`) and recorded in docs/BENCHMARKS.md; the tests
//! assert what happens, never how long it took.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::{Duration, Instant};

use support::load::{Load, LoadSpec};
use support::{Api, Launch, chaos_full, chat, eventually};
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

/// The gateway's routing decisions of the last `limit` requests chose `id` at least once.
async fn recently_chosen(api: &Api, id: &str, limit: usize) -> bool {
    let (_, decisions) = api.get(&format!("/admin/decisions?limit={limit}")).await;
    decisions
        .as_array()
        .is_some_and(|d| d.iter().any(|d| d["explanation"]["chosen"] == id))
}

/// The workers etcd itself lists (not the gateway's view).
async fn registered_in_etcd(endpoint: &str, cluster: &str) -> usize {
    let Ok(registry) =
        switchyard_registry::EtcdRegistry::connect(&[endpoint.to_owned()], cluster).await
    else {
        return 0;
    };
    use switchyard_registry::Registry as _;
    registry.list_workers().await.map_or(0, |w| w.len())
}

/// A worker of these tests: short lease, fast simulated engine.
fn quick_worker(endpoint: &str, cluster: &str, id: &str) -> Launch {
    Launch::worker(endpoint, cluster)
        .arg("--lease-ttl-secs", &TTL_SECS.to_string())
        .arg("--speedup", "20")
        .id(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted_on_its_data_loses_no_request() {
    let mut etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("etcdkill-{}", std::process::id());
    let _a = quick_worker(&endpoint, &cluster, "etcdkill-a")
        .start()
        .await;
    let _b = quick_worker(&endpoint, &cluster, "etcdkill-b")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--policy", "round-robin")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);
    let load = Load::start(
        &api.base,
        LoadSpec::new(if chaos_full() { 6 } else { 3 }, 8),
    );
    assert!(load.wait_for(6, RECOVERY).await, "the load runs");

    // Down for longer than the lease TTL: a restarted etcd renews every lease it had.
    let down_for = Duration::from_secs(if chaos_full() { 30 } else { TTL_SECS * 2 });
    let killed = Instant::now();
    etcd.stop();
    assert!(
        load.wait_for(6, RECOVERY).await,
        "requests are served while etcd is down"
    );
    tokio::time::sleep(down_for.saturating_sub(killed.elapsed())).await;
    tokio::task::block_in_place(|| etcd.restart()).expect("etcd restarts");
    let restarted = Instant::now();

    // The gateway's watch resumes: a worker registered after the restart is routed to.
    let _c = quick_worker(&endpoint, &cluster, "etcdkill-c")
        .start()
        .await;
    assert!(api.lists_workers(3).await, "the new worker is listed");
    let routed = eventually(RECOVERY, || recently_chosen(&api, "etcdkill-c", 6)).await;
    assert!(routed, "the new worker is routed to");
    eprintln!(
        "etcd SIGKILLed for {:.1} s (TTL {TTL_SECS} s), restarted on its data: a worker started after the restart routed to {:.2} s after etcd was back",
        down_for.as_secs_f64(),
        restarted.elapsed().as_secs_f64()
    );
    // The leases are kept alive again: past another two TTLs all three are still in etcd.
    tokio::time::sleep(Duration::from_secs(TTL_SECS * 2)).await;
    assert_eq!(registered_in_etcd(&endpoint, &cluster).await, 3);
    assert!(api.lists_workers(3).await);

    let report = load.stop().await;
    assert!(report.lost.is_empty(), "requests lost: {:#?}", report.lost);
    assert_eq!(report.server_errors, 0, "no 5xx while etcd was away");
    eprintln!(
        "load across the etcd restart: {} requests served, longest gap {:.2} s",
        report.ok,
        report.longest_gap_after(killed).as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restarted_empty_gets_every_worker_registered_again() {
    let mut etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("etcdwipe-{}", std::process::id());
    let _a = quick_worker(&endpoint, &cluster, "etcdwipe-a")
        .start()
        .await;
    let _b = quick_worker(&endpoint, &cluster, "etcdwipe-b")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--policy", "round-robin")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);
    let load = Load::start(
        &api.base,
        LoadSpec::new(if chaos_full() { 6 } else { 3 }, 8),
    );
    assert!(load.wait_for(6, RECOVERY).await, "the load runs");

    // Everything etcd knew is gone: keys, leases, revisions.
    let wiped = Instant::now();
    tokio::task::block_in_place(|| etcd.restart_empty()).expect("etcd restarts empty");
    let restarted = Instant::now();
    let registered = eventually(RECOVERY, || async {
        registered_in_etcd(&endpoint, &cluster).await == 2
    })
    .await;
    assert!(registered, "the workers register again in the empty etcd");
    let reregistered = restarted.elapsed();
    let _c = quick_worker(&endpoint, &cluster, "etcdwipe-c")
        .start()
        .await;
    assert!(
        api.lists_workers(3).await,
        "the gateway follows the new etcd"
    );
    let routed = eventually(RECOVERY, || recently_chosen(&api, "etcdwipe-c", 6)).await;
    assert!(routed, "a worker registered in the new etcd is routed to");
    eprintln!(
        "etcd restarted empty: both workers registered again {:.2} s after it was back (wiped and restarted in {:.2} s); a new worker routed to {:.2} s after",
        reregistered.as_secs_f64(),
        restarted.duration_since(wiped).as_secs_f64(),
        restarted.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(TTL_SECS * 2)).await;
    assert_eq!(registered_in_etcd(&endpoint, &cluster).await, 3);

    let report = load.stop().await;
    assert!(report.lost.is_empty(), "requests lost: {:#?}", report.lost);
    // The gateway kept the workers through the resync that found etcd empty.
    assert_eq!(
        report.server_errors, 0,
        "no 5xx while the workers re-registered"
    );
    eprintln!(
        "load across the empty restart: {} requests served, {} 5xx, longest gap {:.2} s",
        report.ok,
        report.server_errors,
        report.longest_gap_after(wiped).as_secs_f64()
    );
}
