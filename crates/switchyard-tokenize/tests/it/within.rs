//! Tokenizing with a token limit: a text that fits gives exactly the full tokenization (cut in
//! chunks at clean splits), one that does not is refused after little work and leaves the
//! session cache as it was, and the byte-length bound never refuses a text that fits.

use std::sync::Arc;

use switchyard_tokenize::{ModelDir, SessionConfig, SessionTokenizer, TokenizeError};

use crate::support::{builtin, qwen3};
use crate::synth::{Rng, words};

/// About `bytes` of mixed text: words, code, digits, multi-byte characters, whitespace runs,
/// and now and then a ChatML turn boundary (added tokens).
fn long_text(seed: u64, bytes: usize) -> String {
    let mut rng = Rng::new(seed);
    let mut text = String::with_capacity(bytes + 4096);
    while text.len() < bytes {
        text.push_str(&words(&mut rng, 400));
        if rng.below(4) == 0 {
            text.push_str("<|im_end|>\n<|im_start|>user\n");
        }
        if rng.below(8) == 0 {
            // A long run with no clean split inside: letters, then spaces.
            text.push_str(&"x".repeat(rng.below(5000)));
            text.push_str(&" ".repeat(rng.below(3000)));
        }
    }
    text
}

fn models() -> [Arc<ModelDir>; 2] {
    [builtin(), qwen3()]
}

#[test]
fn a_text_that_fits_is_tokenized_exactly_in_chunks() {
    for model in models() {
        let tok = model.tokenizer();
        for seed in 0..3 {
            let text = long_text(seed, 150_000 + seed as usize * 77_777);
            let full = tok.encode(&text).unwrap();
            let within = tok.encode_within(&text, full.len()).unwrap();
            assert!(
                within == full,
                "{}: seed {seed}: chunked differs from full at {:?} ({} vs {} tokens)",
                tok.name(),
                within.iter().zip(&full).position(|(a, b)| a != b),
                within.len(),
                full.len()
            );
            let err = tok.encode_within(&text, full.len() - 1).unwrap_err();
            assert!(
                matches!(err, TokenizeError::TooManyTokens { at_least, max } if at_least > max && at_least <= full.len()),
                "{}: {err}",
                tok.name()
            );
        }
    }
}

#[test]
fn the_byte_bound_never_exceeds_the_true_count() {
    // Texts built to need few tokens per byte: long runs of one character, the longest
    // tokens repeated, decomposed characters NFC composes.
    let mut texts = vec![
        " ".repeat(100_000),
        "-".repeat(100_000),
        "=".repeat(50_000),
        "\n".repeat(50_000),
        "a".repeat(20_000),
        "0".repeat(30_000),
        "e\u{0301}".repeat(20_000),
        "\u{1100}\u{1161}\u{11A8}".repeat(10_000),
        "<|im_end|>".repeat(5_000),
        "________________________________".repeat(3_000),
    ];
    texts.push(long_text(11, 200_000));
    for model in models() {
        let tok = model.tokenizer();
        assert!(tok.min_tokens(1 << 20) > 0, "{}: no byte bound", tok.name());
        for text in &texts {
            let count = tok.encode(text).unwrap().len();
            let bound = tok.min_tokens(text.len());
            assert!(
                bound <= count,
                "{}: bound {bound} above the true count {count} for {:?}…",
                tok.name(),
                &text[..text.len().min(20)]
            );
        }
    }
}

fn sessions(model: &Arc<ModelDir>) -> SessionTokenizer {
    SessionTokenizer::new(
        Arc::clone(model.tokenizer()),
        SessionConfig {
            verify_sample_rate: 1.0,
            ..SessionConfig::default()
        },
    )
}

#[test]
fn an_over_long_prompt_stops_early_and_is_not_kept() {
    for model in models() {
        let name = model.tokenizer().name().to_owned();
        let session = sessions(&model);
        let first = long_text(21, 50_000);
        let first_tokens = session.encode_turn(Some("s"), &first).unwrap().token_ids;
        let before = session.stats();
        assert_eq!(before.sessions, 1);

        // 2 MB more: far past a 20k-token limit, but not provably from its length alone.
        let mut second = first.clone();
        second.push_str(&long_text(22, 2_000_000));
        assert!(model.tokenizer().min_tokens(second.len()) <= 20_000);
        let err = session
            .encode_turn_within(Some("s"), &second, 20_000)
            .unwrap_err();
        assert!(
            matches!(err, TokenizeError::TooManyTokens { at_least, max: 20_000 } if at_least > 20_000),
            "{name}: {err}"
        );
        let after = session.stats();
        let tokenized = after.tokenized_bytes - before.tokenized_bytes;
        assert!(
            tokenized < second.len() as u64 / 8,
            "{name}: tokenized {tokenized} of {} bytes before refusing",
            second.len()
        );
        assert_eq!(after.sessions, 1, "{name}: the refused turn was kept");
        assert_eq!(
            after.bytes, before.bytes,
            "{name}: the refused turn was kept"
        );

        // The session is still the first turn: its next real turn reuses it.
        let mut third = first.clone();
        third.push_str(" and one more question?");
        let turn = session.encode_turn(Some("s"), &third).unwrap();
        assert!(turn.reused_tokens > first_tokens.len() / 2, "{name}");
        assert_eq!(turn.token_ids, model.tokenizer().encode(&third).unwrap());
    }
}

#[test]
fn a_huge_prompt_is_refused_after_little_or_no_work() {
    for model in models() {
        let session = sessions(&model);
        let text = "lorem ipsum dolor sit amet ".repeat(800_000); // 21.6 MB
        let before = session.stats();
        let err = session
            .encode_turn_within(None, &text, 131_071)
            .unwrap_err();
        assert!(
            matches!(err, TokenizeError::TooManyTokens { at_least, .. } if at_least > 131_071),
            "{err}"
        );
        let after = session.stats();
        let tokenized = after.tokenized_bytes - before.tokenized_bytes;
        if model.tokenizer().min_tokens(text.len()) > 131_071 {
            // cl100k: no token is longer than 128 bytes, so 21.6 MB cannot fit.
            assert_eq!(tokenized, 0, "{}", model.tokenizer().name());
        } else {
            // Qwen3's NFC allows a looser bound only; the chunks stop soon after the limit.
            assert!(tokenized < text.len() as u64 / 16, "{tokenized}");
        }
        assert_eq!(after.sessions, 0);
    }
}
