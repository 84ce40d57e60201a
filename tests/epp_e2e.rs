//! `switchyard epp` end to end with the real binaries and no cluster: two vLLM stand-ins
//! (`tests/python/fake_vllm.py`), a `switchyard worker --engine vllm` in front of each (they
//! register their engines' HTTP endpoints), the endpoint picker, and the Envoy stand-in
//! (`tests/support/envoy_proxy.rs`) driving the picker over ext_proc as Envoy does and sending
//! each request to the engine it names. A prefix lands on the engine that holds it, the admin
//! API explains and logs the picker's decisions, a fallback serves when the first engine is
//! down, and the proxy fails open or closed when the picker itself is gone. A shared-prefix
//! workload gets the same KV hit rate through the picker as through `switchyard gateway`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use crate::support::envoy_proxy;

use std::time::Duration;

use envoy_proxy::{ClientRequest, EnvoyProxy, Outcome, ProxyConfig};
use serde_json::{Value, json};
use support::fake_engine::{Fake, assert_mirrored, explain, indexed};
use support::{Launch, eventually, tokens};
use switchyard_epp::proto::mode::processing_mode::BodySendMode;
use switchyard_testkit::EtcdServer;

fn completion(prompt: &[u32], request_id: &str) -> ClientRequest {
    ClientRequest::post(
        "/v1/completions",
        &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 4, "ignore_eos": true,
                "stream": true}),
    )
    .header("x-request-id", request_id)
}

fn endpoint_of(fake: &Fake) -> String {
    fake.http.trim_start_matches("http://").to_owned()
}

fn streamed_to_the_end(outcome: &Outcome) {
    assert_eq!(outcome.status, 200, "{outcome:?}");
    let text = String::from_utf8_lossy(&outcome.body);
    let events = switchyard_core::sse::events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_sends_prefixes_to_their_holders_and_the_proxy_falls_back() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("epp-{}", std::process::id());
    let fake_a = Fake::start(&[]).await;
    let fake_b = Fake::start(&[]).await;
    let (at_a, at_b) = (endpoint_of(&fake_a), endpoint_of(&fake_b));
    let _a = fake_a
        .worker("vllm", "vllm-a", &endpoint, &cluster)
        .start()
        .await;
    let _b = fake_b
        .worker("vllm", "vllm-b", &endpoint, &cluster)
        .start()
        .await;
    let mut picker = Launch::new("epp")
        .arg("--etcd", &endpoint)
        .arg("--cluster", &cluster)
        .arg("--http", "127.0.0.1:0")
        .arg("--grpc", "127.0.0.1:0")
        .start()
        .await;
    let grpc = picker.ready["grpc"]
        .as_str()
        .expect("grpc address")
        .to_owned();
    let api = format!("http://{}", picker.address);
    let both = eventually(Duration::from_secs(15), || async {
        indexed(&api, "vllm-a").await.is_some() && indexed(&api, "vllm-b").await.is_some()
    })
    .await;
    assert!(both, "the picker follows both workers");
    let ready = reqwest::get(format!("{api}/ready")).await.unwrap();
    assert_eq!(ready.status(), 200);

    // A prefix each engine holds: requests for it go there, in either body mode.
    let on_a = tokens(42, 64);
    let on_b = tokens(43, 64);
    fake_a.admin("store", json!({"tokens": on_a})).await;
    fake_b.admin("store", json!({"tokens": on_b})).await;
    assert_mirrored(&api, "vllm-a", &fake_a).await;
    assert_mirrored(&api, "vllm-b", &fake_b).await;
    let grow = |prefix: &[u32], seed: u32| [prefix, &tokens(seed, 12)].concat();
    let duplex = EnvoyProxy::new(&grpc, ProxyConfig::default());
    let buffered = EnvoyProxy::new(
        &grpc,
        ProxyConfig {
            request_body: BodySendMode::Buffered,
            response_body: BodySendMode::Streamed,
            ..ProxyConfig::default()
        },
    );
    for (proxy, prompt, holder, other, id) in [
        (&duplex, grow(&on_a, 1), &at_a, &at_b, "epp-1"),
        (&buffered, grow(&on_b, 2), &at_b, &at_a, "epp-2"),
        (&buffered, grow(&on_a, 3), &at_a, &at_b, "epp-3"),
        (&duplex, grow(&on_b, 4), &at_b, &at_a, "epp-4"),
    ] {
        let outcome = proxy.send(completion(&prompt, id)).await;
        streamed_to_the_end(&outcome);
        assert_eq!(outcome.destination, [holder.clone(), other.clone()], "{id}");
        assert_eq!(outcome.served.as_ref(), Some(holder), "{id}");
    }
    // The engine got the request as the client sent it (the picker changes no byte).
    let last: Value = fake_b.admin("requests", json!({})).await["requests"]
        .as_array()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    assert_eq!(last["prompt"], json!(grow(&on_b, 4)));

    // The admin API: the decision log has the picker's decisions, explain agrees.
    let decisions: Value = reqwest::get(format!("{api}/admin/decisions"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let logged = decisions.to_string();
    for id in ["epp-1", "epp-2", "epp-3", "epp-4"] {
        assert!(logged.contains(id), "{id} in {logged}");
    }
    let why = explain(&api, &grow(&on_b, 5)).await;
    assert_eq!(why["decision"]["worker"], "vllm-b", "{why}");

    // Engine a goes away (its worker stays registered): the picker still names a first for
    // a's prefix, the proxy cannot connect and goes down the list to b.
    drop(fake_a);
    let gone = eventually(Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(&at_a).await.is_err()
    })
    .await;
    assert!(gone, "engine a stopped listening");
    let outcome = duplex.send(completion(&grow(&on_a, 6), "epp-6")).await;
    streamed_to_the_end(&outcome);
    assert_eq!(outcome.destination, [at_a.clone(), at_b.clone()]);
    assert_eq!(outcome.served.as_ref(), Some(&at_b));

    // The picker goes away: Envoy fails closed (500) or, with failure_mode_allow, open.
    picker.terminate().await;
    let closed = duplex.send(completion(&on_b, "epp-7")).await;
    assert_eq!(closed.status, 500, "{closed:?}");
    let open = EnvoyProxy::new(
        &grpc,
        ProxyConfig {
            failure_mode_allow: true,
            pool: vec![at_b.clone()],
            ..ProxyConfig::default()
        },
    );
    let outcome = open.send(completion(&on_b, "epp-8")).await;
    streamed_to_the_end(&outcome);
    assert_eq!(outcome.served.as_ref(), Some(&at_b));
}

/// The shared-prefix workload: `GROUPS` prefixes of 48 tokens (12 blocks of the stand-ins' 4),
/// each sent `PER_GROUP` times with its own 8-token suffix, groups interleaved, so every
/// request after a group's first can be served from the cache of the engine that ran it.
fn shared_prefix_prompts() -> Vec<Vec<u32>> {
    const GROUPS: u32 = 3;
    const PER_GROUP: u32 = 4;
    let prefixes: Vec<Vec<u32>> = (0..GROUPS).map(|g| tokens(500 + g, 48)).collect();
    (0..PER_GROUP)
        .flat_map(|turn| {
            prefixes.iter().enumerate().map(move |(g, prefix)| {
                [prefix.clone(), tokens(600 + turn * 10 + g as u32, 8)].concat()
            })
        })
        .collect()
}

/// Prompt and cached tokens of one non-streamed completion's `usage`.
fn usage_of(body: &[u8]) -> (u64, u64) {
    let answer: Value = serde_json::from_slice(body).expect("a JSON completion");
    let usage = &answer["usage"];
    let prompt = usage["prompt_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens");
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (prompt, cached)
}

/// Prompt tokens and prefix-cache hits the engines counted (vLLM's `prompt_tokens_total` and
/// `prefix_cache_hits_total`), summed over `fakes`.
async fn engine_hits(fakes: &[Fake]) -> (f64, f64) {
    let (mut prompt, mut hits) = (0.0, 0.0);
    for fake in fakes {
        let text = reqwest::get(format!("{}/metrics", fake.http))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for sample in switchyard_core::promtext::parse(&text) {
            match sample.name.as_str() {
                "vllm:prompt_tokens_total" => prompt += sample.value,
                "vllm:prefix_cache_hits_total" => hits += sample.value,
                _ => {}
            }
        }
    }
    (prompt, hits)
}

/// Two fresh stand-in engines with a `switchyard worker --engine vllm` each, in `cluster`.
async fn two_engines(etcd: &str, cluster: &str) -> (Vec<Fake>, Vec<support::SwitchyardProcess>) {
    let fakes = vec![Fake::start(&[]).await, Fake::start(&[]).await];
    let mut workers = Vec::new();
    for (fake, id) in fakes.iter().zip(["vllm-a", "vllm-b"]) {
        workers.push(fake.worker("vllm", id, etcd, cluster).start().await);
    }
    (fakes, workers)
}

/// Waits until the router at `api` indexes exactly what each engine holds, so the next request
/// is routed on the engines' true state (the same state on either path).
async fn settle(api: &str, fakes: &[Fake]) {
    for (fake, id) in fakes.iter().zip(["vllm-a", "vllm-b"]) {
        assert_mirrored(api, id, fake).await;
    }
}

/// The done-when check of the endpoint picker: the shared-prefix workload gets the same KV hit
/// rate (prompt tokens served from the prefix cache / prompt tokens, as the engines count them)
/// through the picker and the Envoy stand-in as through `switchyard gateway`, over the same kind
/// of workers (two fresh vLLM stand-ins with a `switchyard worker --engine vllm` each).
///
/// Tolerance: the workload is sent one request at a time and each waits until the router's
/// index mirrors both engines, so both paths route every request on the same cache state and
/// the rates come out equal; the one block of slack (4 tokens of the workload's 672 prompt
/// tokens, 0.6 %) only allows one request's partial block to count differently. A path that
/// sent one warm request to the wrong engine would lose its 48-token prefix, twelve times the
/// tolerance; the rate itself is 9 × 48 / 672 = 0.643 when every warm request finds its prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_gets_the_gateways_kv_hit_rate_on_a_shared_prefix_workload() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let prompts = shared_prefix_prompts();
    let body = |prompt: &[u32]| json!({"model": "fake-model", "prompt": prompt, "max_tokens": 4, "ignore_eos": true});

    // Through the endpoint picker: Envoy (the stand-in) carries each request to the engine.
    let cluster = format!("epp-hit-{}", std::process::id());
    let (fakes, workers) = two_engines(&endpoint, &cluster).await;
    let picker = Launch::new("epp")
        .arg("--etcd", &endpoint)
        .arg("--cluster", &cluster)
        .arg("--http", "127.0.0.1:0")
        .arg("--grpc", "127.0.0.1:0")
        .start()
        .await;
    let api = format!("http://{}", picker.address);
    settle(&api, &fakes).await;
    let proxy = EnvoyProxy::new(
        picker.ready["grpc"].as_str().expect("grpc address"),
        ProxyConfig::default(),
    );
    let (mut client_prompt, mut client_cached) = (0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let request = ClientRequest::post("/v1/completions", &body(prompt))
            .header("x-request-id", &format!("hit-{i}"));
        let outcome = proxy.send(request).await;
        assert_eq!(outcome.status, 200, "{outcome:?}");
        let (prompt_tokens, cached) = usage_of(&outcome.body);
        client_prompt += prompt_tokens;
        client_cached += cached;
        settle(&api, &fakes).await;
    }
    let (picker_prompt, picker_hits) = engine_hits(&fakes).await;
    // The client reads the same figures in its usage (the engine answered it directly).
    assert_eq!(
        (client_prompt as f64, client_cached as f64),
        (picker_prompt, picker_hits)
    );
    drop((picker, workers, fakes));

    // Through the standalone gateway, over two fresh engines of the same kind.
    let cluster = format!("gw-hit-{}", std::process::id());
    let (fakes, _workers) = two_engines(&endpoint, &cluster).await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    settle(&api, &fakes).await;
    let client = reqwest::Client::new();
    // Every other request streams: vLLM counts cached tokens only in its final usage, and the
    // gateway's answer must still carry them, whole and streamed.
    let mut gateway_client_cached = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let mut request = body(prompt);
        let streamed = i % 2 == 1;
        if streamed {
            request["stream"] = json!(true);
            request["stream_options"] = json!({"include_usage": true});
        }
        let response = client
            .post(format!("{api}/v1/completions"))
            .json(&request)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let answer = response.bytes().await.unwrap();
        let usage = if streamed {
            let text = String::from_utf8(answer.to_vec()).unwrap();
            let events = switchyard_core::sse::events(&text);
            let last_usage = events
                .iter()
                .rev()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .find(|c| !c["usage"].is_null())
                .expect("a usage chunk");
            serde_json::to_vec(&last_usage).unwrap()
        } else {
            answer.to_vec()
        };
        gateway_client_cached += usage_of(&usage).1;
        settle(&api, &fakes).await;
    }
    let (gateway_prompt, gateway_hits) = engine_hits(&fakes).await;
    assert_eq!(
        gateway_client_cached as f64, gateway_hits,
        "the gateway's answers report the cached tokens the engines served"
    );

    assert_eq!(
        picker_prompt, gateway_prompt,
        "both paths sent the same prompts"
    );
    let picker_rate = picker_hits / picker_prompt;
    let gateway_rate = gateway_hits / gateway_prompt;
    println!(
        "KV hit rate on the shared-prefix workload ({} requests, {picker_prompt} prompt tokens): \
         endpoint picker {picker_rate:.4} ({picker_hits} cached), gateway {gateway_rate:.4} \
         ({gateway_hits} cached)",
        prompts.len()
    );
    assert!(gateway_rate > 0.5, "gateway hit rate {gateway_rate}");
    let tolerance = 4.0 / gateway_prompt;
    assert!(
        (picker_rate - gateway_rate).abs() <= tolerance,
        "picker {picker_rate} vs gateway {gateway_rate} (tolerance {tolerance})"
    );
}
