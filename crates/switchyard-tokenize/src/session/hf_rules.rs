//! Which [`SeamPolicy`] a Hugging Face `tokenizer.json` allows, read from its pipeline.
//!
//! Word boundaries are trusted only for pipelines whose every layer is understood: NFC or
//! no normaliser, the GPT-4 family split regex (exact text, Qwen's or Llama 3's) or GPT-2's
//! (a bare `ByteLevel` with its regex), byte-level BPE without dropout, plain added tokens. Added-token starts alone are trusted when the
//! added tokens are plain and the layers below work on each segment alone, whatever its
//! position (no `Metaspace`, whose "prepend to the first piece" depends on position).
//! Anything else, or truncation, turns incremental tokenization off.

use serde_json::Value as Json;
use tokenizers::models::ModelWrapper;

use super::seam::{SeamPolicy, SeamRules};

/// Qwen2 / Qwen2.5 / Qwen3: one digit per word.
const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 (cl100k's regex): digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub(crate) fn seam_rules(tok: &tokenizers::Tokenizer) -> SeamRules {
    let added = tok.get_added_tokens_decoder();
    let plain = added
        .values()
        .all(|t| !t.lstrip && !t.rstrip && !t.single_word);
    let all_raw = added.values().all(|t| !t.normalized);
    let normalizer = tok
        .get_normalizer()
        .and_then(|n| serde_json::to_value(n).ok());
    let pre_tokenizer = tok
        .get_pre_tokenizer()
        .and_then(|p| serde_json::to_value(p).ok());
    let bpe_without_dropout =
        matches!(tok.get_model(), ModelWrapper::BPE(bpe) if bpe.dropout.is_none());
    let policy = if tok.get_truncation().is_some() || !plain {
        SeamPolicy::Disabled
    } else if let (true, true, Some(digit_runs)) = (
        all_raw && bpe_without_dropout,
        normalizer.as_ref().is_none_or(is_nfc),
        pre_tokenizer.as_ref().and_then(digit_runs_of_split),
    ) {
        SeamPolicy::Words {
            digit_runs,
            contractions_attach: false,
        }
    } else if pre_tokenizer
        .as_ref()
        .is_some_and(|p| p.to_string().contains("Metaspace"))
    {
        SeamPolicy::Disabled
    } else {
        SeamPolicy::AddedTokens
    };
    // Only added tokens matched on the raw text cut it into segments.
    SeamRules::new(
        policy,
        added
            .into_iter()
            .filter(|(_, t)| !t.normalized)
            .map(|(id, t)| (t.content, id)),
    )
}

/// The most bytes of raw text one token can stand for, when the pipeline makes that provable:
/// the [`SeamPolicy::Words`] pipelines (byte-level BPE, plain added tokens matched on the raw
/// text, NFC or no normaliser). A byte-level vocabulary entry spells each byte it covers with
/// one character of one or two bytes, and an added token covers exactly its content, so the
/// longest entry bounds the bytes per token of the normalised text. NFC can shorten text
/// (three Hangul jamo, 9 bytes, compose to one 3-byte syllable), so with NFC the bound is
/// four times that. `None` for any other pipeline: a whitespace-stripping or regex-replacing
/// step could make any amount of text into few tokens.
pub(crate) fn max_token_bytes(tok: &tokenizers::Tokenizer, policy: SeamPolicy) -> Option<usize> {
    if !matches!(policy, SeamPolicy::Words { .. }) {
        return None;
    }
    let longest = tok.get_vocab(true).keys().map(String::len).max()?;
    let nfc = tok
        .get_normalizer()
        .and_then(|n| serde_json::to_value(n).ok())
        .is_some_and(|n| is_nfc(&n));
    Some(if nfc { longest * 4 } else { longest })
}

fn is_nfc(normalizer: &Json) -> bool {
    normalizer.get("type").and_then(Json::as_str) == Some("NFC")
}

/// `Sequence[Split(regex, Isolated), ByteLevel(no prefix space, no regex)]` with a known
/// regex, or a bare `ByteLevel(no prefix space)` with GPT-2's: whether digits go in runs
/// (judged as [`SeamPolicy::Words`] says).
fn digit_runs_of_split(pre: &Json) -> Option<bool> {
    let is = |v: &Json, key: &str, want: Json| v.get(key) == Some(&want);
    let steps = match pre.get("type")?.as_str()? {
        "Sequence" => pre.get("pretokenizers")?.as_array()?,
        "ByteLevel" => {
            let gpt2 = is(pre, "add_prefix_space", false.into())
                && pre.get("use_regex").is_none_or(|r| *r == Json::Bool(true));
            return gpt2.then_some(true);
        }
        _ => return None,
    };
    let [split, byte_level] = steps.as_slice() else {
        return None;
    };
    let split_ok = is(split, "type", "Split".into())
        && is(split, "behavior", "Isolated".into())
        && is(split, "invert", false.into());
    let byte_level_ok = is(byte_level, "type", "ByteLevel".into())
        && is(byte_level, "add_prefix_space", false.into())
        && is(byte_level, "use_regex", false.into());
    if !split_ok || !byte_level_ok {
        return None;
    }
    match split.get("pattern")?.get("Regex")?.as_str()? {
        QWEN_SPLIT => Some(false),
        LLAMA3_SPLIT | crate::fast::GPT2_REGEX => Some(true),
        _ => None,
    }
}
