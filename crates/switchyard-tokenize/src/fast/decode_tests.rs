//! The table-driven decoder against `tokenizers`' own decode: the same text for every id
//! sequence, with special tokens kept or skipped, unknown ids, and bytes that are not UTF-8.

use std::path::Path;
use std::sync::LazyLock;

use proptest::prelude::*;
use serde_json::Value;
use switchyard_core::TokenId;

use super::exact_tests::{qwen3_json, small_json};
use crate::Tokenizer;

/// (table-driven, library) decoders of one file.
fn pair(path: &Path) -> (Tokenizer, Tokenizer) {
    let pair = (
        Tokenizer::from_hf_file(path).unwrap(),
        Tokenizer::from_hf_file_without_fast_path(path).unwrap(),
    );
    assert!(!pair.1.decodes_from_table());
    pair
}

fn written(json: &Value) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(json).unwrap()).unwrap();
    (dir, path)
}

/// The small tokenizer with added tokens whose text is outside the byte alphabet (a space, a
/// non-ASCII character): the library decodes those from their UTF-8 bytes.
fn small_with_odd_added_tokens() -> Value {
    let mut json = small_json();
    let added = json["added_tokens"].as_array_mut().unwrap();
    for (id, content, special) in [(302, "a b", false), (303, "✓ done", true)] {
        added.push(
            serde_json::json!({"id": id, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": special}),
        );
    }
    json
}

static QWEN3: LazyLock<(Tokenizer, Tokenizer)> = LazyLock::new(|| pair(&qwen3_json()));
static SMALL: LazyLock<(Tokenizer, Tokenizer)> = LazyLock::new(|| {
    let (_dir, path) = written(&small_with_odd_added_tokens());
    pair(&path)
});

fn assert_same((fast, reference): &(Tokenizer, Tokenizer), ids: &[TokenId]) {
    assert!(fast.decodes_from_table() || !reference.decodes_from_table());
    for skip in [false, true] {
        assert_eq!(
            fast.decode(ids, skip).unwrap(),
            reference.decode(ids, skip).unwrap(),
            "ids {ids:?}, skip_special_tokens {skip}"
        );
    }
}

#[test]
fn every_id_of_the_small_tokenizer_decodes_as_the_library_does() {
    // Each id alone (unknown ones included), then all of them at once.
    assert!(SMALL.0.decodes_from_table());
    let all: Vec<TokenId> = (0..320).collect();
    for id in &all {
        assert_same(&SMALL, std::slice::from_ref(id));
    }
    assert_same(&SMALL, &all);
    // Special and non-special added tokens between ordinary ones, outside the byte alphabet
    // (the library numbers added tokens itself: their ids are looked up).
    let id = |text| SMALL.1.token_to_id(text).unwrap();
    let (space, check) = (id("a b"), id("✓ done"));
    assert_same(
        &SMALL,
        &[104, id("<|im_start|>"), space, check, id("<think>"), 105],
    );
    assert_eq!(SMALL.0.decode(&[space, check], false).unwrap(), "a b✓ done");
    assert_eq!(SMALL.0.decode(&[space, check], true).unwrap(), "a b");
}

#[test]
fn a_decoder_other_than_byte_level_keeps_the_library_decode() {
    let mut json = small_json();
    json["decoder"] = serde_json::json!({"type": "Fuse"});
    let (_dir, path) = written(&json);
    let pair = pair(&path);
    assert!(!pair.0.decodes_from_table());
    // Fuse joins the token strings as they are: the byte alphabet's "Ġ" stays.
    assert_eq!(pair.0.decode(&[258], false).unwrap(), "Ġt");
    assert_same(&pair, &[258, 256, 300]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn qwen3_ids_decode_as_the_library_does(
        ids in prop::collection::vec(
            prop_oneof![
                8 => 0..151_643u32,
                // Added and special tokens, and ids past the vocabulary.
                2 => 151_640..151_700u32,
                // Byte tokens, whose runs make characters split across ids (and invalid UTF-8).
                2 => 0..256u32,
            ],
            0..24,
        )
    ) {
        prop_assert!(QWEN3.0.decodes_from_table());
        assert_same(&QWEN3, &ids);
    }
}
