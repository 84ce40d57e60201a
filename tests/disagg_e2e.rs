//! Disaggregated serving end to end through the real binary: etcd, two prefill and two decode
//! `switchyard worker` processes and a `switchyard gateway --disaggregation auto`. Long prompts
//! go through both pools with a pipelined KV transfer and land in the decode worker's index;
//! short prompts stay on a decode worker; a SIGKILLed prefill worker, before or in the middle of
//! a pipelined prefill, costs a retry or a fallback, never a failed request; with no prefill
//! worker left, `enforce` answers 503 while `auto` still serves.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::EtcdServer;

async fn complete(api: &Api, prompt: Vec<u32>, max_tokens: u32) -> (u16, Value) {
    api.post(
        "/v1/completions",
        &json!({"model": "sim-8b", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}),
    )
    .await
}

/// Decision records of one stage (`prefill` or `decode`), newest first.
async fn decisions(api: &Api, stage: &str) -> Vec<Value> {
    let (status, all) = api.get("/admin/decisions?limit=1000").await;
    assert_eq!(status, 200);
    all.as_array()
        .unwrap()
        .iter()
        .filter(|d| d["stage"] == stage)
        .cloned()
        .collect()
}

async fn indexed_blocks(api: &Api, worker: &str) -> u64 {
    let (_, workers) = api.get("/admin/workers").await;
    workers
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == worker)
        .map_or(0, |w| w["indexed_blocks"].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_flow_through_both_pools_and_survive_a_killed_prefill_worker() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("disagg-{}", std::process::id());
    let start = |id: &str, role: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", "2")
            .arg("--speedup", "20")
            .arg("--max-context", "8192")
            .role(role)
            .id(id)
            .start()
    };
    let mut prefill_a = start("prefill-a", "prefill").await;
    let mut prefill_b = start("prefill-b", "prefill").await;
    let _decode_a = start("decode-a", "decode").await;
    let _decode_b = start("decode-b", "decode").await;
    let gateway = |mode: &str| {
        Launch::gateway(&endpoint, &cluster)
            .arg("--disaggregation", mode)
            .arg("--disagg-min-uncached-tokens", "512")
            .arg("--prefill-timeout-secs", "1")
            .start()
    };
    let auto = gateway("auto").await;
    let api = Api::new(&auto);
    assert!(api.lists_workers(4).await, "gateway sees all four workers");
    let prefill_pool = ["prefill-a", "prefill-b"];
    let decode_pool = ["decode-a", "decode-b"];

    // Explain shows both choices for a long prompt.
    let long = tokens(1, 2000);
    let (status, explained) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": long}),
        )
        .await;
    assert_eq!(status, 200, "{explained}");
    assert_eq!(
        explained["disaggregation"]["mode"], "disaggregated",
        "{explained}"
    );
    let prefill_choice = explained["disaggregation"]["prefill"]["worker"]
        .as_str()
        .unwrap();
    assert!(prefill_pool.contains(&prefill_choice), "{explained}");
    let decode_choice = explained["decision"]["worker"].as_str().unwrap();
    assert!(decode_pool.contains(&decode_choice), "{explained}");

    // A long prompt runs through a prefill worker, then a decode worker.
    let (status, body) = complete(&api, long.clone(), 8).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(body["usage"]["prompt_tokens"], 2000);
    // The prefill worker answered at once and streamed the KV while it computed.
    let pipelined = r#"switchyard_disagg_prefills_total{kv_transfer="pipelined"}"#;
    assert_eq!(api.metric(pipelined).await, 1.0);
    let prefills = decisions(&api, "prefill").await;
    assert_eq!(prefills.len(), 1, "{prefills:?}");
    let request_id = prefills[0]["request_id"].clone();
    let prefill_worker = prefills[0]["explanation"]["chosen"].as_str().unwrap();
    assert!(prefill_pool.contains(&prefill_worker));
    let decodes = decisions(&api, "decode").await;
    let decode = decodes
        .iter()
        .find(|d| d["request_id"] == request_id)
        .expect("decode decision of the same request");
    let decode_worker = decode["explanation"]["chosen"].as_str().unwrap().to_owned();
    assert!(decode_pool.contains(&decode_worker.as_str()));
    // The decode worker announced the transferred prompt blocks: the gateway indexed them.
    assert!(
        eventually(Duration::from_secs(10), || async {
            indexed_blocks(&api, &decode_worker).await >= 2000 / 16
        })
        .await,
        "decode worker's index holds the prompt"
    );
    // So the same prompt is now cached on that decode worker and stays aggregated there.
    let (_, again) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": long}),
        )
        .await;
    assert_eq!(
        again["decision"]["worker"],
        decode_worker.as_str(),
        "{again}"
    );
    assert_eq!(again["disaggregation"]["mode"], "aggregated", "{again}");

    // A short prompt stays aggregated on a decode worker.
    let (status, body) = complete(&api, tokens(2, 100), 4).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(decisions(&api, "prefill").await.len(), 1, "no new prefill");
    let newest = &decisions(&api, "decode").await[0];
    assert!(decode_pool.contains(&newest["explanation"]["chosen"].as_str().unwrap()));

    // SIGKILL one prefill worker: its lease still lists it, so the first prefill sent to it
    // fails and is retried on the other (or falls back to aggregated). Nothing fails.
    prefill_a.kill_hard().await;
    for i in 0..4 {
        let (status, body) = complete(&api, tokens(10 + i, 1500), 4).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 4);
    }
    // The survivor took prefills after the kill.
    let after_kill = decisions(&api, "prefill").await;
    assert!(
        after_kill
            .iter()
            .any(|d| d["explanation"]["chosen"] == "prefill-b"),
        "{after_kill:?}"
    );

    // A prefill worker that accepts connections but never answers (hung, not dead): the
    // prefill times out, and with no other prefill worker left the request falls back to
    // aggregated within the timeout instead of hanging.
    prefill_b.kill_hard().await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let registry =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &cluster)
            .await
            .unwrap();
    let hung = switchyard_core::WorkerInfo {
        id: switchyard_core::WorkerId::new("prefill-hung").unwrap(),
        address: silent_addr.to_string(),
        model: "sim-8b".into(),
        role: switchyard_core::Role::Prefill,
        block_size: switchyard_core::BlockSize::new(16).unwrap(),
        kv_capacity_blocks: 8192,
        max_context_tokens: 8192,
        engine: switchyard_core::EngineKind::Sim,
        incarnation: 1,
        adapters: Vec::new(),
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    };
    use switchyard_registry::Registry as _;
    let _hung_registration = registry
        .register(hung, Duration::from_secs(30))
        .await
        .unwrap();
    // Wait until the killed workers' leases are gone and the hung one is listed.
    assert!(
        eventually(Duration::from_secs(15), || async {
            let (_, workers) = api.get("/admin/workers").await;
            let ids: Vec<String> = workers
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w["id"].as_str().unwrap_or_default().to_owned())
                .collect();
            ids.len() == 3 && ids.contains(&"prefill-hung".to_owned())
        })
        .await,
        "gateway sees the two decode workers and the hung prefill worker"
    );
    let started = std::time::Instant::now();
    let (status, body) = complete(&api, tokens(31, 1500), 4).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        decisions(&api, "prefill")
            .await
            .iter()
            .any(|d| d["explanation"]["chosen"] == "prefill-hung"),
        "the hung prefill worker was tried"
    );

    // `enforce` with no working prefill worker refuses clearly; `auto` serves aggregated.
    let enforce = gateway("enforce").await;
    let strict = Api::new(&enforce);
    assert!(strict.lists_workers(3).await);
    let (status, body) = complete(&strict, tokens(30, 1500), 4).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.to_string().contains("prefill"), "{body}");
    let (status, body) = complete(&api, tokens(32, 1500), 4).await;
    assert_eq!(status, 200, "{body}");
}

async fn active_blocks(api: &Api, worker: &str) -> u64 {
    let (_, workers) = api.get("/admin/workers").await;
    workers
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == worker)
        .map_or(u64::MAX, |w| {
            w["load"]["active_blocks"].as_u64().unwrap_or(u64::MAX)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_mid_pipeline_costs_a_retry_not_the_request() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("pipeline-{}", std::process::id());
    // Slow prefill workers: 256-token chunks at a fifth of real speed, so a 6000-token prompt
    // prefills in about 24 steps over a few seconds and the kill lands mid-prefill.
    let dir = tempfile::tempdir().unwrap();
    let slow = dir.path().join("slow-prefill.toml");
    std::fs::write(&slow, "speedup = 0.2\n[sim]\nmax_batched_tokens = 256\n").unwrap();
    let slow = slow.to_str().unwrap().to_owned();
    let start = |id: &str, role: &str| {
        let worker = Launch::worker(&endpoint, &cluster)
            .arg("--lease-ttl-secs", "2")
            .arg("--max-context", "8192")
            .role(role)
            .id(id);
        if role == "prefill" {
            worker.arg("--config", &slow).start()
        } else {
            worker.arg("--speedup", "20").start()
        }
    };
    let mut prefill_a = start("prefill-a", "prefill").await;
    let mut prefill_b = start("prefill-b", "prefill").await;
    let _decode_a = start("decode-a", "decode").await;
    let _decode_b = start("decode-b", "decode").await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--disaggregation", "auto")
        .arg("--disagg-min-uncached-tokens", "512")
        .arg("--kv-transfer", "pipelined")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(4).await, "gateway sees all four workers");

    let long = tokens(40, 6000);
    let request = {
        let api = Api::new(&gateway);
        tokio::spawn(async move { complete(&api, long, 4).await })
    };
    // The prefill is placed, and the decode worker's KV events already show some of its
    // blocks: the transfer is under way while the prefill still runs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let chosen = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the decode worker announces blocks mid-pipeline"
        );
        if let Some(first) = decisions(&api, "prefill").await.pop() {
            let indexed =
                indexed_blocks(&api, "decode-a").await + indexed_blocks(&api, "decode-b").await;
            if indexed > 0 && indexed < 6000 / 16 {
                break first["explanation"]["chosen"].as_str().unwrap().to_owned();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    match chosen.as_str() {
        "prefill-a" => prefill_a.kill_hard().await,
        "prefill-b" => prefill_b.kill_hard().await,
        other => panic!("prefill on {other}"),
    }
    let (status, body) = request.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    assert_eq!(body["usage"]["prompt_tokens"], 6000);
    // The failed pull was retried (on the other prefill worker, or aggregated).
    assert!(api.metric("switchyard_dispatch_retries_total").await >= 1.0);
    let prefills = decisions(&api, "prefill").await;
    assert!(
        prefills.len() == 1 || prefills[0]["explanation"]["chosen"] != chosen.as_str(),
        "{prefills:?}"
    );
    // Neither decode worker keeps the half-imported blocks pinned.
    assert!(
        eventually(Duration::from_secs(10), || async {
            active_blocks(&api, "decode-a").await == 0 && active_blocks(&api, "decode-b").await == 0
        })
        .await,
        "decode workers released the imported blocks"
    );
}

/// `/metrics` of a worker started with `--metrics-listen`, sample by sample.
async fn worker_sample(worker: &SwitchyardProcess, name: &str, labels: &[(&str, &str)]) -> f64 {
    let url = worker.ready["metrics"].as_str().expect("metrics url");
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    switchyard_worker::metrics::sample(&text, name, labels).unwrap_or(0.0)
}

/// Prefill at `--tensor-parallel 1`, decode at `--tensor-parallel 2` with nothing configured
/// about the prefill side: the decode worker plans the strided TP1 → TP2 copy from the layout
/// the prefill worker announces. Then a prefill worker of another model shape (40 layers) is
/// refused with a 502 naming both layouts, and not retried as if it had failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_plans_from_the_prefill_workers_announced_layout() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("layout-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let deep = dir.path().join("deep.toml");
    // 40 layers of the same heads: 160 KiB of KV a token instead of 128 KiB.
    std::fs::write(
        &deep,
        "kv_bytes_per_token = 163840\n[kv_layout]\nlayers = 40\n",
    )
    .unwrap();
    let deep = deep.to_str().unwrap().to_owned();
    let worker = |id: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--speedup", "20")
            .arg("--max-context", "8192")
            .arg("--block-size", "16")
            .id(id)
    };
    let mut prefill = worker("prefill-tp1")
        .role("prefill")
        .arg("--tensor-parallel", "1")
        .start()
        .await;
    let decode = worker("decode-tp2")
        .role("decode")
        .arg("--tensor-parallel", "2")
        .arg("--metrics-listen", "127.0.0.1:0")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--disaggregation", "enforce")
        .start()
        .await;
    let api = Api::new(&gateway);
    let sees = |ids: &'static [&'static str]| {
        let api = &api;
        async move {
            eventually(Duration::from_secs(10), || async {
                let (_, workers) = api.get("/admin/workers").await;
                let mut seen: Vec<String> = workers
                    .as_array()
                    .map(|w| {
                        w.iter()
                            .filter_map(|w| w["id"].as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                seen.sort();
                seen == ids
            })
            .await
        }
    };
    assert!(sees(&["decode-tp2", "prefill-tp1"]).await);

    let (status, body) = complete(&api, tokens(41, 640), 4).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(decisions(&api, "prefill").await.len(), 1);
    let received = worker_sample(
        &decode,
        "switchyard_worker_kv_transfer_blocks_total",
        &[("direction", "received")],
    )
    .await;
    let planned = worker_sample(
        &decode,
        "switchyard_worker_kv_transfer_descriptors_total",
        &[("stage", "planned")],
    )
    .await;
    assert_eq!(received, 40.0, "640 tokens in blocks of 16");
    // TP1 → TP2 of the default layout: 2,048 strided fragments a block (TP2 → TP2, which the
    // decode worker assumed before layouts were announced, would be 2 a block).
    assert_eq!(planned, received * 2048.0);

    // Another model shape behind the only prefill worker: refused, not retried.
    assert!(prefill.terminate().await.success());
    let _deep = worker("prefill-deep")
        .role("prefill")
        .arg("--config", &deep)
        .start()
        .await;
    assert!(sees(&["decode-tp2", "prefill-deep"]).await);
    let (status, body) = complete(&api, tokens(42, 640), 4).await;
    assert_eq!(status, 502, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("holds KV for 40 layers"), "{message}");
    assert!(
        message.contains("this decode worker holds 32 layers"),
        "{message}"
    );
    let prefills = decisions(&api, "prefill").await;
    assert_eq!(prefills.len(), 2, "one prefill, no retry: {prefills:?}");
    assert_eq!(
        worker_sample(
            &decode,
            "switchyard_worker_kv_pull_failures_total",
            &[("reason", "layout_mismatch")],
        )
        .await,
        1.0
    );
}
