//! Trusting the router, end to end through the real binary: a client's `x-request-id` finds its
//! decision with what then happened; a worker whose KV events are cut is reported within
//! seconds and its realized hits show up against the predictions; an index corrupted on the
//! way from worker to gateway is caught by the digest check and repaired; a worker with another
//! block size than its model's is refused with a sentence naming both.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::kv_tamper::{KvTamper, Tamper};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::{EtcdServer, free_port};

/// Sends a completion with extra headers; returns the status, the `x-request-id` answered and
/// the body.
async fn complete(api: &Api, headers: &[(&str, &str)], body: &Value) -> (u16, String, Value) {
    let mut request = api.http.post(format!("{}/v1/completions", api.base));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.json(body).send().await.unwrap();
    let status = response.status().as_u16();
    let id = response
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, id, response.json().await.unwrap())
}

fn prompt(seed: u32, len: u32, max_tokens: u32) -> Value {
    json!({"model": "sim-8b", "prompt": tokens(seed, len), "max_tokens": max_tokens,
           "ignore_eos": true, "user": "alice"})
}

async fn decisions(api: &Api, query: &str) -> Vec<Value> {
    let (status, found) = api.get(&format!("/admin/decisions?{query}")).await;
    assert_eq!(status, 200, "{found}");
    found.as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_request_id_finds_its_decision_and_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("decisions.jsonl");
    let up = Launch::up(2)
        .arg("--speedup", "50")
        .arg("--decision-log-path", log_path.to_str().unwrap())
        .start()
        .await;
    let api = Api::new(&up);

    let (status, id, body) = complete(
        &api,
        &[
            ("x-request-id", "client-req-42"),
            ("x-session-id", "sess-7"),
        ],
        &prompt(11, 256, 2),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(id, "client-req-42");
    let completed = |query: &'static str| {
        let api = &api;
        async move {
            let found = decisions(api, query).await;
            found.len() == 1 && found[0]["outcome"]["status"] == "completed"
        }
    };
    assert!(
        eventually(Duration::from_secs(10), || completed(
            "request_id=client-req-42"
        ))
        .await,
        "{:?}",
        decisions(&api, "request_id=client-req-42").await
    );
    let first = &decisions(&api, "request_id=client-req-42").await[0];
    assert_eq!(first["session"], "sess-7", "{first}");
    assert_eq!(first["tenant"], "user:alice", "{first}");
    assert_eq!(first["stage"], "decode", "{first}");
    assert_eq!(first["attempt"], 1, "{first}");
    assert_eq!(first["outcome"]["mode"], "aggregated", "{first}");
    assert_eq!(first["outcome"]["realized_cached_tokens"], 0, "{first}");
    assert_eq!(first["outcome"]["prediction_error_tokens"], 0, "{first}");
    let worker = first["worker"].as_str().unwrap().to_owned();
    let candidates = first["explanation"]["workers"].as_array().unwrap();
    assert_eq!(candidates.len(), 2, "every candidate's scores: {first}");
    assert!(candidates.iter().all(|c| c["score"].is_number()));

    // Once the worker's KV events reached the index, a longer prompt with the same start is
    // predicted to hit 16 blocks there, and the engine reports reusing exactly those.
    let indexed = eventually(Duration::from_secs(10), || async {
        let (_, explain) = api
            .post(
                "/admin/explain",
                &json!({"model": "sim-8b", "prompt": tokens(11, 256)}),
            )
            .await;
        explain["decision"]["explanation"]["workers"]
            .as_array()
            .is_some_and(|ws| ws.iter().any(|w| w["overlap"]["device"] == 16))
    })
    .await;
    assert!(indexed, "the first prompt's blocks reached the index");
    let mut longer = tokens(11, 256);
    longer.extend(tokens(12, 40));
    let body = json!({"model": "sim-8b", "prompt": longer, "max_tokens": 2, "ignore_eos": true,
                      "user": "alice"});
    let (status, id, answer) = complete(
        &api,
        &[
            ("x-request-id", "client-req-43"),
            ("x-session-id", "sess-7"),
        ],
        &body,
    )
    .await;
    assert_eq!((status, id.as_str()), (200, "client-req-43"), "{answer}");
    assert!(
        eventually(Duration::from_secs(10), || completed(
            "request_id=client-req-43"
        ))
        .await
    );
    let second = &decisions(&api, "request_id=client-req-43").await[0];
    assert_eq!(second["worker"], worker.as_str(), "{second}");
    assert_eq!(second["predicted_cached_tokens"], 256, "{second}");
    assert_eq!(second["outcome"]["realized_cached_tokens"], 256, "{second}");
    assert_eq!(second["outcome"]["prediction_error_tokens"], 0, "{second}");
    assert!(second["outcome"].get("flag").is_none(), "{second}");

    // Every filter, alone and together.
    let ids = |found: Vec<Value>| -> Vec<String> {
        found
            .iter()
            .map(|d| d["request_id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        ids(decisions(&api, "session=sess-7").await),
        ["client-req-43", "client-req-42"]
    );
    assert_eq!(
        ids(decisions(
            &api,
            "tenant=user:alice&model=sim-8b&outcome=completed&limit=1"
        )
        .await),
        ["client-req-43"]
    );
    assert_eq!(
        ids(decisions(&api, &format!("worker={worker}&stage=decode&flagged=false")).await).len(),
        2
    );
    let at = first["at_unix_ms"].as_u64().unwrap();
    assert_eq!(
        ids(decisions(&api, &format!("session=sess-7&until_ms={}", at + 1)).await),
        ["client-req-42"]
    );
    assert!(decisions(&api, "outcome=failed").await.is_empty());
    let (status, err) = api.get("/admin/decisions?outcome=done").await;
    assert_eq!(status, 400, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("completed")
    );
    let (status, err) = api.get("/admin/decisions?colour=red").await;
    assert_eq!(status, 400, "{err}");

    // The accuracy metrics saw both generations on that worker as accurate.
    let labels = format!("{{model=\"sim-8b\",worker=\"{worker}\"}}");
    assert_eq!(
        api.metric(&format!("switchyard_route_predictions_evaluated{labels}"))
            .await,
        2.0
    );
    assert_eq!(
        api.metric(&format!("switchyard_route_accuracy_ratio{labels}"))
            .await,
        1.0
    );

    // A bad request id is refused by name; without one, the answer's id is the request's.
    let (status, id, err) =
        complete(&api, &[("x-request-id", "has space")], &prompt(1, 16, 1)).await;
    assert_eq!(status, 400, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-request-id"),
        "{err}"
    );
    assert!(!id.is_empty(), "even a refusal carries a request id");
    let long = "a".repeat(129);
    let (status, _, _) = complete(&api, &[("x-request-id", &long)], &prompt(1, 16, 1)).await;
    assert_eq!(status, 400);
    let (status, id, answer) = complete(&api, &[], &prompt(2, 16, 1)).await;
    assert_eq!(status, 200);
    assert_eq!(answer["id"], id.as_str(), "{answer}");
    assert_eq!(decisions(&api, &format!("request_id={id}")).await.len(), 1);

    // Finished decisions are on disk too, one JSON line each.
    let logged = eventually(Duration::from_secs(10), || async {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|d| d["request_id"] == "client-req-43" && d["outcome"]["status"] == "completed")
    })
    .await;
    assert!(logged, "the decision log file holds the decision");
}

/// A gateway (digests every 200 ms, silence after 1 s) and one simulated worker `id` reached
/// through a tamper proxy in `mode`.
async fn tampered(
    etcd: &EtcdServer,
    cluster: &str,
    id: &str,
    mode: Tamper,
    worker_args: &[&str],
) -> (SwitchyardProcess, SwitchyardProcess, KvTamper, Api) {
    let port = free_port();
    let proxy = KvTamper::start(format!("127.0.0.1:{port}").parse().unwrap(), mode).await;
    let worker = Launch::worker(&etcd.endpoint(), cluster)
        .id(id)
        .arg("--listen", &format!("127.0.0.1:{port}"))
        .arg("--advertise-address", &proxy.address().to_string())
        .arg("--speedup", "50")
        .args(worker_args)
        .start()
        .await;
    let gateway = Launch::gateway(&etcd.endpoint(), cluster)
        .arg("--digest-interval-ms", "200")
        .arg("--kv-silence-after-ms", "1000")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await, "the gateway sees the worker");
    (worker, gateway, proxy, api)
}

async fn worker_view(api: &Api, id: &str) -> Value {
    let (_, workers) = api.get("/admin/workers").await;
    workers
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_kv_events_are_cut_is_flagged_and_its_hits_diverge() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = format!("audit-cut-{}", std::process::id());
    let (_worker, _gateway, proxy, api) =
        tampered(&etcd, &cluster, "w-cut", Tamper::Cut, &[]).await;

    // The worker computes and caches 16 new blocks; no event reaches the gateway.
    let (status, _, body) = complete(&api, &[], &prompt(21, 256, 2)).await;
    assert_eq!(status, 200, "{body}");
    let flagged = eventually(Duration::from_secs(10), || async {
        worker_view(&api, "w-cut").await["kv"]["events_silent"].is_string()
    })
    .await;
    let view = worker_view(&api, "w-cut").await;
    assert!(flagged, "the silent worker is reported: {view}");
    let silent = view["kv"]["events_silent"].as_str().unwrap();
    assert!(silent.contains("no KV event since it joined"), "{silent}");
    assert_eq!(
        api.metric("switchyard_worker_kv_events_silent{worker=\"w-cut\"}")
            .await,
        1.0
    );
    let (status, ready) = api.get("/ready").await;
    assert_eq!(status, 200);
    assert!(
        ready
            .as_str()
            .unwrap()
            .contains("worker w-cut kv events silent"),
        "{ready}"
    );

    // The same prefix again: the engine reuses 256 tokens the router predicted as 0.
    let mut longer = tokens(21, 256);
    longer.extend(tokens(22, 40));
    let body = json!({"model": "sim-8b", "prompt": longer, "max_tokens": 2, "ignore_eos": true});
    let (status, id, answer) = complete(&api, &[], &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"], 256,
        "{answer}"
    );
    let found = decisions(&api, &format!("request_id={id}")).await;
    let outcome = &found[0]["outcome"];
    assert_eq!(outcome["prediction_error_tokens"], -256, "{outcome}");
    assert_eq!(outcome["flag"]["cause"], "kv_events_silent", "{outcome}");
    assert_eq!(
        decisions(&api, "flagged=true").await.len(),
        1,
        "only the diverging decision is flagged"
    );
    let labels = "model=\"sim-8b\",worker=\"w-cut\"";
    assert_eq!(
        api.metric(&format!(
            "switchyard_route_mispredictions{{{labels},cause=\"kv_events_silent\"}}"
        ))
        .await,
        1.0
    );
    assert_eq!(
        api.metric(&format!(
            "switchyard_route_prediction_error_tokens_sum{{{labels}}}"
        ))
        .await,
        -256.0
    );
    assert_eq!(
        api.metric(&format!("switchyard_route_accuracy_ratio{{{labels}}}"))
            .await,
        0.5
    );

    // Events flow again: the gap is resynchronised, and the next stored blocks clear the flag.
    proxy.set(Tamper::Pass);
    let (status, _, _) = complete(&api, &[], &prompt(23, 64, 1)).await;
    assert_eq!(status, 200);
    let cleared = eventually(Duration::from_secs(10), || async {
        worker_view(&api, "w-cut").await["kv"]["events_silent"].is_null()
    })
    .await;
    assert!(cleared, "{}", worker_view(&api, "w-cut").await);
    assert_eq!(
        api.metric("switchyard_worker_kv_events_silent{worker=\"w-cut\"}")
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_index_is_caught_by_the_digest_check_and_repaired() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = format!("audit-digest-{}", std::process::id());
    // 48 blocks of KV: distinct prompts of 8 blocks soon evict, and the proxy strips the
    // removals on their way, so the index keeps blocks the worker no longer holds.
    let (_worker, _gateway, proxy, api) = tampered(
        &etcd,
        &cluster,
        "w-lossy",
        Tamper::EmptyRemovals,
        &["--kv-blocks", "48"],
    )
    .await;
    for seed in 0..10 {
        let (status, _, body) = complete(&api, &[], &prompt(100 + seed, 128, 1)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert!(
        eventually(Duration::from_secs(10), || async { proxy.emptied() > 0 }).await,
        "the worker evicted blocks and the proxy hid their removal"
    );
    let caught = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_index_digest_checks{result=\"mismatch\"}")
            .await
            >= 1.0
    })
    .await;
    assert!(caught, "{}", worker_view(&api, "w-lossy").await);
    let resynced = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_kv_resyncs").await >= 2.0
    })
    .await;
    assert!(resynced, "the mismatch asked for a snapshot");

    // With the link honest again, the resynchronised index matches the worker's own view.
    proxy.set(Tamper::Pass);
    let repaired = eventually(Duration::from_secs(10), || async {
        let kv = &worker_view(&api, "w-lossy").await["kv"]["digest"];
        kv["diverged"] == false
            && kv["repairs"].as_u64().unwrap_or(0) >= 1
            && kv["worker_blocks"] == kv["index_blocks"]
    })
    .await;
    let view = worker_view(&api, "w-lossy").await;
    assert!(repaired, "{view}");
    assert_eq!(
        view["indexed_blocks"], view["kv"]["digest"]["worker_blocks"],
        "{view}"
    );
    assert!(api.metric("switchyard_index_digest_repairs").await >= 1.0);
    assert_eq!(
        api.metric("switchyard_worker_index_diverged{worker=\"w-lossy\"}")
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_block_size_is_refused_naming_both_sizes() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = format!("audit-bs-{}", std::process::id());
    let _first = Launch::worker(&etcd.endpoint(), &cluster)
        .id("bs-16")
        .arg("--block-size", "16")
        .start()
        .await;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["worker", "--etcd", &etcd.endpoint(), "--cluster", &cluster])
        .args([
            "--id",
            "bs-32",
            "--block-size",
            "32",
            "--listen",
            "127.0.0.1:0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the refused worker exits")
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("block size mismatch")
            && stderr.contains("announces 32 tokens")
            && stderr.contains("uses 16"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"ready\""),
        "it never announced itself ready"
    );
}
