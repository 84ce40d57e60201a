//! Replays every turn of the 20 sample Weka sessions as rendered Qwen3 chat text and checks
//! incremental tokenization against full tokenization on every transition.
//!
//! Text: each hash id (one 64-token block of the recorded prompt) becomes a few synthetic
//! words seeded by (trace id, hash id); a hash id whose seed says so starts a new message,
//! with a role from the same seed. So two turns share a rendered prefix exactly as far as
//! their hash ids agree, and the seam falls inside a message, at the template's
//! generation prompt, or in an assistant message the template renders differently once it
//! is no longer last (Qwen3's `<think>` block): an edit behind the seam.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use flate2::read::GzDecoder;
use serde_json::Value;
use switchyard_tokenize::{ChatMessage, ChatRequest, ModelDir, SessionConfig, SessionTokenizer};

use crate::support::qwen3;
use crate::synth::{Rng, seed_of, words};

fn sample_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/agentx/weka_kv_cache_tester/sample_20.jsonl.gz")
}

/// One replayable sequence of turns: a trace's top-level requests, or one sub-agent's.
pub struct Sequence {
    pub name: String,
    pub turns: Vec<Vec<u64>>,
}

fn load_sequences() -> Vec<Sequence> {
    load_sequences_from(&sample_path())
}

/// The sequences of a Weka trace file, gzipped (`.gz`) or plain.
pub fn load_sequences_from(path: &std::path::Path) -> Vec<Sequence> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reader: Box<dyn std::io::Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    let mut sequences = Vec::new();
    for line in BufReader::new(reader).lines() {
        let trace: Value = serde_json::from_str(&line.unwrap()).unwrap();
        let id = trace["id"].as_str().unwrap().to_owned();
        let hash_ids = |r: &Value| -> Vec<u64> {
            r["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect()
        };
        let mut top = Vec::new();
        for request in trace["requests"].as_array().unwrap() {
            if request["type"] == "subagent" {
                let agent = request["agent_id"].as_str().unwrap();
                sequences.push(Sequence {
                    name: format!("{id}/{agent}"),
                    turns: request["requests"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(hash_ids)
                        .collect(),
                });
            } else {
                top.push(hash_ids(request));
            }
        }
        sequences.push(Sequence {
            name: id,
            turns: top,
        });
    }
    sequences
}

/// The chat for one turn: messages made of the blocks' synthetic words.
pub fn conversation(trace: &str, blocks: &[u64], words_per_block: usize) -> ChatRequest {
    let mut messages = vec![ChatMessage::text("system", "You are a coding agent.")];
    let mut contents: Vec<(usize, String)> = Vec::new();
    for (i, &block) in blocks.iter().enumerate() {
        let mut rng = Rng::new(seed_of(&[trace.as_bytes(), &block.to_le_bytes()]));
        let starts_message = i == 0 || rng.below(6) == 0;
        let role = if i == 0 { 0 } else { rng.below(3) };
        let count = 1 + rng.below(words_per_block);
        let text = words(&mut rng, count);
        if starts_message {
            contents.push((role, String::new()));
        }
        if let Some((_, content)) = contents.last_mut() {
            content.push_str(&text);
        }
    }
    for (role, content) in contents {
        messages.push(ChatMessage::text(
            ["user", "assistant", "tool"][role],
            content,
        ));
    }
    ChatRequest::new(messages)
}

fn replay(model: &Arc<ModelDir>, max_turns: usize, words_per_block: usize) {
    let sequences = load_sequences();
    assert_eq!(
        sequences.iter().filter(|s| !s.name.contains('/')).count(),
        20,
        "the sample holds 20 sessions"
    );
    let sessions = SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            verify_sample_rate: 0.0,
            ..SessionConfig::default()
        },
    );
    let tok = model.tokenizer();
    let started = Instant::now();
    let (mut transitions, mut reused, mut total) = (0usize, 0usize, 0usize);
    for sequence in &sequences {
        let trace = sequence.name.split('/').next().unwrap();
        for (turn, blocks) in sequence.turns.iter().take(max_turns).enumerate() {
            let text = model
                .render_chat(&conversation(trace, blocks, words_per_block))
                .unwrap();
            let got = sessions.encode_turn(Some(&sequence.name), &text).unwrap();
            let full = tok.encode(&text).unwrap();
            assert!(
                got.token_ids == full,
                "{} turn {turn}: incremental differs from full (first at {:?})",
                sequence.name,
                got.token_ids.iter().zip(&full).position(|(a, b)| a != b)
            );
            if turn > 0 {
                transitions += 1;
                reused += got.reused_tokens;
                total += full.len();
            }
        }
    }
    let stats = sessions.stats();
    eprintln!(
        "replayed {} sequences, {transitions} transitions, {:.0}% of tokens reused, {stats:?} in {:?}",
        sequences.len(),
        100.0 * reused as f64 / total.max(1) as f64,
        started.elapsed()
    );
    assert!(transitions > 300);
    assert!(
        reused * 10 >= total * 8,
        "most tokens of later turns are reused ({reused} of {total})"
    );
}

/// Every session of the sample and its sub-agents, the first 16 turns of each (300+
/// transitions), one or two words per block: fast enough for debug builds in CI.
#[test]
fn weka_sample_sessions_tokenize_incrementally_like_full() {
    replay(&qwen3(), 16, 2);
}

/// Every turn of every session, longer text per block. Minutes in debug builds:
/// `cargo test --release -p switchyard-tokenize -- --ignored weka_sample_every_turn`.
#[test]
#[ignore = "slow in debug builds; run with --release"]
fn weka_sample_every_turn_tokenizes_incrementally_like_full() {
    replay(&qwen3(), usize::MAX, 6);
}
