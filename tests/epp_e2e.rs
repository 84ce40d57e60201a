//! `switchyard epp` end to end with the real binaries and no cluster: two vLLM stand-ins
//! (`tests/python/fake_vllm.py`), a `switchyard worker --engine vllm` in front of each (they
//! register their engines' HTTP endpoints), the endpoint picker, and the Envoy stand-in
//! (`tests/support/envoy_proxy.rs`) driving the picker over ext_proc as Envoy does and sending
//! each request to the engine it names. A prefix lands on the engine that holds it, the admin
//! API explains and logs the picker's decisions, a fallback serves when the first engine is
//! down, and the proxy fails open or closed when the picker itself is gone.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod support;

#[path = "support/envoy_proxy.rs"]
mod envoy_proxy;

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
