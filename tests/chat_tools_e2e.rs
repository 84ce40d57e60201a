//! Tool calls and reasoning end to end: the real binary (gateway + `worker --engine vllm`) in
//! front of the vLLM stand-in scripted to answer with a reasoning block and a tool call; the
//! gateway parses them into OpenAI's `reasoning_content` and `tool_calls`, whole and streamed,
//! for raw HTTP and for the official `openai` SDK.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, indexed};
use support::{Launch, eventually};
use switchyard_testkit::EtcdServer;
use switchyard_tokenize::Tokenizer;

const MODEL: &str = "fake-model";

const ANSWER: &str = "<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"type": "string"}}}}}])
}

fn chat(tools: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": 200, "tools": tools,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Length of the prompt the engine received last.
async fn last_prompt_len(fake: &Fake) -> usize {
    fake.admin("requests", json!({})).await["requests"]
        .as_array()
        .and_then(|r| r.last())
        .map(|r| r["prompt"].as_array().map_or(0, Vec::len))
        .unwrap()
}

/// Makes the engine answer its next request with `text` (as the gateway's tokenizer encodes it).
async fn script(fake: &Fake, text: &str) {
    let ids = Tokenizer::builtin_cl100k().encode(text).unwrap();
    fake.admin("script", json!({ "tokens": ids })).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_tool_calls_come_back_parsed_whole_and_streamed() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("tools-{}", std::process::id());
    let fake = Fake::start(&[]).await;
    let _worker = fake
        .worker("vllm", "vllm-t", &endpoint, &cluster)
        .start()
        .await;
    // The built-in template writes Hermes <tool_call>s (the tool parser it implies); the
    // reasoning parser is configured.
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--reasoning-parser", &format!("{MODEL}=qwen3"))
        .start()
        .await;
    let api = format!("http://{}", gateway.address);
    assert!(
        eventually(Duration::from_secs(15), || async {
            indexed(&api, "vllm-t").await.is_some()
        })
        .await
    );
    let http = reqwest::Client::new();
    let post = |body: Value| {
        let http = http.clone();
        let url = format!("{api}/v1/chat/completions");
        async move { http.post(url).json(&body).send().await.unwrap() }
    };

    // Whole.
    script(&fake, ANSWER).await;
    let response = post(chat(tools(), json!({}))).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer}");
    let message = &choice["message"];
    assert!(message["content"].is_null(), "{answer}");
    assert_eq!(
        message["reasoning_content"].as_str().map(str::trim),
        Some("The user wants the weather in Paris."),
        "{answer}"
    );
    assert_eq!(
        message["reasoning"], message["reasoning_content"],
        "{answer}"
    );
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "unit": "celsius"}));
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1);

    // Streamed: reasoning deltas, then the call as one delta, then the finish.
    script(&fake, ANSWER).await;
    let text = post(chat(tools(), json!({"stream": true})))
        .await
        .text()
        .await
        .unwrap();
    let chunks: Vec<Value> = switchyard_core::sse::events(&text)
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let deltas = || chunks.iter().map(|c| &c["choices"][0]["delta"]);
    let reasoning: String = deltas()
        .filter_map(|d| d["reasoning_content"].as_str())
        .collect();
    assert_eq!(
        reasoning.trim(),
        "The user wants the weather in Paris.",
        "{text}"
    );
    let calls: Vec<&Value> = deltas()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let content: String = deltas().filter_map(|d| d["content"].as_str()).collect();
    assert!(
        !content.contains("tool_call"),
        "no call text in the content: {text}"
    );
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("tool_calls"), "{text}");

    // tool_choice "none": the tools are not rendered and the text is the answer.
    let with_tools = last_prompt_len(&fake).await;
    script(&fake, ANSWER).await;
    let answer: Value = post(chat(tools(), json!({"tool_choice": "none"})))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        last_prompt_len(&fake).await < with_tools,
        "tools left out of the prompt"
    );
    let message = &answer["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{answer}");
    assert!(
        message["content"].as_str().unwrap().contains("<tool_call>"),
        "{answer}"
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");

    // A call that does not parse is not lost: it is the content, and counted.
    script(
        &fake,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>",
    )
    .await;
    let answer: Value = post(chat(tools(), json!({}))).await.json().await.unwrap();
    let message = &answer["choices"][0]["message"];
    assert!(
        message["content"]
            .as_str()
            .unwrap()
            .contains("\"city\": </tool_call>"),
        "{answer}"
    );
    assert!(message.get("tool_calls").is_none(), "{answer}");
    let metrics = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("switchyard_tool_calls_total 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("switchyard_tool_calls_malformed_total 1"),
        "{metrics}"
    );

    // A constraint reaches the engine in its own field (vLLM's structured_outputs).
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let answer = post(json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "json please"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))
    .await;
    assert_eq!(answer.status(), 200);
    let sent = fake.admin("requests", json!({})).await["requests"]
        .as_array()
        .and_then(|r| r.last())
        .cloned()
        .unwrap();
    assert_eq!(
        sent["structured_outputs"],
        json!({"json": schema}),
        "{sent}"
    );

    // What cannot be honoured is refused by name, before anything runs.
    for (extra, param) in [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ] {
        let response = post(chat(tools(), extra)).await;
        assert_eq!(response.status(), 400);
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{error}");
    }
    let response = post(chat(
        json!([{"type": "function", "function": {}}]),
        json!({}),
    ))
    .await;
    assert_eq!(response.status(), 400);

    // The official OpenAI SDK, on two more scripted answers.
    script(&fake, ANSWER).await;
    script(&fake, ANSWER).await;
    let client = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/tool_calls_client.py"
    );
    let output = tokio::process::Command::new("python3")
        .arg(client)
        .arg(format!("{api}/v1"))
        .arg(MODEL)
        .output()
        .await
        .expect("run python3");
    assert!(
        output.status.success(),
        "openai SDK client failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("all checks passed"),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

/// Structured output and compulsory tool calls against `switchyard up`: the simulator writes a
/// valid answer for the constraint, and the official SDK reads it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_and_compulsory_calls_through_switchyard_up() {
    let up = Launch::up(2).arg("--speedup", "100").start().await;
    let api = format!("http://{}", up.address);
    let http = reqwest::Client::new();
    // A regex the simulator cannot write: refused by the engine, clearly.
    let response = http
        .post(format!("{api}/v1/chat/completions"))
        .json(
            &json!({"model": "sim-8b", "max_tokens": 8, "guided_regex": "[a-z]+",
                      "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("regular expression"),
        "{error}"
    );
    let client = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/structured_client.py"
    );
    let output = tokio::process::Command::new("python3")
        .arg(client)
        .arg(format!("{api}/v1"))
        .output()
        .await
        .expect("run python3");
    assert!(
        output.status.success(),
        "openai SDK client failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("all checks passed"));
}
