//! Anthropic's Messages API end to end: `switchyard up` (gateway and simulated workers, API keys
//! on) answered over raw HTTP (the wire events, the error shapes, both key headers, the
//! request metrics) and through the official, unmodified `anthropic` Python SDK
//! (`tests/python/anthropic_client.py`); and the real binary in front of the vLLM stand-in
//! scripted to reason and call a tool, read back as `thinking` and `tool_use` blocks.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, indexed};
use support::{Launch, eventually};
use switchyard_security::secret::sha256_hex;
use switchyard_testkit::EtcdServer;
use switchyard_tokenize::Tokenizer;

const KEY: &str = "sk-anthropic-e2e-0123456789";

fn ask(extra: Value) -> Value {
    let mut body = json!({"model": "sim-8b", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three rivers."}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_api_through_switchyard_up_raw_and_with_the_anthropic_sdk() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("api-keys");
    std::fs::write(&keys, format!("{} team-a\n", sha256_hex(KEY.as_bytes()))).unwrap();
    let up = Launch::up(2)
        .arg("--speedup", "100")
        .arg("--api-keys-file", keys.to_str().unwrap())
        .start()
        .await;
    let api = format!("http://{}", up.address);
    let http = reqwest::Client::new();
    let post = |path: &str, headers: &[(&str, &str)], body: Value| {
        let mut request = http.post(format!("{api}{path}")).json(&body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        async move { request.send().await.unwrap() }
    };
    let anthropic_key = [("x-api-key", KEY), ("anthropic-version", "2023-06-01")];

    // No key: 401 in Anthropic's shape; either key header lets the request in.
    let response = post("/v1/messages", &[], ask(json!({}))).await;
    assert_eq!(response.status(), 401);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "authentication_error", "{error}");
    let bearer = format!("Bearer {KEY}");
    let response = post(
        "/v1/messages",
        &[("authorization", bearer.as_str())],
        ask(json!({})),
    )
    .await;
    assert_eq!(response.status(), 200);
    let response = post("/v1/messages", &anthropic_key, ask(json!({}))).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-request-id"));
    let message: Value = response.json().await.unwrap();
    assert_eq!(message["type"], "message", "{message}");
    assert!(
        message["id"].as_str().unwrap().starts_with("msg_"),
        "{message}"
    );
    assert_eq!(message["content"][0]["type"], "text", "{message}");
    let text = message["content"][0]["text"].as_str().unwrap().to_owned();
    // Chat requests still take the key as a bearer only (x-api-key works there too).
    let response = post(
        "/v1/chat/completions",
        &anthropic_key,
        json!({"model": "sim-8b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(response.status(), 200);

    // Streamed: the event names on the wire, in Anthropic's order, with the same text.
    let response = post("/v1/messages", &anthropic_key, ask(json!({"stream": true}))).await;
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = response.text().await.unwrap();
    let names: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{body}");
    assert_eq!(names.get(1), Some(&"ping"), "{body}");
    assert_eq!(names.get(2), Some(&"content_block_start"), "{body}");
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{body}"
    );
    let events: Vec<Value> = switchyard_core::sse::events(&body)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(events.len(), names.len(), "one data line per event: {body}");
    for (event, name) in events.iter().zip(&names) {
        assert_eq!(event["type"], *name, "{body}");
    }
    let streamed: String = events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let start_usage = &events[0]["message"]["usage"];
    let prompt = start_usage["input_tokens"].as_u64().unwrap()
        + start_usage["cache_read_input_tokens"].as_u64().unwrap();
    let counted: Value = post(
        "/v1/messages/count_tokens",
        &anthropic_key,
        json!({"model": "sim-8b", "messages": [{"role": "user", "content": "Name three rivers."}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(counted["input_tokens"], prompt, "{counted}");

    // Refusals name the field, in Anthropic's shape.
    for (path, headers, body, status, kind, named) in [
        (
            "/v1/messages",
            &anthropic_key[..],
            ask(json!({"top_logprobs": 2})),
            400,
            "invalid_request_error",
            "top_logprobs",
        ),
        (
            "/v1/messages",
            &anthropic_key[..],
            ask(json!({"messages": [{"role": "tool", "content": "x"}]})),
            400,
            "invalid_request_error",
            "messages.0.role",
        ),
        (
            "/v1/messages",
            &anthropic_key[..],
            ask(
                json!({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}),
            ),
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            "/v1/messages/count_tokens",
            &anthropic_key[..],
            json!({"model": "sim-8b", "max_tokens": 5, "messages": []}),
            400,
            "invalid_request_error",
            "messages",
        ),
        (
            "/v1/messages/count_tokens",
            &anthropic_key[..],
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "not_found_error",
            "nope",
        ),
    ] {
        let response = post(path, headers, body.clone()).await;
        assert_eq!(response.status(), status, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains(named),
            "{error}"
        );
    }
    // Betas and advisory fields are taken (Claude Code always sends some), and counted.
    let beta = [
        ("x-api-key", KEY),
        (
            "anthropic-beta",
            "interleaved-thinking-2025-05-14,brand-new-2030-01-01",
        ),
    ];
    let response = post(
        "/v1/messages",
        &beta,
        ask(json!({"service_tier": "auto", "frobnicate": 1})),
    )
    .await;
    assert_eq!(response.status(), 200);

    // The requests are counted under their own endpoint.
    let metrics = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("endpoint=\"messages\"") && l.contains("status=\"ok\"")),
        "{metrics}"
    );
    for field in [
        "anthropic-beta:interleaved-thinking-2025-05-14",
        "anthropic-beta:brand-new-2030-01-01",
        "service_tier",
        "frobnicate",
    ] {
        let series =
            format!("switchyard_ignored_fields_total{{api=\"messages\",field=\"{field}\"}} 1");
        assert!(metrics.contains(&series), "{series} in {metrics}");
    }

    // The official SDK.
    let client = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/anthropic_client.py"
    );
    let output = tokio::process::Command::new("python3")
        .arg(client)
        .arg(&api)
        .arg(KEY)
        .output()
        .await
        .expect("run python3");
    assert!(
        output.status.success(),
        "anthropic SDK client failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("all checks passed"),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

const ANSWER: &str = "<think>\nThe user wants the weather in Paris.\n</think>\n\nLet me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

/// The engine's reasoning and tool call, parsed by the model's parsers, come back as `thinking`,
/// `text` and `tool_use` blocks, whole and as stream events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_tool_calls_come_back_as_thinking_and_tool_use_blocks() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("anthropic-{}", std::process::id());
    let fake = Fake::start(&[]).await;
    let _worker = fake
        .worker("vllm", "vllm-a", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--reasoning-parser", "fake-model=qwen3")
        .start()
        .await;
    let api = format!("http://{}", gateway.address);
    assert!(
        eventually(Duration::from_secs(15), || async {
            indexed(&api, "vllm-a").await.is_some()
        })
        .await
    );
    let http = reqwest::Client::new();
    let script = || async {
        let ids = Tokenizer::builtin_cl100k().encode(ANSWER).unwrap();
        fake.admin("script", json!({ "tokens": ids })).await;
    };
    let body = |stream: bool| {
        json!({"model": "fake-model", "max_tokens": 2048, "stream": stream,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                "properties": {"city": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
    };
    let post = |body: Value| {
        let request = http.post(format!("{api}/v1/messages")).json(&body);
        async move { request.send().await.unwrap() }
    };

    script().await;
    let response = post(body(false)).await;
    assert_eq!(response.status(), 200);
    let message: Value = response.json().await.unwrap();
    assert_eq!(message["stop_reason"], "tool_use", "{message}");
    let content = message["content"].as_array().unwrap();
    let kinds: Vec<&str> = content.iter().filter_map(|b| b["type"].as_str()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use"], "{message}");
    assert_eq!(
        content[0]["thinking"].as_str().map(str::trim),
        Some("The user wants the weather in Paris."),
        "{message}"
    );
    assert_eq!(
        content[1]["text"].as_str().map(str::trim),
        Some("Let me check.")
    );
    assert_eq!(content[2]["name"], "get_weather");
    assert_eq!(content[2]["input"], json!({"city": "Paris"}));
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));

    // Streamed: thinking_delta, text_delta and input_json_delta in blocks 0, 1 and 2.
    script().await;
    let text = post(body(true)).await.text().await.unwrap();
    let events: Vec<Value> = switchyard_core::sse::events(&text)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let starts: Vec<(u64, &str)> = events
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| {
            (
                e["index"].as_u64().unwrap(),
                e["content_block"]["type"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        starts,
        [(0, "thinking"), (1, "text"), (2, "tool_use")],
        "{text}"
    );
    let deltas = |kind: &str, field: &str| -> String {
        events
            .iter()
            .filter(|e| e["delta"]["type"] == kind)
            .filter_map(|e| e["delta"][field].as_str())
            .collect()
    };
    assert_eq!(
        deltas("thinking_delta", "thinking").trim(),
        "The user wants the weather in Paris."
    );
    assert_eq!(deltas("text_delta", "text").trim(), "Let me check.");
    let input: Value = serde_json::from_str(&deltas("input_json_delta", "partial_json")).unwrap();
    assert_eq!(input, json!({"city": "Paris"}));
    let end = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap();
    assert_eq!(end["delta"]["stop_reason"], "tool_use", "{text}");

    // This model reasons: switching thinking off cannot be honoured.
    let mut off = body(false);
    off["thinking"] = json!({"type": "disabled"});
    let response = post(off).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("thinking:"),
        "{error}"
    );
}
