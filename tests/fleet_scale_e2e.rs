//! A fleet of simulated workers, many per process (`switchyard workers`), in front of real
//! gateway processes and a real etcd.
//!
//! - `many_workers_in_one_process_serve_through_gateways` (CI-sized, 50 workers): every worker
//!   registers, every gateway sees and indexes them, requests are served.
//! - `fleet_scale` (ignored; run by hand, see `docs/scaling.md`): 1,000 workers in 4 processes
//!   and 2 gateways; prints event ingestion CPU per gateway, index memory, routing p99, etcd
//!   (registry) load and the time a new gateway takes to become ready. Sizes from
//!   `FLEET_WORKERS`, `FLEET_GATEWAYS`, `FLEET_PROCESSES`, `FLEET_REQUESTS` (sent at
//!   `FLEET_RATE` per second when set, else as fast as 32 clients go); with
//!   `FLEET_EVENT_PLANE=1` the KV events go over the event plane (a nats-server started here)
//!   instead of a gRPC stream per worker and gateway, the new gateway replays its history, and
//!   the nats-server's CPU, memory and consumer count are printed too.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, eventually};
use switchyard_core::promtext;
use switchyard_testkit::EtcdServer;

/// `switchyard workers` for `count` workers from index `first`.
fn workers(etcd: &str, cluster: &str, first: usize, count: usize) -> Launch {
    Launch::new("workers")
        .arg("--etcd", etcd)
        .arg("--cluster", cluster)
        .arg("--count", &count.to_string())
        .arg("--first", &first.to_string())
        .arg("--speedup", "100")
        // Small KV caches: the fleet's size is in its workers, not in each one's cache.
        .arg("--kv-blocks", "512")
}

async fn indexed_workers(api: &Api) -> usize {
    let (_, index) = api.get("/admin/index").await;
    index[0]["stats"]["workers"].as_u64().unwrap_or(0) as usize
}

/// A prompt of `len` tokens in group `group` (requests of a group share their first half).
fn prompt(group: usize, request: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < len / 2 {
                (1000 + group * 7919 + i * 13) as u32 % 50_000
            } else {
                (2000 + request * 104_729 + i * 17) as u32 % 50_000
            }
        })
        .collect()
}

fn completion(tokens: Vec<u32>) -> Value {
    json!({"model": "sim-8b", "prompt": tokens, "max_tokens": 2, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_workers_in_one_process_serve_through_gateways() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("fleet-{}", std::process::id());
    let fleet = workers(&endpoint, &cluster, 0, 50).start().await;
    assert_eq!(fleet.ready["workers"], 50, "{}", fleet.ready);
    // The first gateway opens at most 4 worker streams at once (`--subscribe-concurrency`).
    let mut gateways = vec![
        Launch::gateway(&endpoint, &cluster)
            .arg("--subscribe-concurrency", "4")
            .start()
            .await,
    ];
    gateways.push(Launch::gateway(&endpoint, &cluster).start().await);
    for gateway in &gateways {
        let api = Api::new(gateway);
        assert!(api.lists_workers(50).await, "every worker registered");
        assert!(
            eventually(Duration::from_secs(30), || async {
                indexed_workers(&api).await == 50
            })
            .await,
            "every worker subscribed"
        );
        assert!(
            eventually(Duration::from_secs(30), || async {
                api.get("/admin/subscriptions").await.1["subscribed"] == 50
            })
            .await,
            "every worker's snapshot and load in"
        );
    }
    let (_, progress) = Api::new(&gateways[0]).get("/admin/subscriptions").await;
    assert_eq!(progress["workers"], 50, "{progress}");
    assert_eq!(progress["concurrency"], 4, "{progress}");
    let peak = progress["peak_opening"].as_u64().unwrap();
    assert!((1..=4).contains(&peak), "the bound held: {progress}");
    assert_eq!(
        Api::new(&gateways[1])
            .metric("switchyard_workers_subscribed")
            .await,
        50.0
    );
    // Requests over both gateways land on many workers of the one process.
    for i in 0..40 {
        let api = Api::new(&gateways[i % 2]);
        let (status, answer) = api
            .post("/v1/completions", &completion(prompt(i, i, 64)))
            .await;
        assert_eq!(status, 200, "{answer}");
    }
    let mut chosen = std::collections::BTreeSet::new();
    for gateway in &gateways {
        let (_, decisions) = Api::new(gateway).get("/admin/decisions?limit=100").await;
        collect_chosen(&decisions, &mut chosen);
    }
    assert!(
        chosen.len() > 1,
        "requests spread over the process's workers: {chosen:?}"
    );
    let applied = Api::new(&gateways[0])
        .metric("switchyard_kv_events_applied")
        .await;
    assert!(
        applied > 0.0,
        "KV events of the in-process workers reach the gateways"
    );
    // Each live message carries when its events entered the worker's log, and every gateway
    // (the one that served a request or not) measures how late it applied them.
    for gateway in &gateways {
        let api = Api::new(gateway);
        assert!(
            eventually(Duration::from_secs(10), || async {
                api.metric("switchyard_kv_event_lag_seconds_count").await > 0.0
            })
            .await,
            "event lag measured"
        );
    }
}

/// Every `chosen` worker named anywhere in `value` (the decision log's entries).
fn collect_chosen(value: &Value, out: &mut std::collections::BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v.as_str()) {
                    ("chosen", Some(worker)) => {
                        out.insert(worker.to_owned());
                    }
                    _ => collect_chosen(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_chosen(v, out)),
        _ => {}
    }
}

/// CPU seconds (user + system) a process has used.
pub(crate) fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The `q` quantile of a Prometheus histogram (upper bound of the bucket it falls in).
async fn histogram_quantile(base: &str, name: &str, q: f64) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let buckets: Vec<(f64, f64)> = promtext::parse(&text)
        .into_iter()
        .filter(|s| s.name == format!("{name}_bucket"))
        .filter_map(|s| {
            let le = s.label("le")?;
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((bound, s.value))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets
        .iter()
        .find(|(_, count)| *count >= q * total)
        .map_or(f64::NAN, |(bound, _)| *bound)
}

async fn etcd_metric(etcd: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{etcd}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let selector = promtext::parse(&format!("{name} 0")).pop().unwrap();
    promtext::parse(&text)
        .iter()
        .filter(|s| {
            s.name == selector.name && selector.labels.iter().all(|(k, v)| s.label(k) == Some(v))
        })
        .map(|s| s.value)
        .sum()
}

/// Load reports each gateway has received so far.
async fn load_reports(gateways: &[SwitchyardProcess]) -> Vec<f64> {
    futures::future::join_all(
        gateways
            .iter()
            .map(|g| async { Api::new(g).metric("switchyard_load_reports").await }),
    )
    .await
}

pub(crate) fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub(crate) fn pid_of(process: &SwitchyardProcess) -> u32 {
    process.child.id().unwrap()
}

/// Sends `n_requests` completions over `serving`, spread over the gateways in turn: at `rate`
/// per second (each sent at its time, however many are in flight), or with `rate` 0 as fast as
/// 32 clients go. Returns how many failed: an overloaded machine answers some requests with an
/// error (a worker taken out of routing for late load reports) or drops their connection,
/// counted and reported, as a measurement should.
async fn drive(serving: &[String], n_requests: usize, rate: usize) -> usize {
    let http = reqwest::Client::new();
    let failed = Arc::new(AtomicUsize::new(0));
    let send = |i: usize| {
        let (http, failed) = (http.clone(), Arc::clone(&failed));
        let url = format!("{}/v1/completions", serving[i % serving.len()]);
        async move {
            let response = http
                .post(url)
                .json(&completion(prompt(i % 500, i, 256)))
                .send()
                .await;
            match response {
                Ok(response) if response.status() == 200 => {
                    let _ = response.bytes().await;
                }
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    };
    if rate > 0 {
        let started = tokio::time::Instant::now();
        let mut sent = Vec::with_capacity(n_requests);
        for i in 0..n_requests {
            tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate as f64))
                .await;
            sent.push(tokio::spawn(send(i)));
        }
        for request in futures::future::join_all(sent).await {
            request.unwrap();
        }
    } else {
        let next = Arc::new(AtomicUsize::new(0));
        let clients = (0..32).map(|_| {
            let (next, send) = (Arc::clone(&next), &send);
            async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n_requests {
                        return;
                    }
                    send(i).await;
                }
            }
        });
        futures::future::join_all(clients).await;
    }
    failed.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement (minutes, the whole machine): run by hand, see docs/scaling.md"]
async fn fleet_scale() {
    let n_workers = env_or("FLEET_WORKERS", 1000);
    let n_gateways = env_or("FLEET_GATEWAYS", 2);
    let n_processes = env_or("FLEET_PROCESSES", 8);
    let n_requests = env_or("FLEET_REQUESTS", 4000);
    // Requests per second over the load phase; 0 sends them as fast as 32 clients go.
    let rate = env_or("FLEET_RATE", 0);
    let nats = (env_or("FLEET_EVENT_PLANE", 0) == 1).then(|| {
        switchyard_event_plane::server::NatsServer::start(
            switchyard_event_plane::server::ServerAuth::Open,
        )
        .expect("nats-server")
    });
    let plane_url = nats.as_ref().map(|n| n.url());
    // Workers and gateways alike, when the event plane is on.
    let on_plane = |launch: Launch| match &plane_url {
        Some(url) => launch
            .arg("--event-plane", url)
            .arg("--event-plane-storage", "memory"),
        None => launch,
    };
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let etcd_pid = etcd.pid().unwrap();
    let cluster = format!("scale-{}", std::process::id());
    let report = |what: &str, value: String| println!("FLEET {what}: {value}");

    // Workers: n_processes processes, one after the other, so one process's registrations and
    // the gateways' subscriptions do not all land on a busy machine at once (docs/scaling.md).
    let started = Instant::now();
    let per = n_workers / n_processes;
    let mut fleets = Vec::new();
    for p in 0..n_processes {
        fleets.push(
            on_plane(workers(&endpoint, &cluster, p * per, per))
                .start()
                .await,
        );
    }
    report(
        "workers",
        format!(
            "{} in {n_processes} processes, registered in {:.1} s",
            per * n_processes,
            started.elapsed().as_secs_f64()
        ),
    );
    let n_workers = per * n_processes;
    let worker_rss: f64 = fleets.iter().map(|f| rss_mib(pid_of(f))).sum();
    report(
        "worker memory",
        format!(
            "{worker_rss:.0} MiB RSS in all ({:.2} MiB per worker)",
            worker_rss / n_workers as f64
        ),
    );

    // Gateways, one after the other: time to the ready line and to every worker subscribed.
    let mut gateways = Vec::new();
    for g in 0..n_gateways {
        let spawned = Instant::now();
        let gateway = on_plane(Launch::gateway(&endpoint, &cluster)).start().await;
        let ready = spawned.elapsed();
        let api = Api::new(&gateway);
        assert!(
            eventually(Duration::from_secs(300), || async {
                indexed_workers(&api).await == n_workers
            })
            .await
        );
        let indexed = spawned.elapsed();
        assert!(
            eventually(Duration::from_secs(300), || async {
                api.get("/admin/subscriptions").await.1["subscribed"] == n_workers
            })
            .await
        );
        let (_, progress) = api.get("/admin/subscriptions").await;
        report(
            &format!("gateway {g} start"),
            format!(
                "ready line {:.2} s, all {n_workers} workers indexed {:.2} s, with their load {:.2} s ({} stream opens at once at most, bound {})",
                ready.as_secs_f64(),
                indexed.as_secs_f64(),
                spawned.elapsed().as_secs_f64(),
                progress["peak_opening"],
                progress["concurrency"],
            ),
        );
        gateways.push(gateway);
    }
    let bases: Vec<String> = gateways.iter().map(SwitchyardProcess::endpoint).collect();

    // Idle: load reports only (every worker to every gateway, 10 per second by default).
    let idle = Duration::from_secs(10);
    let reports0 = load_reports(&gateways).await;
    let cpu0: Vec<f64> = gateways.iter().map(|g| cpu_secs(pid_of(g))).collect();
    let (etcd_cpu0, keepalives0) = (
        cpu_secs(etcd_pid),
        etcd_metric(
            &endpoint,
            r#"grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}"#,
        )
        .await,
    );
    let nats_pid = nats.as_ref().and_then(|n| n.pid());
    let nats_idle0 = nats_pid.map(cpu_secs);
    tokio::time::sleep(idle).await;
    if let (Some(pid), Some(cpu0)) = (nats_pid, nats_idle0) {
        report(
            "nats-server idle",
            format!(
                "{:.1} % of a core, RSS {:.0} MiB",
                (cpu_secs(pid) - cpu0) / idle.as_secs_f64() * 100.0,
                rss_mib(pid)
            ),
        );
    }
    let mut idle_cpu = Vec::new();
    let mut idle_reports = Vec::new();
    let reports1 = load_reports(&gateways).await;
    for (g, gateway) in gateways.iter().enumerate() {
        let cpu = (cpu_secs(pid_of(gateway)) - cpu0[g]) / idle.as_secs_f64();
        idle_cpu.push(cpu);
        let reports = reports1[g] - reports0[g];
        idle_reports.push(reports / idle.as_secs_f64());
        report(
            &format!("gateway {g} idle"),
            format!(
                "{:.0} % of a core (load reports of {n_workers} workers: {:.0}/s, {:.0} µs CPU each), RSS {:.0} MiB",
                cpu * 100.0,
                reports / idle.as_secs_f64(),
                cpu * idle.as_secs_f64() / reports.max(1.0) * 1e6,
                rss_mib(pid_of(gateway))
            ),
        );
    }
    let keepalives = (etcd_metric(
        &endpoint,
        r#"grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}"#,
    )
    .await
        - keepalives0)
        / idle.as_secs_f64();
    report(
        "etcd idle",
        format!(
            "{:.1} % of a core, {keepalives:.0} lease keep-alives/s, {} watchers, {} keys, RSS {:.0} MiB",
            (cpu_secs(etcd_pid) - etcd_cpu0) / idle.as_secs_f64() * 100.0,
            etcd_metric(&endpoint, "etcd_debugging_mvcc_watcher_total").await,
            etcd_metric(&endpoint, "etcd_debugging_mvcc_keys_total").await,
            rss_mib(etcd_pid)
        ),
    );

    // Load: requests spread over every gateway but the last (paced by FLEET_RATE or 32 at a
    // time); each stores blocks
    // on its worker, whose KV events go to every gateway. The last gateway serves nothing: its
    // CPU above idle is event ingestion alone.
    let serving = bases[..bases.len().saturating_sub(1).max(1)].to_vec();
    let events0: Vec<f64> = futures::future::join_all(
        gateways
            .iter()
            .map(|g| async { Api::new(g).metric("switchyard_kv_events_applied").await }),
    )
    .await;
    let messages0: Vec<f64> = futures::future::join_all(gateways.iter().map(|g| async {
        Api::new(g)
            .metric("switchyard_kv_event_lag_seconds_count")
            .await
    }))
    .await;
    let reports0 = load_reports(&gateways).await;
    let cpu0: Vec<f64> = gateways.iter().map(|g| cpu_secs(pid_of(g))).collect();
    let nats_load0 = nats_pid.map(cpu_secs);
    let load_started = Instant::now();
    let failed = drive(&serving, n_requests, rate).await;
    let wall = load_started.elapsed().as_secs_f64();
    report(
        "load",
        format!(
            "{n_requests} requests in {wall:.1} s ({:.0}/s over {} of {n_gateways} gateways, {}), {failed} failed",
            n_requests as f64 / wall,
            serving.len(),
            if rate > 0 {
                format!("paced at {rate}/s")
            } else {
                "32 clients".to_owned()
            }
        ),
    );
    if let (Some(pid), Some(cpu0), Some(url)) = (nats_pid, nats_load0, &plane_url) {
        let observer = switchyard_event_plane::EventPlane::connect(
            &switchyard_event_plane::EventPlaneConfig {
                url: Some(url.clone()),
                ..Default::default()
            },
            &cluster,
            "fleet_scale",
        )
        .await
        .unwrap();
        report(
            "nats-server load",
            format!(
                "{:.0} % of a core over the load, RSS {:.0} MiB, {} consumers for {n_gateways} gateways",
                (cpu_secs(pid) - cpu0) / wall * 100.0,
                rss_mib(pid),
                observer.consumer_count().await.unwrap()
            ),
        );
    }
    let reports1 = load_reports(&gateways).await;
    for (g, gateway) in gateways.iter().enumerate() {
        let api = Api::new(gateway);
        let events = api.metric("switchyard_kv_events_applied").await - events0[g];
        // Each live message observes the lag once.
        let messages = api.metric("switchyard_kv_event_lag_seconds_count").await - messages0[g];
        // Each request also moves its worker's load, pushed to every gateway: messages above
        // the idle rate of load reports come with the events, and cost alike.
        let reports = reports1[g] - reports0[g];
        let extra_reports = (reports - idle_reports[g] * wall).max(0.0);
        let cpu = cpu_secs(pid_of(gateway)) - cpu0[g];
        let above_idle = (cpu - idle_cpu[g] * wall).max(0.0);
        let role = if g < serving.len() {
            "serving"
        } else {
            "ingesting only"
        };
        let (_, index) = api.get("/admin/index").await;
        let stats = &index[0]["stats"];
        let p50 = histogram_quantile(&bases[g], "switchyard_routing_overhead_seconds", 0.5).await;
        let p99 = histogram_quantile(&bases[g], "switchyard_routing_overhead_seconds", 0.99).await;
        let lag50 = histogram_quantile(&bases[g], "switchyard_kv_event_lag_seconds", 0.5).await;
        let lag99 = histogram_quantile(&bases[g], "switchyard_kv_event_lag_seconds", 0.99).await;
        report(
            &format!("gateway {g} load"),
            format!(
                "({role}) {events:.0} KV events ({:.0}/s, {:.2}/s per worker, {:.2} per message) and {extra_reports:.0} load reports above the idle rate, {:.0} % of a core ({:.0} µs CPU per event above idle, {:.0} µs per message), routing p50 ≤ {:.0} µs p99 ≤ {:.0} µs, event lag p50 ≤ {:.1} ms p99 ≤ {:.1} ms, index {} blocks {} entries {:.1} MiB heap, RSS {:.0} MiB",
                events / wall,
                events / wall / n_workers as f64,
                events / messages.max(1.0),
                cpu / wall * 100.0,
                above_idle / events.max(1.0) * 1e6,
                above_idle / (events + extra_reports).max(1.0) * 1e6,
                p50 * 1e6,
                p99 * 1e6,
                lag50 * 1e3,
                lag99 * 1e3,
                stats["blocks"],
                stats["entries"],
                stats["heap_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
                rss_mib(pid_of(gateway))
            ),
        );
    }

    // A new gateway joins the loaded fleet: subscribe to every worker and load its snapshot.
    let entries = |index: &Value| index[0]["stats"]["entries"].as_u64().unwrap_or(0);
    let (_, reference) = Api::new(&gateways[0]).get("/admin/index").await;
    let target = entries(&reference);
    let spawned = Instant::now();
    let late = on_plane(Launch::gateway(&endpoint, &cluster)).start().await;
    let ready = spawned.elapsed();
    let api = Api::new(&late);
    assert!(
        eventually(Duration::from_secs(300), || async {
            let (_, index) = api.get("/admin/index").await;
            entries(&index) >= target * 99 / 100
        })
        .await
    );
    report(
        "new gateway",
        format!(
            "ready line {:.2} s, index caught up ({target} entries from {}) {:.2} s",
            ready.as_secs_f64(),
            if plane_url.is_some() {
                "the event plane's history".to_owned()
            } else {
                format!("{n_workers} snapshots")
            },
            spawned.elapsed().as_secs_f64()
        ),
    );
    // Checked last, so an overloaded run still prints every figure.
    assert!(
        failed * 10 < n_requests,
        "most requests are served: {failed} failed"
    );
}
