//! The Responses API (`POST /v1/responses`) end to end, against the real binary: `switchyard up`
//! driven by the unmodified `openai` Python SDK (plain text, instructions, streaming, function
//! tools and their outputs, structured output, refusals), and a gateway in front of the vLLM
//! stand-in scripted to answer with reasoning and a tool call, read back as output items, whole
//! and as the Responses event stream.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

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

/// Stored responses are shared by two gateway replicas through Redis: one stores, the other
/// reads it back, lists its input, continues from it (`previous_response_id`) and deletes it.
/// With `store: false` and `include: ["reasoning.encrypted_content"]` (Codex's way) the
/// reasoning travels sealed through the client and is read back by the other replica, which
/// holds the same key; a sealed text it cannot open is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_and_sealed_reasoning_work_across_two_replicas_sharing_redis() {
    let etcd = EtcdServer::start().expect("etcd");
    let redis = switchyard_testkit::redis::RedisServer::start()
        .expect("redis-server (deploy/build-deps.sh test)");
    let endpoint = etcd.endpoint();
    let cluster = format!("responses-state-{}", std::process::id());
    let fake = Fake::start(&["--max-model-len", "32768"]).await;
    let _worker = fake
        .worker("vllm", "vllm-s", &endpoint, &cluster)
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("responses-key");
    std::fs::write(&key, "a secret both replicas hold").unwrap();
    let replica = || {
        Launch::gateway(&endpoint, &cluster)
            .arg(
                "--model-tokenizer",
                &format!("{MODEL}={}", support::qwen3_dir()),
            )
            .arg("--reasoning-parser", &format!("{MODEL}=qwen3"))
            .arg("--responses-redis-url", &redis.url())
            .arg("--responses-key-file", key.to_str().unwrap())
            .start()
    };
    let (a, b) = (replica().await, replica().await);
    let (a, b) = (Api::new(&a), Api::new(&b));
    for api in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(15), || async {
                indexed(&api.base, "vllm-s").await.is_some()
            })
            .await
        );
    }
    // The engine answers in Qwen3's tokens, as the gateway's tokenizer writes them.
    let script = |text: &'static str| {
        let (a, fake) = (&a, &fake);
        async move {
            let (_, tokens) = a
                .post("/tokenize", &json!({"model": MODEL, "prompt": text}))
                .await;
            fake.admin("script", json!({"tokens": tokens["tokens"]}))
                .await;
        }
    };
    // The prompt the engine was last sent, as text.
    let sent = || async {
        let requests = fake.admin("requests", json!({})).await;
        let prompt = requests["requests"].as_array().unwrap().last().unwrap()["prompt"].clone();
        let (_, text) = a
            .post("/detokenize", &json!({"model": MODEL, "tokens": prompt}))
            .await;
        text["prompt"].as_str().unwrap().to_owned()
    };

    // Stored on A (the default), read back on B.
    script("<think>\nPlan the greeting.\n</think>\n\nHello there.").await;
    let (status, first) = a
        .post(
            "/v1/responses",
            &json!({"model": MODEL, "input": "Greet me."}),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["store"], true);
    let id = first["id"].as_str().unwrap().to_owned();
    let (status, read) = b.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["output"], first["output"]);
    let (status, items) = b.get(&format!("/v1/responses/{id}/input_items")).await;
    assert_eq!(status, 200, "{items}");
    assert_eq!(
        items["data"][0]["content"][0]["text"], "Greet me.",
        "{items}"
    );

    // Continued on B: the engine is sent the first turn before the new input.
    script("Goodbye.").await;
    let (status, second) = b
        .post(
            "/v1/responses",
            &json!({"model": MODEL, "input": "Now say goodbye.", "previous_response_id": id}),
        )
        .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], id.as_str());
    let prompt = sent().await;
    let (greet, hello, goodbye) = (
        prompt.find("Greet me.").unwrap(),
        prompt.find("Hello there.").unwrap(),
        prompt.find("Now say goodbye.").unwrap(),
    );
    assert!(greet < hello && hello < goodbye, "{prompt}");

    // Deleted on B: gone for A too, and nothing continues from it.
    let (status, deleted) = b
        .send(b.http.delete(format!("{}/v1/responses/{id}", b.base)))
        .await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], true);
    let (status, _) = a.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(status, 404);
    let (status, refused) = a
        .post(
            "/v1/responses",
            &json!({"model": MODEL, "input": "x", "previous_response_id": id}),
        )
        .await;
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "previous_response_id");

    // Not stored, reasoning sealed: A writes it, the client carries it, B reads it back into
    // the tool-calling turn it belongs to (Qwen3 renders that turn's reasoning).
    let tools = json!([{"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    script("<think>\nLook up Paris first.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>").await;
    let ask = json!({"model": MODEL, "store": false, "include": ["reasoning.encrypted_content"],
        "tools": tools, "input": "Weather in Paris?"});
    let (status, turn) = a.post("/v1/responses", &ask).await;
    assert_eq!(status, 200, "{turn}");
    let (status, _) = a
        .get(&format!("/v1/responses/{}", turn["id"].as_str().unwrap()))
        .await;
    assert_eq!(status, 404, "store: false keeps nothing");
    let reasoning = turn["output"][0].clone();
    assert_eq!(reasoning["type"], "reasoning", "{turn}");
    let sealed = reasoning["encrypted_content"].as_str().unwrap().to_owned();
    assert!(!sealed.contains("Paris"), "{sealed}");
    let call = turn["output"][1].clone();
    let next = |sealed: &str| {
        json!({"model": MODEL, "store": false, "include": ["reasoning.encrypted_content"],
            "tools": tools, "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "id": reasoning["id"], "summary": [], "encrypted_content": sealed},
                call,
                {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}]})
    };
    script("It is 18 C.").await;
    let (status, answer) = b.post("/v1/responses", &next(&sealed)).await;
    assert_eq!(status, 200, "{answer}");
    assert!(sent().await.contains("Look up Paris first."));
    // Sealed by someone else: the turn goes on without that reasoning.
    script("It is 18 C.").await;
    let foreign = format!("sy1.{}", "A".repeat(80));
    let (status, answer) = b.post("/v1/responses", &next(&foreign)).await;
    assert_eq!(status, 200, "{answer}");
    assert!(!sent().await.contains("Look up Paris first."));
}
