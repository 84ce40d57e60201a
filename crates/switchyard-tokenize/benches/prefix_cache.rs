//! Tokenization time of a chat prompt whose system prompt and tool list are in the
//! cross-request prefix cache, against the same prompt tokenized in full, in one run: ~3k
//! tokens (2k system + tools) and ~32k tokens (30k system + tools), Qwen3's template and
//! tokenizer. CPU time of the calling thread per prompt (one pass: no runtime, so no
//! parallel pieces), each prompt with a user message of its own, as distinct sessions send.
//!
//! `cargo bench -p switchyard-tokenize --bench prefix_cache` (Qwen3 from
//! `fetch-test-models.sh`). Every timed prompt's ids are checked against a full tokenization
//! once before timing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use switchyard_tokenize::{ChatMessage, ChatRequest, ModelDir, SessionConfig, SessionTokenizer};

mod texts;

use texts::{cut, qwen3_json, read_tree, thread_cpu};

/// (system prompt tokens, user message tokens, prompts timed): ~3k and ~32k in all with the
/// tools; enough prompts for the cache-hit loop to take well over the 10 ms clock tick.
const SHAPES: [(usize, usize, u64); 2] = [(1_600, 1_000, 1_500), (29_000, 2_000, 200)];

/// Mean CPU time per prompt of tokenizing each of `prompts` once (never one twice: the cache
/// would then hold its user message too).
fn cpu_per_prompt(sessions: &SessionTokenizer, prompts: &[String]) -> Duration {
    let started = thread_cpu();
    for prompt in prompts {
        drop(std::hint::black_box(sessions.encode(None, prompt).unwrap()));
    }
    (thread_cpu() - started) / prompts.len() as u32
}

fn tools() -> Vec<serde_json::Value> {
    [
        "read_file",
        "write_file",
        "run_tests",
        "search_code",
        "list_dir",
    ]
    .iter()
    .map(|name| {
        json!({"type": "function", "function": {
            "name": name,
            "description": format!("{name}: operate on the repository; errors come back as JSON."),
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "Path relative to the repository root."},
                "offset": {"type": "integer", "description": "First line, 0-based."}
            }, "required": ["path"]}
        }})
    })
    .collect()
}

fn sessions(model: &ModelDir, prefix_cache_bytes: usize) -> SessionTokenizer {
    SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            // No session state: every prompt is a first turn, served by the prefix cache or
            // tokenized in full.
            max_sessions: 0,
            verify_sample_rate: 0.0,
            prefix_cache_bytes,
            ..SessionConfig::default()
        },
    )
}

fn main() {
    let dir = qwen3_json().parent().unwrap().to_path_buf();
    let model = ModelDir::load(&dir).unwrap();
    let tok = model.tokenizer();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut prose = String::new();
    read_tree(&root.join("docs"), "md", &mut prose);
    let render = |system: &str, user: &str| {
        let mut request = ChatRequest::new(vec![
            ChatMessage::text("system", system),
            ChatMessage::text("user", user),
        ]);
        request.tools = Some(tools());
        model.render_chat(&request).unwrap()
    };
    println!(
        "| prompt tokens | cached opening tokens | full ms | prefix-cache hit ms | full / hit |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for (system_tokens, user_tokens, count) in SHAPES {
        let system = cut(tok, &prose, system_tokens);
        let user_body = cut(tok, &prose[prose.len() / 2..], user_tokens);
        let prompt = |i: u64| render(&system, &format!("Request {i}: {user_body}"));
        let cold = sessions(&model, 0);
        let warm = sessions(&model, SessionConfig::default().prefix_cache_bytes);
        let first = prompt(0);
        warm.encode(None, &first).unwrap();
        let check = prompt(1);
        let turn = warm.encode_turn(None, &check).unwrap();
        assert_eq!(turn.token_ids, tok.encode(&check).unwrap(), "a hit differs");
        assert_eq!(cold.encode(None, &check).unwrap(), turn.token_ids);
        // Rendering is outside the timing: only the tokenization of each prompt counts.
        let prompts: Vec<String> = (2..2 + count).map(prompt).collect();
        let full = cpu_per_prompt(&cold, &prompts);
        let hit = cpu_per_prompt(&warm, &prompts);
        let ms = |t: Duration| t.as_secs_f64() * 1e3;
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.1}× |",
            turn.token_ids.len(),
            turn.prefix_tokens,
            ms(full),
            ms(hit),
            full.as_secs_f64() / hit.as_secs_f64()
        );
    }
}
