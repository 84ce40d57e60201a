//! The fast encoder against Hugging Face's pipeline over Weka session text: every message of
//! every turn (the synthetic words of `session_replay`, which mix prose, code punctuation,
//! digits, whitespace runs, CJK and emoji) and each sequence's last rendered chat prompt,
//! special tokens included.
//!
//! - `weka_slice_matches_hugging_face`: a committed slice (3 sessions, ≤ 200 blocks a turn),
//!   always runs.
//! - `weka_sample_sessions_match_hugging_face`: the 20 sample sessions of `../shared`; says
//!   it skipped when the shared data is absent.
//! - `weka_all_sessions_match_hugging_face` (ignored: minutes in a debug build): the 240
//!   sessions of `dev_120` and `dev_b_120`. Run it with
//!   `cargo nextest run --release -p switchyard-tokenize --test it weka_all --run-ignored only`.
//!
//! The built-in vocabularies (`cl100k_base`, `o200k_base`) are checked the same way against
//! `tiktoken-rs`: `weka_slice_matches_tiktoken` always, `weka_all_sessions_match_tiktoken`
//! (ignored, `dev_120`) with the command above.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use switchyard_tokenize::builtin::BuiltinVocab;
use switchyard_tokenize::{MessageContent, ModelDir, Tokenizer};

use crate::session_replay::{conversation, load_sequences_from};
use crate::support::{qwen3, qwen3_dir};

fn reference() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::from_hf_file_without_fast_path(&qwen3_dir().join("tokenizer.json")).unwrap()
    })
}

fn shared_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/agentx/weka_kv_cache_tester")
}

/// Compares every distinct message and each sequence's last prompt; returns how many texts
/// and tokens were compared.
fn compare_sessions(model: &ModelDir, reference: &Tokenizer, path: &Path) -> (usize, usize) {
    let fast = model.tokenizer();
    assert!(
        fast.uses_fast_path(),
        "{} must load with the fast path",
        fast.name()
    );
    let mut seen = HashSet::new();
    let (mut texts, mut tokens) = (0, 0);
    let mut check = |what: &str, text: &str| {
        let want = reference.encode(text).unwrap();
        let got = fast.encode(text).unwrap();
        assert!(
            got == want,
            "{what}: fast ids differ from the reference's at token {:?} of {text:?}",
            got.iter().zip(&want).position(|(a, b)| a != b)
        );
        texts += 1;
        tokens += want.len();
    };
    let sequences = load_sequences_from(path);
    assert!(
        !sequences.is_empty(),
        "{} holds no sessions",
        path.display()
    );
    for sequence in &sequences {
        let trace = sequence.name.split('/').next().unwrap();
        for (turn, blocks) in sequence.turns.iter().enumerate() {
            let chat = conversation(trace, blocks, 3);
            for message in &chat.messages {
                if let Some(MessageContent::Text(text)) = &message.content
                    && seen.insert(text.clone())
                {
                    check(&format!("{} turn {turn}", sequence.name), text);
                }
            }
        }
        if let Some(blocks) = sequence.turns.last() {
            let prompt = model.render_chat(&conversation(trace, blocks, 3)).unwrap();
            check(&format!("{} last prompt", sequence.name), &prompt);
        }
    }
    (texts, tokens)
}

#[test]
fn weka_slice_matches_hugging_face() {
    let (texts, tokens) = compare_sessions(&qwen3(), reference(), &weka_slice());
    assert!(
        texts > 20 && tokens > 5_000,
        "{texts} texts, {tokens} tokens"
    );
}

#[test]
fn weka_sample_sessions_match_hugging_face() {
    let path = shared_dir().join("sample_20.jsonl.gz");
    if !path.is_file() {
        eprintln!(
            "SKIPPED: {} absent (shared data not mounted)",
            path.display()
        );
        return;
    }
    let (texts, tokens) = compare_sessions(&qwen3(), reference(), &path);
    eprintln!("sample_20: {texts} texts, {tokens} tokens identical");
}

#[test]
#[ignore = "minutes in a debug build; run with --release --run-ignored only"]
fn weka_all_sessions_match_hugging_face() {
    for name in ["dev_120.jsonl.gz", "dev_b_120.jsonl.gz"] {
        let path = shared_dir().join(name);
        assert!(path.is_file(), "{} absent", path.display());
        let (texts, tokens) = compare_sessions(&qwen3(), reference(), &path);
        eprintln!("{name}: {texts} texts, {tokens} tokens identical");
    }
}

fn weka_slice() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/weka_slice.jsonl")
}

#[test]
fn weka_slice_matches_tiktoken() {
    for vocab in BuiltinVocab::ALL {
        let model = ModelDir::builtin_vocab(vocab);
        let reference = Tokenizer::builtin_without_fast_path(vocab);
        let (texts, tokens) = compare_sessions(&model, &reference, &weka_slice());
        assert!(
            texts > 20 && tokens > 5_000,
            "{vocab:?}: {texts} texts, {tokens} tokens"
        );
    }
}

#[test]
#[ignore = "minutes in a debug build; run with --release --run-ignored only"]
fn weka_all_sessions_match_tiktoken() {
    let path = shared_dir().join("dev_120.jsonl.gz");
    assert!(path.is_file(), "{} absent", path.display());
    for vocab in BuiltinVocab::ALL {
        let model = ModelDir::builtin_vocab(vocab);
        let reference = Tokenizer::builtin_without_fast_path(vocab);
        let (texts, tokens) = compare_sessions(&model, &reference, &path);
        eprintln!("dev_120, {vocab:?}: {texts} texts, {tokens} tokens identical");
    }
}
