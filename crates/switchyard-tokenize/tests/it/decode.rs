//! The incremental detokenizer against a full decode: byte by byte (the built-in BPE, Qwen3
//! with its table decoder) and by a sliding window (Qwen3 through the `tokenizers` library).

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use switchyard_tokenize::{IncrementalDecoder, Tokenizer};

use crate::support::{builtin, qwen3, qwen3_dir};

/// Qwen3 without the fast paths: decoded by the library, so the decoder keeps a window.
fn qwen3_library() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let path = qwen3_dir().join("tokenizer.json");
            Arc::new(Tokenizer::from_hf_file_without_fast_path(&path).unwrap())
        })
        .clone()
}

#[test]
fn each_tokenizer_takes_the_mode_these_tests_cover() {
    let by_bytes =
        |tokenizer: Arc<Tokenizer>| IncrementalDecoder::new(tokenizer, true).decodes_by_bytes();
    assert!(by_bytes(builtin().tokenizer().clone()));
    assert!(by_bytes(qwen3().tokenizer().clone()));
    assert!(!by_bytes(qwen3_library()));
}

/// Streams `ids` through a decoder; returns the pieces.
fn stream(tokenizer: &Arc<Tokenizer>, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut decoder = IncrementalDecoder::new(tokenizer.clone(), skip_special_tokens);
    let mut pieces: Vec<String> = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    pieces.push(decoder.finish().unwrap());
    pieces
}

fn check(tokenizer: &Arc<Tokenizer>, text: &str) -> Result<(), TestCaseError> {
    let ids = tokenizer.encode(text).unwrap();
    let full = tokenizer.decode(&ids, true).unwrap();
    let pieces = stream(tokenizer, &ids, true);
    prop_assert_eq!(pieces.concat(), full);
    if !text.contains(char::REPLACEMENT_CHARACTER) {
        for piece in &pieces {
            prop_assert!(
                !piece.contains(char::REPLACEMENT_CHARACTER),
                "piece {:?} of {:?}",
                piece,
                text
            );
        }
    }
    Ok(())
}

/// Text mixing ASCII, accented Latin, CJK, emoji (with ZWJ sequences and skin tones), rare
/// planes, and now and then a real U+FFFD or a special token.
fn mixed_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => "[a-zA-Z0-9 ,.!?'\n\t]{1,12}",
        2 => "[\u{4E00}-\u{9FFF}\u{3040}-\u{30FF}]{1,6}",
        2 => "[\u{1F300}-\u{1FAFF}\u{2600}-\u{27BF}]{1,4}",
        1 => Just("👨‍👩‍👧👍🏽🇫🇷".to_owned()),
        1 => "[àéîõüßøñçłŋ\u{0300}-\u{036F}]{1,6}",
        1 => "[\u{10000}-\u{10FFFF}]{1,2}",
        1 => "\\PC{1,8}",
        1 => Just("\u{FFFD}".to_owned()),
        1 => Just("<|im_end|>".to_owned()),
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn builtin_pieces_concatenate_to_the_full_decode(text in mixed_text()) {
        check(builtin().tokenizer(), &text)?;
    }

    #[test]
    fn qwen3_pieces_concatenate_to_the_full_decode(text in mixed_text()) {
        check(qwen3().tokenizer(), &text)?;
    }

    #[test]
    fn qwen3_window_pieces_concatenate_to_the_full_decode(text in mixed_text()) {
        check(&qwen3_library(), &text)?;
    }

    /// Qwen3's byte tokens in any order (most not valid UTF-8 in sequence), special tokens
    /// among them, by bytes and by window: both equal the full decode.
    #[test]
    fn qwen3_random_ids(ids in proptest::collection::vec(
        prop_oneof![8 => 0u32..300, 2 => 0u32..151_700], 0..40), skip in any::<bool>()) {
        for tokenizer in [qwen3().tokenizer().clone(), qwen3_library()] {
            let pieces = stream(&tokenizer, &ids, skip);
            prop_assert_eq!(pieces.concat(), tokenizer.decode(&ids, skip).unwrap());
        }
    }

    /// Arbitrary ids (most not valid UTF-8 in sequence) still concatenate to the full decode.
    #[test]
    fn builtin_random_ids(ids in proptest::collection::vec(0u32..100_277, 0..40)) {
        let tokenizer = builtin().tokenizer().clone();
        let pieces = stream(&tokenizer, &ids, false);
        prop_assert_eq!(pieces.concat(), tokenizer.decode(&ids, false).unwrap());
    }
}

#[test]
fn holds_a_character_split_across_tokens() {
    // "🦀" is four bytes that cl100k_base splits over several byte tokens.
    let tokenizer = builtin().tokenizer().clone();
    let ids = tokenizer.encode("🦀").unwrap();
    assert!(ids.len() > 1, "expected a split emoji, got {ids:?}");
    let pieces = stream(&tokenizer, &ids, true);
    assert!(
        pieces[..ids.len() - 1].iter().all(String::is_empty),
        "{pieces:?}"
    );
    assert_eq!(pieces.concat(), "🦀");
}

#[test]
fn window_stays_small_over_a_long_stream() {
    let tokenizer = qwen3_library();
    let text = "Streaming 你好 🦀 text. ".repeat(500);
    let ids = tokenizer.encode(&text).unwrap();
    let mut decoder = IncrementalDecoder::new(tokenizer.clone(), true);
    assert!(!decoder.decodes_by_bytes());
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&decoder.push(id).unwrap());
        assert!(
            decoder.window_len() <= 8,
            "window grew to {}",
            decoder.window_len()
        );
    }
    out.push_str(&decoder.finish().unwrap());
    assert_eq!(out, text);
}

#[test]
fn prompt_context_does_not_leak_into_output() {
    for tokenizer in [qwen3().tokenizer().clone(), qwen3_library()] {
        prompt_context_stays_out(tokenizer);
    }
}

fn prompt_context_stays_out(tokenizer: Arc<Tokenizer>) {
    let prompt = tokenizer.encode("<|im_start|>assistant\n").unwrap();
    let generated = tokenizer.encode("Hello there, 世界").unwrap();
    let mut decoder = IncrementalDecoder::new(tokenizer.clone(), true)
        .with_prompt_context(&prompt)
        .unwrap();
    let out = decoder.push_all(&generated).unwrap() + &decoder.finish().unwrap();
    assert_eq!(out, "Hello there, 世界");
}
