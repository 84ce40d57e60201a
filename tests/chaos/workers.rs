//! Chaos: workers die, freeze and come back under real processes (etcd, workers, gateway), and
//! the gateway notices from the workers themselves, not from their leases.
//!
//! - a SIGKILLed worker whose lease has 30 s to live leaves routing at once: no request after
//!   it died is sent to it (counted by the gateway's retries);
//! - a SIGSTOPped worker's stream moves to another worker as soon as its load reports stop,
//!   and the worker is back in routing when it thaws;
//! - a worker restarted under its id inside its lease's TTL takes over its registration, and a
//!   second live process under the same id is still refused.
//!
//! Detection and recovery times are printed (`--nocapture`) and recorded in docs/BENCHMARKS.md;
//! the tests assert what happens, never how long it took.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Api, Launch, chat, eventually, signal};
use switchyard_testkit::EtcdServer;

/// Longer than any test here: a worker that leaves does so because the gateway noticed, not
/// because its lease ran out.
const LONG_TTL: &str = "30";
const RECOVERY: Duration = Duration::from_secs(60);

/// The gateway's view of one worker (`/admin/workers`).
async fn worker_view(api: &Api, id: &str) -> Option<Value> {
    let (_, workers) = api.get("/admin/workers").await;
    workers.as_array()?.iter().find(|w| w["id"] == id).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_leaves_routing_before_its_lease_expires() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("kill-{}", std::process::id());
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", LONG_TTL)
            .arg("--speedup", "20")
            .id(id)
            .start()
    };
    let _a = worker("kill-a").await;
    let mut b = worker("kill-b").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--policy", "round-robin")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);
    for _ in 0..4 {
        assert_eq!(
            api.post("/v1/chat/completions", &chat("warm up", 2))
                .await
                .0,
            200
        );
    }
    let retries_before = api.metric("switchyard_dispatch_retries").await;

    let killed = Instant::now();
    b.kill_hard().await;
    let noticed = eventually(RECOVERY, || async {
        worker_view(&api, "kill-b")
            .await
            .is_some_and(|w| w["responsive"] == false)
    })
    .await;
    assert!(noticed, "the gateway notices the dead worker");
    eprintln!(
        "a SIGKILLed worker (lease TTL {LONG_TTL} s) was out of routing {:.2} s after the kill",
        killed.elapsed().as_secs_f64()
    );
    // Still registered (its lease lives on), but round-robin no longer sends it anything.
    let view = worker_view(&api, "kill-b").await.unwrap();
    assert!(
        view["unresponsive_reason"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{view}"
    );
    for i in 0..12 {
        let (status, body) = api
            .post("/v1/chat/completions", &chat(&format!("after {i}"), 2))
            .await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        api.metric("switchyard_dispatch_retries").await,
        retries_before,
        "no request went to the dead worker"
    );
    assert!(
        api.metric("switchyard_worker_unresponsive_transitions")
            .await
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_s_stream_moves_at_once_and_it_returns_when_it_thaws() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("freeze-{}", std::process::id());
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", LONG_TTL)
            .arg("--speedup", "1")
            .id(id)
            .start()
    };
    let a = worker("freeze-a").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--unresponsive-after-ms", "1000")
        .arg("--load-interval-ms", "250")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await);
    // A stream on a, the only worker; then b joins and a freezes mid-stream.
    let mut long = chat("a long answer", 400);
    long["stream"] = json!(true);
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
    let _b = worker("freeze-b").await;
    assert!(api.lists_workers(2).await);
    let frozen = Instant::now();
    signal(a.child.id().unwrap(), "-STOP");
    while let Some(chunk) = response.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    let finished = frozen.elapsed();
    let events = switchyard_core::sse::events(&String::from_utf8(body).unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned());
    if let Some(usage) = usage {
        assert_eq!(usage["completion_tokens"], 400, "{usage}");
    }
    assert!(api.metric("switchyard_dispatch_migrations").await >= 1.0);
    // Moved because the worker stopped answering, not after a transport timeout.
    assert!(api.metric("switchyard_dispatch_unresponsive_cuts").await >= 1.0);
    let view = worker_view(&api, "freeze-a").await.unwrap();
    assert_eq!(view["responsive"], false, "{view}");
    eprintln!(
        "a stream whose worker froze finished on another {:.2} s after SIGSTOP",
        finished.as_secs_f64()
    );

    let thawed = Instant::now();
    signal(a.child.id().unwrap(), "-CONT");
    let back = eventually(RECOVERY, || async {
        worker_view(&api, "freeze-a")
            .await
            .is_some_and(|w| w["responsive"] == true)
    })
    .await;
    assert!(back, "a thawed worker returns to routing");
    eprintln!(
        "the thawed worker was back in routing {:.2} s after SIGCONT",
        thawed.elapsed().as_secs_f64()
    );
    assert_eq!(
        api.post("/v1/chat/completions", &chat("again", 2)).await.0,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_under_its_id_takes_over_its_registration() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("restart-{}", std::process::id());
    let worker = || {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", LONG_TTL)
            .arg("--speedup", "20")
            .id("restart-x")
            .start()
    };
    let mut first = worker().await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await);
    let old_incarnation = worker_view(&api, "restart-x").await.unwrap()["incarnation"].clone();

    // A second live process under the same id is refused, naming the id.
    let duplicate = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["worker", "--etcd", &endpoint, "--cluster", &cluster])
        .args(["--id", "restart-x", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let duplicate = tokio::time::timeout(RECOVERY, duplicate)
        .await
        .expect("the duplicate exits")
        .unwrap();
    assert!(!duplicate.status.success());
    let stderr = String::from_utf8_lossy(&duplicate.stderr);
    assert!(
        stderr.contains("restart-x") && stderr.contains("already registered"),
        "{stderr}"
    );

    // Killed, and started again at once: the new process takes the registration over.
    first.kill_hard().await;
    let restarted = Instant::now();
    let _second = worker().await;
    eprintln!(
        "a worker restarted under its id (lease TTL {LONG_TTL} s) registered {:.2} s after it started",
        restarted.elapsed().as_secs_f64()
    );
    let taken_over = eventually(RECOVERY, || async {
        worker_view(&api, "restart-x")
            .await
            .is_some_and(|w| w["incarnation"] != old_incarnation && w["responsive"] == true)
    })
    .await;
    assert!(taken_over, "the gateway follows the new process");
    assert_eq!(
        api.post("/v1/chat/completions", &chat("hello again", 2))
            .await
            .0,
        200
    );
}
