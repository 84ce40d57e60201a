//! `SessionTokenizer`: incremental equals full on seams built to break it, on random edits,
//! for Qwen3, the built-in cl100k and a GPT-2-shaped pipeline; bounds and counters; the
//! async path.

use std::sync::Arc;

use proptest::prelude::*;
use switchyard_tokenize::{
    ChatMessage, ChatRequest, ModelDir, Preprocessor, SessionConfig, SessionTokenizer,
};

use crate::support::{builtin, builtin_o200k, gpt2_shaped, qwen3};
use crate::synth::{Rng, words};

fn sessions(model: &Arc<ModelDir>, verify: f64) -> SessionTokenizer {
    SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            verify_sample_rate: verify,
            ..SessionConfig::default()
        },
    )
}

/// A history long enough that the seam is far from the start.
fn history() -> String {
    let mut rng = Rng::new(7);
    format!(
        "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\n{}",
        words(&mut rng, 300)
    )
}

/// Tokenizes `turns` in order as one session and checks each against a full tokenization;
/// returns the tokens reused.
fn check_turns(
    model: &Arc<ModelDir>,
    session: &SessionTokenizer,
    id: &str,
    turns: &[String],
) -> usize {
    let tok = model.tokenizer();
    let mut reused = 0;
    for (i, text) in turns.iter().enumerate() {
        let got = session.encode_turn(Some(id), text).unwrap();
        let full = tok.encode(text).unwrap();
        assert!(
            got.token_ids == full,
            "{}: turn {i} differs (first at {:?}): {:?}",
            tok.name(),
            got.token_ids.iter().zip(&full).position(|(a, b)| a != b),
            text.get(text.len().saturating_sub(60)..).unwrap_or(text)
        );
        reused += got.reused_tokens;
    }
    reused
}

/// (before, after) pairs whose seam cuts a word, a whitespace run, a number, a contraction,
/// a multi-byte character or a special token. Runs are longer than the back-off margin
/// (the longest added token), so a wrong rule for that class would cut inside the run.
const SEAMS: &[(&str, &str)] = &[
    (
        "x                                        ",
        "x                                        y",
    ),
    (
        "x\n\n\n\n                              ",
        "x\n\n\n\n                              z\n",
    ),
    (
        "x\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t",
        "x\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\n",
    ),
    (
        "pneumonoultramicroscopicsilicovolcanoconiosisAndAntidisestablishmentarianism",
        "pneumonoultramicroscopicsilicovolcanoconiosisAndAntidisestablishmentarianisms",
    ),
    (
        "f(((((((((((((((((((((((((((((((((((((((",
        "f((((((((((((((((((((((((((((((((((((((((x",
    ),
    (
        "))))))))))))))))))))))))))))))))))))))))",
        ")))))))))))))))))))))))))))))))))))))))))\n",
    ),
    (
        "a contraction follows the word",
        "a contraction follows the word's",
    ),
    (
        "12345678901234567890123456789012345678901",
        "123456789012345678901234567890123456789012",
    ),
    (
        "数字和中文数字和中文数字和中文数字和中文数字和中文",
        "数字和中文数字和中文数字和中文数字和中文数字和中文数",
    ),
    ("Hello wor", "Hello world"),
    ("abc", "abcdef"),
    ("x  ", "x    y"),
    ("x  ", "x  \n\n  y"),
    ("a\n", "a\n\n  b"),
    ("foo \t", "foo \t\nbar"),
    ("end.", "end.\n"),
    ("end.", "end.)\r\n"),
    ("12345", "1234567"),
    ("x 99", "x 999 1"),
    ("v1", "v1.2.3"),
    ("it", "it's"),
    ("they'", "they're"),
    ("don", "don't"),
    ("x '", "x 's"),
    ("(", "(foo"),
    ("数字", "数字和中文"),
    ("🦀", "🦀🚀"),
    ("👨‍👩", "👨‍👩‍👧"),
    ("e", "e\u{301}"),
    ("A", "A\u{30a}\u{301}"),
    ("한", "한\u{1100}"),
    ("abc<|im_", "abc<|im_end|>"),
    ("abc<|im_end|>", "abc<|im_end|>\n<|im_start|>user\nhi"),
    ("abc<|im_end", "abc<|im_endless"),
    ("call <tool_ca", "call <tool_call>\n{}"),
    ("x<|endof", "x<|endoftext|>y"),
    ("<|im_start|>", "<|im_start|>assistant\n"),
    ("tail   ", "tail   <|im_end|>"),
];

fn check_seams(model: &Arc<ModelDir>) {
    let session = sessions(model, 0.0);
    let base = history();
    let mut reused = 0;
    for (i, (before, after)) in SEAMS.iter().enumerate() {
        let id = format!("seam-{i}");
        let turns = [
            base.clone() + before,
            base.clone() + after,
            base.clone() + before, // and back: the new text is a prefix of the old
            base.clone() + after + before + after,
        ];
        reused += check_turns(model, &session, &id, &turns);
    }
    assert!(
        reused > SEAMS.len() * 3 * 200,
        "the history is reused ({reused})"
    );
}

#[test]
fn seams_qwen3() {
    check_seams(&qwen3());
}

#[test]
fn seams_builtin_cl100k() {
    check_seams(&builtin());
}

/// GPT-2's split regex (a bare `ByteLevel` pre-tokenizer) gets word seams too.
#[test]
fn seams_gpt2_byte_level() {
    check_seams(&gpt2_shaped());
}

#[test]
fn seams_builtin_o200k() {
    check_seams(&builtin_o200k());
}

/// A growing ChatML conversation with the generation prompt, as the gateway sees it.
#[test]
fn chat_turns_reuse_almost_everything() {
    for model in [qwen3(), builtin(), gpt2_shaped()] {
        let session = sessions(&model, 1.0);
        let mut rng = Rng::new(11);
        let mut messages = vec![ChatMessage::text("system", "Be brief.")];
        let mut turns = Vec::new();
        for turn in 0..12 {
            messages.push(ChatMessage::text("user", words(&mut rng, 60)));
            turns.push(
                model
                    .render_chat(&ChatRequest::new(messages.clone()))
                    .unwrap(),
            );
            messages.push(ChatMessage::text(
                "assistant",
                format!("<think>\nhm\n</think>\n\n{}", words(&mut rng, 40 + turn)),
            ));
        }
        let reused = check_turns(&model, &session, "chat", &turns);
        let stats = session.stats();
        assert_eq!((stats.hits, stats.misses), (11, 1), "{stats:?}");
        assert_eq!((stats.verified, stats.verify_mismatches), (11, 0));
        let total: usize = turns[1..]
            .iter()
            .map(|t| model.tokenizer().encode(t).unwrap().len())
            .sum();
        assert!(reused * 10 > total * 8, "{reused} of {total}");
    }
}

/// Fragments that stress every layer; random appends, edits anywhere and truncations.
const PIECES: &[&str] = &[
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "a",
    "ab",
    "The",
    "'s",
    "'ll",
    "'",
    "1",
    "23",
    "456",
    ".",
    "(",
    "::",
    "数",
    "字",
    "🦀",
    "\u{200d}",
    "\u{301}",
    "é",
    "<|im_end|>",
    "<|im_",
    "end|>",
    "<|",
    "<tool_call>",
    "<think>",
    "\u{a0}",
    "x_1",
    "                ",
    "\n\n\n\n\n\n\n\n",
    "\t\t\t\t\t\t\t\t",
    ")))))))))",
    "aaaaaaaaaaaaaaaa",
    "Antidisestablishmentarianism",
];

#[derive(Debug, Clone)]
enum Op {
    Append(Vec<usize>),
    Edit { at: usize, cut: usize, piece: usize },
    Truncate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec(0..PIECES.len(), 1..12).prop_map(Op::Append),
        2 => (any::<usize>(), 0usize..8, 0..PIECES.len()).prop_map(|(at, cut, piece)| Op::Edit { at, cut, piece }),
        1 => any::<usize>().prop_map(Op::Truncate),
    ]
}

fn char_floor(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn apply(text: &str, op: &Op) -> String {
    match op {
        Op::Append(pieces) => pieces.iter().fold(text.to_owned(), |t, &p| t + PIECES[p]),
        Op::Edit { at, cut, piece } => {
            let at = char_floor(text, at % (text.len() + 1));
            let end = char_floor(text, at + cut);
            format!("{}{}{}", &text[..at], PIECES[*piece], &text[end.max(at)..])
        }
        Op::Truncate(n) => {
            let keep = char_floor(text, text.len() - n % (text.len() / 4 + 1));
            text[..keep].to_owned()
        }
    }
}

fn random_edits(model: &Arc<ModelDir>, start: &[usize], ops: &[Op]) {
    let session = sessions(model, 0.0);
    let mut text = history();
    text.extend(start.iter().map(|&p| PIECES[p]));
    let mut turns = vec![text.clone()];
    for op in ops {
        text = apply(&text, op);
        turns.push(text.clone());
    }
    check_turns(model, &session, "random", &turns);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_edits_qwen3(start in prop::collection::vec(0..PIECES.len(), 0..40), ops in prop::collection::vec(op(), 1..8)) {
        random_edits(&qwen3(), &start, &ops);
    }

    #[test]
    fn random_edits_gpt2_byte_level(start in prop::collection::vec(0..PIECES.len(), 0..40), ops in prop::collection::vec(op(), 1..8)) {
        random_edits(&gpt2_shaped(), &start, &ops);
    }

    #[test]
    fn random_edits_builtin(start in prop::collection::vec(0..PIECES.len(), 0..40), ops in prop::collection::vec(op(), 1..8)) {
        random_edits(&builtin(), &start, &ops);
    }

    /// o200k keeps a contraction with its word: "The" then "'s" is not a seam.
    #[test]
    fn random_edits_builtin_o200k(start in prop::collection::vec(0..PIECES.len(), 0..40), ops in prop::collection::vec(op(), 1..8)) {
        random_edits(&builtin_o200k(), &start, &ops);
    }
}

#[test]
fn sessions_are_bounded_by_count_and_bytes() {
    let model = builtin();
    // Texts differ at the start, so no session can serve as the base of another.
    let text = |i: usize| format!("session {i} {}", history());
    let by_count = SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            max_sessions: 3,
            max_bytes: usize::MAX,
            verify_sample_rate: 0.0,
            prefix_cache_bytes: 0,
        },
    );
    for i in 0..5 {
        by_count.encode(Some(&format!("s{i}")), &text(i)).unwrap();
    }
    let stats = by_count.stats();
    assert_eq!((stats.sessions, stats.evictions), (3, 2), "{stats:?}");
    // s0 was evicted: its next turn starts over (a miss), s4's is a hit.
    let misses = stats.misses;
    by_count.encode(Some("s4"), &(text(4) + " more")).unwrap();
    assert_eq!(by_count.stats().hits, 1);
    assert!(by_count.forget("s4") && !by_count.forget("s0"));
    assert_eq!(by_count.stats().sessions, 2);
    assert_eq!(by_count.stats().misses, misses);

    let one = by_count.stats().bytes / 2;
    let by_bytes = SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            max_sessions: 100,
            max_bytes: one * 2 + one / 2,
            verify_sample_rate: 0.0,
            prefix_cache_bytes: 0,
        },
    );
    for i in 0..6 {
        by_bytes.encode(Some(&format!("s{i}")), &text(i)).unwrap();
        assert!(by_bytes.stats().bytes <= one * 2 + one / 2);
    }
    let stats = by_bytes.stats();
    assert_eq!(
        (stats.sessions, stats.evictions, stats.misses),
        (2, 4, 6),
        "{stats:?}"
    );
}

#[test]
fn finds_the_session_by_prefix_without_an_id() {
    let model = qwen3();
    let session = sessions(&model, 1.0);
    let first = history();
    let a = session.encode_turn(None, &first).unwrap();
    let b = session
        .encode_turn(None, &(first.clone() + " and more"))
        .unwrap();
    assert_eq!(a.session, b.session, "the second turn continues the first");
    assert!(b.reused_tokens > 100);
    // A different conversation sharing only the system prompt branches off into its own.
    let other = format!("{} other", &first[..300]);
    let c = session.encode_turn(None, &other).unwrap();
    assert_ne!(c.session, a.session);
    assert_eq!(c.token_ids, model.tokenizer().encode(&other).unwrap());
    let stats = session.stats();
    assert_eq!(stats.verify_mismatches, 0);
    assert_eq!(stats.sessions, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preprocessor_encodes_chat_sessions_off_the_reactor() {
    let model = qwen3();
    let pre = Preprocessor::new(model.clone(), 2).with_session_config(SessionConfig {
        verify_sample_rate: 1.0,
        ..SessionConfig::default()
    });
    let mut rng = Rng::new(3);
    let mut messages = vec![ChatMessage::text("user", words(&mut rng, 400))];
    for _ in 0..4 {
        let request = ChatRequest::new(messages.clone());
        let got = pre
            .encode_chat_session(Some("s"), request.clone())
            .await
            .unwrap();
        assert_eq!(got, pre.encode_chat(request).await.unwrap());
        messages.push(ChatMessage::text("assistant", words(&mut rng, 30)));
        messages.push(ChatMessage::text("user", words(&mut rng, 30)));
    }
    let stats = pre.session_stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.verify_mismatches),
        (3, 1, 0)
    );
}
