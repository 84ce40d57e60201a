//! The cross-request prefix cache through `SessionTokenizer`: a prompt whose opening came from
//! the cache tokenizes exactly as a fresh one, for random openings and tails (added tokens,
//! whitespace runs, digits, CJK, emoji and combining marks at the seam), for Qwen3 and the
//! built-in cl100k; and sessions that share only a system prompt reuse it.

use std::sync::Arc;

use proptest::prelude::*;
use switchyard_tokenize::{ChatMessage, ChatRequest, ModelDir, SessionConfig, SessionTokenizer};

use crate::support::{builtin, qwen3};

/// No session is kept, so every turn goes through the prefix cache alone.
fn prefix_only(model: &Arc<ModelDir>) -> SessionTokenizer {
    SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            max_sessions: 0,
            verify_sample_rate: 0.0,
            ..SessionConfig::default()
        },
    )
}

const FRAGMENTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|im_start|>user\n",
    "<|im_end|>\n",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "word",
    " word",
    "Word",
    "'s",
    "'ll",
    "123",
    "4",
    ".",
    "(",
    "){",
    "::",
    "é",
    "e",
    "\u{301}",
    "数据",
    "日本語",
    "🦀",
    "👨‍👩‍👧",
    "<tool_call>",
    "</tool_call>",
    "<",
    "|",
];

fn text(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..max).prop_map(|parts| parts.concat())
}

fn check(model: &Arc<ModelDir>, opening: &str, tails: &[String]) -> Result<usize, TestCaseError> {
    let sessions = prefix_only(model);
    let tok = model.tokenizer();
    let mut reused = 0;
    for tail in tails {
        let text = format!("{opening}{tail}");
        let turn = sessions.encode_turn(None, &text).unwrap();
        prop_assert_eq!(&turn.token_ids, &tok.encode(&text).unwrap(), "{:?}", text);
        reused += turn.prefix_tokens;
    }
    Ok(reused)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn hits_equal_fresh_tokenizations_qwen3(
        opening in text(400),
        tails in prop::collection::vec(text(60), 2..4),
    ) {
        check(&qwen3(), &opening, &tails)?;
    }

    #[test]
    fn hits_equal_fresh_tokenizations_cl100k(
        opening in text(400),
        tails in prop::collection::vec(text(60), 2..4),
    ) {
        check(&builtin(), &opening, &tails)?;
    }
}

/// Openings that end on a message boundary followed by text built to merge across it.
#[test]
fn seams_after_a_cached_opening_match_fresh() {
    let system =
        "<|im_start|>system\nYou are terse. ".to_owned() + &"Rules: é数据 🦀 ok. ".repeat(30);
    let tails: Vec<String> = [
        "<|im_end|>\n",
        "<|im_end|>",
        "\u{301}x<|im_end|>",
        "123<|im_end|>4",
    ]
    .iter()
    .map(|t| (*t).to_owned())
    .collect();
    for model in [qwen3(), builtin()] {
        check(&model, &system, &tails).unwrap();
    }
}

fn chat(model: &ModelDir, system: &str, user: &str) -> String {
    let mut request = ChatRequest::new(vec![
        ChatMessage::text("system", system),
        ChatMessage::text("user", user),
    ]);
    request.add_generation_prompt = true;
    model.render_chat(&request).unwrap()
}

#[test]
fn sessions_sharing_only_a_system_prompt_reuse_it() {
    let model = qwen3();
    let sessions = SessionTokenizer::new(Arc::clone(model.tokenizer()), SessionConfig::default());
    let system = "You are a coding agent working in a large Rust repository. ".repeat(60);
    let first = chat(&model, &system, "Fix the build.");
    let second = chat(&model, &system, "Write the release notes, s'il vous plaît.");
    let a = sessions.encode_turn(Some("a"), &first).unwrap();
    let b = sessions.encode_turn(Some("b"), &second).unwrap();
    assert_eq!(b.token_ids, model.tokenizer().encode(&second).unwrap());
    assert_eq!((a.prefix_tokens, b.reused_tokens), (0, 0));
    assert!(
        b.prefix_tokens * 10 >= b.token_ids.len() * 9,
        "{} of {} tokens reused",
        b.prefix_tokens,
        b.token_ids.len()
    );
    let stats = sessions.prefix_stats();
    assert_eq!((stats.hits, stats.misses), (1, 1));
    assert_eq!(stats.reused_tokens, b.prefix_tokens as u64);
    // The session's own next turn splices from its own state, not from the cache.
    let next = second.clone() + "Sure.<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n";
    let turn = sessions.encode_turn(Some("b"), &next).unwrap();
    assert!(turn.reused_tokens > 0 && turn.prefix_tokens == 0);
    assert_eq!(sessions.prefix_stats().hits, 1);
}
