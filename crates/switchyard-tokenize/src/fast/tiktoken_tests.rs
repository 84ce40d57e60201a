//! The built-in vocabularies' fast path against `tiktoken-rs` (the reference for them): ids
//! and token starts must be identical for every input.

use proptest::prelude::*;

use super::exact_tests::{assert_same, check_variant, unicode_run_strategy};
use crate::Tokenizer;
use crate::builtin::BuiltinVocab;

fn pair(vocab: BuiltinVocab) -> (Tokenizer, Tokenizer) {
    let fast = Tokenizer::builtin(vocab);
    let reference = Tokenizer::builtin_without_fast_path(vocab);
    assert!(fast.uses_fast_path(), "{vocab:?} must build its fast path");
    assert!(!reference.uses_fast_path());
    (fast, reference)
}

/// What o200k's pattern treats apart from cl100k's: letter case, title case (`ǅ`), modifier
/// letters, combining marks, contractions after words, `/` after punctuation.
const CASED_FRAGMENTS: &[&str] = &[
    "HTTPServer",
    "helloWorld",
    "camelCase",
    "SHOUT",
    "I'M",
    "don'T",
    "ǅemal",
    "ǅ",
    "ʰ",
    "aʰB",
    "\u{301}",
    "A\u{301}b",
    "!\u{301}",
    "/",
    "//\n/",
    "://",
    "'",
    "'s",
    "'ll",
    "ſ",
    " ",
    "\n",
    "  ",
    "1",
    "1234",
    "é",
    "É",
    "Straße",
    "ΣΊΣΥΦΟΣ",
    "日本",
    "😀",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
];

fn cased_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => proptest::sample::select(CASED_FRAGMENTS).prop_map(str::to_owned),
        1 => any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|parts| parts.concat())
}

fn check_vocab(vocab: BuiltinVocab) {
    let pair = pair(vocab);
    check_variant(&pair);
    for strategy in [cased_strategy().boxed(), unicode_run_strategy().boxed()] {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 300,
            ..ProptestConfig::default()
        });
        runner
            .run(&strategy, |text| {
                assert_same(&pair, &text);
                Ok(())
            })
            .unwrap();
    }
    for text in [
        "trailing  \n  ",
        "x \n",
        " \n ",
        "a<|im_end|>  ",
        "  <|im_start|>",
        "HTTPServer's 'S I'M",
        "a/b//\n/c",
    ] {
        assert_same(&pair, text);
    }
}

#[test]
fn cl100k_matches_tiktoken() {
    check_vocab(BuiltinVocab::Cl100k);
}

#[test]
fn o200k_matches_tiktoken() {
    check_vocab(BuiltinVocab::O200k);
}

#[test]
fn the_fast_path_holds_every_ordinary_token() {
    for (vocab, ordinary) in [
        (BuiltinVocab::Cl100k, 100_256),
        (BuiltinVocab::O200k, 199_998),
    ] {
        let tokens = vocab.ordinary_tokens();
        assert_eq!(tokens.len(), ordinary, "{vocab:?}");
        let fast = super::FastBpe::from_ranks(vocab.pattern().unwrap(), &tokens, &[]).unwrap();
        // A whole token is looked up, never merged: the longest one comes back as itself.
        let (bytes, id) = tokens.iter().max_by_key(|(b, _)| b.len()).unwrap();
        if let Ok(text) = std::str::from_utf8(bytes) {
            assert_eq!(fast.encode(text), Some(vec![*id]));
        }
    }
}

#[test]
fn chatml_tokens_are_single_ids_in_both_vocabularies() {
    for (vocab, start, end) in [
        (BuiltinVocab::Cl100k, 100_264, 100_265),
        (BuiltinVocab::O200k, 200_264, 200_265),
    ] {
        let tok = Tokenizer::builtin(vocab);
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
        assert_eq!(ids.first(), Some(&start), "{vocab:?}");
        assert_eq!(ids.last(), Some(&end), "{vocab:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<|im_start|>user\nhi<|im_end|>"
        );
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    }
    assert_eq!(
        Tokenizer::builtin(BuiltinVocab::O200k).vocab_size(),
        200_267
    );
}

/// Every cut the seam rules call clean really is one: tokenizing the two sides apart gives
/// the tokens of the whole (o200k: not between a word and its contraction).
#[test]
fn clean_splits_of_the_builtin_vocabularies_are_exact() {
    for vocab in BuiltinVocab::ALL {
        let tok = Tokenizer::builtin(vocab);
        let rules = tok.seam_rules();
        let check = |text: &str| {
            let whole = tok.encode(text).unwrap();
            for r in 1..text.len() {
                if rules.clean_split(text.as_bytes(), r) {
                    let mut parts = tok.encode(&text[..r]).unwrap();
                    parts.extend(tok.encode(&text[r..]).unwrap());
                    assert_eq!(parts, whole, "{vocab:?}: cut at {r} of {text:?}");
                }
            }
        };
        check("I don't know what you're doing, it's the WORLD's best.");
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 200,
            ..ProptestConfig::default()
        });
        runner
            .run(&cased_strategy(), |text| {
                check(&text);
                Ok(())
            })
            .unwrap();
    }
}
