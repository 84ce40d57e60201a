//! The KV event plane (issue 43 item 3): workers publish each KV event once to a real
//! `nats-server` with JetStream, and gateways read it there instead of opening a gRPC stream to
//! every worker. Real processes: etcd, nats-server, `switchyard worker` and `switchyard gateway`.
//!
//! - Three gateways, two workers: each event leaves each worker once (the worker's own counters
//!   of what it sent, by sink), every gateway's index matches each worker's own view (the
//!   digests the workers publish to the plane, checked by every gateway), and a gateway started
//!   after the traffic catches up from the stream without asking any worker for a snapshot.
//! - Three gateways, four workers of two models: the server holds one consumer per gateway and
//!   model (not one per worker), a worker that registers after the gateways' consumers started
//!   is followed through them, a gateway started last catches up, and every index agrees with
//!   its workers.
//! - A history trimmed by the stream's byte bound, then purged: gateways started afterwards
//!   take a snapshot over gRPC (counted by the worker) and end equal to the worker all the same.
//! - A quiet worker (no digests) whose history was purged: a gateway started afterwards takes
//!   its snapshot over gRPC once its consumer has read the history.
//! - An event larger than the server's `max_payload` is left out of the plane (counted); the
//!   worker's next digest shows the gateway the gap, it takes a snapshot over gRPC and ends
//!   equal to the worker.
//! - `switchyard up --event-plane embedded` starts its own nats-server and runs on it.
//! - `event_plane_cost` (ignored; run by hand, `docs/scaling.md`): CPU per KV event of the
//!   workers, gateways and nats-server, direct streams against the plane, at 1 and 3 gateways.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, eventually};
use switchyard_event_plane::server::{NatsServer, ServerAuth};
use switchyard_event_plane::{EventPlane, EventPlaneConfig};
use switchyard_testkit::EtcdServer;

/// A prompt of `blocks` blocks of 16 tokens, distinct per `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16)
        .map(|i| (seed * 7919 + i * 13 + 1) % 50_000)
        .collect()
}

async fn complete(api: &Api, seed: u32, blocks: u32) {
    complete_model(api, "sim-8b", seed, blocks).await;
}

async fn complete_model(api: &Api, model: &str, seed: u32, blocks: u32) {
    let body = json!({"model": model, "prompt": prompt(seed, blocks), "max_tokens": 2, "ignore_eos": true});
    let (status, answer) = api.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
}

/// The flags that put a process on the plane at `url` with a memory-stored stream, then `extra`.
fn plane_args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--event-plane", url, "--event-plane-storage", "memory"];
    args.extend_from_slice(extra);
    args
}

/// A simulated worker `id` on the plane, with its metrics served.
async fn worker(etcd: &str, cluster: &str, id: &str, plane: &[&str]) -> (SwitchyardProcess, Api) {
    let process = Launch::worker(etcd, cluster)
        .id(id)
        .arg("--speedup", "50")
        .arg("--metrics-listen", "127.0.0.1:0")
        .args(plane)
        .start()
        .await;
    let metrics = process.ready["metrics"].as_str().expect("metrics url");
    let api = Api::at(metrics.trim_end_matches("/metrics"));
    (process, api)
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

async fn gateway(etcd: &str, cluster: &str, plane: &[&str]) -> (SwitchyardProcess, Api) {
    let process = Launch::gateway(etcd, cluster).args(plane).start().await;
    let api = Api::new(&process);
    (process, api)
}

async fn worker_view(api: &Api, id: &str) -> Value {
    let (_, workers) = api.get("/admin/workers").await;
    workers
        .as_array()
        .and_then(|w| w.iter().find(|w| w["id"] == id).cloned())
        .unwrap_or(Value::Null)
}

/// Whether the gateway's index holds what worker `id` says it holds: a digest check after
/// `after` checks matched, and the indexed blocks are the worker's own count.
async fn matches_worker(gateway: &Api, id: &str, worker: &Api, after: u64) -> bool {
    let truth = worker.metric("switchyard_worker_kv_event_log_blocks").await;
    follows_worker(gateway, id, worker, after).await && truth > 0.0
}

/// [`matches_worker`], the worker's holding no block allowed: the gateway reads the digests
/// the worker publishes, and they and its index agree with the worker.
async fn follows_worker(gateway: &Api, id: &str, worker: &Api, after: u64) -> bool {
    let view = worker_view(gateway, id).await;
    let digest = &view["kv"]["digest"];
    let truth = worker.metric("switchyard_worker_kv_event_log_blocks").await;
    digest["checks"].as_u64().unwrap_or(0) > after
        && digest["diverged"] == false
        && digest["worker_blocks"] == digest["index_blocks"]
        && view["indexed_blocks"].as_f64() == Some(truth)
}

/// Whether the gateway's index comes to match worker `id`'s own view within 30 s (see
/// [`matches_worker`]).
async fn comes_to_match(gateway: &Api, id: &str, worker: &Api, after: u64) -> bool {
    eventually(Duration::from_secs(30), || async {
        matches_worker(gateway, id, worker, after).await
    })
    .await
}

/// Whether the gateway indexes as many blocks of worker `id` as the worker holds (some).
async fn indexed_as(gateway: &Api, id: &str, worker: &Api) -> bool {
    let truth = worker.metric("switchyard_worker_kv_event_log_blocks").await;
    truth > 0.0 && worker_view(gateway, id).await["indexed_blocks"].as_f64() == Some(truth)
}

async fn digest_checks(gateway: &Api, id: &str) -> u64 {
    worker_view(gateway, id).await["kv"]["digest"]["checks"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_read_each_event_once_from_the_plane_and_a_late_one_catches_up() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let nats = NatsServer::start(ServerAuth::Open).expect("nats-server");
    let cluster = format!("plane-{}", std::process::id());
    let url = nats.url();
    let plane = plane_args(&url, &[]);
    let worker_plane = plane_args(&url, &["--event-plane-digest-interval-ms", "300"]);
    let ids = ["w-a", "w-b"];
    let mut workers = Vec::new();
    for id in ids {
        workers.push(worker(&endpoint, &cluster, id, &worker_plane).await);
    }
    let mut gateways = Vec::new();
    for _ in 0..2 {
        gateways.push(gateway(&endpoint, &cluster, &plane).await);
    }
    for (_, api) in &gateways {
        assert!(api.lists_workers(2).await);
    }
    // Traffic through both gateways: the workers store (and, past their cache, evict) blocks.
    for seed in 0..12 {
        complete(&gateways[seed as usize % 2].1, seed, 6).await;
    }
    // A gateway that starts after the traffic.
    gateways.push(gateway(&endpoint, &cluster, &plane).await);
    assert!(gateways[2].1.lists_workers(2).await);
    for seed in 12..18 {
        complete(&gateways[2].1, seed, 6).await;
    }

    for (g, (_, api)) in gateways.iter().enumerate() {
        for (id, (_, worker_api)) in ids.iter().zip(&workers) {
            let after = digest_checks(api, id).await;
            let equal = comes_to_match(api, id, worker_api, after).await;
            assert!(
                equal,
                "gateway {g}'s index of {id}: {} (the worker holds {} blocks)",
                worker_view(api, id).await,
                worker_api
                    .metric("switchyard_worker_kv_event_log_blocks")
                    .await
            );
        }
        assert_eq!(
            api.metric("switchyard_index_digest_checks{result=\"mismatch\"}")
                .await,
            0.0,
            "gateway {g}"
        );
    }
    for (id, (_, worker_api)) in ids.iter().zip(&workers) {
        let published = worker_api
            .metric("switchyard_worker_kv_events_published")
            .await;
        assert!(published > 0.0, "{id} published events");
        // Each event left the worker once, on the plane; no gateway opened an event stream,
        // and none asked for a snapshot (the only subscription is the plane publisher's own).
        assert_eq!(
            worker_api
                .metric("switchyard_worker_kv_events_sent{sink=\"plane\"}")
                .await,
            published,
            "{id}"
        );
        assert_eq!(
            worker_api
                .metric("switchyard_worker_kv_events_sent{sink=\"grpc\"}")
                .await,
            0.0,
            "{id}"
        );
        assert_eq!(
            worker_api
                .metric("switchyard_worker_kv_event_subscriptions")
                .await,
            1.0,
            "{id}: only the plane publisher subscribed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gateway_reads_a_model_with_one_consumer_and_follows_workers_that_join_later() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let nats = NatsServer::start(ServerAuth::Open).expect("nats-server");
    let cluster = format!("plane-one-{}", std::process::id());
    let url = nats.url();
    let plane = plane_args(&url, &[]);
    let worker_plane = plane_args(&url, &["--event-plane-digest-interval-ms", "300"]);
    let observer = EventPlane::connect(
        &EventPlaneConfig {
            url: Some(url.clone()),
            ..EventPlaneConfig::default()
        },
        &cluster,
        "test",
    )
    .await
    .unwrap();
    // Two models, the second's name and the late worker's id escaped into one subject token.
    let second = "sim.v2";
    let with_model = |model: &str| {
        let mut args: Vec<String> = worker_plane.iter().map(|a| (*a).to_owned()).collect();
        args.extend(["--model".to_owned(), model.to_owned()]);
        args
    };
    let first_args = with_model("sim-8b");
    let second_args = with_model(second);
    let mut workers = Vec::new();
    for (id, args) in [
        ("w-a", &first_args),
        ("w-b", &first_args),
        ("w-c", &second_args),
    ] {
        let (process, api) = worker(&endpoint, &cluster, id, &as_strs(args)).await;
        workers.push((id, process, api));
    }
    // The processes are kept (dropped, they stop); their APIs are used.
    let mut processes = Vec::new();
    let mut gateways = Vec::new();
    for _ in 0..2 {
        let (process, api) = gateway(&endpoint, &cluster, &plane).await;
        processes.push(process);
        gateways.push(api);
    }
    for api in &gateways {
        assert!(api.lists_workers(3).await);
    }
    for seed in 0..8 {
        complete(&gateways[seed as usize % 2], seed, 6).await;
    }
    for seed in 0..4 {
        complete_model(&gateways[seed as usize % 2], second, 50 + seed, 6).await;
    }
    // A worker that registers after the gateways' consumers started: they follow it all the
    // same, through the consumer they already have.
    let (process, api) = worker(&endpoint, &cluster, "w.late", &as_strs(&first_args)).await;
    workers.push(("w.late", process, api));
    for api in &gateways {
        assert!(api.lists_workers(4).await);
    }
    for seed in 100..112 {
        complete(&gateways[seed as usize % 2], seed, 6).await;
    }
    // A gateway that starts after all of it catches up from the stream's history.
    let (process, api) = gateway(&endpoint, &cluster, &plane).await;
    processes.push(process);
    gateways.push(api);
    assert!(gateways[2].lists_workers(4).await);

    // One consumer per gateway and model (one per worker would be 3 × 4).
    let consumers = || async { observer.consumer_count().await.unwrap() };
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumers().await == 3 * 2
        })
        .await,
        "{} consumers for 3 gateways, 2 models and 4 workers",
        consumers().await
    );
    for (g, api) in gateways.iter().enumerate() {
        for (id, _, worker_api) in &workers {
            let after = digest_checks(api, id).await;
            let followed = eventually(Duration::from_secs(30), || async {
                follows_worker(api, id, worker_api, after).await
            })
            .await;
            assert!(
                followed,
                "gateway {g}'s index of {id}: {} (the worker holds {} blocks)",
                worker_view(api, id).await,
                worker_api
                    .metric("switchyard_worker_kv_event_log_blocks")
                    .await
            );
        }
        assert_eq!(
            api.metric("switchyard_index_digest_checks{result=\"mismatch\"}")
                .await,
            0.0,
            "gateway {g}"
        );
    }
    // The workers that were there from the start were read from the plane alone: no gateway
    // asked any of them for a snapshot.
    for (id, _, worker_api) in &workers[..3] {
        assert!(
            worker_api
                .metric("switchyard_worker_kv_event_log_blocks")
                .await
                > 0.0,
            "{id} stored blocks"
        );
        assert_eq!(
            worker_api
                .metric("switchyard_worker_kv_event_subscriptions{start=\"snapshot\"}")
                .await,
            1.0,
            "{id}: only the plane publisher's own"
        );
    }
    assert_eq!(consumers().await, 3 * 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_larger_than_the_plane_takes_is_left_out_and_its_readers_take_a_snapshot() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    // A NATS that takes messages of at most 4 KiB: an 8-block prompt's stored event fits (≈ 0.5
    // KiB), a 200-block prompt's (≈ 10 KiB of block hashes and token ids) does not.
    let nats = NatsServer::start_with(ServerAuth::Open, Some(4096)).expect("nats-server");
    let cluster = format!("plane-big-{}", std::process::id());
    let url = nats.url();
    let plane = plane_args(&url, &["--event-plane-digest-interval-ms", "300"]);
    let (_w, worker_api) = worker(&endpoint, &cluster, "w-big", &plane).await;
    let (_g, gateway_api) = gateway(&endpoint, &cluster, &plane).await;
    assert!(gateway_api.lists_workers(1).await);
    let snapshots = || async {
        worker_api
            .metric("switchyard_worker_kv_event_subscriptions{start=\"snapshot\"}")
            .await
    };
    for seed in 0..4 {
        complete(&gateway_api, 300 + seed, 8).await;
    }
    assert!(
        comes_to_match(&gateway_api, "w-big", &worker_api, 0).await,
        "{}",
        worker_view(&gateway_api, "w-big").await
    );
    assert_eq!(snapshots().await, 1.0, "only the publisher's own so far");
    let oversized = "switchyard_worker_event_plane_oversized_messages";
    assert_eq!(worker_api.metric(oversized).await, 0.0);

    // The long prompt's stored event is left out of the plane (the publisher does not retry a
    // message the server can never take). No event follows it yet: the worker's next digest,
    // past the gateway's position, shows the gap, and the gateway takes a snapshot over gRPC.
    complete(&gateway_api, 400, 200).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            worker_api.metric(oversized).await >= 1.0
                && snapshots().await == 2.0
                && matches_worker(&gateway_api, "w-big", &worker_api, 0).await
        })
        .await,
        "{} after {} snapshots, {} left out",
        worker_view(&gateway_api, "w-big").await,
        snapshots().await,
        worker_api.metric(oversized).await
    );
    // Later events go through the plane, on top of the snapshot.
    for seed in 0..3 {
        complete(&gateway_api, 500 + seed, 8).await;
    }
    let after = digest_checks(&gateway_api, "w-big").await;
    assert!(
        comes_to_match(&gateway_api, "w-big", &worker_api, after).await,
        "{}",
        worker_view(&gateway_api, "w-big").await
    );
    assert_eq!(snapshots().await, 2.0, "no further snapshot was needed");
    assert!(
        worker_api
            .metric("switchyard_worker_kv_events_sent{sink=\"plane\"}")
            .await
            > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trimmed_history_sends_late_gateways_to_a_grpc_snapshot() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let nats = NatsServer::start(ServerAuth::Open).expect("nats-server");
    let cluster = format!("plane-trim-{}", std::process::id());
    let url = nats.url();
    // 4 KiB of history: a few messages, the oldest dropped first.
    let plane = plane_args(
        &url,
        &[
            "--event-plane-max-bytes",
            "4096",
            "--event-plane-digest-interval-ms",
            "300",
        ],
    );
    let (_w, worker_api) = worker(&endpoint, &cluster, "w-t", &plane).await;
    let (_g0, first) = gateway(&endpoint, &cluster, &plane).await;
    assert!(first.lists_workers(1).await);
    for seed in 0..12 {
        complete(&first, 100 + seed, 8).await;
    }
    let config = EventPlaneConfig {
        url: Some(url.clone()),
        ..EventPlaneConfig::default()
    };
    let observer = EventPlane::connect(&config, &cluster, "test")
        .await
        .unwrap();
    let (_, first_seq, last_seq) = observer.held().await.unwrap();
    assert!(
        first_seq > 1 && last_seq > first_seq,
        "the byte bound trimmed the history: stream sequences {first_seq}..={last_seq}"
    );
    let snapshots = || async {
        worker_api
            .metric("switchyard_worker_kv_event_subscriptions{start=\"snapshot\"}")
            .await
    };
    assert_eq!(snapshots().await, 1.0, "only the publisher's own so far");

    // A gateway starting now finds the history without its start: a gap, so a snapshot.
    let (_g1, late) = gateway(&endpoint, &cluster, &plane).await;
    assert!(late.lists_workers(1).await);
    assert!(
        eventually(Duration::from_secs(30), || async {
            snapshots().await == 2.0 && matches_worker(&late, "w-t", &worker_api, 0).await
        })
        .await,
        "{} after {} snapshots",
        worker_view(&late, "w-t").await,
        snapshots().await
    );

    // Nothing left of the worker's subject at all: the next gateway takes a snapshot too.
    let subject = observer.subject("sim-8b", "w-t");
    assert!(observer.purge(&subject).await.unwrap() > 0);
    let (_g2, latest) = gateway(&endpoint, &cluster, &plane).await;
    assert!(latest.lists_workers(1).await);
    assert!(
        eventually(Duration::from_secs(30), || async {
            snapshots().await == 3.0 && matches_worker(&latest, "w-t", &worker_api, 0).await
        })
        .await,
        "{}",
        worker_view(&latest, "w-t").await
    );
    // New traffic reaches all three through the plane alone.
    for seed in 0..4 {
        complete(&latest, 200 + seed, 8).await;
    }
    for (g, api) in [&first, &late, &latest].into_iter().enumerate() {
        let after = digest_checks(api, "w-t").await;
        assert!(
            comes_to_match(api, "w-t", &worker_api, after).await,
            "gateway {g}: {}",
            worker_view(api, "w-t").await
        );
    }
    assert_eq!(snapshots().await, 3.0, "no further snapshot was needed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_finding_nothing_of_a_quiet_worker_in_the_history_takes_a_snapshot() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let nats = NatsServer::start(ServerAuth::Open).expect("nats-server");
    let cluster = format!("plane-quiet-{}", std::process::id());
    let url = nats.url();
    // No digests: nothing the worker publishes while it is quiet shows a gateway it is behind.
    let plane = plane_args(&url, &["--event-plane-digest-interval-ms", "0"]);
    let (_w, worker_api) = worker(&endpoint, &cluster, "w-q", &plane).await;
    let (_g0, first) = gateway(&endpoint, &cluster, &plane).await;
    assert!(first.lists_workers(1).await);
    for seed in 0..4 {
        complete(&first, 700 + seed, 8).await;
    }
    let snapshots = || async {
        worker_api
            .metric("switchyard_worker_kv_event_subscriptions{start=\"snapshot\"}")
            .await
    };
    assert!(
        eventually(Duration::from_secs(30), || indexed_as(
            &first,
            "w-q",
            &worker_api
        ))
        .await
    );
    assert_eq!(snapshots().await, 1.0, "only the publisher's own so far");
    let config = EventPlaneConfig {
        url: Some(url.clone()),
        ..EventPlaneConfig::default()
    };
    let observer = EventPlane::connect(&config, &cluster, "test")
        .await
        .unwrap();
    assert!(
        observer
            .purge(&observer.subject("sim-8b", "w-q"))
            .await
            .unwrap()
            > 0
    );
    // The history holds nothing of the worker, and the worker publishes nothing: once its
    // consumer has read the history, the new gateway asks the worker for a snapshot.
    let (_g1, late) = gateway(&endpoint, &cluster, &plane).await;
    assert!(late.lists_workers(1).await);
    assert!(
        eventually(Duration::from_secs(30), || async {
            snapshots().await == 2.0 && indexed_as(&late, "w-q", &worker_api).await
        })
        .await,
        "{} after {} snapshots",
        worker_view(&late, "w-q").await,
        snapshots().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_an_embedded_plane_runs_its_workers_and_gateways_on_it() {
    let mut up = Launch::up(2).arg("--event-plane", "embedded").start().await;
    // The nats-server `up` started: its child process.
    let up_pid = up.child.id().unwrap();
    // Started from one of its threads: the children of every thread.
    let children: String = std::fs::read_dir(format!("/proc/{up_pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("children")).ok())
        .collect::<Vec<_>>()
        .join(" ");
    let nats_pid = children
        .split_whitespace()
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| cmd.contains("nats-server"))
        })
        .expect("up runs a nats-server")
        .to_owned();
    let api = Api::new(&up);
    assert!(api.lists_workers(2).await);
    for seed in 0..6 {
        complete(&api, 300 + seed, 4).await;
    }
    let urls = up.ready["worker_metrics"]
        .as_object()
        .expect("the banner lists the workers' metrics")
        .clone();
    let mut sent = 0.0;
    for (id, url) in &urls {
        let worker = Api::at(url.as_str().unwrap().trim_end_matches("/metrics"));
        let published = worker.metric("switchyard_worker_kv_events_published").await;
        // Every event went to the plane, none over a gRPC stream (the gateway reads the plane).
        assert!(
            eventually(Duration::from_secs(10), || async {
                worker
                    .metric("switchyard_worker_kv_events_sent{sink=\"plane\"}")
                    .await
                    == published
            })
            .await,
            "{id}"
        );
        assert_eq!(
            worker
                .metric("switchyard_worker_kv_events_sent{sink=\"grpc\"}")
                .await,
            0.0,
            "{id}"
        );
        sent += published;
        let (_, workers) = api.get("/admin/workers").await;
        let view = workers
            .as_array()
            .and_then(|w| w.iter().find(|w| w["id"] == id.as_str()).cloned())
            .unwrap_or(Value::Null);
        let truth = worker.metric("switchyard_worker_kv_event_log_blocks").await;
        assert_eq!(view["indexed_blocks"].as_f64(), Some(truth), "{view}");
    }
    assert!(sent > 0.0, "the requests stored blocks");
    // Stopped, `up` stops its server too.
    assert!(up.terminate().await.success());
    assert!(
        !std::path::Path::new(&format!("/proc/{nats_pid}")).exists(),
        "the embedded nats-server outlived up"
    );
}

/// One configuration of [`event_plane_cost`]: KV events over direct gRPC streams or the plane,
/// to `n_gateways` gateways.
async fn measure_transport(
    etcd: &EtcdServer,
    nats: &NatsServer,
    on_plane: bool,
    n_gateways: usize,
    n_workers: usize,
    n_requests: usize,
) {
    use crate::fleet_scale_e2e::{cpu_secs, pid_of};
    let endpoint = etcd.endpoint();
    let mode = if on_plane { "plane" } else { "direct" };
    let cluster = format!("cost-{mode}-{n_gateways}-{}", std::process::id());
    let url = nats.url();
    let plane: Vec<&str> = if on_plane {
        vec![
            "--event-plane",
            url.as_str(),
            "--event-plane-storage",
            "memory",
        ]
    } else {
        Vec::new()
    };
    let mut worker_args = plane.clone();
    // Small caches: each request stores its blocks and evicts older ones (two events or more).
    worker_args.extend(["--kv-blocks", "128"]);
    let mut workers = Vec::new();
    for i in 0..n_workers {
        workers.push(worker(&endpoint, &cluster, &format!("w{i}"), &worker_args).await);
    }
    let mut gateways = Vec::new();
    for _ in 0..n_gateways {
        gateways.push(gateway(&endpoint, &cluster, &plane).await);
    }
    for (_, api) in &gateways {
        assert!(api.lists_workers(n_workers).await);
    }
    let mut pids: Vec<u32> = workers.iter().map(|(p, _)| pid_of(p)).collect();
    pids.extend(gateways.iter().map(|(p, _)| pid_of(p)));
    let nats_pid = nats.pid().expect("nats-server runs");
    pids.push(nats_pid);
    let cpu = |pids: &[u32]| pids.iter().map(|&p| cpu_secs(p)).collect::<Vec<f64>>();
    // The idle rate (load reports, digests, heartbeats) over a quiet window, subtracted below.
    let idle_window = Duration::from_secs(5);
    let idle0 = cpu(&pids);
    tokio::time::sleep(idle_window).await;
    let idle1 = cpu(&pids);
    let events0: f64 = {
        let mut sum = 0.0;
        for (_, api) in &workers {
            sum += api.metric("switchyard_worker_kv_events_published").await;
        }
        sum
    };
    let cpu0 = cpu(&pids);
    let started = std::time::Instant::now();
    let serving = gateways[0].1.base.clone();
    let http = reqwest::Client::new();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients = (0..4).map(|_| {
        let (http, serving, next) = (http.clone(), serving.clone(), std::sync::Arc::clone(&next));
        tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= n_requests {
                    return;
                }
                let body = json!({"model": "sim-8b", "prompt": prompt(n as u32 + 1000, 8), "max_tokens": 1, "ignore_eos": true});
                let response = http
                    .post(format!("{serving}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
            }
        })
    });
    for client in futures::future::join_all(clients).await {
        client.unwrap();
    }
    let mut published = 0.0;
    let mut sent_grpc = 0.0;
    let mut sent_plane = 0.0;
    for (_, api) in &workers {
        published += api.metric("switchyard_worker_kv_events_published").await;
        sent_grpc += api
            .metric("switchyard_worker_kv_events_sent{sink=\"grpc\"}")
            .await;
        sent_plane += api
            .metric("switchyard_worker_kv_events_sent{sink=\"plane\"}")
            .await;
    }
    // Every gateway has applied every event before the CPU is read.
    for (_, api) in &gateways {
        assert!(
            eventually(Duration::from_secs(120), || async {
                api.metric("switchyard_kv_events_applied").await >= published
            })
            .await
        );
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu1 = cpu(&pids);
    let events = published - events0;
    let above_idle = |i: usize| {
        let idle_rate = (idle1[i] - idle0[i]) / idle_window.as_secs_f64();
        ((cpu1[i] - cpu0[i]) - idle_rate * wall).max(0.0)
    };
    let workers_cpu: f64 = (0..n_workers).map(above_idle).sum();
    let gateways_cpu: f64 = (n_workers..n_workers + n_gateways).map(above_idle).sum();
    let ingest_only_cpu: f64 = (n_workers + 1..n_workers + n_gateways)
        .map(above_idle)
        .sum::<f64>()
        / (n_gateways.max(2) - 1) as f64;
    let nats_cpu = above_idle(pids.len() - 1);
    let per_event = |secs: f64| secs / events.max(1.0) * 1e6;
    // Idle, in % of a core: what following W workers costs with no event flowing.
    let idle_pct = |range: std::ops::Range<usize>| {
        range
            .map(|i| (idle1[i] - idle0[i]) / idle_window.as_secs_f64() * 100.0)
            .sum::<f64>()
    };
    let idle_line = format!(
        "idle % of a core: workers {:.1}, gateways {:.1}, nats-server {:.1}",
        idle_pct(0..n_workers),
        idle_pct(n_workers..n_workers + n_gateways),
        idle_pct(pids.len() - 1..pids.len())
    );
    println!(
        "PLANE mode={mode} gateways={n_gateways} workers={n_workers} requests={n_requests} events={events:.0} \
         sent_grpc={sent_grpc:.0} sent_plane={sent_plane:.0} wall={wall:.1}s | CPU µs per event above idle: \
         workers {:.1}, all gateways {:.1}, ingest-only gateway {}, nats-server {:.1}, total {:.1} | {idle_line}",
        per_event(workers_cpu),
        per_event(gateways_cpu),
        if n_gateways > 1 {
            format!("{:.1}", per_event(ingest_only_cpu))
        } else {
            "-".to_owned()
        },
        per_event(nats_cpu),
        per_event(workers_cpu + gateways_cpu + if on_plane { nats_cpu } else { 0.0 }),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (minutes, the whole machine): run by hand, see docs/scaling.md"]
async fn event_plane_cost() {
    use crate::fleet_scale_e2e::env_or;
    let etcd = EtcdServer::start().expect("etcd");
    let nats = NatsServer::start(ServerAuth::Open).expect("nats-server");
    let n_workers = env_or("PLANE_WORKERS", 4);
    let n_requests = env_or("PLANE_REQUESTS", 2000);
    for n_gateways in [1, 3] {
        for on_plane in [false, true] {
            measure_transport(&etcd, &nats, on_plane, n_gateways, n_workers, n_requests).await;
        }
    }
}
