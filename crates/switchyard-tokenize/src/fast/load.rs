//! Deciding from a `tokenizer.json` whether [`FastBpe`] reproduces its pipeline exactly, and
//! building it when it does.

use std::collections::HashMap;

use aho_corasick::{AhoCorasickBuilder, MatchKind};
use serde_json::Value;
use switchyard_core::TokenId;

use super::FastBpe;
use super::bpe::Merges;
use super::pretokenize::{self, Pattern};
use super::whole::WholePieces;

/// Why a tokenizer keeps the Hugging Face pipeline: the first stage that differs from the
/// shape [`FastBpe`] implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotRecognised(pub &'static str);

impl std::fmt::Display for NotRecognised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

fn need(ok: bool, why: &'static str) -> Result<(), NotRecognised> {
    if ok { Ok(()) } else { Err(NotRecognised(why)) }
}

/// `value` is absent, null, or the given string.
fn absent_or(value: Option<&Value>, allowed: &str) -> bool {
    match value {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s == allowed,
        Some(_) => false,
    }
}

fn flag(value: &Value, key: &str) -> Option<bool> {
    match value.get(key) {
        None | Some(Value::Null) => Some(false),
        Some(v) => v.as_bool(),
    }
}

impl FastBpe {
    /// Builds the fast path for a `tokenizer.json`, or says which stage it does not cover.
    /// `added_id` gives the id the loaded Hugging Face tokenizer assigned to an added token's
    /// content: `tokenizers` does not take the file's `id` field at its word.
    pub(crate) fn from_json(
        json: &[u8],
        added_id: &dyn Fn(&str) -> Option<TokenId>,
    ) -> Result<Self, NotRecognised> {
        let root: Value =
            serde_json::from_slice(json).map_err(|_| NotRecognised("not a JSON object"))?;
        need(pretokenize::tables_ready(), "unicode tables unavailable")?;
        let nfc = match root.get("normalizer") {
            None | Some(Value::Null) => false,
            Some(n) if n.get("type").and_then(Value::as_str) == Some("NFC") => true,
            Some(_) => return Err(NotRecognised("normalizer other than NFC")),
        };
        let pattern = pre_tokenizer(root.get("pre_tokenizer"))?;
        post_processor(root.get("post_processor"))?;
        let model = root.get("model").ok_or(NotRecognised("no model"))?;
        need(
            model.get("type").and_then(Value::as_str) == Some("BPE"),
            "model is not BPE",
        )?;
        need(
            matches!(model.get("dropout"), None | Some(Value::Null)),
            "BPE dropout",
        )?;
        need(flag(model, "byte_fallback") == Some(false), "byte fallback")?;
        need(
            absent_or(model.get("continuing_subword_prefix"), "")
                && absent_or(model.get("end_of_word_suffix"), ""),
            "subword prefix or suffix",
        )?;
        let ignore_merges = flag(model, "ignore_merges").ok_or(NotRecognised("ignore_merges"))?;
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or(NotRecognised("no vocab"))?;
        let mut by_text: HashMap<&str, TokenId> = HashMap::with_capacity(vocab.len());
        for (text, id) in vocab {
            let id = id
                .as_u64()
                .and_then(|id| TokenId::try_from(id).ok())
                .ok_or(NotRecognised("vocab id"))?;
            by_text.insert(text.as_str(), id);
        }
        let byte_chars = byte_chars();
        let mut byte_ids = [0; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            byte_ids[b] = *by_text
                .get(c.encode_utf8(&mut [0; 4]) as &str)
                .ok_or(NotRecognised("a byte missing from the vocab"))?;
        }
        let merges = model
            .get("merges")
            .and_then(Value::as_array)
            .ok_or(NotRecognised("no merges"))?;
        let mut pairs = Vec::with_capacity(merges.len());
        let mut joined = String::new();
        for merge in merges {
            let (left, right) = merge_pair(merge).ok_or(NotRecognised("merge format"))?;
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let id = |s: &str| by_text.get(s).copied();
            match (id(left), id(right), id(&joined)) {
                (Some(l), Some(r), Some(m)) => pairs.push((l, r, m)),
                _ => return Err(NotRecognised("a merge outside the vocab")),
            }
        }
        let merges = Merges::new(byte_ids, pairs).ok_or(NotRecognised("a merge listed twice"))?;
        let unicode_to_byte: HashMap<char, u8> = byte_chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut scratch = Vec::new();
        let mut ids = Vec::new();
        let whole_pieces: WholePieces = by_text
            .iter()
            .filter_map(|(text, &id)| {
                // A token that is not byte-level text can never equal a piece's bytes.
                let bytes: Vec<u8> = text
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<_>>()?;
                if !ignore_merges {
                    ids.clear();
                    merges.encode(&bytes, &mut ids, None, &mut scratch);
                    if ids != [id] {
                        return None;
                    }
                }
                Some((bytes, id))
            })
            .collect();
        let added = added_tokens(&root, added_id)?;
        Ok(Self {
            pattern,
            nfc,
            merges,
            whole_pieces,
            added,
        })
    }
}

/// `Sequence[Split(known regex, Isolated), ByteLevel(no prefix space, no regex)]`, or a bare
/// `ByteLevel(no prefix space, regex)`, which splits with GPT-2's pattern itself.
fn pre_tokenizer(value: Option<&Value>) -> Result<Pattern, NotRecognised> {
    let shape = NotRecognised("pre-tokenizer is not Split(known pattern) + ByteLevel");
    let value = value.ok_or(shape)?;
    if value.get("type").and_then(Value::as_str) == Some("ByteLevel") {
        // `trim_offsets` only matters to a post-processor; `use_regex` defaults to true.
        need(
            flag(value, "add_prefix_space") == Some(false)
                && matches!(value.get("use_regex"), None | Some(Value::Bool(true))),
            "ByteLevel pre-tokenizer with a prefix space or without its regex",
        )?;
        return Ok(Pattern::Gpt2);
    }
    need(
        value.get("type").and_then(Value::as_str) == Some("Sequence"),
        shape.0,
    )?;
    let steps = value
        .get("pretokenizers")
        .and_then(Value::as_array)
        .ok_or(shape)?;
    let [split, byte_level] = steps.as_slice() else {
        return Err(shape);
    };
    need(
        split.get("type").and_then(Value::as_str) == Some("Split"),
        shape.0,
    )?;
    need(
        split.get("behavior").and_then(Value::as_str) == Some("Isolated"),
        shape.0,
    )?;
    need(flag(split, "invert") == Some(false), shape.0)?;
    let regex = split
        .get("pattern")
        .and_then(|p| p.get("Regex"))
        .and_then(Value::as_str)
        .ok_or(shape)?;
    let pattern = Pattern::recognise(regex).ok_or(NotRecognised("split regex not recognised"))?;
    need(
        byte_level.get("type").and_then(Value::as_str) == Some("ByteLevel")
            && flag(byte_level, "add_prefix_space") == Some(false)
            && flag(byte_level, "use_regex") == Some(false),
        shape.0,
    )?;
    Ok(pattern)
}

/// None, ByteLevel without offset trimming, TemplateProcessing (Llama 3), or a Sequence of
/// these: each leaves ids and offsets as they are, since `encode` adds no special tokens.
fn post_processor(value: Option<&Value>) -> Result<(), NotRecognised> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(());
    };
    match value.get("type").and_then(Value::as_str) {
        Some("ByteLevel") if flag(value, "trim_offsets") == Some(false) => Ok(()),
        Some("TemplateProcessing") => Ok(()),
        Some("Sequence") => value
            .get("processors")
            .and_then(Value::as_array)
            .ok_or(NotRecognised("post-processor"))?
            .iter()
            .try_for_each(|p| post_processor(Some(p))),
        _ => Err(NotRecognised("post-processor")),
    }
}

/// A merge as `"a b"` or `["a", "b"]`.
fn merge_pair(merge: &Value) -> Option<(&str, &str)> {
    match merge {
        Value::String(s) => {
            let (left, right) = s.split_once(' ')?;
            (!right.contains(' ')).then_some((left, right))
        }
        Value::Array(parts) => match parts.as_slice() {
            [Value::String(left), Value::String(right)] => Some((left, right)),
            _ => None,
        },
        _ => None,
    }
}

/// Added tokens, all matched on the raw text (no normalization, strip or single-word
/// rules), found leftmost-longest as `tokenizers` finds them.
fn added_tokens(
    root: &Value,
    added_id: &dyn Fn(&str) -> Option<TokenId>,
) -> Result<Option<super::AddedTokens>, NotRecognised> {
    let tokens = match root.get("added_tokens") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tokens)) => tokens,
        Some(_) => return Err(NotRecognised("added tokens")),
    };
    let mut contents: Vec<&str> = Vec::with_capacity(tokens.len());
    let mut ids = Vec::with_capacity(tokens.len());
    for token in tokens {
        for rule in ["single_word", "lstrip", "rstrip", "normalized"] {
            need(
                flag(token, rule) == Some(false),
                "an added token with normalized/strip/single-word rules",
            )?;
        }
        let content = token
            .get("content")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .ok_or(NotRecognised("added token content"))?;
        let id = added_id(content).ok_or(NotRecognised("added token without an id"))?;
        if contents.contains(&content) {
            return Err(NotRecognised("an added token listed twice"));
        }
        contents.push(content);
        ids.push(id);
    }
    if contents.is_empty() {
        return Ok(None);
    }
    let automaton = AhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build(&contents)
        .map_err(|_| NotRecognised("added tokens automaton"))?;
    Ok(Some((automaton, ids)))
}

/// GPT-2's byte-to-character table: the character that stands for each byte in the vocab.
pub(super) fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        let cp = if printable {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        chars[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    chars
}
