//! A request's `priority` through the real gateway and `switchyard worker` processes to the
//! vLLM/SGLang stand-in (`tests/python/fake_vllm.py`, which refuses a priority its engine would
//! refuse): carried in the engine's own field to an engine the worker says schedules by
//! priority (`--engine-priority-scheduling`), never sent to one that does not (the request is
//! still served), and a non-integer priority is a 400 naming the field.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::eventually;
use support::fake_engine::{Fake, indexed};
use switchyard_testkit::EtcdServer;

/// Posts a completion of `prompt` at `priority` to the gateway at `api`: its status and body.
async fn complete(api: &str, prompt: u32, priority: Value) -> (u16, Value) {
    let body = json!({"model": "fake-model", "prompt": (prompt..prompt + 12).collect::<Vec<_>>(),
                      "max_tokens": 3, "ignore_eos": true, "priority": priority});
    let response = reqwest::Client::new()
        .post(format!("{api}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn last_body(fake: &Fake) -> Value {
    fake.admin("requests", json!({})).await["requests"]
        .as_array()
        .and_then(|r| r.last())
        .cloned()
        .expect("the engine received a request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_reaches_engines_that_schedule_by_it_and_no_other() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let pid = std::process::id();
    // A vLLM scheduling by priority and a worker that says so, in one cluster; an SGLang that
    // does not, with a worker that does not claim it, in another.
    let vllm = Fake::start(&["--scheduling-policy", "priority"]).await;
    let sglang = Fake::start(&["--flavor", "sglang"]).await;
    let (vllm_cluster, sglang_cluster) = (format!("prio-v-{pid}"), format!("prio-s-{pid}"));
    let _vllm_worker = vllm
        .worker("vllm", "prio-vllm", &endpoint, &vllm_cluster)
        .args(["--engine-priority-scheduling"])
        .start()
        .await;
    let _sglang_worker = sglang
        .worker("sglang", "prio-sglang", &endpoint, &sglang_cluster)
        .start()
        .await;
    let vllm_gateway = support::Launch::gateway(&endpoint, &vllm_cluster)
        .start()
        .await;
    let sglang_gateway = support::Launch::gateway(&endpoint, &sglang_cluster)
        .start()
        .await;
    let vllm_api = format!("http://{}", vllm_gateway.address);
    let sglang_api = format!("http://{}", sglang_gateway.address);
    let ready = eventually(Duration::from_secs(15), || async {
        indexed(&vllm_api, "prio-vllm").await.is_some()
            && indexed(&sglang_api, "prio-sglang").await.is_some()
    })
    .await;
    assert!(ready, "each gateway sees its worker");

    // Carried to the vLLM that schedules by it, as `priority`.
    let (status, body) = complete(&vllm_api, 1, json!(-4)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(last_body(&vllm).await["priority"], json!(-4));
    // Not asked: not sent.
    let (status, body) = complete(&vllm_api, 2, Value::Null).await;
    assert_eq!(status, 200, "{body}");
    assert!(last_body(&vllm).await.get("priority").is_none());

    // The SGLang without priority scheduling (which would refuse it) serves the request
    // without it.
    let (status, body) = complete(&sglang_api, 3, json!(7)).await;
    assert_eq!(status, 200, "{body}");
    let sent = last_body(&sglang).await;
    assert!(sent.get("priority").is_none(), "{sent}");
    assert_eq!(sent["input_ids"][0], json!(3), "{sent}");

    // A priority that is not an integer is the client's error, named.
    for bad in [json!("high"), json!(1.5), json!(1_u64 << 40)] {
        let (status, body) = complete(&vllm_api, 4, bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"]["param"], "priority", "{body}");
    }
}
