//! The planner end to end through the real binary: etcd, four simulated `switchyard worker`
//! processes (two prefill, two decode), a `switchyard gateway --disaggregation auto` and a
//! `switchyard planner` with a one-second interval. The workload shifts from decode-heavy
//! (short prompts, long outputs) to prefill-heavy (long prompts, short outputs); the planner
//! moves workers to the decode pool and then to the prefill pool, every request completes in
//! full, the plan and its reasons are on the planner's admin API (behind its token), and the
//! desired roles are in etcd.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_core::{Role, WorkerId};
use switchyard_registry::{EtcdRegistry, Registry};
use switchyard_testkit::EtcdServer;

const SPEEDUP: &str = "4";
const TOKEN: &str = "planner-secret";

/// One closed-loop client phase: `clients` loops send requests of `prompt_len` tokens asking
/// for `max_tokens` until `stop` is set. Returns (requests sent, failures with their reason).
fn client_phase(
    api: Arc<Api>,
    clients: u32,
    prompt_len: u32,
    max_tokens: u32,
    seeds: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u32, Vec<String>)> {
    tokio::spawn(async move {
        let loops = (0..clients).map(|_| {
            let (api, seeds, stop) = (Arc::clone(&api), Arc::clone(&seeds), Arc::clone(&stop));
            tokio::spawn(async move {
                let (mut sent, mut failures) = (0u32, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let seed = seeds.fetch_add(1, Ordering::Relaxed);
                    let body = json!({
                        "model": "sim-8b",
                        "prompt": tokens(seed, prompt_len),
                        "max_tokens": max_tokens,
                        "ignore_eos": true,
                    });
                    let (status, answer) = api.post("/v1/completions", &body).await;
                    sent += 1;
                    let completed = answer["usage"]["completion_tokens"].as_u64();
                    if status != 200 || completed != Some(u64::from(max_tokens)) {
                        failures.push(format!("status {status}: {answer}"));
                    }
                }
                (sent, failures)
            })
        });
        let mut total = (0, Vec::new());
        for handle in loops.collect::<Vec<_>>() {
            let (sent, failures) = handle.await.unwrap();
            total.0 += sent;
            total.1.extend(failures);
        }
        total
    })
}

/// The planner's admin overview, through an [`Api`] that carries the admin token.
async fn overview(planner: &Api) -> Value {
    let (status, body) = planner.get("/admin/planner?limit=200").await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn pools(planner: &Api) -> (u64, u64) {
    let body = overview(planner).await;
    let current = &body["plan"]["current"];
    (
        current["prefill"].as_u64().unwrap_or(0),
        current["decode"].as_u64().unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_follows_a_shift_from_decode_heavy_to_prefill_heavy_without_losing_a_request() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("planner-{}", std::process::id());
    let ids = ["w-0", "w-1", "w-2", "w-3"];
    let mut workers = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let role = if i < 2 { "prefill" } else { "decode" };
        let worker = Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", "2")
            .arg("--speedup", SPEEDUP)
            .arg("--max-context", "8192")
            .role(role)
            .id(id);
        workers.push(worker.start().await);
    }
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--disaggregation", "auto")
        .arg("--disagg-min-uncached-tokens", "512")
        .start()
        .await;
    let api = Arc::new(Api::new(&gateway));
    assert!(api.lists_workers(4).await, "gateway sees all four workers");
    let gateway_url = format!("http://{}", gateway.address);
    let planner_process = SwitchyardProcess::spawn(
        "planner",
        &[
            "--etcd",
            &endpoint,
            "--cluster",
            &cluster,
            "--gateway",
            &gateway_url,
            "--interval",
            "1",
            "--cooldown",
            "2",
            "--hysteresis-intervals",
            "2",
            "--ttft-target-ms",
            "150",
            "--itl-target-ms",
            "2.1",
            "--max-workers",
            "4",
            "--min-prefill",
            "1",
            "--min-decode",
            "1",
            "--sim-speedup",
            SPEEDUP,
            "--disagg-min-uncached-tokens",
            "512",
            "--admin-listen",
            "127.0.0.1:0",
            "--admin-token",
            TOKEN,
        ],
    )
    .await;
    let (status, _) = Api::new(&planner_process).get("/admin/planner").await;
    assert_eq!(status, 401, "the planner's admin API needs its token");
    let planner = Api::new(&planner_process).with_token(TOKEN);

    let seeds = Arc::new(AtomicU32::new(1));
    // Decode-heavy: short prompts, long outputs, many sequences decoding at once.
    let stop = Arc::new(AtomicBool::new(false));
    let phase = client_phase(
        Arc::clone(&api),
        16,
        32,
        200,
        Arc::clone(&seeds),
        Arc::clone(&stop),
    );
    let moved_to_decode = eventually(Duration::from_secs(90), || async {
        let (prefill, decode) = pools(&planner).await;
        prefill == 1 && decode == 3
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (sent_a, failures_a) = phase.await.unwrap();
    assert!(
        moved_to_decode,
        "decode-heavy load moves workers to the decode pool; last decisions: {}",
        overview(&planner).await["decisions"]
    );

    // Prefill-heavy: long prompts, a few output tokens.
    let stop = Arc::new(AtomicBool::new(false));
    let phase = client_phase(
        Arc::clone(&api),
        8,
        3000,
        4,
        Arc::clone(&seeds),
        Arc::clone(&stop),
    );
    let moved_to_prefill = eventually(Duration::from_secs(90), || async {
        let (prefill, decode) = pools(&planner).await;
        prefill == 3 && decode == 1
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (sent_b, failures_b) = phase.await.unwrap();
    assert!(
        moved_to_prefill,
        "prefill-heavy load moves workers to the prefill pool; last decisions: {}",
        overview(&planner).await["decisions"]
    );

    // Every request completed in full through both moves.
    assert!(sent_a > 0 && sent_b > 0);
    assert!(
        failures_a.is_empty(),
        "decode-heavy failures: {failures_a:?}"
    );
    assert!(
        failures_b.is_empty(),
        "prefill-heavy failures: {failures_b:?}"
    );

    // The decisions say why: a scale toward decode, then one toward prefill.
    let body = overview(&planner).await;
    let decisions = body["decisions"].as_array().unwrap();
    let scales: Vec<&Value> = decisions
        .iter()
        .filter(|d| d["action"] == "scale")
        .collect();
    assert!(scales.len() >= 2, "two moves at least: {decisions:?}");
    let newest = scales[0];
    assert_eq!(newest["target"], json!({"prefill": 3, "decode": 1}));
    let reason = newest["reason"].as_str().unwrap();
    assert!(
        reason.contains("needs") && reason.contains("tok/s"),
        "{reason}"
    );
    assert!(
        scales
            .iter()
            .any(|d| d["target"] == json!({"prefill": 1, "decode": 3})),
        "{scales:?}"
    );
    assert_eq!(body["settings"]["connector"], "local");

    // The registry holds the plan and the desired roles, and the workers carry them.
    let registry = EtcdRegistry::connect(std::slice::from_ref(&endpoint), &cluster)
        .await
        .unwrap();
    let plan = registry.plan().await.unwrap().expect("a plan in etcd");
    assert_eq!(plan["current"], json!({"prefill": 3, "decode": 1}));
    let mut desired = Vec::new();
    for id in ids {
        desired.push(
            registry
                .desired_role(&WorkerId::new(id).unwrap())
                .await
                .unwrap()
                .expect("a desired role for every pool worker"),
        );
    }
    assert_eq!(desired.iter().filter(|r| **r == Role::Prefill).count(), 3);
    let live = registry.list_workers().await.unwrap();
    for worker in &live {
        let index = ids.iter().position(|id| *id == worker.id.as_str()).unwrap();
        assert_eq!(
            worker.role, desired[index],
            "{} has its desired role",
            worker.id
        );
    }
    let metrics = planner
        .metric("switchyard_planner_decisions_total{action=\"scale\"}")
        .await;
    assert!(metrics >= 2.0, "scale decisions counted: {metrics}");
    drop(workers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_planner_serves_its_admin_api_and_metrics_through_the_gateway() {
    let up = Launch::up(2)
        .args(["--planner"])
        .arg("--speedup", "10")
        .arg("--interval", "0.5")
        .arg("--admin-token", TOKEN)
        .start()
        .await;
    let api = Api::new(&up);
    let (status, _) = api.get("/admin/planner").await;
    assert_eq!(status, 401, "behind the gateway's admin token");
    let admin = Api::new(&up).with_token(TOKEN);
    let (_, workers) = admin.get("/admin/workers").await;
    let mut roles: Vec<&str> = workers
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["role"].as_str().unwrap())
        .collect();
    roles.sort_unstable();
    assert_eq!(roles, ["decode", "prefill"], "the workers start split");
    assert!(
        eventually(Duration::from_secs(20), || async {
            let body = overview(&admin).await;
            body["decisions"].as_array().is_some_and(|d| d.len() >= 2)
        })
        .await,
        "the embedded planner decides every interval"
    );
    let body = overview(&admin).await;
    assert_eq!(body["settings"]["connector"], "local");
    assert_eq!(body["plan"]["current"], json!({"prefill": 1, "decode": 1}));
    assert_eq!(
        body["settings"]["correction"]["enabled"], true,
        "the profile correction is on by default"
    );
    assert!(body["plan"]["correction"]["prefill"].is_f64(), "{body}");
    let (status, decisions) = admin.get("/admin/planner/decisions?limit=1").await;
    assert_eq!(status, 200);
    assert_eq!(decisions.as_array().unwrap().len(), 1);
    let text = api
        .http
        .get(format!("{}/metrics", api.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("switchyard_planner_decisions_total"),
        "{text}"
    );
    assert!(
        text.contains("switchyard_planner_correction_factor{pool=\"decode\"}"),
        "{text}"
    );
    assert!(text.contains("switchyard_requests_in_flight"), "{text}");
    assert_eq!(
        text.matches("# EOF").count(),
        1,
        "one exposition, one end marker"
    );
    assert!(text.trim_end().ends_with("# EOF"));
}

#[tokio::test]
async fn the_planner_refuses_bad_configuration_with_exit_code_64() {
    let run = |args: &'static [&'static str]| async move {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .arg("planner")
            .args(args)
            .output()
            .await
            .unwrap()
    };
    let kubernetes = run(&[
        "--etcd",
        "http://127.0.0.1:1",
        "--gateway",
        "http://127.0.0.1:8000",
        "--connector",
        "kubernetes",
        "--kube-namespace",
        "ns",
    ])
    .await;
    assert_eq!(kubernetes.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&kubernetes.stderr);
    assert!(stderr.contains("--prefill-deployment"), "{stderr}");
    let no_etcd = run(&["--gateway", "http://127.0.0.1:8000"]).await;
    assert_eq!(no_etcd.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&no_etcd.stderr).contains("--etcd"));
    let bad_limits = run(&[
        "--etcd",
        "http://127.0.0.1:1",
        "--gateway",
        "http://127.0.0.1:8000",
        "--max-workers",
        "1",
    ])
    .await;
    assert_eq!(bad_limits.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad_limits.stderr).contains("exceed max_workers"));
}

/// A stand-in for a gateway's `/metrics` and the Kubernetes API's `scale` subresource of two
/// Deployments (prefill 1 replica, decode 2), recording every request as `METHOD path`.
async fn fake_gateway_and_kube_api() -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::Request;
    use axum::response::IntoResponse;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let app = axum::Router::new().fallback(move |request: Request| {
        let log = Arc::clone(&log);
        async move {
            let path = request.uri().path().to_owned();
            log.lock()
                .unwrap()
                .push(format!("{} {path}", request.method()));
            if path == "/metrics" {
                return (
                    [(
                        "content-type",
                        "application/openmetrics-text; version=1.0.0",
                    )],
                    "# EOF\n",
                )
                    .into_response();
            }
            let name = path
                .strip_prefix("/apis/apps/v1/namespaces/ns/deployments/")
                .and_then(|rest| rest.strip_suffix("/scale"));
            let replicas = match name {
                Some("prefill-pool") => 1,
                Some("decode-pool") => 2,
                _ => return axum::http::StatusCode::NOT_FOUND.into_response(),
            };
            axum::Json(json!({
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas},
            }))
            .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_connector_reads_the_pools_from_the_deployments_scale() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let (url, seen) = fake_gateway_and_kube_api().await;
    let planner_process = SwitchyardProcess::spawn(
        "planner",
        &[
            "--etcd",
            &endpoint,
            "--gateway",
            &url,
            "--connector",
            "kubernetes",
            "--kube-namespace",
            "ns",
            "--prefill-deployment",
            "prefill-pool",
            "--decode-deployment",
            "decode-pool",
            "--kube-api-url",
            &url,
            "--interval",
            "0.2",
            "--admin-listen",
            "127.0.0.1:0",
            "--admin-token",
            TOKEN,
        ],
    )
    .await;
    let planner = Api::new(&planner_process).with_token(TOKEN);
    let read = |name: &str| format!("GET /apis/apps/v1/namespaces/ns/deployments/{name}/scale");
    assert!(
        eventually(Duration::from_secs(30), || async {
            let seen = seen.lock().unwrap();
            seen.contains(&read("prefill-pool")) && seen.contains(&read("decode-pool"))
        })
        .await,
        "the planner reads both Deployments' scale: {:?}",
        seen.lock().unwrap()
    );
    let body = overview(&planner).await;
    assert_eq!(body["plan"]["current"]["prefill"], json!(1), "{body}");
    assert_eq!(body["plan"]["current"]["decode"], json!(2), "{body}");
    assert!(
        !seen.lock().unwrap().iter().any(|r| r.starts_with("PATCH")),
        "no traffic figures, so nothing to scale"
    );
}
