//! Chaos: the network between the gateway and its workers misbehaves. Each worker advertises
//! the address of a fault-injecting TCP proxy ([`support::fault_proxy`]) in front of its gRPC
//! port, so every byte between the gateway and the worker (generation streams, KV events, load
//! reports) goes through it, while client load keeps running:
//!
//! - connections cut mid-stream: the stream moves to another worker, its tokens continue where
//!   they stopped, and no request is lost;
//! - added latency on every link: requests are slower and none is lost;
//! - a blackholed worker (bytes held, nothing answers) is marked unresponsive and routed
//!   around, and is back once the link heals; so is a worker whose port refuses connections.
//!
//! Recovery times are printed (`--no-capture`) and recorded in docs/BENCHMARKS.md; the tests
//! assert what happens, never how long it took. `SWITCHYARD_CHAOS_FULL=1` runs longer faults
//! and more load.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::fault_proxy::{Fault, FaultProxy};
use support::load::{Load, LoadSpec};
use support::{Api, Launch, SwitchyardProcess, chaos_full, eventually};
use switchyard_testkit::{EtcdServer, free_port};

/// Longer than any test here: a worker leaves routing because the gateway noticed, not because
/// its lease ran out.
const LONG_TTL: &str = "30";
const RECOVERY: Duration = Duration::from_secs(60);

/// A worker whose gRPC port is reached only through its own fault proxy.
struct ProxiedWorker {
    _process: SwitchyardProcess,
    proxy: FaultProxy,
}

async fn proxied_worker(etcd: &str, cluster: &str, id: &str, speedup: &str) -> ProxiedWorker {
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let proxy = FaultProxy::start(listen).await;
    let process = Launch::worker(etcd, cluster)
        .arg("--lease-ttl-secs", LONG_TTL)
        .arg("--speedup", speedup)
        .arg("--listen", &listen.to_string())
        .arg("--advertise-address", &proxy.address().to_string())
        .id(id)
        .start()
        .await;
    assert_eq!(
        process.address,
        proxy.address().to_string(),
        "the worker registers the address it advertises"
    );
    ProxiedWorker {
        _process: process,
        proxy,
    }
}

/// The gateway's view of one worker (`/admin/workers`).
async fn worker_view(api: &Api, id: &str) -> Option<Value> {
    let (_, workers) = api.get("/admin/workers").await;
    workers.as_array()?.iter().find(|w| w["id"] == id).cloned()
}

async fn responsive(api: &Api, id: &str, answering: bool) -> bool {
    eventually(RECOVERY, || async {
        worker_view(api, id)
            .await
            .is_some_and(|w| w["responsive"] == answering)
    })
    .await
}

/// Whether one of the last `limit` routing decisions chose `id`.
async fn recently_chosen(api: &Api, id: &str, limit: usize) -> bool {
    let (_, decisions) = api.get(&format!("/admin/decisions?limit={limit}")).await;
    decisions
        .as_array()
        .is_some_and(|d| d.iter().any(|d| d["explanation"]["chosen"] == id))
}

fn assert_none_lost(report: &support::load::LoadReport) {
    assert!(
        report.lost.is_empty(),
        "{} of {} requests lost: {:#?}",
        report.lost.len(),
        report.ok + report.lost.len() as u64,
        report.lost
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_cut_mid_stream_moves_the_stream_and_loses_no_request() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("cut-{}", std::process::id());
    let a = proxied_worker(&endpoint, &cluster, "cut-a", "2").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--unresponsive-after-ms", "1000")
        .arg("--load-interval-ms", "250")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await);

    // A long stream on a, the only worker; then b joins, load starts, and a's link is cut.
    // The stream must still be running when the link is cut, however slowly b starts and the
    // load gets going on a busy machine, so it is long (seconds of decoding); it finishes on b.
    let max_tokens = if chaos_full() { 4000 } else { 1500 };
    let mut long = support::chat("a long answer", max_tokens);
    long["stream"] = json!(true);
    long["stream_options"] = json!({"include_usage": true});
    let mut response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = Vec::new();
    body.extend_from_slice(&response.chunk().await.unwrap().expect("first chunk"));
    let b = proxied_worker(&endpoint, &cluster, "cut-b", "2").await;
    assert!(api.lists_workers(2).await);
    let load = Load::start(
        &api.base,
        LoadSpec::new(if chaos_full() { 6 } else { 2 }, 8),
    );
    assert!(load.wait_for(4, RECOVERY).await, "the load runs");

    // Every connection to a, and every new one, is cut after another 2 KiB.
    let cut_at = Instant::now();
    a.proxy.set(Fault::CutAfter(2048));
    while let Some(chunk) = response.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    let finished = cut_at.elapsed();
    assert!(
        a.proxy.cut() >= 1,
        "the long stream finished before a's link was cut: nothing was tested"
    );
    let text = String::from_utf8(body).unwrap();
    let events = switchyard_core::sse::events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "the client saw an error: {text}"
    );
    let usage = chunks
        .iter()
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("a usage chunk");
    // Continuous: `completion_tokens` counts the tokens the gateway sent this client, across
    // both workers; a token repeated or skipped at the move would change it.
    assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
    assert!(api.metric("switchyard_dispatch_migrations").await >= 1.0);
    eprintln!(
        "a stream whose link was cut (after 2 KiB) finished on another worker {:.2} s after the cut",
        finished.as_secs_f64()
    );

    // The link heals: a answers again and is routed to.
    let healed = Instant::now();
    a.proxy.set(Fault::Pass);
    assert!(
        responsive(&api, "cut-a", true).await,
        "a returns to routing"
    );
    eprintln!(
        "the cut worker was back in routing {:.2} s after the link healed",
        healed.elapsed().as_secs_f64()
    );
    assert!(load.wait_for(4, RECOVERY).await);
    let report = load.stop().await;
    assert_none_lost(&report);
    eprintln!(
        "load during the cuts: {} requests served, {} client retries, longest gap {:.2} s",
        report.ok,
        report.transport_retries,
        report.longest_gap_after(cut_at).as_secs_f64()
    );
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_latency_slows_requests_and_loses_none() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("delay-{}", std::process::id());
    let a = proxied_worker(&endpoint, &cluster, "delay-a", "20").await;
    let b = proxied_worker(&endpoint, &cluster, "delay-b", "20").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--policy", "round-robin")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);
    let (requests, delay) = if chaos_full() {
        (60, Duration::from_millis(250))
    } else {
        (12, Duration::from_millis(50))
    };

    let load = Load::start(&api.base, LoadSpec::new(3, 16));
    let clear = Instant::now();
    assert!(load.wait_for(requests, RECOVERY).await);
    let clear = clear.elapsed();
    let delayed = Instant::now();
    a.proxy.set(Fault::Delay(delay));
    b.proxy.set(Fault::Delay(delay));
    assert!(
        load.wait_for(requests, RECOVERY * 2).await,
        "requests complete over slow links"
    );
    let slow = delayed.elapsed();
    // Both workers still answer: the delay is far below the silence that marks one down.
    for id in ["delay-a", "delay-b"] {
        assert_eq!(worker_view(&api, id).await.unwrap()["responsive"], true);
    }
    a.proxy.set(Fault::Pass);
    b.proxy.set(Fault::Pass);
    let report = load.stop().await;
    assert_none_lost(&report);
    assert_eq!(report.transport_retries, 0, "no connection failed");
    eprintln!(
        "{requests} requests (3 clients, 16 tokens) took {:.2} s on clear links and {:.2} s with {} ms added to every chunk each way",
        clear.as_secs_f64(),
        slow.as_secs_f64(),
        delay.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_or_refusing_worker_is_routed_around_and_returns_when_the_link_heals() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("hole-{}", std::process::id());
    let a = proxied_worker(&endpoint, &cluster, "hole-a", "5").await;
    let _b = proxied_worker(&endpoint, &cluster, "hole-b", "5").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--policy", "round-robin")
        .arg("--unresponsive-after-ms", "1000")
        .arg("--load-interval-ms", "250")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);
    let load = Load::start(
        &api.base,
        LoadSpec::new(if chaos_full() { 6 } else { 3 }, 24),
    );
    assert!(load.wait_for(6, RECOVERY).await);
    // Longer than the gateway's HTTP/2 keep-alive (5 s + 5 s) in the full run, so the held
    // connection is given up and a new one made when the link heals.
    let hold = Duration::from_secs(if chaos_full() { 20 } else { 2 });

    for fault in [Fault::Blackhole, Fault::Refuse] {
        let name = format!("{fault:?}").to_lowercase();
        let start = Instant::now();
        a.proxy.set(fault);
        assert!(
            responsive(&api, "hole-a", false).await,
            "the gateway notices a {name} worker"
        );
        let detected = start.elapsed();
        // Routed around: requests keep completing on b meanwhile.
        assert!(load.wait_for(6, RECOVERY).await, "requests go on around a");
        tokio::time::sleep(hold).await;
        assert_eq!(
            worker_view(&api, "hole-a").await.unwrap()["responsive"],
            false,
            "a {name} worker stays out of routing"
        );
        let healed = Instant::now();
        a.proxy.set(Fault::Pass);
        assert!(
            responsive(&api, "hole-a", true).await,
            "a returns when the link heals"
        );
        let back = healed.elapsed();
        let routed = eventually(RECOVERY, || recently_chosen(&api, "hole-a", 4)).await;
        assert!(routed, "requests are routed to a again");
        eprintln!(
            "{name}: the worker was out of routing {:.2} s after the fault, back {:.2} s after it was lifted and routed to {:.2} s after",
            detected.as_secs_f64(),
            back.as_secs_f64(),
            healed.elapsed().as_secs_f64()
        );
    }
    let report = load.stop().await;
    assert_none_lost(&report);
    eprintln!(
        "load through a blackhole and a refusal: {} requests served, longest gap {:.2} s",
        report.ok,
        report
            .longest_gap_after(report.completions[0])
            .as_secs_f64()
    );
}
