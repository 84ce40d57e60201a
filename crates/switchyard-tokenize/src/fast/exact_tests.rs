//! The fast path against the `tokenizers` pipeline it replaces: ids and token starts must be
//! identical for every input. Needs Qwen3's `tokenizer.json` (`fetch-test-models.sh`); the
//! cl100k-pattern and Llama 3-shaped cases are Qwen3's file with those fields changed, so
//! each recognised variant runs through the real Hugging Face pipeline.

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::Value;

use super::pretokenize::CL100K_REGEX;
use crate::Tokenizer;

pub(crate) fn qwen3_json() -> PathBuf {
    let root = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/switchyard/test-models"));
    let path = root.join("qwen3/tokenizer.json");
    assert!(
        path.is_file(),
        "{} missing: run crates/switchyard-tokenize/fetch-test-models.sh",
        path.display()
    );
    path
}

/// (fast, reference) for Qwen3's file, after `edit` when one is given.
fn pair(edit: Option<&dyn Fn(&mut Value)>) -> (Tokenizer, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    let path = match edit {
        None => qwen3_json(),
        Some(edit) => {
            let mut json: Value =
                serde_json::from_slice(&std::fs::read(qwen3_json()).unwrap()).unwrap();
            edit(&mut json);
            let path = dir.path().join("tokenizer.json");
            std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
            path
        }
    };
    let fast = Tokenizer::from_hf_file(&path).unwrap();
    let reference = Tokenizer::from_hf_file_without_fast_path(&path).unwrap();
    assert!(
        fast.uses_fast_path(),
        "the fast path must take this tokenizer"
    );
    assert!(!reference.uses_fast_path());
    (fast, reference)
}

pub(crate) fn assert_same((fast, reference): &(Tokenizer, Tokenizer), text: &str) {
    let want = reference.encode_with_starts(text).unwrap();
    let got = fast.encode_with_starts(text).unwrap();
    assert_eq!(got.0, want.0, "ids differ for {text:?}");
    assert_eq!(got.1, want.1, "token starts differ for {text:?}");
    assert_eq!(
        fast.encode(text).unwrap(),
        want.0,
        "encode differs for {text:?}"
    );
}

/// Fragments chosen to hit every branch of the split pattern and of the merge loop.
pub(crate) const FRAGMENTS: &[&str] = &[
    "the",
    " quick",
    "Hello",
    "WORLD",
    "'s",
    "'S",
    "'t",
    "'re",
    "'VE",
    "'m",
    "'ll",
    "'LL",
    "'d",
    "'x",
    "'",
    "ſ",
    "'ſ",
    "don't",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    " \n ",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{b}",
    "\u{c}",
    "0",
    "42",
    "12345",
    "٣",
    "²",
    "Ⅻ",
    "3.14",
    ".",
    ",",
    "...",
    "!?",
    "->",
    "::",
    "{",
    "}",
    "();",
    "\"",
    "#",
    "--",
    "//",
    "/*",
    "*/",
    "你好",
    "世界",
    "，",
    "。",
    "日本語",
    "カタカナ",
    "한국어",
    "Ω",
    "café",
    "naïve",
    "é",
    "e\u{301}",
    "\u{301}",
    "\u{300}",
    "🦀",
    "🚀",
    "👨\u{200d}👩\u{200d}👧",
    "🇫🇷",
    "\u{1F3FD}",
    "—",
    "€",
    "مرحبا",
    "नमस्ते",
    "ẞ",
    "ǅ",
    "\u{0}",
    "\u{7f}",
    "\u{1d400}",
    "\u{20000}",
    "\u{e000}",
    "\u{10ffff}",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|im_",
    "<|endoftext|>",
    "<<|im_end|>>",
    "fn main() {\n    println!(\"hi\");\n}",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        6 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
        2 => any::<char>().prop_map(String::from),
        1 => (proptest::sample::select(FRAGMENTS), 2usize..40)
            .prop_map(|(f, n)| f.repeat(n)),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|parts| parts.concat())
}

/// Random texts, long single pieces (the heap merge path) and edge cases, all compared.
pub(crate) fn check_variant(pair: &(Tokenizer, Tokenizer)) {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 400,
        ..ProptestConfig::default()
    });
    runner
        .run(&text_strategy(), |text| {
            assert_same(pair, &text);
            Ok(())
        })
        .unwrap();
    for text in [
        "中文数据日本語".repeat(40),
        "-".repeat(500),
        " ".repeat(300) + "x",
        "\n".repeat(100) + "  end",
        "a".repeat(1000),
        "🦀".repeat(100),
        "é".repeat(200),
        "0123456789".repeat(30),
    ] {
        assert_same(pair, &text);
    }
    for text in [
        "",
        " ",
        "\n",
        "'",
        "'s",
        "<|im_start|>",
        "a<|im_end|>b",
        "x  ",
        "\r",
    ] {
        assert_same(pair, text);
    }
}

#[test]
fn qwen3_matches_hugging_face() {
    check_variant(&pair(None));
}

/// Qwen3's merge list is monotone, so most CJK characters (and many others) start merging as
/// one token; the comparisons above and below then exercise that path.
#[test]
fn qwen3_starts_cjk_characters_whole() {
    let json = std::fs::read(qwen3_json()).unwrap();
    let fast = super::FastBpe::from_json(&json, &|_| Some(0)).unwrap();
    let chars = fast.merges.char_tokens();
    assert!(chars.len() > 10_000, "{} characters", chars.len());
    assert!(
        "的是中文数据日本語"
            .chars()
            .all(|c| chars.get(c, None, None).is_some())
    );
}

/// Random strings of CJK, other scripts, emoji and spaces, without the fragment list's
/// bias towards ASCII: long pieces made mostly of multi-byte characters.
pub(crate) fn unicode_run_strategy() -> impl Strategy<Value = String> {
    let c = prop_oneof![
        4 => (0x4E00u32..0x9FFF).prop_map(|cp| char::from_u32(cp).unwrap_or(' ')),
        1 => (0x3040u32..0x30FF).prop_map(|cp| char::from_u32(cp).unwrap_or(' ')),
        1 => (0xAC00u32..0xD7A3).prop_map(|cp| char::from_u32(cp).unwrap_or(' ')),
        1 => (0x1F300u32..0x1FAFF).prop_map(|cp| char::from_u32(cp).unwrap_or(' ')),
        1 => proptest::sample::select(&[' ', '\n', '，', '。', 'a', 'é', '\u{3000}', '1'][..]),
        1 => any::<char>(),
    ];
    proptest::collection::vec(c, 0..400).prop_map(String::from_iter)
}

#[test]
fn long_unicode_runs_match_hugging_face() {
    for variant in [pair(None), cl100k_pair()] {
        long_unicode_runs_match(&variant);
    }
}

#[test]
fn long_unicode_runs_match_hugging_face_gpt2() {
    long_unicode_runs_match(&gpt2_pair());
}

fn long_unicode_runs_match(variant: &(Tokenizer, Tokenizer)) {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 300,
        ..ProptestConfig::default()
    });
    runner
        .run(&unicode_run_strategy(), |text| {
            assert_same(variant, &text);
            Ok(())
        })
        .unwrap();
}

/// One text of over 100k tokens: CJK paragraphs without punctuation (pieces of thousands of
/// bytes, the heap path), prose, code, emoji and whitespace runs.
#[test]
fn a_text_over_100k_tokens_matches_hugging_face() {
    let (fast, reference) = pair(None);
    let mut text = String::new();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    while text.len() < 420_000 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let pick = (state >> 33) as usize;
        match pick % 6 {
            0 => text.extend((0..200 + pick % 900).map(|k| {
                char::from_u32(0x4E00 + ((pick.wrapping_mul(k + 7)) % 0x5000) as u32)
                    .unwrap_or('中')
            })),
            1 => text.push_str(FRAGMENTS[pick % FRAGMENTS.len()]),
            2 => text.push_str(&" ".repeat(1 + pick % 70)),
            3 => text.push_str(&"🦀👨\u{200d}👩\u{200d}👧🇫🇷".repeat(1 + pick % 5)),
            4 => text.push_str("The quick brown fox jumps over the lazy dog, again; "),
            _ => text.push_str("fn main() {\n    let x = vec![1, 2, 3];\n}\n"),
        }
    }
    let want = reference.encode_with_starts(&text).unwrap();
    assert!(want.0.len() > 100_000, "{} tokens", want.0.len());
    let got = fast.encode_with_starts(&text).unwrap();
    assert!(got.0 == want.0, "ids differ");
    assert!(got.1 == want.1, "token starts differ");
    assert!(fast.encode(&text).unwrap() == want.0, "encode differs");
}

fn cl100k_pair() -> (Tokenizer, Tokenizer) {
    pair(Some(&|json| {
        json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = Value::from(CL100K_REGEX);
    }))
}

#[test]
fn cl100k_pattern_matches_hugging_face() {
    check_variant(&cl100k_pair());
}

/// The pipeline `tokenizers`' own BPE trainer writes (the peers harness's tokenizer): a bare
/// `ByteLevel` pre-tokenizer that splits with GPT-2's pattern, no normalizer, and a
/// `ByteLevel` post-processor that leaves offsets alone.
fn gpt2_pair() -> (Tokenizer, Tokenizer) {
    pair(Some(&|json| {
        json["normalizer"] = Value::Null;
        json["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel",
            "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        json["post_processor"] = serde_json::json!({"type": "ByteLevel",
            "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
    }))
}

#[test]
fn gpt2_byte_level_matches_hugging_face() {
    let variant = gpt2_pair();
    check_variant(&variant);
    for text in [
        " 1234567 x",
        "a\tb  c\t d",
        " 'sx 'S don't",
        "x \n\n y",
        "(( ,, )) \u{a0}x",
    ] {
        assert_same(&variant, text);
    }
}

/// Llama 3's pipeline on Qwen3's vocabulary: cl100k pattern, no normalizer, `ignore_merges`,
/// and its `Sequence[ByteLevel, TemplateProcessing]` post-processor.
#[test]
fn llama3_shape_matches_hugging_face() {
    check_variant(&pair(Some(&|json| {
        json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = Value::from(CL100K_REGEX);
        json["normalizer"] = Value::Null;
        json["model"]["ignore_merges"] = Value::from(true);
        json["post_processor"] = serde_json::json!({
            "type": "Sequence",
            "processors": [
                {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                 "use_regex": true},
                {"type": "TemplateProcessing",
                 "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}},
                          {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}},
                          {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>",
                                    "ids": [151643], "tokens": ["<|endoftext|>"]}}}
            ]
        });
    })));
}

/// A small tokenizer of the recognised shape: the 256 byte tokens, a few merges, two added
/// tokens.
pub(crate) fn small_json() -> Value {
    let mut vocab = serde_json::Map::new();
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let cp = if matches!(b, 33..=126 | 161..=172 | 174..=255) {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        vocab.insert(char::from_u32(cp).unwrap().to_string(), Value::from(b));
    }
    for (k, t) in ["th", "the", "Ġt"].iter().enumerate() {
        vocab.insert((*t).to_owned(), Value::from(256 + k));
    }
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 300, "content": "<|im_start|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": 301, "content": "<think>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": false}
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": super::pretokenize::QWEN2_REGEX},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false,
                           "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                    "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                  "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": [["t", "h"], ["th", "e"], ["Ġ", "t"]]}
    })
}

#[test]
fn small_tokenizer_matches_hugging_face() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&small_json()).unwrap()).unwrap();
    let pair = (
        Tokenizer::from_hf_file(&path).unwrap(),
        Tokenizer::from_hf_file_without_fast_path(&path).unwrap(),
    );
    assert!(pair.0.uses_fast_path());
    for text in [
        "the thethe<think>",
        " the<|im_start|>the",
        "théé 12 'll",
        "<|im_start|><think>",
    ] {
        assert_same(&pair, text);
    }
    // `tokenizers` numbers added tokens after the vocab, whatever the file's `id` says.
    assert_eq!(pair.0.encode("the<think>").unwrap(), [257, 260]);
}

#[test]
fn other_pipelines_keep_hugging_face() {
    let json = small_json();
    let rejected = |edit: &dyn Fn(&mut Value)| {
        let mut json = json.clone();
        edit(&mut json);
        super::FastBpe::from_json(&serde_json::to_vec(&json).unwrap(), &|_| Some(300)).err()
    };
    assert!(rejected(&|_| {}).is_none());
    assert!(rejected(&|j| j["normalizer"] = serde_json::json!({"type": "NFKC"})).is_some());
    assert!(
        rejected(
            &|j| j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
                Value::from(r"\s+|\S+")
        )
        .is_some()
    );
    assert!(rejected(&|j| j["model"]["dropout"] = Value::from(0.1)).is_some());
    assert!(rejected(&|j| j["model"]["byte_fallback"] = Value::from(true)).is_some());
    assert!(rejected(&|j| j["added_tokens"][0]["lstrip"] = Value::from(true)).is_some());
    assert!(rejected(&|j| j["added_tokens"][0]["normalized"] = Value::from(true)).is_some());
    assert!(
        rejected(&|j| j["post_processor"] =
            serde_json::json!({"type": "ByteLevel", "trim_offsets": true}))
        .is_some()
    );
    assert!(
        rejected(&|j| {
            let merges = j["model"]["merges"].as_array_mut().unwrap();
            let first = merges[0].clone();
            merges.push(first);
        })
        .is_some()
    );
}
