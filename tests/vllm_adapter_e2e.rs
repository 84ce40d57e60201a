//! End to end with the real binary in front of two vLLM stand-ins (`tests/python/fake_vllm.py`):
//! a gateway and two `switchyard worker --engine vllm` processes. Requests stream through, and the
//! gateway's index mirrors what each stand-in holds, across a forced gap that replay repairs and
//! across an engine restart.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, assert_mirrored, indexed, overlap};
use support::{Launch, eventually};
use switchyard_testkit::EtcdServer;

const BLOCK: usize = 4;

fn tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_and_vllm_workers_stream_and_mirror_the_engines_through_gap_and_restart() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("vllm-{}", std::process::id());
    let fake_a = Fake::start(&[]).await;
    let fake_b = Fake::start(&["--encoding", "map", "--hash-bytes"]).await;
    let worker = |id: &str, fake: &Fake| fake.worker("vllm", id, &endpoint, &cluster).start();
    let _a = worker("vllm-a", &fake_a).await;
    let _b = worker("vllm-b", &fake_b).await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    let both = eventually(Duration::from_secs(15), || async {
        indexed(&api, "vllm-a").await.is_some() && indexed(&api, "vllm-b").await.is_some()
    })
    .await;
    assert!(both, "the gateway sees both vllm workers");
    // The SUB sockets and the gateway's event streams settle before the engines publish.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Requests stream through the gateway to the engines and back.
    let http = reqwest::Client::new();
    for seed in 0..4 {
        let body = json!({"model": "fake-model", "prompt": tokens(seed, 40), "max_tokens": 6,
                          "ignore_eos": true, "stream": true});
        let response = http
            .post(format!("{api}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        let data = switchyard_core::sse::events(&text);
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
        let finish = data
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned));
        assert_eq!(finish.as_deref(), Some("length"), "{text}");
    }
    let body = json!({"model": "fake-model", "prompt": tokens(9, 40), "max_tokens": 5, "ignore_eos": true});
    let done: Value = http
        .post(format!("{api}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(done["usage"]["completion_tokens"], 5, "{done}");
    assert_mirrored(&api, "vllm-a", &fake_a).await;
    assert_mirrored(&api, "vllm-b", &fake_b).await;

    // A known prefix on A only: explain sees the overlap there.
    let prompt = tokens(42, 64);
    fake_a.admin("store", json!({"tokens": prompt})).await;
    assert_mirrored(&api, "vllm-a", &fake_a).await;
    assert_eq!(overlap(&api, "vllm-a", &prompt).await, (64 / BLOCK) as u64);
    assert_eq!(overlap(&api, "vllm-b", &prompt).await, 0);

    // A gap on A that the replay socket repairs: the index still mirrors A.
    fake_a.admin("drop_next", json!({"count": 2})).await;
    let gap_prompt = tokens(43, 32);
    fake_a.admin("store", json!({"tokens": gap_prompt})).await;
    fake_a
        .admin("store", json!({"tokens": tokens(44, 32)}))
        .await;
    fake_a
        .admin("store", json!({"tokens": tokens(45, 32)}))
        .await;
    assert_mirrored(&api, "vllm-a", &fake_a).await;
    assert_eq!(
        overlap(&api, "vllm-a", &gap_prompt).await,
        (32 / BLOCK) as u64
    );

    // B restarts (new incarnation: empty cache, new hashes, sequence from 0).
    fake_b.admin("store", json!({"tokens": prompt})).await;
    assert_mirrored(&api, "vllm-b", &fake_b).await;
    assert_eq!(overlap(&api, "vllm-b", &prompt).await, (64 / BLOCK) as u64);
    fake_b.admin("restart", json!({})).await;
    let after = tokens(46, 24);
    fake_b.admin("store", json!({"tokens": after})).await;
    assert_mirrored(&api, "vllm-b", &fake_b).await;
    assert_eq!(overlap(&api, "vllm-b", &prompt).await, 0);
    assert_eq!(overlap(&api, "vllm-b", &after).await, (24 / BLOCK) as u64);
}
