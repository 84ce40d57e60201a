//! End to end with the real binary in front of two `trtllm-serve` stand-ins
//! (`tests/python/fake_trtllm.py`): a gateway and two `switchyard worker --engine trtllm`
//! processes. The workers register, a chat request streams through, the KV events they poll
//! from `/kv_cache_events` reach the gateway's index (a second request with the same prefix is
//! routed to the worker holding it), and events lost in the engine's queue are detected,
//! counted and resynchronised.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{explain, indexed, overlap};
use support::fake_trtllm::FakeTrtllm;
use support::{Launch, SwitchyardProcess, eventually};
use switchyard_testkit::EtcdServer;

const BLOCK: u64 = 4;

fn tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

/// A sample of a worker's `/metrics` (`--metrics-listen`), 0 when absent.
async fn worker_sample(worker: &SwitchyardProcess, name: &str) -> f64 {
    let url = worker.ready["metrics"].as_str().expect("metrics url");
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    switchyard_worker::metrics::sample(&text, name, &[("rank", "0")]).unwrap_or(0.0)
}

/// Waits until the gateway indexes as many blocks for `worker` as `fake` holds.
async fn mirrored(api: &str, worker: &str, fake: &FakeTrtllm) -> bool {
    eventually(Duration::from_secs(15), || async {
        indexed(api, worker).await == Some(fake.held().await)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_workers_register_serve_and_route_by_their_polled_kv_events() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("trtllm-{}", std::process::id());
    let fake_a = FakeTrtllm::start(&[]).await;
    let fake_b = FakeTrtllm::start(&[]).await;
    let worker_a = fake_a.worker("trt-a", &endpoint, &cluster).start().await;
    let worker_b = fake_b.worker("trt-b", &endpoint, &cluster).start().await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    let http = reqwest::Client::new();

    // Both register, as TensorRT-LLM workers.
    let registered = eventually(Duration::from_secs(15), || async {
        indexed(&api, "trt-a").await.is_some() && indexed(&api, "trt-b").await.is_some()
    })
    .await;
    assert!(registered, "the gateway sees both trtllm workers");
    use switchyard_registry::Registry as _;
    let registry =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &cluster)
            .await
            .expect("connect to etcd");
    let mut registered: Vec<_> = registry
        .list_workers()
        .await
        .unwrap()
        .into_iter()
        .map(|w| (w.id.to_string(), w.engine, w.block_size.get()))
        .collect();
    registered.sort_by(|a, b| a.0.cmp(&b.0));
    let trtllm = switchyard_core::EngineKind::Trtllm;
    assert_eq!(
        registered,
        [("trt-a".into(), trtllm, 4), ("trt-b".into(), trtllm, 4)]
    );

    // A chat request streams through the gateway to an engine and back.
    let chat = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hello"}],
                      "max_tokens": 4, "ignore_eos": true, "stream": true});
    let text = http
        .post(format!("{api}/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = switchyard_core::sse::events(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let finish = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned));
    assert_eq!(finish.as_deref(), Some("length"), "{text}");
    assert!(mirrored(&api, "trt-a", &fake_a).await, "trt-a mirrored");
    assert!(mirrored(&api, "trt-b", &fake_b).await, "trt-b mirrored");

    // A prompt served once: its blocks reach the index of the worker that served it, and a
    // second request with the same prefix goes there.
    let prompt = tokens(42, 64);
    let body =
        json!({"model": "fake-model", "prompt": prompt, "max_tokens": 3, "ignore_eos": true});
    let done: Value = http
        .post(format!("{api}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(done["usage"]["completion_tokens"], 3, "{done}");
    let (mut served, mut other) = (("trt-a", &fake_a, &worker_a), ("trt-b", &fake_b, &worker_b));
    let seen = eventually(Duration::from_secs(15), || async {
        overlap(&api, "trt-a", &prompt).await + overlap(&api, "trt-b", &prompt).await > 0
    })
    .await;
    assert!(seen, "the served prompt's blocks reach the index");
    if overlap(&api, "trt-b", &prompt).await > 0 {
        std::mem::swap(&mut served, &mut other);
    }
    let (served_id, served_fake, served_worker) = served;
    assert!(mirrored(&api, served_id, served_fake).await);
    assert_eq!(overlap(&api, served_id, &prompt).await, 64 / BLOCK);
    assert_eq!(overlap(&api, other.0, &prompt).await, 0);
    let mut longer = prompt.clone();
    longer.extend(tokens(7, 12));
    let why = explain(&api, &longer).await;
    assert_eq!(why["decision"]["worker"], served_id, "{why}");

    // Events lost in the served engine's queue: the worker sees the ids skip, counts it, and
    // drops what it can no longer vouch for, then indexes what follows.
    let lost = tokens(43, 32);
    let after = tokens(44, 32);
    served_fake.admin("drop_next", json!({"count": 1})).await;
    served_fake.admin("store", json!({"tokens": lost})).await;
    served_fake.admin("store", json!({"tokens": after})).await;
    let resynced = eventually(Duration::from_secs(15), || async {
        worker_sample(
            served_worker,
            "switchyard_worker_engine_kv_replay_failures_total",
        )
        .await
            == 1.0
    })
    .await;
    assert!(resynced, "the gap is counted as a resync");
    assert_eq!(
        worker_sample(served_worker, "switchyard_worker_engine_kv_gaps_total").await,
        1.0
    );
    assert_eq!(
        worker_sample(
            served_worker,
            "switchyard_worker_engine_kv_buffer_wraps_total"
        )
        .await,
        1.0
    );
    let rebuilt = eventually(Duration::from_secs(15), || async {
        overlap(&api, served_id, &after).await == 32 / BLOCK
    })
    .await;
    assert!(rebuilt, "what follows the gap is indexed");
    assert_eq!(
        overlap(&api, served_id, &prompt).await,
        0,
        "cleared by the resync"
    );
    assert_eq!(overlap(&api, served_id, &lost).await, 0, "never seen");
    assert_eq!(
        worker_sample(other.2, "switchyard_worker_engine_kv_gaps_total").await,
        0.0
    );
}
