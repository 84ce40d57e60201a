//! End to end through the real binary: the OpenAI API (Rust HTTP client, the official `openai`
//! Python SDK), bad input, the admin API, KV-aware routing against round-robin, migration of a
//! stream whose worker is SIGKILLed, and cancellation when a client goes away.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::EtcdServer;

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": "sim-8b",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_api_serves_requests_and_refuses_bad_input() {
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "2",
            "--speedup",
            "50",
            "--max-context",
            "4096",
        ],
    )
    .await;
    let api = Api::new(&up);

    let (status, models) = api.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "sim-8b");

    // Non-streaming chat.
    let (status, body) = api
        .post("/v1/chat/completions", &chat("Hello there", 12))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 3);

    // Streaming chat with usage in the last chunk.
    let mut req = chat("Stream to me", 6);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let events = api.stream("/v1/chat/completions", &req).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("length")]);

    // Text completions, prompt as text and as token ids, streamed and not.
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let events = api
        .stream(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": tokens(1, 40), "max_tokens": 4, "ignore_eos": true, "stream": true}),
        )
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));

    // Stop strings: the same request (same prompt, same seed) lands on the worker holding its
    // prefix and generates the same text; cutting at a word of it ends the answer there.
    let base = json!({"model": "sim-8b", "prompt": tokens(2, 48), "max_tokens": 30, "seed": 7, "ignore_eos": true});
    let (_, full) = api.post("/v1/completions", &base).await;
    let full_text = full["choices"][0]["text"].as_str().unwrap().to_owned();
    let (_, again) = api.post("/v1/completions", &base).await;
    assert_eq!(
        again["choices"][0]["text"], full_text,
        "same seed, same worker, same text"
    );
    let cut = full_text
        .char_indices()
        .nth(full_text.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = full_text[cut..].chars().take(3).collect();
    let mut with_stop = base.clone();
    with_stop["stop"] = json!(stop);
    let (status, stopped) = api.post("/v1/completions", &with_stop).await;
    assert_eq!(status, 200);
    let stopped_text = stopped["choices"][0]["text"].as_str().unwrap();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert!(full_text.starts_with(stopped_text));
    assert!(
        !stopped_text.contains(&stop),
        "{stopped_text:?} contains {stop:?}"
    );

    // Bad input: the right status and an OpenAI error object, every time.
    let long_prompt = "word ".repeat(5000);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("malformed json", b"{\"model\": ".to_vec(), 400, "invalid request body"),
        ("invalid utf-8", vec![b'{', 0xff, 0xfe, b'}'], 400, "UTF-8"),
        ("unknown model", serde_json::to_vec(&json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]})).unwrap(), 404, "nope"),
        ("missing messages", serde_json::to_vec(&json!({"model": "sim-8b"})).unwrap(), 400, "messages"),
        ("empty messages", serde_json::to_vec(&json!({"model": "sim-8b", "messages": []})).unwrap(), 400, "messages"),
        ("bad message", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"content": "no role"}]})).unwrap(), 400, "messages[0]"),
        ("prompt over context", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": long_prompt}]})).unwrap(), 400, "maximum context length"),
        ("max_tokens over context", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000})).unwrap(), 400, "maximum context length"),
        ("max_tokens zero", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})).unwrap(), 400, "max_tokens"),
        ("n > 1", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "n": 2})).unwrap(), 400, "n = 1"),
        ("temperature out of range", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "temperature": 9})).unwrap(), 400, "temperature"),
        (
            "unsupported content part",
            serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})).unwrap(),
            400,
            "image_url",
        ),
        // Just over the 32 MiB limit: the gateway answers once it has read the limit, and the
        // few bytes left are already on their way (a far larger body races the server's close
        // and the client can see a broken pipe instead of the answer).
        (
            "body too large",
            vec![b' '; (32 << 20) + 1024],
            413,
            "larger than",
        ),
    ];
    for (name, body, want, needle) in cases {
        let (status, err) = api.post_raw("/v1/chat/completions", body).await;
        assert_eq!(status, want, "{name}: {err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(needle),
            "{name}: {message:?} lacks {needle:?}"
        );
        assert!(err["error"]["type"].is_string(), "{name}: {err}");
    }
    let (status, err) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": ["a", "b"]}),
        )
        .await;
    assert_eq!(status, 400, "{err}");
    let (status, _) = api.get("/v1/nothing-here").await;
    assert_eq!(status, 404);
    // Still healthy and serving.
    let (status, _) = api.get("/health").await;
    assert_eq!(status, 200);
    let (status, _) = api.get("/ready").await;
    assert_eq!(status, 200);
    let (status, body) = api
        .post("/v1/chat/completions", &chat("still there?", 3))
        .await;
    assert_eq!(status, 200, "{body}");

    // An agent session: each turn resends the growing history. The gateway tokenizes only the
    // new part, and the prompt it counts equals a full tokenization (explain bypasses the cache).
    let mut history = vec![
        json!({"role": "system", "content": "You are a coding agent. Tools: read_file, run_tests."}),
        json!({"role": "user", "content": "Fix the failing test in src/lib.rs, please."}),
    ];
    for turn in 0..3 {
        let body =
            json!({"model": "sim-8b", "messages": history, "max_tokens": 5, "ignore_eos": true});
        let response = api
            .http
            .post(format!("{}/v1/chat/completions", api.base))
            .header("x-session-id", "agent-7")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let answer: Value = response.json().await.unwrap();
        let (_, full) = api
            .post(
                "/admin/explain",
                &json!({"model": "sim-8b", "messages": history}),
            )
            .await;
        assert_eq!(
            answer["usage"]["prompt_tokens"], full["prompt_tokens"],
            "turn {turn}: incremental tokenization differs from full"
        );
        history.push(
            json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}),
        );
        history.push(json!({"role": "tool", "content": format!("test output {turn}: 3 passed, 1 failed ✗ — 失败")}));
    }
    assert!(
        api.metric("switchyard_tokenizer_turns_total{tokenization=\"incremental\"}")
            .await
            >= 2.0,
        "later turns reused the session's tokens"
    );
    assert!(api.metric("switchyard_tokenizer_reused_tokens_total").await > 20.0);
    assert_eq!(
        api.metric("switchyard_tokenizer_verify_mismatches_total")
            .await,
        0.0
    );

    // Admin API.
    let (status, workers) = api.get("/admin/workers").await;
    assert_eq!(status, 200);
    assert_eq!(workers.as_array().unwrap().len(), 2);
    let (status, decisions) = api.get("/admin/decisions?limit=3").await;
    assert_eq!(status, 200);
    assert_eq!(decisions.as_array().unwrap().len(), 3);
    assert!(decisions[0]["explanation"]["why"].is_string());
    let (status, index) = api.get("/admin/index").await;
    assert_eq!(status, 200);
    assert!(
        index[0]["stats"]["entries"].as_u64().unwrap() > 0,
        "{index}"
    );
    let (status, body) = api
        .post("/admin/policy", &json!({"policy": "least-loaded"}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, policy) = api.get("/admin/policy").await;
    assert_eq!(policy["policy"], "least-loaded");
    let (status, _) = api.post("/admin/policy", &json!({"policy": "bogus"})).await;
    assert_eq!(status, 400);

    // Draining every worker leaves nobody to serve: 503 with an error object; resume heals it.
    let (_, workers) = api.get("/admin/workers").await;
    let ids: Vec<String> = workers
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap().to_owned())
        .collect();
    for id in &ids {
        let (status, body) = api
            .post(&format!("/admin/workers/{id}/drain"), &json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["draining"], true);
    }
    let (status, err) = api.post("/v1/chat/completions", &chat("anyone?", 2)).await;
    assert_eq!(status, 503, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no worker")
    );
    let (status, _) = api.get("/ready").await;
    assert_eq!(status, 503);
    for id in &ids {
        let (status, _) = api
            .post(&format!("/admin/workers/{id}/resume"), &json!({}))
            .await;
        assert_eq!(status, 200);
    }
    let (status, body) = api.post("/v1/chat/completions", &chat("back?", 2)).await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = api.post("/admin/workers/nobody/drain", &json!({})).await;
    assert_eq!(status, 404);

    // curl, as the README shows it: JSON and a streamed answer.
    let curl = |body: Value| {
        let url = format!("{}/v1/chat/completions", api.base);
        async move {
            let output = tokio::process::Command::new("curl")
                .args([
                    "-sS",
                    "-N",
                    "--max-time",
                    "30",
                    "-H",
                    "content-type: application/json",
                    "-d",
                ])
                .arg(body.to_string())
                .arg(url)
                .output()
                .await
                .expect("run curl");
            assert!(output.status.success(), "curl failed: {output:?}");
            String::from_utf8(output.stdout).expect("utf-8 answer")
        }
    };
    let answer: Value = serde_json::from_str(&curl(chat("Hello from curl", 4)).await).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");
    let mut streamed = chat("Stream to curl", 3);
    streamed["stream"] = json!(true);
    let text = curl(streamed).await;
    assert!(text.contains("\"role\":\"assistant\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // The official OpenAI Python SDK.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/openai_client.py"
    );
    let output = tokio::process::Command::new("python3")
        .arg(script)
        .arg(format!("{}/v1", api.base))
        .output()
        .await
        .expect("run python3");
    assert!(
        output.status.success(),
        "openai SDK client failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("openai sdk: all checks passed"));

    // Metrics are exported under conventional names.
    assert!(api.metric("switchyard_requests_total").await >= 10.0);
    assert!(
        api.metric("switchyard_time_to_first_token_seconds_count")
            .await
            >= 5.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_routing_follows_prefixes_and_beats_round_robin() {
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "4",
            "--speedup",
            "50",
            "--admin-token",
            "s3cret",
        ],
    )
    .await;
    let api = Api::new(&up);
    let admin = |path: &str| {
        api.http
            .get(format!("{}{path}", api.base))
            .bearer_auth("s3cret")
    };
    // The admin API wants the token.
    let (status, err) = api.get("/admin/workers").await;
    assert_eq!(status, 401);
    assert_eq!(err["error"]["type"], "authentication_error");

    // A long prefix, then the same prefix with a new suffix: the second goes where the first
    // left its blocks, and explain says why.
    let prefix = tokens(3, 1024);
    let first = json!({"model": "sim-8b", "prompt": prefix, "max_tokens": 2, "ignore_eos": true});
    let (status, body) = api.post("/v1/completions", &first).await;
    assert_eq!(status, 200, "{body}");
    let decisions: Value = admin("/admin/decisions?limit=1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let holder = decisions[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    // Wait until the holder's KV events reached the index.
    let indexed =
        eventually(Duration::from_secs(10), || async {
            let workers: Value = admin("/admin/workers")
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            workers.as_array().unwrap().iter().any(|w| {
                w["id"] == holder.as_str() && w["indexed_blocks"].as_u64().unwrap_or(0) >= 64
            })
        })
        .await;
    assert!(indexed, "the prompt's blocks reached the index");
    let mut second_prompt = prefix.clone();
    second_prompt.extend(tokens(4, 100));
    let explain: Value = api
        .http
        .post(format!("{}/admin/explain", api.base))
        .bearer_auth("s3cret")
        .json(&json!({"model": "sim-8b", "prompt": second_prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let decision = &explain["decision"];
    assert_eq!(decision["worker"], holder.as_str(), "{explain}");
    let holder_score = decision["explanation"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == holder.as_str())
        .unwrap();
    assert_eq!(holder_score["overlap"]["device"], 64, "{holder_score}");
    assert!(
        decision["explanation"]["why"]
            .as_str()
            .unwrap()
            .contains(&holder)
    );
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": second_prompt, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 1008,
        "{body}"
    );

    // Shared-prefix workload: 5 groups of 4 requests sharing a 512-token prefix, interleaved.
    // (5 groups over 4 workers: round-robin never sends a group back to the same worker.)
    async fn workload(api: &Api, seed: u32) -> f64 {
        let mut cached = 0u64;
        let mut total = 0u64;
        for round in 0..4 {
            for group in 0..5 {
                let mut prompt = tokens(seed + group, 512);
                prompt.extend(tokens(seed * 100 + round * 10 + group, 64));
                let (status, body) = api
                    .post(
                        "/v1/completions",
                        &json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
                    )
                    .await;
                assert_eq!(status, 200, "{body}");
                cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                total += body["usage"]["prompt_tokens"].as_u64().unwrap();
                // Wait until this request's KV events reached the gateway: some worker's
                // indexed prefix covers the whole prompt (36 blocks of 16).
                let indexed = eventually(Duration::from_secs(10), || async {
                    let explain: Value = api
                        .http
                        .post(format!("{}/admin/explain", api.base))
                        .bearer_auth("s3cret")
                        .json(&json!({"model": "sim-8b", "prompt": prompt}))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    explain["decision"]["explanation"]["workers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|w| w["overlap"]["device"] == 36)
                })
                .await;
                assert!(indexed, "the request's blocks reached the index");
            }
        }
        cached as f64 / total as f64
    }
    let kv_hit = workload(&api, 10).await;
    let status = api
        .http
        .put(format!("{}/admin/policy", api.base))
        .bearer_auth("s3cret")
        .json(&json!({"policy": "round-robin"}))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
    let rr_hit = workload(&api, 20).await;
    eprintln!("cache hit rate: kv {kv_hit:.3}, round-robin {rr_hit:.3}");
    assert!(
        kv_hit > 0.5 && kv_hit > rr_hit + 0.3,
        "kv {kv_hit:.3} should clearly beat round-robin {rr_hit:.3}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_migrated_away_and_a_dropped_client_cancels() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("gw-{}", std::process::id());
    let worker_args = |id: &'static str| {
        vec![
            "--etcd".to_owned(),
            endpoint.clone(),
            "--cluster".to_owned(),
            cluster.clone(),
            "--lease-ttl-secs".to_owned(),
            "2".to_owned(),
            "--speedup".to_owned(),
            "0.5".to_owned(),
            "--max-context".to_owned(),
            "8192".to_owned(),
            "--id".to_owned(),
            id.to_owned(),
        ]
    };
    let a_args = worker_args("worker-a");
    let b_args = worker_args("worker-b");
    let mut a =
        SwitchyardProcess::start(&a_args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let mut b =
        SwitchyardProcess::start(&b_args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let gateway = SwitchyardProcess::spawn(
        "gateway",
        &[
            "--etcd",
            &endpoint,
            "--cluster",
            &cluster,
            "--http",
            "127.0.0.1:0",
        ],
    )
    .await;
    let api = Api::new(&gateway);
    let both = eventually(Duration::from_secs(10), || async {
        let (_, workers) = api.get("/admin/workers").await;
        workers.as_array().map_or(0, Vec::len) == 2
    })
    .await;
    assert!(both, "gateway sees both workers");

    // A registered worker that does not answer (its process is gone, its lease not yet expired)
    // costs a retry, not a failed request. Round-robin makes sure it gets picked.
    let registry =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &cluster)
            .await
            .unwrap();
    let dead_port = switchyard_testkit::free_port();
    let ghost = switchyard_core::WorkerInfo {
        id: switchyard_core::WorkerId::new("worker-ghost").unwrap(),
        address: format!("127.0.0.1:{dead_port}"),
        model: "sim-8b".into(),
        role: switchyard_core::Role::Both,
        block_size: switchyard_core::BlockSize::new(16).unwrap(),
        kv_capacity_blocks: 8192,
        max_context_tokens: 8192,
        engine: switchyard_core::EngineKind::Sim,
        incarnation: 1,
    };
    use switchyard_registry::Registry as _;
    let ghost_registration = registry
        .register(ghost, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            let (_, workers) = api.get("/admin/workers").await;
            workers.as_array().map_or(0, Vec::len) == 3
        })
        .await
    );
    let (status, _) = api
        .post("/admin/policy", &json!({"policy": "round-robin"}))
        .await;
    assert_eq!(status, 200);
    for i in 0..3 {
        let (status, body) = api
            .post(
                "/v1/completions",
                &json!({"model": "sim-8b", "prompt": tokens(40 + i, 32), "max_tokens": 2, "ignore_eos": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    assert!(api.metric("switchyard_dispatch_retries_total").await >= 1.0);
    ghost_registration.deregister().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            let (_, workers) = api.get("/admin/workers").await;
            workers.as_array().map_or(0, Vec::len) == 2
        })
        .await
    );
    let (status, _) = api.post("/admin/policy", &json!({"policy": "kv"})).await;
    assert_eq!(status, 200);

    // Stream a long answer; kill its worker after the first tokens.
    let body = json!({
        "model": "sim-8b",
        "prompt": tokens(5, 200),
        "max_tokens": 120,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut response = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    while !text.contains("\"text\"") {
        let chunk = response.chunk().await.unwrap().expect("first chunk");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (_, decisions) = api.get("/admin/decisions?limit=1").await;
    let serving = decisions[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    let (victim, survivor) = if serving == "worker-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    victim.kill_hard().await;
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let payloads: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(payloads.last(), Some(&"[DONE]"), "{text}");
    assert!(
        !text.contains("\"error\""),
        "the client saw an error: {text}"
    );
    let usage: Value = serde_json::from_str(payloads[payloads.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"]["completion_tokens"], 120,
        "complete answer: {usage}"
    );
    assert!(api.metric("switchyard_dispatch_migrations_total").await >= 1.0);

    // The dead worker leaves the gateway, and its blocks leave the index.
    let gone = eventually(Duration::from_secs(15), || async {
        let (_, workers) = api.get("/admin/workers").await;
        let (_, index) = api.get("/admin/index").await;
        workers.as_array().map_or(0, Vec::len) == 1 && index[0]["stats"]["workers"] == 1
    })
    .await;
    assert!(gone, "killed worker still known to the gateway");

    // A client that goes away stops its generation on the worker.
    let body = json!({"model": "sim-8b", "prompt": tokens(6, 64), "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut response = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    response.chunk().await.unwrap().expect("first chunk");
    let running = |n: u64| {
        let api = &api;
        async move {
            let (_, workers) = api.get("/admin/workers").await;
            workers[0]["load"]["running_requests"].as_u64() == Some(n)
        }
    };
    assert!(
        eventually(Duration::from_secs(10), || running(1)).await,
        "request is running"
    );
    drop(response);
    assert!(
        eventually(Duration::from_secs(5), || running(0)).await,
        "the worker still runs a request whose client left"
    );
    let _ = survivor;

    // `switchyard up --etcd` uses etcd instead of the in-memory registry.
    let other = format!("{cluster}-up");
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--speedup",
            "50",
            "--etcd",
            &endpoint,
            "--cluster",
            &other,
        ],
    )
    .await;
    let up_api = Api::new(&up);
    let (status, body) = up_api
        .post("/v1/chat/completions", &chat("via etcd", 3))
        .await;
    assert_eq!(status, 200, "{body}");
    let listed =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &other)
            .await
            .unwrap()
            .list_workers()
            .await
            .unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hugging_face_tokenizer_and_chat_template_serve_the_api() {
    let dir = std::env::var("SWITCHYARD_TEST_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::PathBuf::from(std::env::var("HOME").expect("HOME"))
                .join(".cache/switchyard/test-models")
        })
        .join("qwen3");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "Qwen3 tokenizer missing in {}: run crates/switchyard-tokenize/fetch-test-models.sh (the README test command does)",
        dir.display()
    );
    let dir = dir.to_string_lossy().into_owned();
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--speedup",
            "50",
            "--tokenizer",
            &dir,
        ],
    )
    .await;
    let api = Api::new(&up);
    // Rendered with Qwen3's chat template and tokenized with its tokenizer, this conversation is
    // 26 tokens (the same ids as Python transformers; see switchyard-tokenize's fixtures).
    let (status, body) = api
        .post(
            "/v1/chat/completions",
            &json!({
                "model": "sim-8b",
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"}
                ],
                "max_tokens": 8,
                "ignore_eos": true
            }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 26, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_gateway_answers_429_with_retry_after() {
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--speedup",
            "1",
            "--max-concurrent-requests",
            "1",
            "--max-queued-requests",
            "0",
        ],
    )
    .await;
    let api = Api::new(&up);
    // One long streamed request holds the only slot (about 200 decode steps in real time).
    let mut long = chat("hold the slot", 200);
    long["stream"] = json!(true);
    let mut holder = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(holder.status(), 200);
    holder.chunk().await.unwrap().expect("first chunk");
    let response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&chat("me too", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let err: Value = response.json().await.unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error");
    // When the slot frees, requests are served again.
    drop(holder);
    let served = eventually(Duration::from_secs(10), || async {
        api.post("/v1/chat/completions", &chat("now?", 2)).await.0 == 200
    })
    .await;
    assert!(served, "the gateway recovers once the slot is free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_fanning_out_does_not_starve_other_sessions() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--speedup",
            "1",
            "--max-concurrent-requests",
            "2",
        ],
    )
    .await;
    let api = Arc::new(Api::new(&up));
    // Each request decodes 40 tokens in real time (about a third of a second), two at a time.
    let send = |session: String, content: String| {
        let api = Arc::clone(&api);
        async move {
            let response = api
                .http
                .post(format!("{}/v1/chat/completions", api.base))
                .header("x-session-id", session)
                .json(&chat(&content, 40))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
    };
    let fan_done = Arc::new(AtomicUsize::new(0));
    let mut fan = Vec::new();
    for i in 0..32 {
        let request = send("fan".into(), format!("sub-agent {i}"));
        let fan_done = Arc::clone(&fan_done);
        fan.push(tokio::spawn(async move {
            request.await;
            fan_done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    // Two of the fan-out run, the other 30 wait; only then do the other sessions arrive.
    let queued = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_requests_queued").await >= 30.0
    })
    .await;
    assert!(queued, "the fan-out fills the slots and waits");
    let mut singles = Vec::new();
    for i in 0..4 {
        let request = send(format!("single-{i}"), format!("main agent {i}"));
        let fan_done = Arc::clone(&fan_done);
        singles.push(tokio::spawn(async move {
            request.await;
            fan_done.load(Ordering::SeqCst)
        }));
    }
    // Served in turn with the fan-out, not behind it: each single session finishes while at
    // most a handful of the 32 have (first come, first served would make it 32).
    for single in singles {
        let fan_finished_before = single.await.unwrap();
        assert!(
            fan_finished_before < 8,
            "a single session waited for {fan_finished_before} of the fan-out's 32 requests"
        );
    }
    for request in fan {
        request.await.unwrap();
    }
    assert_eq!(api.metric("switchyard_requests_queued").await, 0.0);
    assert!(api.metric("switchyard_admission_wait_seconds_count").await >= 36.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_recording_replays_offline_and_kv_agrees_with_the_live_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let recordings = dir.path().join("recordings");
    std::fs::create_dir(&recordings).unwrap();
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "3",
            "--speedup",
            "50",
            "--admin-token",
            "s3cret",
            "--recording-dir",
            recordings.to_str().unwrap(),
        ],
    )
    .await;
    let api = Api::new(&up);
    let admin = |path: &str, body: Value| {
        let request = api
            .http
            .post(format!("{}{path}", api.base))
            .bearer_auth("s3cret")
            .json(&body);
        api.send(request)
    };
    // The token is required, and paths outside the recording directory are refused.
    assert_eq!(api.post("/admin/recording/start", &json!({})).await.0, 401);
    let (status, err) = admin("/admin/recording/start", json!({"path": "../x.jsonl"})).await;
    assert_eq!(status, 400, "{err}");
    let (status, err) = admin("/admin/recording/start", json!({"path": "/tmp/x.jsonl"})).await;
    assert_eq!(status, 400, "{err}");
    let (status, started) = admin("/admin/recording/start", json!({"path": "run.jsonl"})).await;
    assert_eq!(status, 200, "{started}");
    assert_eq!(started["active"], true);
    let (status, again) = admin("/admin/recording/start", json!({"path": "other.jsonl"})).await;
    assert_eq!(status, 400, "one recording at a time: {again}");

    // Shared-prefix workload: 4 groups of 5 requests sharing a 512-token prefix, interleaved
    // (4 groups over 3 workers: round-robin rarely sends a group back where its prefix is).
    for round in 0..5u32 {
        for group in 0..4u32 {
            let mut prompt = tokens(40 + group, 512);
            prompt.extend(tokens(4000 + round * 10 + group, 64));
            let body =
                json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true});
            let (status, body) = api.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{body}");
            // Let the request's KV events reach the index before the next one.
            let indexed = eventually(Duration::from_secs(10), || async {
                let (_, explain) = admin(
                    "/admin/explain",
                    json!({"model": "sim-8b", "prompt": prompt}),
                )
                .await;
                explain["decision"]["explanation"]["workers"]
                    .as_array()
                    .is_some_and(|ws| ws.iter().any(|w| w["overlap"]["device"] == 36))
            })
            .await;
            assert!(indexed, "the request's blocks reached the index");
        }
    }
    let status: Value = api
        .http
        .get(format!("{}/admin/recording", api.base))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["active"], true, "{status}");
    let (code, stopped) = admin("/admin/recording/stop", json!({})).await;
    assert_eq!(code, 200, "{stopped}");
    assert_eq!(stopped["dropped"], 0, "{stopped}");
    assert_eq!(stopped["complete"], true, "{stopped}");
    let path = std::path::PathBuf::from(stopped["path"].as_str().unwrap());
    assert!(path.starts_with(recordings.canonicalize().unwrap()));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        stopped["bytes"].as_u64().unwrap()
    );
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["type"], "header");
    assert_eq!(lines[0]["format"], "switchyard-kv-recording");
    assert_eq!(lines.last().unwrap()["type"], "trailer");
    let count = |kind: &str| lines.iter().filter(|l| l["type"] == kind).count();
    assert!(
        count("snapshot") >= 3,
        "starting a recording resyncs every worker"
    );
    assert_eq!(count("route"), 20);
    assert_eq!(count("finished"), 20);
    assert!(count("kv_event") > 0 && count("load") > 0);

    // Replay it offline with the real binary.
    let out = dir.path().join("report");
    let replay = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "events", "--recording"])
        .arg(&path)
        .args(["--policies", "kv,round-robin", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert!(
        replay.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    eprintln!("{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("events.json")).unwrap()).unwrap();
    assert_eq!(report["complete"], true);
    assert_eq!(report["index"]["gaps"], 0, "{report}");
    let policy = |name: &str| {
        report["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["policy"] == name)
            .unwrap_or_else(|| panic!("{name} in {report}"))
            .clone()
    };
    let (live, kv, rr) = (policy("live (kv)"), policy("kv"), policy("round-robin"));
    assert_eq!(kv["decisions"], 20);
    // The same inputs in the same order: the replayed kv policy decides exactly as live did.
    assert_eq!(kv["agreement"], 1.0, "{kv}");
    assert_eq!(kv["cached_tokens"], live["cached_tokens"], "{kv} vs {live}");
    let hit = |p: &Value| p["hit_rate"].as_f64().unwrap();
    assert!(hit(&kv) > hit(&rr), "kv {kv} should beat round-robin {rr}");
    assert!(out.join("events.csv").exists());
}
