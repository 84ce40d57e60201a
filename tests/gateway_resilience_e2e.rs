//! The gateway under failure and load, end to end through the real binary: migration of a
//! stream whose worker is SIGKILLed, cancellation when a client goes away, 429 when saturated,
//! and fair queueing between sessions.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, chat, eventually, register_ghost, tokens};
use switchyard_registry::Registry as _;
use switchyard_testkit::EtcdServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_migrated_away_and_a_dropped_client_cancels() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("gw-{}", std::process::id());
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", "2")
            .arg("--speedup", "0.5")
            .arg("--max-context", "8192")
            .id(id)
            .start()
    };
    let mut a = worker("worker-a").await;
    let mut b = worker("worker-b").await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::new(&gateway);
    let both = api.lists_workers(2).await;
    assert!(both, "gateway sees both workers");

    // A registered worker that does not answer (its process is gone, its lease not yet expired)
    // costs a retry, not a failed request. Round-robin makes sure it gets picked.
    let ghost_registration = register_ghost(
        &endpoint,
        &cluster,
        "worker-ghost",
        switchyard_core::Role::Both,
        Duration::from_secs(30),
    )
    .await;
    assert!(api.lists_workers(3).await);
    let (status, _) = api
        .post("/admin/policy", &json!({"policy": "round-robin"}))
        .await;
    assert_eq!(status, 200);
    for i in 0..3 {
        let (status, body) = api
            .post(
                "/v1/completions",
                &json!({"model": "sim-8b", "prompt": tokens(40 + i, 32), "max_tokens": 2, "ignore_eos": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    assert!(api.metric("switchyard_dispatch_retries_total").await >= 1.0);
    ghost_registration.deregister().await.unwrap();
    assert!(api.lists_workers(2).await);
    let (status, _) = api.post("/admin/policy", &json!({"policy": "kv"})).await;
    assert_eq!(status, 200);

    // Stream a long answer; kill its worker after the first tokens.
    let body = json!({
        "model": "sim-8b",
        "prompt": tokens(5, 200),
        "max_tokens": 120,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut response = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    while !text.contains("\"text\"") {
        let chunk = response.chunk().await.unwrap().expect("first chunk");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (_, decisions) = api.get("/admin/decisions?limit=1").await;
    let serving = decisions[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    let (victim, survivor) = if serving == "worker-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    victim.kill_hard().await;
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let payloads = switchyard_core::sse::events(&text);
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    assert!(
        !text.contains("\"error\""),
        "the client saw an error: {text}"
    );
    let usage: Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"]["completion_tokens"], 120,
        "complete answer: {usage}"
    );
    assert!(api.metric("switchyard_dispatch_migrations_total").await >= 1.0);

    // The dead worker leaves the gateway, and its blocks leave the index.
    let gone = eventually(Duration::from_secs(15), || async {
        let (_, workers) = api.get("/admin/workers").await;
        let (_, index) = api.get("/admin/index").await;
        workers.as_array().map_or(0, Vec::len) == 1 && index[0]["stats"]["workers"] == 1
    })
    .await;
    assert!(gone, "killed worker still known to the gateway");

    // A client that goes away stops its generation on the worker.
    let body = json!({"model": "sim-8b", "prompt": tokens(6, 64), "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut response = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    response.chunk().await.unwrap().expect("first chunk");
    let running = |n: u64| {
        let api = &api;
        async move {
            let (_, workers) = api.get("/admin/workers").await;
            workers[0]["load"]["running_requests"].as_u64() == Some(n)
        }
    };
    assert!(
        eventually(Duration::from_secs(10), || running(1)).await,
        "request is running"
    );
    drop(response);
    assert!(
        eventually(Duration::from_secs(5), || running(0)).await,
        "the worker still runs a request whose client left"
    );
    let _ = survivor;

    // `switchyard up --etcd` uses etcd instead of the in-memory registry.
    let other = format!("{cluster}-up");
    let up = Launch::up(1)
        .arg("--speedup", "50")
        .arg("--etcd", &endpoint)
        .arg("--cluster", &other)
        .start()
        .await;
    let up_api = Api::new(&up);
    let (status, body) = up_api
        .post("/v1/chat/completions", &chat("via etcd", 3))
        .await;
    assert_eq!(status, 200, "{body}");
    let listed =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &other)
            .await
            .unwrap()
            .list_workers()
            .await
            .unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_gateway_answers_429_with_retry_after() {
    let up = Launch::up(1)
        .arg("--speedup", "1")
        .arg("--max-concurrent-requests", "1")
        .arg("--max-queued-requests", "0")
        .start()
        .await;
    let api = Api::new(&up);
    // One long streamed request holds the only slot (about 200 decode steps in real time).
    let mut long = chat("hold the slot", 200);
    long["stream"] = json!(true);
    let mut holder = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(holder.status(), 200);
    holder.chunk().await.unwrap().expect("first chunk");
    let response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&chat("me too", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let err: Value = response.json().await.unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error");
    // When the slot frees, requests are served again.
    drop(holder);
    let served = eventually(Duration::from_secs(10), || async {
        api.post("/v1/chat/completions", &chat("now?", 2)).await.0 == 200
    })
    .await;
    assert!(served, "the gateway recovers once the slot is free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_fanning_out_does_not_starve_other_sessions() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let up = Launch::up(1)
        .arg("--speedup", "1")
        .arg("--max-concurrent-requests", "2")
        .start()
        .await;
    let api = Arc::new(Api::new(&up));
    // Each request decodes 40 tokens in real time (about a third of a second), two at a time.
    let send = |session: String, content: String| {
        let api = Arc::clone(&api);
        async move {
            let response = api
                .http
                .post(format!("{}/v1/chat/completions", api.base))
                .header("x-session-id", session)
                .json(&chat(&content, 40))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
    };
    let fan_done = Arc::new(AtomicUsize::new(0));
    let mut fan = Vec::new();
    for i in 0..32 {
        let request = send("fan".into(), format!("sub-agent {i}"));
        let fan_done = Arc::clone(&fan_done);
        fan.push(tokio::spawn(async move {
            request.await;
            fan_done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    // Two of the fan-out run, the other 30 wait; only then do the other sessions arrive.
    let queued = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_requests_queued").await >= 30.0
    })
    .await;
    assert!(queued, "the fan-out fills the slots and waits");
    let mut singles = Vec::new();
    for i in 0..4 {
        let request = send(format!("single-{i}"), format!("main agent {i}"));
        let fan_done = Arc::clone(&fan_done);
        singles.push(tokio::spawn(async move {
            request.await;
            fan_done.load(Ordering::SeqCst)
        }));
    }
    // Served in turn with the fan-out, not behind it: each single session finishes while at
    // most a handful of the 32 have (first come, first served would make it 32).
    for single in singles {
        let fan_finished_before = single.await.unwrap();
        assert!(
            fan_finished_before < 8,
            "a single session waited for {fan_finished_before} of the fan-out's 32 requests"
        );
    }
    for request in fan {
        request.await.unwrap();
    }
    assert_eq!(api.metric("switchyard_requests_queued").await, 0.0);
    assert!(api.metric("switchyard_admission_wait_seconds_count").await >= 36.0);
}
