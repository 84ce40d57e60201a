use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use switchyard_tokenize::ModelDir;

/// The directory holding Qwen3's tokenizer files; panics with the fix when it is missing.
pub fn qwen3_dir() -> PathBuf {
    let root = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/switchyard/test-models"));
    let dir = root.join("qwen3");
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "Qwen3 test tokenizer missing in {}: run crates/switchyard-tokenize/fetch-test-models.sh \
         (or set SWITCHYARD_TEST_MODELS to a directory holding qwen3/)",
        dir.display()
    );
    dir
}

/// Qwen3 loaded once per test binary (the tokenizer.json is 11 MB).
pub fn qwen3() -> Arc<ModelDir> {
    static MODEL: OnceLock<Arc<ModelDir>> = OnceLock::new();
    MODEL
        .get_or_init(|| Arc::new(ModelDir::load(&qwen3_dir()).unwrap_or_else(|e| panic!("{e}"))))
        .clone()
}

pub fn builtin() -> Arc<ModelDir> {
    static MODEL: OnceLock<Arc<ModelDir>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(ModelDir::builtin())).clone()
}

pub fn builtin_o200k() -> Arc<ModelDir> {
    static MODEL: OnceLock<Arc<ModelDir>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            Arc::new(ModelDir::builtin_vocab(
                switchyard_tokenize::builtin::BuiltinVocab::O200k,
            ))
        })
        .clone()
}

pub fn fixtures() -> serde_json::Value {
    let text = include_str!("../fixtures/qwen3.json");
    serde_json::from_str(text).unwrap_or_else(|e| panic!("qwen3.json: {e}"))
}

/// Qwen3's vocabulary behind the pipeline `tokenizers`' BPE trainer writes by default (the
/// peers harness's tokenizer): a bare `ByteLevel` pre-tokenizer splitting with GPT-2's regex,
/// no normalizer. Loaded once per test binary from a directory that lives as long.
pub fn gpt2_shaped() -> Arc<ModelDir> {
    static MODEL: OnceLock<(tempfile::TempDir, Arc<ModelDir>)> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let src = qwen3_dir();
            let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
            let raw = std::fs::read(src.join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}"));
            let mut json: serde_json::Value =
                serde_json::from_slice(&raw).unwrap_or_else(|e| panic!("{e}"));
            json["normalizer"] = serde_json::Value::Null;
            json["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel",
                "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
            let out = serde_json::to_vec(&json).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(dir.path().join("tokenizer.json"), out)
                .unwrap_or_else(|e| panic!("{e}"));
            std::fs::copy(
                src.join("tokenizer_config.json"),
                dir.path().join("tokenizer_config.json"),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let model = ModelDir::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
            assert!(model.tokenizer().uses_fast_path());
            (dir, Arc::new(model))
        })
        .1
        .clone()
}
