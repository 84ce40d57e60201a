//! The gateway's OpenAI API end to end through the real binary: the Rust HTTP client and the
//! official `openai` Python SDK, bad input, and a Hugging Face tokenizer with its chat template.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use serde_json::{Value, json};
use support::{Api, Launch, chat, tokens};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_api_serves_requests_and_refuses_bad_input() {
    let up = Launch::up(2)
        .arg("--speedup", "50")
        .arg("--max-context", "4096")
        .start()
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
        ("best_of", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "n": 2, "best_of": 3})).unwrap(), 400, "best_of"),
        ("too many choices", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "n": 129})).unwrap(), 400, "at most 128"),
        ("top_logprobs without logprobs", serde_json::to_vec(&json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})).unwrap(), 400, "logprobs: true"),
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
    // A batch of prompts: one choice each, in order.
    let (status, batch) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": ["a", "b"], "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["choices"][1]["index"], 1, "{batch}");
    assert_eq!(batch["usage"]["completion_tokens"], 4, "{batch}");
    // n choices of one prompt: the prompt counted once, every choice's completion.
    let (_, one) = api.post("/v1/chat/completions", &chat("Choose", 3)).await;
    let mut three = chat("Choose", 3);
    three["n"] = json!(3);
    let (status, many) = api.post("/v1/chat/completions", &three).await;
    assert_eq!(status, 200, "{many}");
    assert_eq!(many["choices"].as_array().unwrap().len(), 3, "{many}");
    assert_eq!(
        many["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"]
    );
    assert_eq!(many["usage"]["completion_tokens"], 9);
    let (status, err) = api
        .post("/v1/completions", &json!({"model": "sim-8b", "prompt": []}))
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
    let entries = index[0]["stats"]["entries"].as_u64().unwrap();
    let blocks = index[0]["stats"]["blocks"].as_u64().unwrap();
    assert!(entries > 0, "{index}");
    // Distinct blocks, counted after the lock is released: at least one, at most one per pair.
    assert!(blocks > 0 && blocks <= entries, "{index}");
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

    // vLLM's /tokenize and /detokenize, with the model's tokenizer and chat template.
    let (status, tokenized) = api
        .post(
            "/tokenize",
            &json!({"model": "sim-8b", "prompt": "Hello tokenizer"}),
        )
        .await;
    assert_eq!(status, 200, "{tokenized}");
    assert_eq!(tokenized["max_model_len"], 4096);
    let ids = tokenized["tokens"].as_array().unwrap().clone();
    assert_eq!(tokenized["count"], ids.len());
    let (status, back) = api
        .post("/detokenize", &json!({"model": "sim-8b", "tokens": ids}))
        .await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], "Hello tokenizer");
    let messages = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    let (_, with_prompt) = api
        .post(
            "/tokenize",
            &json!({"model": "sim-8b", "messages": messages}),
        )
        .await;
    let (_, without) = api
        .post(
            "/tokenize",
            &json!({"model": "sim-8b", "messages": messages, "add_generation_prompt": false}),
        )
        .await;
    assert!(
        with_prompt["count"].as_u64().unwrap() > without["count"].as_u64().unwrap(),
        "the generation prompt adds the assistant's opener: {with_prompt} vs {without}"
    );
    let (_, chat_answer) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "sim-8b", "messages": messages, "max_tokens": 1}),
        )
        .await;
    assert_eq!(
        chat_answer["usage"]["prompt_tokens"], with_prompt["count"],
        "/tokenize counts what a chat request's prompt is"
    );
    for (path, body, param) in [
        ("/tokenize", json!({"model": "sim-8b"}), "prompt"),
        (
            "/tokenize",
            json!({"model": "sim-8b", "prompt": "x", "bogus": 1}),
            "bogus",
        ),
        (
            "/detokenize",
            json!({"model": "sim-8b", "tokens": [4_000_000_000u32]}),
            "tokens",
        ),
    ] {
        let (status, err) = api.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {err}");
        assert_eq!(err["error"]["param"], param, "{err}");
    }
    let (status, err) = api
        .post("/tokenize", &json!({"model": "nope", "prompt": "x"}))
        .await;
    assert_eq!(status, 404, "{err}");
    let (status, card) = api.get("/v1/models/sim-8b").await;
    assert_eq!((status, &card["id"]), (200, &json!("sim-8b")), "{card}");
    let (status, err) = api.get("/v1/models/nope").await;
    assert_eq!(status, 404, "{err}");
    assert_eq!(err["error"]["code"], "model_not_found", "{err}");

    // Metrics are exported under conventional names, request metrics by model.
    assert!(api.metric("switchyard_requests_total").await >= 10.0);
    assert!(
        api.metric("switchyard_requests_total{model=\"sim-8b\",status=\"ok\"}")
            .await
            >= 10.0
    );
    assert!(
        api.metric("switchyard_time_to_first_token_seconds_count{model=\"sim-8b\"}")
            .await
            >= 5.0
    );
    assert!(
        api.metric("switchyard_request_duration_seconds_count{model=\"sim-8b\"}")
            .await
            >= 10.0
    );
    // An unknown model's 404 is counted without a made-up label.
    assert!(
        api.metric("switchyard_requests_total{model=\"\",status=\"model_not_found\"}")
            .await
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hugging_face_tokenizer_and_chat_template_serve_the_api() {
    let dir = support::qwen3_dir();
    let up = Launch::up(1)
        .arg("--speedup", "50")
        .arg("--tokenizer", &dir)
        .arg("--max-context", "131072")
        .start()
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

    // A long fresh prompt (≥ 64 KiB) with nothing else tokenizing: cut over the free cores (on
    // one core, taken whole), and the count equals one pass's (explain tokenizes it whole).
    let long: String = (0..1_500)
        .map(|i| {
            format!(
                "Line {i}: the parser reads `fn item_{i}()` — 解析 {}.\n",
                i * 7
            )
        })
        .collect();
    assert!(long.len() > 80_000);
    let messages = json!([{"role": "user", "content": long}]);
    let (status, body) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "sim-8b", "messages": messages, "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, full) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "messages": messages}),
        )
        .await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(body["usage"]["prompt_tokens"], full["prompt_tokens"]);
    let split = api
        .metric("switchyard_tokenizer_long_texts_total{how=\"split\"}")
        .await;
    let whole = api
        .metric("switchyard_tokenizer_long_texts_total{how=\"whole\"}")
        .await;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert_eq!(
        (split, whole),
        (
            f64::from(u8::from(cores > 1)),
            f64::from(u8::from(cores == 1))
        )
    );
}

/// On the simulator, the same seed and prompt give the same tokens on any worker, and greedy
/// decoding (temperature 0) is deterministic; without either, two workers differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_or_greedy_decoding_gives_the_same_answer_on_any_worker() {
    let up = Launch::up(2).start().await;
    let api = Api::new(&up);
    assert!(api.lists_workers(2).await);
    let (status, _) = api
        .post("/admin/policy", &json!({"policy": "round-robin"}))
        .await;
    assert_eq!(status, 200);
    let complete = |extra: Value| {
        let mut body = json!({"model": "sim-8b", "prompt": tokens(5, 32), "max_tokens": 8, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let api = &api;
        async move {
            let (status, answer) = api.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].as_str().unwrap().to_owned()
        }
    };
    // Round-robin: consecutive requests go to the two workers in turn.
    let seeded = (
        complete(json!({"seed": 42})).await,
        complete(json!({"seed": 42})).await,
    );
    assert_eq!(seeded.0, seeded.1, "same seed, same tokens on both workers");
    let greedy = (
        complete(json!({"temperature": 0})).await,
        complete(json!({"temperature": 0})).await,
    );
    assert_eq!(greedy.0, greedy.1, "greedy is deterministic");
    let other_seed = complete(json!({"seed": 43})).await;
    assert_ne!(seeded.0, other_seed);
    let free = (complete(json!({})).await, complete(json!({})).await);
    assert_ne!(free.0, free.1, "unseeded sampling differs between workers");
}
