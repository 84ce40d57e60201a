//! LoRA adapters end to end with the real binary: a request whose `model` names an adapter runs
//! on its base model's workers that serve the adapter, under the adapter's KV, and reaches the
//! engine as vLLM serves adapters (the adapter's name as `model`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, indexed, overlap_as};
use support::{Api, Launch, SwitchyardProcess, eventually, refused_at_start, run_to_exit, tokens};
use switchyard_testkit::EtcdServer;

fn candidates(explain_workers: &Value) -> Vec<String> {
    let mut ids: Vec<String> = explain_workers
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

/// A gateway over one `switchyard worker --engine vllm` (or `sglang`, see [`Self::engine`];
/// `worker_args` added) in front of a stand-in engine started with `fake_args`, once the
/// gateway follows the worker.
struct VllmCluster {
    _etcd: EtcdServer,
    fake: Fake,
    _worker: SwitchyardProcess,
    _gateway: SwitchyardProcess,
    url: String,
    api: Api,
}

impl VllmCluster {
    async fn start(worker: &str, fake_args: &[&str], worker_args: &[&str]) -> Self {
        Self::engine("vllm", worker, fake_args, worker_args).await
    }

    async fn engine(engine: &str, worker: &str, fake_args: &[&str], worker_args: &[&str]) -> Self {
        let etcd = EtcdServer::start().expect("etcd");
        let endpoint = etcd.endpoint();
        let cluster = format!("{worker}-{}", std::process::id());
        let fake = Fake::start(fake_args).await;
        let process = fake
            .worker(engine, worker, &endpoint, &cluster)
            .args(worker_args)
            .start()
            .await;
        let gateway = Launch::gateway(&endpoint, &cluster).start().await;
        let url = format!("http://{}", gateway.address);
        assert!(
            eventually(Duration::from_secs(15), || async {
                indexed(&url, worker).await.is_some()
            })
            .await
        );
        let api = Api::at(&url);
        Self {
            _etcd: etcd,
            fake,
            _worker: process,
            _gateway: gateway,
            url,
            api,
        }
    }

    /// The last generation request the engine received.
    async fn last_request(&self) -> Value {
        self.fake.admin("requests", json!({})).await["requests"]
            .as_array()
            .and_then(|r| r.last())
            .cloned()
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_runs_only_where_it_is_served_and_under_its_own_kv() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("lora-{}", std::process::id());
    let _with = Launch::worker(&endpoint, &cluster)
        .id("sim-lora")
        .arg("--lora-adapter", "sql-lora,chat-lora")
        .start()
        .await;
    let _without = Launch::worker(&endpoint, &cluster)
        .id("sim-plain")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let url = format!("http://{}", gateway.address);
    let api = Api::at(&url);
    assert!(
        eventually(Duration::from_secs(15), || api.lists_workers(2)).await,
        "both workers registered"
    );

    // Listed as vLLM lists adapters: after the base model, with it as parent.
    let (status, models) = api.get("/v1/models").await;
    assert_eq!(status, 200, "{models}");
    let ids: Vec<(&str, Option<&str>)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["parent"].as_str()))
        .collect();
    assert_eq!(
        ids,
        [
            ("sim-8b", None),
            ("chat-lora", Some("sim-8b")),
            ("sql-lora", Some("sim-8b"))
        ]
    );
    let (status, card) = api.get("/v1/models/sql-lora").await;
    assert_eq!((status, card["parent"].as_str()), (200, Some("sim-8b")));
    let (_, workers) = api.get("/admin/workers").await;
    let served: Vec<(&str, &Value)> = workers
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap(), &w["adapters"]))
        .collect();
    assert!(
        served.contains(&("sim-lora", &json!(["sql-lora", "chat-lora"])))
            && served.contains(&("sim-plain", &Value::Null)),
        "{workers}"
    );

    // Only the worker that serves the adapter is a candidate.
    let prompt = tokens(11, 96);
    let (status, explain) = api
        .post(
            "/admin/explain",
            &json!({"model": "sql-lora", "prompt": prompt}),
        )
        .await;
    assert_eq!(status, 200, "{explain}");
    assert_eq!(
        candidates(&explain["decision"]["explanation"]["workers"]),
        ["sim-lora"]
    );
    let (status, explain) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": prompt}),
        )
        .await;
    assert_eq!(status, 200, "{explain}");
    assert_eq!(
        candidates(&explain["decision"]["explanation"]["workers"]),
        ["sim-lora", "sim-plain"]
    );

    // Served, answered under the adapter's name, and its blocks are the adapter's: the same
    // tokens asked of the base model find nothing cached.
    for model in ["sql-lora", "chat-lora"] {
        let (status, answer) = api
            .post(
                "/v1/completions",
                &json!({"model": model, "prompt": prompt, "max_tokens": 4}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["model"], model, "{answer}");
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            overlap_as(&url, "sql-lora", "sim-lora", &prompt).await >= 5
        })
        .await,
        "the adapter's blocks are indexed under it"
    );
    assert_eq!(
        overlap_as(&url, "sim-8b", "sim-lora", &prompt).await,
        0,
        "the base model never matches an adapter's KV"
    );
    let (status, answer) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "chat-lora", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "chat-lora");

    // A name nobody serves is a 404, as an unknown model is.
    let (status, answer) = api
        .post(
            "/v1/completions",
            &json!({"model": "nope-lora", "prompt": [1, 2, 3], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 404, "{answer}");
    assert_eq!(answer["error"]["code"], "model_not_found", "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_engine_gets_the_adapter_as_its_model_and_must_serve_it() {
    let c = VllmCluster::start(
        "vllm-lora",
        &["--lora-modules", "sql-lora"],
        &["--lora-adapter", "sql-lora"],
    )
    .await;
    let (api, api_url) = (&c.api, &c.url);
    let prompt = tokens(5, 20);
    let (status, answer) = api
        .post(
            "/v1/completions",
            &json!({"model": "sql-lora", "prompt": prompt, "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "sql-lora", "{answer}");
    let sent = c.last_request().await;
    assert_eq!(sent["model"], "sql-lora", "{sent}");
    // The engine publishes the adapter's blocks with its name (`lora_name`); the worker keys
    // them under it, so the gateway matches them for the adapter and never for the base model.
    assert!(
        eventually(Duration::from_secs(10), || async {
            overlap_as(api_url, "sql-lora", "vllm-lora", &prompt).await == 5
        })
        .await,
        "the adapter's 5 prompt blocks are indexed under it"
    );
    assert_eq!(
        overlap_as(api_url, "fake-model", "vllm-lora", &prompt).await,
        0
    );

    // A worker naming an adapter its vLLM engine does not list refuses to start, naming it.
    let plain = Fake::start(&[]).await;
    let args: Vec<String> = [
        "worker",
        "--engine",
        "vllm",
        "--engine-url",
        &plain.http,
        "--kv-events",
        &format!("tcp://127.0.0.1:{}", plain.zmq),
        "--model",
        "fake-model",
        "--lora-adapter",
        "sql-lora",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let (output, stderr) = run_to_exit(&args, Duration::from_secs(60)).await;
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("\"sql-lora\"") && stderr.contains("--lora-modules"),
        "the refusal names the adapter and the engine flag: {stderr}"
    );

    // The name itself is checked like any configuration.
    refused_at_start(
        &["worker", "--model", "m", "--lora-adapter", "m"],
        "base model's name",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchyard_up_serves_adapters_on_its_simulated_workers() {
    let up = Launch::up(2)
        .arg("--lora-adapter", "sql-lora")
        .start()
        .await;
    let api = Api::at(&format!("http://{}", up.address));
    assert!(
        eventually(Duration::from_secs(15), || api.lists_workers(2)).await,
        "both workers registered"
    );
    let (status, card) = api.get("/v1/models/sql-lora").await;
    assert_eq!(
        (status, card["parent"].as_str()),
        (200, Some("sim-8b")),
        "{card}"
    );
    let (status, answer) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "sql-lora");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_into_a_running_vllm_is_registered_and_one_unloaded_is_dropped() {
    let c = VllmCluster::start("vllm-live", &[], &["--engine-adapters-interval-ms", "100"]).await;
    let (api, fake) = (&c.api, &c.fake);
    let ask = json!({"model": "hot-lora", "prompt": tokens(8, 12), "max_tokens": 2});
    assert_eq!(api.post("/v1/completions", &ask).await.0, 404);

    // vLLM's run-time endpoint (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the worker sees the adapter
    // in /v1/models and registers it; the gateway routes it.
    assert_eq!(fake.lora("hot-lora", Some("/adapters/hot")).await.0, 200);
    assert!(
        eventually(Duration::from_secs(10), || async {
            api.get("/v1/models/hot-lora").await.0 == 200
        })
        .await,
        "the loaded adapter is served"
    );
    let (status, answer) = api.post("/v1/completions", &ask).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(c.last_request().await["model"], "hot-lora");

    assert_eq!(fake.lora("hot-lora", None).await.0, 200);
    assert!(
        eventually(Duration::from_secs(10), || async {
            api.post("/v1/completions", &ask).await.0 == 404
        })
        .await,
        "an unloaded adapter is no longer routed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_into_a_running_sglang_is_registered_and_one_unloaded_is_dropped() {
    let c = VllmCluster::engine(
        "sglang",
        "sglang-live",
        &["--flavor", "sglang", "--lora-modules", "sql-lora"],
        &[
            "--lora-adapter",
            "sql-lora",
            "--engine-adapters-interval-ms",
            "100",
        ],
    )
    .await;
    let (api, fake) = (&c.api, &c.fake);
    let ask = json!({"model": "hot-lora", "prompt": tokens(8, 12), "max_tokens": 2});
    assert_eq!(api.post("/v1/completions", &ask).await.0, 404);

    // SGLang's run-time endpoint: the worker sees the adapter in /v1/models, registers it, and
    // the gateway sends it to SGLang as `lora_path`.
    let (status, loaded) = fake.lora("hot-lora", Some("/adapters/hot")).await;
    assert_eq!(status, 200, "{loaded}");
    let loaded: Value = serde_json::from_str(&loaded).unwrap();
    assert_eq!(loaded["success"], true, "{loaded}");
    assert_eq!(loaded["loaded_adapters"]["hot-lora"], "/adapters/hot");
    assert!(
        eventually(Duration::from_secs(10), || async {
            api.get("/v1/models/hot-lora").await.0 == 200
        })
        .await,
        "the loaded adapter is served"
    );
    let (status, answer) = api.post("/v1/completions", &ask).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(c.last_request().await["lora_path"], "hot-lora");

    // Unloading the adapter the worker was started with drops it too: the engine's list is
    // followed, not the flags.
    for name in ["hot-lora", "sql-lora"] {
        assert_eq!(fake.lora(name, None).await.0, 200);
    }
    // SGLang's answer to a name it does not hold: 400 with `success: false`.
    let (status, refused) = fake.lora("hot-lora", None).await;
    assert_eq!(status, 400, "{refused}");
    for name in ["hot-lora", "sql-lora"] {
        let ask = json!({"model": name, "prompt": tokens(8, 12), "max_tokens": 2});
        assert!(
            eventually(Duration::from_secs(10), || async {
                api.post("/v1/completions", &ask).await.0 == 404
            })
            .await,
            "an unloaded adapter ({name}) is no longer routed"
        );
    }

    // A worker naming an adapter its SGLang engine does not list refuses to start, naming it
    // and SGLang's own flag.
    let args: Vec<String> = [
        "worker",
        "--engine",
        "sglang",
        "--engine-url",
        &fake.http,
        "--kv-events",
        &format!("tcp://127.0.0.1:{}", fake.zmq),
        "--model",
        "fake-model",
        "--lora-adapter",
        "sql-lora",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let (output, stderr) = run_to_exit(&args, Duration::from_secs(60)).await;
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("\"sql-lora\"") && stderr.contains("--lora-paths"),
        "the refusal names the adapter and the engine flag: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_before_0_5_5_serves_the_adapters_the_worker_names() {
    // SGLang before 0.5.5 lists no adapter in /v1/models: the worker cannot check or follow
    // them, so it registers the ones it is told of, and the gateway routes them as before.
    let c = VllmCluster::engine(
        "sglang",
        "sglang-old",
        &[
            "--flavor",
            "sglang",
            "--sglang-version",
            "0.5.4.post3",
            "--lora-modules",
            "sql-lora",
        ],
        &["--lora-adapter", "sql-lora"],
    )
    .await;
    let ask = json!({"model": "sql-lora", "prompt": tokens(8, 12), "max_tokens": 2});
    let (status, answer) = c.api.post("/v1/completions", &ask).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(c.last_request().await["lora_path"], "sql-lora");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_claimed_by_two_base_models_is_refused_by_name() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("lora-twice-{}", std::process::id());
    let mut workers = Vec::new();
    for (id, model) in [("sim-a", "sim-8b"), ("sim-b", "sim-70b")] {
        workers.push(
            Launch::worker(&endpoint, &cluster)
                .id(id)
                .arg("--model", model)
                .arg("--lora-adapter", "shared-lora")
                .start()
                .await,
        );
    }
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::at(&format!("http://{}", gateway.address));
    assert!(eventually(Duration::from_secs(15), || api.lists_workers(2)).await);
    let (status, answer) = api
        .post(
            "/v1/completions",
            &json!({"model": "shared-lora", "prompt": [1, 2, 3], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "model", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("sim-8b") && message.contains("sim-70b"),
        "{message}"
    );
    // Each base model still serves.
    for model in ["sim-8b", "sim-70b"] {
        let (status, answer) = api
            .post(
                "/v1/completions",
                &json!({"model": model, "prompt": [1, 2, 3], "max_tokens": 2}),
            )
            .await;
        assert_eq!(status, 200, "{model}: {answer}");
    }
}
