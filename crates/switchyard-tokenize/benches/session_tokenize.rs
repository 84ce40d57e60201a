//! Per-turn tokenization time, full vs incremental (`SessionTokenizer`), for a chat history
//! of 32k, 128k and 200k tokens (ending with a user message and the generation prompt)
//! plus the next turn (the assistant's reply and a new user message, ~60 words each), with
//! Qwen3 and cl100k. Only tokenization is timed, not template rendering.
//!
//! `cargo bench -p switchyard-tokenize --bench session_tokenize` (Qwen3 from
//! `fetch-test-models.sh`). A plain harness: each figure is the median of `RUNS` turns, each
//! timed once, and the incremental ids are checked equal to the full ones every time.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_tokenize::{ChatMessage, ChatRequest, ModelDir, SessionConfig, SessionTokenizer};

const RUNS: usize = 7;
const SIZES: [usize; 3] = [32_000, 128_000, 200_000];

fn qwen3_dir() -> PathBuf {
    let root = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/switchyard/test-models"));
    root.join("qwen3")
}

/// SplitMix64 words: prose, code and some multi-byte text.
struct Words(u64);

impl Words {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn text(&mut self, words: usize) -> String {
        const VOCAB: [&str; 24] = [
            "the",
            "tokenizer",
            "session",
            "fn",
            "main()",
            "{",
            "}",
            "let",
            "x",
            "=",
            "42;",
            "return",
            "Ok(())",
            "if",
            "else",
            "// note",
            "数据",
            "café",
            "🦀",
            "\n",
            "\n    ",
            "error:",
            "src/lib.rs:12",
            "can't",
        ];
        let mut out = String::new();
        for _ in 0..words {
            out.push(' ');
            out.push_str(VOCAB[(self.next() % VOCAB.len() as u64) as usize]);
        }
        out
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn bench_model(label: &str, model: &ModelDir) {
    let tok = model.tokenizer();
    let mut words = Words(1);
    // The history ends with a user turn, as a prompt does before the assistant replies.
    let mut messages = vec![
        ChatMessage::text("system", "You are a coding agent."),
        ChatMessage::text("user", words.text(4_000)),
    ];
    for &target in &SIZES {
        // Grow the history to `target` tokens.
        loop {
            let text = model
                .render_chat(&ChatRequest::new(messages.clone()))
                .unwrap();
            if tok.encode(&text).unwrap().len() >= target {
                break;
            }
            messages.push(ChatMessage::text("assistant", words.text(4_000)));
            messages.push(ChatMessage::text("user", words.text(4_000)));
        }
        let history = model
            .render_chat(&ChatRequest::new(messages.clone()))
            .unwrap();
        let history_tokens = tok.encode(&history).unwrap().len();
        let (mut full, mut incremental) = (Vec::new(), Vec::new());
        for run in 0..RUNS {
            let mut next = messages.clone();
            next.push(ChatMessage::text("assistant", words.text(60)));
            next.push(ChatMessage::text("user", words.text(60)));
            let text = model.render_chat(&ChatRequest::new(next)).unwrap();
            let started = Instant::now();
            let want = tok.encode(&text).unwrap();
            full.push(started.elapsed());
            let sessions = SessionTokenizer::new(
                Arc::clone(tok),
                SessionConfig {
                    verify_sample_rate: 0.0,
                    ..SessionConfig::default()
                },
            );
            sessions.encode(Some("s"), &history).unwrap();
            let started = Instant::now();
            let got = sessions.encode(Some("s"), &text).unwrap();
            incremental.push(started.elapsed());
            assert_eq!(got, want, "{label} {target}: run {run} differs");
        }
        let (full, incremental) = (median(full), median(incremental));
        println!(
            "{label:>7} | {:>7} history tokens | full {:>9.2} ms | incremental {:>7.3} ms | {:>6.0}x",
            history_tokens,
            full.as_secs_f64() * 1e3,
            incremental.as_secs_f64() * 1e3,
            full.as_secs_f64() / incremental.as_secs_f64()
        );
    }
}

fn main() {
    // `cargo test --benches` runs benches with `--test`-like flags: do nothing heavy then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let qwen3 = ModelDir::load(&qwen3_dir())
        .unwrap_or_else(|e| panic!("{e}: run crates/switchyard-tokenize/fetch-test-models.sh"));
    bench_model("qwen3", &qwen3);
    bench_model("cl100k", &ModelDir::builtin());
}
