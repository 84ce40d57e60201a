//! End to end with the real binary in front of two vLLM stand-ins (`tests/python/fake_vllm.py`):
//! a gateway and two `switchyard worker --engine vllm` processes. Requests stream through, and the
//! gateway's index mirrors what each stand-in holds, across a forced gap that replay repairs and
//! across an engine restart.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

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

/// The OpenAI sampling fields (and vLLM's extensions) a client sends reach the engine in the
/// engine's own names through the real gateway and worker; unset ones stay unset; an unknown
/// field and an out-of-range one are 400s naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_fields_reach_the_engine_through_the_gateway_and_bad_ones_are_named() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("sampling-{}", std::process::id());
    let fake = Fake::start(&[]).await;
    let _worker = fake
        .worker("vllm", "vllm-s", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    assert!(
        eventually(Duration::from_secs(15), || async {
            indexed(&api, "vllm-s").await.is_some()
        })
        .await
    );
    let http = reqwest::Client::new();
    let post = |body: Value| {
        let http = http.clone();
        let url = format!("{api}/v1/completions");
        async move {
            let response = http.post(url).json(&body).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let last = || async {
        fake.admin("requests", json!({})).await["requests"]
            .as_array()
            .and_then(|r| r.last())
            .cloned()
            .unwrap()
    };
    let (status, body) = post(json!({
        "model": "fake-model", "prompt": tokens(3, 20), "max_tokens": 6,
        "temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.1,
        "presence_penalty": 0.2, "frequency_penalty": 0.4, "repetition_penalty": 1.2,
        "logit_bias": {"17": 5.0}, "seed": 7, "stop_token_ids": [3],
        "min_tokens": 1, "ignore_eos": true
    }))
    .await;
    assert_eq!(status, 200, "{body}");
    let sent = last().await;
    for (field, want) in [
        ("temperature", 0.3),
        ("top_p", 0.8),
        ("top_k", 20.0),
        ("min_p", 0.1),
        ("presence_penalty", 0.2),
        ("frequency_penalty", 0.4),
        ("repetition_penalty", 1.2),
        ("seed", 7.0),
        ("min_tokens", 1.0),
    ] {
        let got = sent[field].as_f64().unwrap_or(f64::NAN);
        assert!((got - want).abs() < 1e-6, "{field}: {got} in {sent}");
    }
    assert_eq!(sent["logit_bias"], json!({"17": 5.0}), "{sent}");
    assert_eq!(sent["ignore_eos"], true);
    assert!(
        sent["stop_token_ids"]
            .as_array()
            .unwrap()
            .contains(&json!(3))
    );

    // Nothing set: the engine's own defaults apply (no temperature of 1.0 forced on it).
    let (status, body) =
        post(json!({"model": "fake-model", "prompt": tokens(4, 20), "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
    let sent = last().await;
    for field in [
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logit_bias",
        "min_tokens",
    ] {
        assert!(sent.get(field).is_none(), "{field} sent unset: {sent}");
    }

    // Refused by name.
    for (body, param) in [
        (
            json!({"model": "fake-model", "prompt": [1, 2], "truncate_prompt_tokens": 1}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"model": "fake-model", "prompt": [1, 2], "top_p": 0}),
            "top_p",
        ),
        (
            json!({"model": "fake-model", "prompt": [1, 2], "logit_bias": {"x": 1}}),
            "logit_bias",
        ),
        (
            json!({"model": "fake-model", "prompt": [1, 2], "presence_penalty": 9}),
            "presence_penalty",
        ),
    ] {
        let (status, answer) = post(body).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["param"], param, "{answer}");
    }
}

/// Log probabilities asked of the gateway reach vLLM and SGLang in each engine's own fields
/// (`logprobs` + `return_tokens_as_token_ids`; `return_logprob` + `top_logprobs_num`) and come
/// back in OpenAI's shape with the engine's figures, streamed and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_asked_in_each_engines_fields_and_come_back_with_its_figures() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("logprobs-{}", std::process::id());
    let vllm = Fake::start(&[]).await;
    let sglang = Fake::start(&["--flavor", "sglang"]).await;
    let _v = vllm
        .worker("vllm", "lp-vllm", &endpoint, &cluster)
        .start()
        .await;
    let _s = sglang
        .worker("sglang", "lp-sglang", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    assert!(
        eventually(Duration::from_secs(15), || async {
            indexed(&api, "lp-vllm").await.is_some() && indexed(&api, "lp-sglang").await.is_some()
        })
        .await
    );
    let http = reqwest::Client::new();
    let policy = http
        .post(format!("{api}/admin/policy"))
        .json(&json!({"policy": "round-robin"}))
        .send()
        .await
        .unwrap();
    assert_eq!(policy.status(), 200);
    // The stand-ins' tokens and made-up figures (fake_vllm.py): token i of a prompt ending in
    // `last` with seed s is (last * 31 + 7 i + s) % 50000 + 1, its log probability
    // -((token % 97) + 1) / 100, the most likely at its place.
    let prompt = tokens(12, 16);
    let seed = 5u32;
    let expected: Vec<f64> = (0..4u32)
        .map(|i| {
            let token = (prompt[prompt.len() - 1] * 31 + i * 7 + seed) % 50000 + 1;
            -f64::from(token % 97 + 1) / 100.0
        })
        .collect();
    let body = json!({"model": "fake-model", "prompt": prompt, "max_tokens": 4, "seed": seed,
                      "ignore_eos": true, "logprobs": 2});
    for _ in 0..2 {
        let answer: Value = http
            .post(format!("{api}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let lp = &answer["choices"][0]["logprobs"];
        let got: Vec<f64> = lp["token_logprobs"]
            .as_array()
            .unwrap_or_else(|| panic!("no logprobs in {answer}"))
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), 4, "{answer}");
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() < 1e-5, "{got:?} vs {expected:?}");
        }
        for top in lp["top_logprobs"].as_array().unwrap() {
            let figures: Vec<f64> = top
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert!(!figures.is_empty() && figures.len() <= 3, "{top}");
            assert!(figures.iter().all(|f| *f <= 0.0), "{top}");
        }
    }
    let to_vllm = vllm.admin("requests", json!({})).await["requests"].clone();
    assert!(
        to_vllm
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["logprobs"] == 2 && r["return_tokens_as_token_ids"] == true),
        "{to_vllm}"
    );
    let to_sglang = sglang.admin("requests", json!({})).await["requests"].clone();
    assert!(
        to_sglang
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["return_logprob"] == true && r["top_logprobs_num"] == 2),
        "{to_sglang}"
    );

    // Streamed chat: one log probability per generated token, across the chunks.
    let chat = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "ignore_eos": true, "logprobs": true, "top_logprobs": 1,
                      "stream": true});
    for _ in 0..2 {
        let text = http
            .post(format!("{api}/v1/chat/completions"))
            .json(&chat)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let entries: Vec<Value> = switchyard_core::sse::events(&text)
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["logprobs"]["content"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(entries.len(), 3, "{text}");
        for e in &entries {
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 1, "{e}");
            assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"], "{e}");
        }
    }
}

/// vLLM and SGLang publish waiting and running requests, not tokens: the worker counts the
/// prompt tokens its requests still have to prefill (the prompt past the prefix its engine's
/// events say it holds) from admission to the first token, and the gateway receives that queue
/// in the load reports the cost model prices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_reports_the_prefill_queue_vllm_does_not_publish() {
    prefill_queue_is_reported("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_reports_the_prefill_queue_sglang_does_not_publish() {
    prefill_queue_is_reported("sglang").await;
}

async fn prefill_queue_is_reported(engine: &str) {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("{engine}-queue-{}", std::process::id());
    let fake = Fake::start(&["--flavor", engine]).await;
    let _worker = fake
        .worker(engine, "vllm-q", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    let client = support::Api::at(&api);
    let seen = eventually(Duration::from_secs(15), || async {
        indexed(&api, "vllm-q").await.is_some()
    })
    .await;
    assert!(seen, "the gateway sees the worker");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // 64 tokens (16 blocks) the engine holds before the requests come.
    let prefix = tokens(7, 64);
    fake.admin("store", json!({"tokens": prefix})).await;
    assert_mirrored(&api, "vllm-q", &fake).await;

    fake.admin("hold_prefill", json!({"hold": true})).await;
    let fresh = tokens(8, 100);
    let mut extended = prefix.clone();
    extended.extend(tokens(9, 36));
    let send = |prompt: Vec<u32>| {
        let http = reqwest::Client::new();
        let url = format!("{api}/v1/completions");
        tokio::spawn(async move {
            let body = json!({"model": "fake-model", "prompt": prompt, "max_tokens": 3,
                              "ignore_eos": true, "stream": true});
            let response = http.post(url).json(&body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.text().await.unwrap()
        })
    };
    let queued = "switchyard_worker_queued_prefill_tokens{worker=\"vllm-q\"}";
    let cold = send(fresh);
    let one = eventually(Duration::from_secs(15), || async {
        client.metric(queued).await == 100.0
    })
    .await;
    assert!(
        one,
        "a cold 100-token prompt queues 100 tokens: {}",
        client.metric(queued).await
    );
    let warm = send(extended);
    let both = eventually(Duration::from_secs(15), || async {
        client.metric(queued).await == 136.0
    })
    .await;
    assert!(
        both,
        "the second prompt queues only the 36 tokens past the held prefix: {}",
        client.metric(queued).await
    );

    // Their first tokens take them off the queue.
    fake.admin("hold_prefill", json!({"hold": false})).await;
    for answer in [cold.await.unwrap(), warm.await.unwrap()] {
        let data = switchyard_core::sse::events(&answer);
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{answer}");
    }
    let drained = eventually(Duration::from_secs(15), || async {
        client.metric(queued).await == 0.0
    })
    .await;
    assert!(
        drained,
        "the queue empties: {}",
        client.metric(queued).await
    );
}
