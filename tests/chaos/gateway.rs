//! Chaos: the gateway itself goes away, under real processes (etcd, workers, gateway) and
//! client load.
//!
//! - SIGKILL, then a new gateway on the same address: clients that retry connection errors
//!   (as the OpenAI SDKs do) lose no request; the new gateway rebuilds its prefix index from
//!   the workers' KV snapshots, so a prompt whose prefix a worker holds is routed there again
//!   and served from its cache;
//! - SIGTERM with streams in flight: the gateway stops accepting connections, lets the streams
//!   finish within its shutdown grace, and exits 0.
//!
//! Recovery times are printed (`--no-capture`) and recorded in docs/BENCHMARKS.md; the tests
//! assert what happens, never how long it took. `SWITCHYARD_CHAOS_FULL=1` runs more load and
//! more restarts.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::load::{Load, LoadSpec};
use support::{Api, Launch, SwitchyardProcess, chaos_full, eventually, signal, tokens};
use switchyard_testkit::{EtcdServer, free_port};

const RECOVERY: Duration = Duration::from_secs(60);

/// A gateway on a fixed address, so a restarted one is found where clients look.
async fn gateway_at(etcd: &str, cluster: &str, address: &str) -> SwitchyardProcess {
    Launch::new("gateway")
        .arg("--etcd", etcd)
        .arg("--cluster", cluster)
        .arg("--http", address)
        .start()
        .await
}

/// The worker `/admin/explain` routes `prompt` to and how many of its blocks it holds there.
async fn explain(api: &Api, prompt: &[u32]) -> (String, u64) {
    let (status, explained) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": prompt}),
        )
        .await;
    if status != 200 {
        return (String::new(), 0);
    }
    let decision = &explained["decision"];
    let worker = decision["worker"].as_str().unwrap_or_default().to_owned();
    let overlap = decision["explanation"]["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["worker"] == worker.as_str()))
        .and_then(|w| w["overlap"]["device"].as_u64())
        .unwrap_or(0);
    (worker, overlap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_restarts_rebuilds_its_index_and_loses_no_request() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("gwkill-{}", std::process::id());
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--speedup", "20")
            .id(id)
            .start()
    };
    let _a = worker("gwkill-a").await;
    let _b = worker("gwkill-b").await;
    let address = format!("127.0.0.1:{}", free_port());
    let mut gateway = gateway_at(&endpoint, &cluster, &address).await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await);

    // A long prompt leaves its 64 blocks on one worker.
    let prefix = tokens(11, 1024);
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": prefix, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let mut follow_up = prefix.clone();
    follow_up.extend(tokens(12, 100));
    let indexed = eventually(RECOVERY, || async {
        explain(&api, &follow_up).await.1 == 64
    })
    .await;
    assert!(indexed, "the prompt's blocks reached the index");
    let (holder, _) = explain(&api, &follow_up).await;

    let mut spec = LoadSpec::new(if chaos_full() { 8 } else { 3 }, 16);
    // A gateway that has just started may answer 503 until it has connected to its workers;
    // clients retry those too, and the report counts them.
    spec.retry_unavailable = true;
    let load = Load::start(&api.base, spec);
    assert!(load.wait_for(6, RECOVERY).await, "the load runs");

    let mut first_kill = None;
    for round in 0..if chaos_full() { 3 } else { 1 } {
        let killed = Instant::now();
        first_kill.get_or_insert(killed);
        gateway.kill_hard().await;
        gateway = gateway_at(&endpoint, &cluster, &address).await;
        let ready = killed.elapsed();
        let rebuilt = eventually(RECOVERY, || async {
            explain(&api, &follow_up).await == (holder.clone(), 64)
        })
        .await;
        assert!(
            rebuilt,
            "the restarted gateway's index routes the prefix to its holder"
        );
        let index_back = killed.elapsed();
        let served = load.wait_for(6, RECOVERY).await;
        assert!(served, "the restarted gateway serves the load");
        eprintln!(
            "gateway SIGKILL #{round}: the new one ready {:.2} s after the kill, its index routing the held prefix {:.2} s after, load served again by {:.2} s",
            ready.as_secs_f64(),
            index_back.as_secs_f64(),
            killed.elapsed().as_secs_f64()
        );
    }

    // The held prefix is served from the holder's cache by the restarted gateway.
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": follow_up, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 1024, "a KV-aware hit after the restart: {body}");

    let report = load.stop().await;
    assert!(
        report.lost.is_empty(),
        "requests lost across the restart: {:#?}",
        report.lost
    );
    assert!(
        report.transport_retries >= 1,
        "the clients saw the gateway go"
    );
    eprintln!(
        "load across gateway restarts: {} requests served, {} connection retries, {} retried 503s, longest gap {:.2} s",
        report.ok,
        report.transport_retries,
        report.unavailable_retries,
        report.longest_gap_after(first_kill.unwrap()).as_secs_f64()
    );
}

/// Starts a streamed chat and returns the response after its first chunk.
async fn open_stream(api: &Api, content: &str, max_tokens: u32) -> (reqwest::Response, Vec<u8>) {
    let mut body = support::chat(content, max_tokens);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap().expect("first chunk");
    (response, first.to_vec())
}

async fn finish_stream(mut response: reqwest::Response, mut body: Vec<u8>) -> Value {
    while let Some(chunk) = response.chunk().await.expect("the stream is not cut") {
        body.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(body).unwrap();
    let events = switchyard_core::sse::events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("a usage chunk")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_streams_in_flight_finish_within_the_grace() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("gwterm-{}", std::process::id());
    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "1")
        .id("gwterm-a")
        .start()
        .await;
    let mut gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--shutdown-grace-secs", "60")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await);

    let streams = if chaos_full() { 8 } else { 3 };
    let max_tokens = 300;
    let mut open = Vec::new();
    for i in 0..streams {
        open.push(open_stream(&api, &format!("stream {i}"), max_tokens).await);
    }
    let terminated = Instant::now();
    signal(gateway.child.id().unwrap(), "-TERM");

    // No new connection is accepted once it is stopping.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let refused = eventually(RECOVERY, || async {
        fresh
            .get(format!("{}/health", api.base))
            .send()
            .await
            .is_err()
    })
    .await;
    assert!(refused, "a stopping gateway refuses new connections");

    let finishing = open
        .into_iter()
        .map(|(response, first)| tokio::spawn(finish_stream(response, first)));
    for stream in finishing {
        let usage = stream.await.expect("the stream finishes whole");
        assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
    }
    let streams_done = terminated.elapsed();
    let status = tokio::time::timeout(RECOVERY, gateway.child.wait())
        .await
        .expect("the gateway exits once its streams are done")
        .unwrap();
    assert!(status.success(), "a clean exit: {status}");
    eprintln!(
        "gateway SIGTERM with {streams} streams of {max_tokens} tokens in flight: streams done {:.2} s and the process gone {:.2} s after the signal (grace 60 s)",
        streams_done.as_secs_f64(),
        terminated.elapsed().as_secs_f64()
    );
}
