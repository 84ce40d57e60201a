//! The Responses API (`POST /v1/responses`) end to end, against the real binary: `switchyard up`
//! driven by the unmodified `openai` Python SDK (plain text, instructions, streaming, function
//! tools and their outputs, structured output, refusals), and a gateway in front of the vLLM
//! stand-in scripted to answer with reasoning and a tool call, read back as output items, whole
//! and as the Responses event stream.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, indexed};
use support::{Api, Launch, eventually};
use switchyard_testkit::EtcdServer;
use switchyard_tokenize::Tokenizer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_drives_responses_through_switchyard_up() {
    let up = Launch::up(2).arg("--speedup", "100").start().await;
    let api = Api::new(&up);
    let client = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/responses_client.py"
    );
    let output = tokio::process::Command::new("python3")
        .arg(client)
        .arg(format!("{}/v1", api.base))
        .arg("sim-8b")
        .output()
        .await
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "openai SDK client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");

    // The requests went through the shared pipeline, counted under their own endpoint label.
    let served = api
        .metric(r#"switchyard_requests{endpoint="responses",status="ok"}"#)
        .await;
    assert!(served >= 10.0, "responses counted as served: {served}");
    let refused = api
        .metric(r#"switchyard_requests{endpoint="responses",status="bad_request"}"#)
        .await;
    assert!(refused >= 6.0, "refusals counted: {refused}");

    // A body that is not a Responses request is refused by name, before anything runs.
    let (status, error) = api
        .post(
            "/v1/responses",
            &json!({"model": "sim-8b", "input": "x", "n": 2}),
        )
        .await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "n", "{error}");
    let (status, error) = api
        .post("/v1/responses", &json!({"model": "nope", "input": "x"}))
        .await;
    assert_eq!(status, 404, "{error}");
}

const MODEL: &str = "fake-model";

const ANSWER: &str = "<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

/// Makes the engine answer its next request with `text` (as the gateway's tokenizer encodes it).
async fn script(fake: &Fake, text: &str) {
    let ids = Tokenizer::builtin_cl100k().encode(text).unwrap();
    fake.admin("script", json!({ "tokens": ids })).await;
}

/// `(event name, data)` of each server-sent event.
fn named_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = Some(v.trim().to_owned());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data = serde_json::from_str(v.trim()).ok();
                }
            }
            Some((name?, data?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_tool_calls_come_back_as_output_items_whole_and_streamed() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("responses-{}", std::process::id());
    let fake = Fake::start(&[]).await;
    let _worker = fake
        .worker("vllm", "vllm-r", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--reasoning-parser", &format!("{MODEL}=qwen3"))
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(
        eventually(Duration::from_secs(15), || async {
            indexed(&api.base, "vllm-r").await.is_some()
        })
        .await
    );
    let body = json!({"model": MODEL, "max_output_tokens": 200,
        "input": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]});

    // Whole: a reasoning item, then the call; no message for the whitespace between.
    script(&fake, ANSWER).await;
    let (status, answer) = api.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{answer}");
    let output = answer["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{answer}");
    assert_eq!(output[0]["type"], "reasoning", "{answer}");
    assert_eq!(
        output[0]["content"][0]["text"].as_str().map(str::trim),
        Some("The user wants the weather in Paris.")
    );
    assert_eq!(output[1]["type"], "function_call", "{answer}");
    assert_eq!(output[1]["name"], "get_weather");
    let arguments: Value = serde_json::from_str(output[1]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    assert_eq!(answer["status"], "completed");
    assert!(
        answer["usage"]["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{answer}"
    );

    // Streamed: the same items, as events in order, each named as its data's type.
    script(&fake, ANSWER).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = api
        .http
        .post(format!("{}/v1/responses", api.base))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = named_events(&text);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str(), "{text}");
        assert_eq!(data["sequence_number"], i as u64, "{text}");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let want = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    assert_eq!(names[..4], want, "{text}");
    let position = |name: &str| names.iter().position(|n| *n == name).unwrap();
    assert!(position("response.reasoning_text.delta") < position("response.reasoning_text.done"));
    assert!(
        position("response.reasoning_text.done")
            < position("response.function_call_arguments.done")
    );
    assert!(!names.contains(&"response.output_text.delta"), "{text}");
    assert_eq!(names.last(), Some(&"response.completed"), "{text}");
    let (_, last) = events.last().unwrap();
    assert_eq!(
        without_ids(&last["response"]["output"]),
        without_ids(&answer["output"]),
        "{text}"
    );

    // Failures before the stream starts are plain HTTP errors with the OpenAI error body.
    let (status, error) = api
        .post(
            "/v1/responses",
            &json!({"model": MODEL, "input": "x", "tool_choice": "required"}),
        )
        .await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "tool_choice", "{error}");
}

/// Output items without their ids (made from each response's own id).
fn without_ids(items: &Value) -> Value {
    let mut items = items.clone();
    for item in items.as_array_mut().unwrap() {
        let item = item.as_object_mut().unwrap();
        item.remove("id");
        item.remove("call_id");
    }
    items
}
