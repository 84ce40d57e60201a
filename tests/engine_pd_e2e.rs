//! Disaggregated serving with real-engine workers, end to end through the real binary: a
//! gateway and `switchyard worker --engine vllm|sglang` processes (two prefill, one decode) in
//! front of stand-in engines (`tests/python/fake_vllm.py` with `fake_pd.py`), which hand the KV
//! over between themselves the way vLLM's KV connectors and SGLang's bootstrap do.
//!
//! Requests stream through both pools; the decode engine received exactly the parameters its
//! prefill engine gave out (the stand-in records them) and took the KV; the gateway's index
//! shows the decode engine's blocks from its own events; a dead prefill engine costs a retry on
//! the other prefill worker (or, under `auto`, an aggregated fallback), never a request; and a
//! prefill worker of another engine kind is never paired with these decode workers.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, assert_mirrored, explain, indexed, overlap};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::EtcdServer;

const BLOCK: u64 = 4;

pub(crate) async fn gateway(etcd: &str, cluster: &str, mode: &str) -> (SwitchyardProcess, Api) {
    let process = Launch::gateway(etcd, cluster)
        .arg("--disaggregation", mode)
        .arg("--disagg-min-uncached-tokens", "16")
        .arg("--prefill-timeout-secs", "10")
        .start()
        .await;
    let api = Api::new(&process);
    (process, api)
}

pub(crate) async fn sees_workers(api: &Api, ids: &[&str]) {
    let ok = eventually(Duration::from_secs(20), || async {
        let mut all = true;
        for id in ids {
            all &= indexed(&api.base, id).await.is_some();
        }
        all
    })
    .await;
    assert!(ok, "gateway {} sees {ids:?}", api.base);
}

/// A non-streaming completion: (status, body).
pub(crate) async fn complete(api: &Api, prompt: &[u32], max_tokens: u32) -> (u16, Value) {
    api.post(
        "/v1/completions",
        &json!({"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}),
    )
    .await
}

/// A streaming completion that must finish by length; returns its payloads.
pub(crate) async fn stream(api: &Api, prompt: &[u32], max_tokens: u32) -> Vec<String> {
    let data = api
        .stream(
            "/v1/completions",
            &json!({"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": true, "stream": true}),
        )
        .await;
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let finish = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned));
    assert_eq!(finish.as_deref(), Some("length"), "{data:?}");
    data
}

/// Decision records of one stage (`prefill` or `decode`), newest first.
pub(crate) async fn decisions(api: &Api, stage: &str) -> Vec<Value> {
    let (status, all) = api.get("/admin/decisions?limit=1000").await;
    assert_eq!(status, 200);
    all.as_array()
        .unwrap()
        .iter()
        .filter(|d| d["stage"] == stage)
        .cloned()
        .collect()
}

/// Makes `fake`'s worker (`worker`) the gateway's clear prefill choice for `prompt`: the
/// stand-in caches it and the gateway indexes it there.
async fn prefer_prefill(api: &Api, worker: &str, fake: &Fake, prompt: &[u32]) {
    fake.admin("store", json!({"tokens": prompt})).await;
    let ok = eventually(Duration::from_secs(15), || async {
        explain(&api.base, prompt).await["disaggregation"]["prefill"]["worker"] == worker
    })
    .await;
    assert!(ok, "{}", explain(&api.base, prompt).await);
}

/// What a decode stand-in was handed, once it has seen `n` transfers.
async fn received(fake: &Fake, n: usize) -> Vec<Value> {
    let ok = eventually(Duration::from_secs(10), || async {
        fake.admin("transfers", json!({})).await["received"]
            .as_array()
            .map_or(0, Vec::len)
            >= n
    })
    .await;
    let all = fake.admin("transfers", json!({})).await["received"].clone();
    assert!(ok, "decode engine saw {all}, wanted {n} transfers");
    all.as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_and_decode_workers_hand_kv_over_through_the_engines() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("vllm-pd-{}", std::process::id());
    let fake_a = Fake::start(&["--kv-transfer"]).await;
    let fake_b = Fake::start(&["--kv-transfer"]).await;
    let fake_d = Fake::start(&["--kv-transfer"]).await;
    let worker = |fake: &Fake, id, role| {
        fake.worker("vllm", id, &endpoint, &cluster)
            .role(role)
            .start()
    };
    let _pa = worker(&fake_a, "prefill-a", "prefill").await;
    let _pb = worker(&fake_b, "prefill-b", "prefill").await;
    let _d = worker(&fake_d, "decode", "decode").await;
    // A healthy simulator prefill worker of the same model: never paired with a vLLM decode.
    let _sim = Launch::worker(&endpoint, &cluster)
        .id("prefill-sim")
        .role("prefill")
        .arg("--model", "fake-model")
        .arg("--block-size", "4")
        .arg("--max-context", "4096")
        .arg("--speedup", "50")
        .start()
        .await;
    let (_enforce, strict) = gateway(&endpoint, &cluster, "enforce").await;
    let (_auto, auto) = gateway(&endpoint, &cluster, "auto").await;
    let all = ["prefill-a", "prefill-b", "decode", "prefill-sim"];
    sees_workers(&strict, &all).await;
    sees_workers(&auto, &all).await;
    // The SUB sockets and the gateways' event streams settle before the engines publish.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Through both pools: streamed, and counted once (the decode engine generates the whole
    // completion; the prefill's first token is not added again).
    let x = tokens(1, 40);
    stream(&strict, &x, 6).await;
    let y = tokens(2, 40);
    let (status, disaggregated) = complete(&strict, &y, 5).await;
    assert_eq!(status, 200, "{disaggregated}");
    assert_eq!(disaggregated["usage"]["completion_tokens"], 5);
    // Cached prompt tokens are the prefill's (none), not the decode engine's count, which
    // includes the KV it received.
    assert_eq!(
        disaggregated["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let prefills = decisions(&strict, "prefill").await;
    assert_eq!(prefills.len(), 2, "{prefills:?}");
    assert!(
        prefills
            .iter()
            .all(|d| d["explanation"]["chosen"] != "prefill-sim"),
        "{prefills:?}"
    );

    // The decode engine received exactly what a prefill engine gave out, and pulled the KV.
    let mut engine_ids = BTreeSet::new();
    for fake in [&fake_a, &fake_b] {
        engine_ids.insert(fake.admin("transfers", json!({})).await["engine_id"].to_string());
    }
    for transfer in received(&fake_d, 2).await {
        assert_eq!(transfer["outcome"], "pulled", "{transfer}");
        assert_eq!(transfer["params"]["do_remote_prefill"], true);
        assert!(engine_ids.contains(&transfer["params"]["remote_engine_id"].to_string()));
        assert_eq!(
            transfer["params"]["remote_block_ids"]
                .as_array()
                .unwrap()
                .len(),
            10
        );
    }
    // The router's index shows the decode engine's blocks, from the decode engine's events.
    assert_mirrored(&strict.base, "decode", &fake_d).await;
    assert_mirrored(&auto.base, "decode", &fake_d).await;
    assert_eq!(overlap(&strict.base, "decode", &y).await, 40 / BLOCK);

    // `auto`: Y is cached on the decode worker now, so it stays aggregated there, and the same
    // prompt gives the same completion as the disaggregated run.
    let (status, aggregated) = complete(&auto, &y, 5).await;
    assert_eq!(status, 200, "{aggregated}");
    assert_eq!(
        aggregated["choices"][0]["text"],
        disaggregated["choices"][0]["text"]
    );
    assert!(decisions(&auto, "prefill").await.is_empty());
    // A new long prompt goes through a prefill worker; a short one does not.
    stream(&auto, &tokens(3, 40), 4).await;
    assert_eq!(decisions(&auto, "prefill").await.len(), 1);
    stream(&auto, &tokens(4, 8), 4).await;
    assert_eq!(decisions(&auto, "prefill").await.len(), 1);

    // prefill-a's engine dies while prefill-a is the preferred choice: its prefill fails and
    // the request is retried on prefill-b.
    let w = tokens(5, 40);
    prefer_prefill(&strict, "prefill-a", &fake_a, &w).await;
    drop(fake_a);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = complete(&strict, &w, 4).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let tried: Vec<Value> = decisions(&strict, "prefill")
        .await
        .into_iter()
        .take(2)
        .collect();
    assert_eq!(tried[1]["explanation"]["chosen"], "prefill-a", "{tried:?}");
    assert_eq!(tried[0]["explanation"]["chosen"], "prefill-b", "{tried:?}");
    assert_eq!(tried[0]["request_id"], tried[1]["request_id"]);

    // Both prefill engines gone: `auto` falls back to aggregated on the decode worker; `enforce`
    // refuses clearly rather than pairing the vLLM decode worker with the simulator.
    drop(fake_b);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = complete(&auto, &tokens(6, 40), 4).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = complete(&strict, &tokens(7, 40), 4).await;
    assert!(status >= 500, "{status} {body}");
    assert!(body.to_string().contains("prefill"), "{body}");
    assert!(
        decisions(&strict, "prefill")
            .await
            .iter()
            .all(|d| d["explanation"]["chosen"] != "prefill-sim")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_and_decode_workers_share_a_bootstrap_room() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("sglang-pd-{}", std::process::id());
    let prefill_flags = ["--flavor", "sglang", "--disaggregation-mode", "prefill"];
    let fake_a = Fake::start(&prefill_flags).await;
    let fake_b = Fake::start(&prefill_flags).await;
    // The decode stand-in gives up on a room after 2 s (SGLang's bootstrap timeout, shortened).
    let fake_d = Fake::start(&[
        "--flavor",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--transfer-timeout",
        "2",
    ])
    .await;
    let worker = |fake: &Fake, id, role| fake.worker("sglang", id, &endpoint, &cluster).role(role);
    let prefill = |fake: &Fake, id| {
        worker(fake, id, "prefill")
            .arg("--engine-bootstrap-port", &fake.bootstrap.to_string())
            .start()
    };
    let _pa = prefill(&fake_a, "prefill-a").await;
    let _pb = prefill(&fake_b, "prefill-b").await;
    let _d = worker(&fake_d, "decode", "decode").start().await;
    let (_enforce, strict) = gateway(&endpoint, &cluster, "enforce").await;
    let (_auto, auto) = gateway(&endpoint, &cluster, "auto").await;
    sees_workers(&strict, &["prefill-a", "prefill-b", "decode"]).await;
    sees_workers(&auto, &["prefill-a", "prefill-b", "decode"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The stand-in's prefill only finishes once the decode engine took the room: this works
    // only because the prefill worker answers before its engine is done.
    stream(&strict, &tokens(1, 40), 6).await;
    let (status, body) = complete(&strict, &tokens(2, 40), 5).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let ports = BTreeSet::from([fake_a.bootstrap, fake_b.bootstrap]);
    let rooms: BTreeSet<u64> = received(&fake_d, 2)
        .await
        .into_iter()
        .map(|t| {
            assert_eq!(t["outcome"], "pulled", "{t}");
            assert_eq!(t["params"]["bootstrap_host"], "127.0.0.1");
            assert!(
                t["params"]["bootstrap_port"]
                    .as_u64()
                    .is_some_and(|p| ports.contains(&p)),
                "{t}"
            );
            t["params"]["bootstrap_room"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(rooms.len(), 2, "a room per request");
    // Both prefill engines' requests completed once their rooms were taken.
    let handed = eventually(Duration::from_secs(10), || async {
        let a = fake_a.admin("transfers", json!({})).await["handed_over"].as_u64();
        let b = fake_b.admin("transfers", json!({})).await["handed_over"].as_u64();
        a.unwrap_or(0) + b.unwrap_or(0) == 2
    })
    .await;
    assert!(handed, "the prefill engines saw their rooms taken");
    assert_mirrored(&strict.base, "decode", &fake_d).await;
    assert_eq!(
        overlap(&strict.base, "decode", &tokens(2, 40)).await,
        40 / BLOCK
    );

    // prefill-a's engine accepts the prefill, then never offers the room (it failed after its
    // worker answered): the decode engine aborts, which the decode worker reports as a failed
    // pull, so the gateway blames prefill-a and retries with prefill-b on the same decode worker.
    let v = tokens(4, 40);
    prefer_prefill(&strict, "prefill-a", &fake_a, &v).await;
    fake_a.admin("lose_rooms", json!({"count": 1})).await;
    let (status, body) = complete(&strict, &v, 4).await;
    assert_eq!(status, 200, "{body}");
    let tried: Vec<Value> = decisions(&strict, "prefill")
        .await
        .into_iter()
        .take(2)
        .collect();
    assert_eq!(tried[1]["explanation"]["chosen"], "prefill-a", "{tried:?}");
    assert_eq!(tried[0]["explanation"]["chosen"], "prefill-b", "{tried:?}");
    let decodes: Vec<Value> = decisions(&strict, "decode")
        .await
        .into_iter()
        .take(2)
        .collect();
    assert!(
        decodes
            .iter()
            .all(|d| d["request_id"] == tried[0]["request_id"])
    );
    assert!(
        decodes
            .iter()
            .all(|d| d["explanation"]["chosen"] == "decode")
    );
    let after = received(&fake_d, 4).await;
    assert_eq!(after[2]["outcome"], "failed");
    assert_eq!(after[3]["outcome"], "pulled");

    // A dead prefill engine behind the preferred prefill worker: retried on the other.
    let w = tokens(5, 40);
    prefer_prefill(&strict, "prefill-a", &fake_a, &w).await;
    drop(fake_a);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = complete(&strict, &w, 4).await;
    assert_eq!(status, 200, "{body}");
    let tried: Vec<Value> = decisions(&strict, "prefill")
        .await
        .into_iter()
        .take(2)
        .collect();
    assert_eq!(tried[1]["explanation"]["chosen"], "prefill-a", "{tried:?}");
    assert_eq!(tried[0]["explanation"]["chosen"], "prefill-b", "{tried:?}");
    let last = received(&fake_d, 5).await;
    assert_eq!(last[4]["params"]["bootstrap_port"], json!(fake_b.bootstrap));

    // `auto` in front of an SGLang decode server, which serves only bootstrapped requests: a
    // prompt below the threshold still goes through the prefill pool (prefill-b, the one whose
    // engine lives) instead of being sent alone to the decode server.
    let short = tokens(6, 8);
    let (status, body) = complete(&auto, &short, 3).await;
    assert_eq!(status, 200, "{body}");
    let explained = explain(&auto.base, &short).await;
    assert_eq!(
        explained["disaggregation"]["mode"], "disaggregated",
        "{explained}"
    );
    assert!(
        explained["disaggregation"]["why"]
            .as_str()
            .unwrap()
            .contains("whatever the threshold"),
        "{explained}"
    );
    let handed = fake_d.admin("transfers", json!({})).await["received"].clone();
    let last = handed.as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["outcome"], "pulled", "{handed}");
    assert_eq!(last["params"]["bootstrap_port"], json!(fake_b.bootstrap));

    // No prefill engine left and no worker that serves aggregated: a 503 that says why, not a
    // bare prompt sent to the decode server (which would answer 400).
    drop(fake_b);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = fake_d.admin("transfers", json!({})).await["received"]
        .as_array()
        .map_or(0, Vec::len);
    let (status, body) = complete(&auto, &tokens(7, 8), 3).await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("decode worker decode (sglang, role decode) serves only requests"),
        "{message}"
    );
    assert!(
        message.contains("no worker that serves without a prefill worker"),
        "{message}"
    );
    // Whatever the dead prefill workers cost, no request reached the decode engine without a
    // bootstrap room (the stand-in would have answered 400 and recorded nothing).
    let after = fake_d.admin("transfers", json!({})).await["received"].clone();
    assert!(
        after.as_array().unwrap()[before..]
            .iter()
            .all(|t| t["params"]["bootstrap_room"].is_u64()),
        "{after}"
    );

    // A worker that serves aggregated (an SGLang server without disaggregation, role both)
    // joins: the request is routed there instead.
    let fake_both = Fake::start(&["--flavor", "sglang"]).await;
    let _both = worker(&fake_both, "both", "both").start().await;
    sees_workers(&auto, &["both"]).await;
    let (status, body) = complete(&auto, &tokens(8, 8), 3).await;
    assert_eq!(status, 200, "{body}");
    let served = decisions(&auto, "decode").await;
    assert_eq!(served[0]["explanation"]["chosen"], "both", "{served:?}");
}
