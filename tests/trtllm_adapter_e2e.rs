//! End to end with the real binary in front of two `trtllm-serve` stand-ins
//! (`tests/python/fake_trtllm.py`): a gateway and two `switchyard worker --engine trtllm`
//! processes. The workers register, a chat request streams through, the KV events they poll
//! from `/kv_cache_events` reach the gateway's index (a second request with the same prefix is
//! routed to the worker holding it), events lost in the engine's queue and an engine restart
//! are detected, counted and resynchronised; and the same shared-prefix workload hits the cache
//! as often behind two trtllm workers as behind two vLLM workers.

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

    // The engine restarts (an empty cache, event ids from 0 again): detected and counted, the
    // rank cleared, and the index equal to the engine's blocks once it caches again.
    served_fake.admin("restart", json!({})).await;
    let fresh = tokens(45, 24);
    served_fake.admin("store", json!({"tokens": fresh})).await;
    let restarted = eventually(Duration::from_secs(15), || async {
        worker_sample(served_worker, "switchyard_worker_engine_restarts_total").await == 1.0
    })
    .await;
    assert!(restarted, "the restart is counted");
    assert!(
        mirrored(&api, served_id, served_fake).await,
        "the index holds exactly the restarted engine's blocks"
    );
    assert_eq!(overlap(&api, served_id, &fresh).await, 24 / BLOCK);
    assert_eq!(
        overlap(&api, served_id, &after).await,
        0,
        "gone with the restart"
    );
}

/// One stand-in engine behind a worker: how many blocks it holds now.
enum Engine {
    Trtllm(FakeTrtllm),
    Vllm(support::fake_engine::Fake),
}

impl Engine {
    async fn held(&self) -> u64 {
        match self {
            Self::Trtllm(fake) => fake.held().await,
            Self::Vllm(fake) => fake.held().await,
        }
    }
}

/// The prompt-token hit rate of a shared-prefix workload (6 sessions of 4 turns, each turn its
/// session's previous prompt plus 16 tokens) through a gateway in front of two workers of one
/// engine kind, the index caught up with both engines before each turn.
async fn shared_prefix_hit_rate(kind: &str) -> (f64, u64) {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("hits-{kind}-{}", std::process::id());
    let mut engines = Vec::new();
    let mut workers = Vec::new();
    for id in ["w-a", "w-b"] {
        let (engine, worker) = if kind == "trtllm" {
            let fake = FakeTrtllm::start(&[]).await;
            let worker = fake.worker(id, &endpoint, &cluster).start().await;
            (Engine::Trtllm(fake), worker)
        } else {
            let fake = support::fake_engine::Fake::start(&[]).await;
            let worker = fake.worker("vllm", id, &endpoint, &cluster).start().await;
            (Engine::Vllm(fake), worker)
        };
        engines.push((id, engine));
        workers.push(worker);
    }
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    let both = eventually(Duration::from_secs(15), || async {
        indexed(&api, "w-a").await.is_some() && indexed(&api, "w-b").await.is_some()
    })
    .await;
    assert!(both, "the gateway sees both {kind} workers");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let http = reqwest::Client::new();
    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    for turn in 0..4u32 {
        for session in 0..6u32 {
            let prompt = tokens(100 + session, 32 + 16 * turn);
            let body = json!({"model": "fake-model", "prompt": prompt, "max_tokens": 2,
                              "ignore_eos": true});
            let done: Value = http
                .post(format!("{api}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            prompt_tokens += done["usage"]["prompt_tokens"].as_u64().expect("usage");
            cached_tokens += done["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            for (id, engine) in &engines {
                let caught_up = eventually(Duration::from_secs(15), || async {
                    indexed(&api, id).await == Some(engine.held().await)
                })
                .await;
                assert!(caught_up, "{kind} {id}: the index mirrors the engine");
            }
        }
    }
    (cached_tokens as f64 / prompt_tokens as f64, cached_tokens)
}

/// Issue 41: TensorRT-LLM workers route by their polled events as well as vLLM workers by their
/// pushed ones: the same shared-prefix workload hits the cache as often behind either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_workers_keep_the_hit_rate_vllm_workers_get_on_shared_prefixes() {
    let (trtllm, trtllm_cached) = shared_prefix_hit_rate("trtllm").await;
    let (vllm, vllm_cached) = shared_prefix_hit_rate("vllm").await;
    println!("prompt-token hit rate: behind trtllm {trtllm:.3}, behind vllm {vllm:.3}");
    // Turns 2-4 of each session find the previous turn's full blocks: 18 of 24 requests hit.
    assert!(
        vllm > 0.4,
        "the workload hits behind vLLM workers: {vllm:.3}"
    );
    assert_eq!(
        trtllm_cached, vllm_cached,
        "hit rate behind trtllm {trtllm:.3}, behind vllm {vllm:.3}"
    );
}
