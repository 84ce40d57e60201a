//! The cross-request prefix cache through the real binary (`switchyard up`): two sessions
//! that share only a long system prompt, the second one's prompt tokens mostly taken from the
//! cache (by the gateway's metrics) and equal to a full tokenization; the byte bound given
//! by `--prefix-cache-bytes` holds while distinct prompts churn it, and 0 turns it off.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use serde_json::{Value, json};
use support::{Api, Launch};

/// A system prompt of roughly 2,000 tokens: instructions and a tool list, as agents send.
fn system_prompt(variant: usize) -> String {
    let mut text = format!("You are coding agent #{variant}. Follow the repository's rules.\n");
    for i in 0..60 {
        text.push_str(&format!(
            "Tool {i}: read_file(path: string, offset: int) returns the file's text from offset; \
             errors are reported as JSON objects — never guess a path.\n"
        ));
    }
    text
}

fn request(system: &str, user: &str) -> Value {
    json!({
        "model": "sim-8b",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": 1,
        "ignore_eos": true,
    })
}

/// Sends one turn of `session`; returns its prompt tokens.
async fn turn(api: &Api, session: &str, body: &Value) -> u64 {
    let response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .header("x-session-id", session)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    answer["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_sharing_a_system_prompt_reuse_its_tokens() {
    let bound = 256 << 10;
    let up = Launch::up(1)
        .arg("--max-context", "16384")
        .arg("--prefix-cache-bytes", &bound.to_string())
        .start()
        .await;
    let api = Api::new(&up);
    let system = system_prompt(0);
    turn(&api, "agent-a", &request(&system, "Fix the failing test.")).await;
    let second = request(
        &system,
        "Write the release notes — in 中文, s'il vous plaît.",
    );
    let prompt_tokens = turn(&api, "agent-b", &second).await;
    assert!(prompt_tokens > 1500, "{prompt_tokens} prompt tokens");
    let explain = json!({"model": "sim-8b", "messages": second["messages"]});
    let (_, full) = api.post("/admin/explain", &explain).await;
    assert_eq!(
        full["prompt_tokens"], prompt_tokens,
        "a hit equals a full tokenization"
    );

    let hits = api
        .metric("switchyard_tokenizer_prefix_lookups{result=\"hit\"}")
        .await;
    let misses = api
        .metric("switchyard_tokenizer_prefix_lookups{result=\"miss\"}")
        .await;
    assert_eq!((hits, misses), (1.0, 1.0));
    let reused = api
        .metric("switchyard_tokenizer_prefix_reused_tokens")
        .await;
    assert!(
        reused >= 0.9 * prompt_tokens as f64,
        "{reused} of {prompt_tokens} prompt tokens reused"
    );
    assert!(api.metric("switchyard_tokenizer_prefix_segments").await >= 1.0);
    assert_eq!(
        api.metric("switchyard_tokenizer_verify_mismatches").await,
        0.0
    );

    // Distinct system prompts churn the cache: it evicts and stays within its bound.
    for variant in 1..40 {
        let body = request(&system_prompt(variant), "Go.");
        turn(&api, &format!("tenant-{variant}"), &body).await;
    }
    let held = api.metric("switchyard_tokenizer_prefix_bytes").await;
    assert!(held > 0.0 && held <= bound as f64, "{held} bytes held");
    assert!(api.metric("switchyard_tokenizer_prefix_evictions").await > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_bound_turns_the_prefix_cache_off() {
    let up = Launch::up(1)
        .arg("--max-context", "16384")
        .env("SWITCHYARD_PREFIX_CACHE_BYTES", "0")
        .start()
        .await;
    let api = Api::new(&up);
    let system = system_prompt(0);
    turn(&api, "agent-a", &request(&system, "Fix the failing test.")).await;
    turn(
        &api,
        "agent-b",
        &request(&system, "Write the release notes."),
    )
    .await;
    assert_eq!(api.metric("switchyard_tokenizer_prefix_lookups").await, 0.0);
    assert_eq!(
        api.metric("switchyard_tokenizer_prefix_reused_tokens")
            .await,
        0.0
    );
    assert_eq!(api.metric("switchyard_tokenizer_prefix_bytes").await, 0.0);
}
