//! Fleet-wide quotas end to end: three real gateway processes in front of simulated workers,
//! counting in one real Redis. A tenant limited to X requests per window gets X over the three
//! replicas (not 3X), whichever replica each request lands on; the 429s carry `Retry-After`
//! and the limit's name; with Redis gone, a fail-open replica serves and a fail-closed one
//! answers 503, and both count it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use support::{Api, Launch, SwitchyardProcess, chat, eventually};
use switchyard_testkit::EtcdServer;
use switchyard_testkit::redis::RedisServer;

/// Requests a tenant may start per window.
const LIMIT: u64 = 30;
const WINDOW_SECS: u64 = 10;

fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sleeps until `offset_ms` into the next window (windows are aligned on the epoch).
async fn into_next_window(offset_ms: u64) -> u64 {
    let len = WINDOW_SECS * 1000;
    let now = epoch_ms();
    let start = (now / len + 1) * len;
    tokio::time::sleep(Duration::from_millis(start + offset_ms - now)).await;
    start
}

fn user_chat(user: &str) -> Value {
    let mut body = chat("quota", 1);
    body["user"] = Value::from(user);
    body
}

struct Tally {
    admitted: AtomicU64,
    refused: AtomicU64,
}

/// Eight clients send `user`'s requests round-robin over `gateways` from now until `until_ms`
/// (epoch), as a Service spreading connections would; every 429 must name the limit and carry
/// `Retry-After`.
async fn hammer(gateways: &[String], user: &str, until_ms: u64) -> (u64, u64, Vec<u64>) {
    let tally = Arc::new(Tally {
        admitted: AtomicU64::new(0),
        refused: AtomicU64::new(0),
    });
    let per_replica: Arc<Vec<AtomicU64>> =
        Arc::new(gateways.iter().map(|_| AtomicU64::new(0)).collect());
    let http = reqwest::Client::new();
    let mut clients = Vec::new();
    for client in 0..8usize {
        let (tally, per_replica, http) = (tally.clone(), per_replica.clone(), http.clone());
        let gateways = gateways.to_vec();
        let body = user_chat(user);
        clients.push(tokio::spawn(async move {
            let mut i = client;
            while epoch_ms() < until_ms {
                let replica = i % gateways.len();
                i += 1;
                let response = http
                    .post(format!("{}/v1/chat/completions", gateways[replica]))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let retry_after = response.headers().get("retry-after").cloned();
                let answer: Value = response.json().await.unwrap();
                match status {
                    200 => {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                        per_replica[replica].fetch_add(1, Ordering::Relaxed);
                    }
                    429 => {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                        assert_eq!(answer["error"]["code"], "quota_exceeded", "{answer}");
                        let message = answer["error"]["message"].as_str().unwrap();
                        assert!(message.contains("requests_per_window"), "{message}");
                        let secs: u64 = retry_after.unwrap().to_str().unwrap().parse().unwrap();
                        assert!((1..=WINDOW_SECS).contains(&secs), "Retry-After {secs}");
                        // Over the limit: no point asking again before the window turns.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!("unexpected {other}: {answer}"),
                }
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    let counts = per_replica
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    (
        tally.admitted.load(Ordering::Relaxed),
        tally.refused.load(Ordering::Relaxed),
        counts,
    )
}

async fn gateway(
    etcd: &str,
    cluster: &str,
    redis: &str,
    on_store_error: &str,
) -> SwitchyardProcess {
    Launch::gateway(etcd, cluster)
        .args([
            "--quota-redis-url",
            redis,
            "--quota-requests-per-window",
            &LIMIT.to_string(),
            "--quota-window-secs",
            &WINDOW_SECS.to_string(),
            "--quota-on-store-error",
            on_store_error,
            "--quota-store-timeout-ms",
            "300",
        ])
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_its_limit_across_three_replicas_and_the_store_going_away_is_handled() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("quota-{}", std::process::id());
    let mut redis = RedisServer::start().expect("redis-server (deploy/build-deps.sh test)");
    let mut workers = Vec::new();
    for id in ["w-1", "w-2"] {
        let worker = Launch::worker(&endpoint, &cluster)
            .id(id)
            .arg("--speedup", "100")
            .start()
            .await;
        workers.push(worker);
    }
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(gateway(&endpoint, &cluster, &redis.url(), "fail-open").await);
    }
    let closed = gateway(&endpoint, &cluster, &redis.url(), "fail-closed").await;
    for process in replicas.iter().chain([&closed]) {
        let api = Api::new(process);
        assert!(eventually(Duration::from_secs(30), || api.lists_workers(2)).await);
    }
    let bases: Vec<String> = replicas.iter().map(SwitchyardProcess::endpoint).collect();

    // Two whole windows, each hammered from just after it starts to just before it ends.
    for (round, other_replica) in replicas.iter().take(2).enumerate() {
        let start = into_next_window(300).await;
        let (admitted, refused, per_replica) =
            hammer(&bases, "tenant-a", start + WINDOW_SECS * 1000 - 500).await;
        eprintln!(
            "round {round}: {admitted} admitted, {refused} refused, per replica {per_replica:?}"
        );
        let (low, high) = (LIMIT * 9 / 10, LIMIT * 11 / 10);
        assert!(
            (low..=high).contains(&admitted),
            "round {round}: {admitted} admitted over 3 replicas, limit {LIMIT} (±10 %); {refused} refused"
        );
        assert!(
            refused > 0,
            "round {round}: the clients asked for more than the limit"
        );
        assert!(
            per_replica.iter().all(|n| *n > 0),
            "round {round}: every replica served some: {per_replica:?}"
        );
        // Another tenant has its own count, on any replica.
        let (status, answer) = Api::new(other_replica)
            .post("/v1/chat/completions", &user_chat("tenant-b"))
            .await;
        assert_eq!(status, 200, "{answer}");
    }
    let api = Api::new(&replicas[0]);
    assert!(
        api.metric(r#"switchyard_quota_refused{limit="requests_per_window"}"#)
            .await
            > 0.0
    );

    // Redis goes away: the fail-open replicas serve (over the limit, uncounted); the
    // fail-closed one answers 503.
    redis.stop();
    for _ in 0..(LIMIT + 5) as usize {
        let (status, answer) = api
            .post("/v1/chat/completions", &user_chat("tenant-c"))
            .await;
        assert_eq!(status, 200, "{answer}");
    }
    let closed_api = Api::new(&closed);
    let (status, answer) = closed_api
        .post("/v1/chat/completions", &user_chat("tenant-c"))
        .await;
    assert_eq!(status, 503, "{answer}");
    assert_eq!(
        answer["error"]["code"], "quota_store_unavailable",
        "{answer}"
    );
    assert_eq!(
        api.metric(r#"switchyard_quota_store_errors{outcome="fail_open"}"#)
            .await,
        (LIMIT + 5) as f64
    );
    assert_eq!(
        closed_api
            .metric(r#"switchyard_quota_store_errors{outcome="fail_closed"}"#)
            .await,
        1.0
    );

    // Redis is back: the fail-closed replica reconnects by itself and serves again.
    redis.restart().expect("redis restarts");
    assert!(
        eventually(Duration::from_secs(20), || async {
            closed_api
                .post("/v1/chat/completions", &user_chat("tenant-d"))
                .await
                .0
                == 200
        })
        .await,
        "the fail-closed replica serves once Redis is back"
    );
}
