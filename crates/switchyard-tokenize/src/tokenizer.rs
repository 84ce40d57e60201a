//! One tokenizer type over two backends: a Hugging Face `tokenizer.json` and the built-in
//! OpenAI BPE. A `tokenizer.json` of the common byte-level BPE shape also gets the exact fast
//! encoder of [`crate::fast`], and one whose decoder is `ByteLevel` decodes from a table of
//! every id's bytes built at load (`fast::ByteLevelDecoder`); everything else stays with
//! Hugging Face.

use std::collections::HashSet;
use std::path::Path;

use switchyard_core::TokenId;

use crate::builtin::{BuiltinBpe, BuiltinVocab};
use crate::error::TokenizeError;
use crate::fast::{ByteLevelDecoder, FastBpe};
use crate::session::seam::{SeamPolicy, SeamRules};

/// A loaded tokenizer. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Tokenizer {
    name: String,
    backend: Backend,
    /// Where incremental (session) tokenization may restart; see `session::seam`.
    seam_rules: SeamRules,
    /// The most bytes of text one token can stand for, where the pipeline makes that
    /// provable: a text of `n` bytes has at least `n / max_token_bytes` tokens.
    max_token_bytes: Option<usize>,
}

/// What [`Tokenizer::encode_with_starts_within`] found, and the bytes it tokenized to find it.
#[derive(Debug)]
pub(crate) struct Bounded {
    pub result: Result<(Vec<TokenId>, Vec<u32>), TokenizeError>,
    pub tokenized_bytes: usize,
}

/// Texts longer than this are tokenized in chunks cut at clean splits when a token limit is
/// given, so an over-long text stops being tokenized soon after the limit is passed.
const CHUNK_BYTES: usize = 64 << 10;
/// How far past a chunk's end a clean split is looked for before the rest is taken whole.
const CUT_SCAN_BYTES: usize = 1 << 20;

#[derive(Debug)]
enum Backend {
    HuggingFace {
        inner: Box<tokenizers::Tokenizer>,
        /// Ids of added tokens marked special, read once: the library clones its whole
        /// added-token table on every lookup.
        special_ids: HashSet<TokenId>,
        /// The fast encoder when the pipeline is one it reproduces exactly.
        fast: Option<Box<FastBpe>>,
        /// The table-driven decoder when the decoder is `ByteLevel`.
        fast_decode: Option<Box<ByteLevelDecoder>>,
    },
    Builtin(BuiltinBpe),
}

impl Tokenizer {
    /// The built-in `cl100k_base` BPE with ChatML special tokens; needs no files.
    pub fn builtin_cl100k() -> Self {
        Self::builtin(BuiltinVocab::Cl100k)
    }

    /// A built-in vocabulary with ChatML special tokens, encoding through the fast path.
    pub fn builtin(vocab: BuiltinVocab) -> Self {
        Self::with_builtin(BuiltinBpe::new(vocab, true))
    }

    /// A built-in vocabulary that always encodes through `tiktoken-rs`: the reference the
    /// fast path is checked and measured against.
    pub fn builtin_without_fast_path(vocab: BuiltinVocab) -> Self {
        Self::with_builtin(BuiltinBpe::new(vocab, false))
    }

    fn with_builtin(bpe: BuiltinBpe) -> Self {
        let seam_rules = bpe.seam_rules();
        Self {
            name: bpe.name().to_owned(),
            max_token_bytes: Some(bpe.max_token_bytes()),
            backend: Backend::Builtin(bpe),
            seam_rules,
        }
    }

    /// Loads a Hugging Face `tokenizer.json`, with the fast encoder when its pipeline is the
    /// common byte-level BPE shape (see [`uses_fast_path`](Self::uses_fast_path)) and the
    /// table-driven decoder when its decoder is `ByteLevel`.
    pub fn from_hf_file(path: &Path) -> Result<Self, TokenizeError> {
        Self::load_hf(path, true)
    }

    /// Loads a Hugging Face `tokenizer.json` that always encodes and decodes through the
    /// `tokenizers` crate: the reference the fast paths are checked and measured against.
    pub fn from_hf_file_without_fast_path(path: &Path) -> Result<Self, TokenizeError> {
        Self::load_hf(path, false)
    }

    /// Whether `encode` runs the fast encoder (texts it cannot take still go to Hugging Face).
    pub fn uses_fast_path(&self) -> bool {
        match &self.backend {
            Backend::HuggingFace { fast, .. } => fast.is_some(),
            Backend::Builtin(bpe) => bpe.uses_fast_path(),
        }
    }

    /// Whether `decode` runs the table-driven decoder (a `ByteLevel` decoder, loaded with the
    /// fast paths).
    pub fn decodes_from_table(&self) -> bool {
        matches!(
            &self.backend,
            Backend::HuggingFace {
                fast_decode: Some(_),
                ..
            }
        )
    }

    fn load_hf(path: &Path, try_fast: bool) -> Result<Self, TokenizeError> {
        let bytes = std::fs::read(path).map_err(|source| TokenizeError::Io {
            path: path.to_owned(),
            source,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|source| {
            TokenizeError::InvalidTokenizer {
                path: path.to_owned(),
                source,
            }
        })?;
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let fast = if try_fast {
            match FastBpe::from_json(&bytes, &|content| inner.token_to_id(content)) {
                Ok(fast) => Some(Box::new(fast)),
                Err(why) => {
                    tracing::info!(tokenizer = %path.display(), %why, "fast tokenizer path not used");
                    None
                }
            }
        } else {
            None
        };
        let fast_decode = if try_fast {
            ByteLevelDecoder::new(&inner).map(Box::new)
        } else {
            None
        };
        let seam_rules = crate::session::hf_rules::seam_rules(&inner);
        let max_token_bytes =
            crate::session::hf_rules::max_token_bytes(&inner, seam_rules.policy());
        Ok(Self {
            name: path.display().to_string(),
            seam_rules,
            max_token_bytes,
            backend: Backend::HuggingFace {
                inner: Box::new(inner),
                special_ids,
                fast,
                fast_decode,
            },
        })
    }

    /// Where this tokenizer came from: a file path, `builtin:cl100k` or `builtin:o200k`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokenizes `text` without adding any special token of the tokenizer's own (the chat
    /// template writes those). Special tokens spelled out in the text, such as
    /// `<|im_start|>`, become their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>, TokenizeError> {
        match &self.backend {
            Backend::HuggingFace {
                inner: tok, fast, ..
            } => match fast.as_ref().and_then(|fast| fast.encode(text)) {
                Some(ids) => Ok(ids),
                None => tok
                    .encode_fast(text, false)
                    .map(|enc| enc.get_ids().to_vec())
                    .map_err(|source| TokenizeError::Encode { source }),
            },
            Backend::Builtin(bpe) => Ok(bpe.encode(text)),
        }
    }

    /// Tokenizes as [`encode`](Self::encode) and also returns the byte offset in `text` at
    /// which each token starts (tokens inside one multi-byte character share its start).
    pub(crate) fn encode_with_starts(
        &self,
        text: &str,
    ) -> Result<(Vec<TokenId>, Vec<u32>), TokenizeError> {
        match &self.backend {
            Backend::HuggingFace {
                inner: tok, fast, ..
            } => {
                if let Some(result) = fast.as_ref().and_then(|f| f.encode_with_starts(text)) {
                    return result;
                }
                let enc = tok
                    .encode(text, false)
                    .map_err(|source| TokenizeError::Encode { source })?;
                let starts = enc
                    .get_offsets()
                    .iter()
                    .map(|&(start, _)| offset_u32(start))
                    .collect::<Result<_, _>>()?;
                Ok((enc.get_ids().to_vec(), starts))
            }
            Backend::Builtin(bpe) => bpe.encode_with_starts(text),
        }
    }

    /// Tokenizes as [`encode`](Self::encode) unless the text has more than `max` tokens, in
    /// which case it fails with [`TokenizeError::TooManyTokens`] after as little work as it
    /// can: at once when the byte length alone proves it (see [`min_tokens`](Self::min_tokens)),
    /// otherwise soon after the `max`-th token, tokenizing long texts chunk by chunk.
    pub fn encode_within(&self, text: &str, max: usize) -> Result<Vec<TokenId>, TokenizeError> {
        if text.len() > CHUNK_BYTES && self.seam_policy() != SeamPolicy::Disabled {
            return self
                .encode_with_starts_within(text, max)
                .result
                .map(|(ids, _)| ids);
        }
        let at_least = self.min_tokens(text.len());
        if at_least > max {
            return Err(TokenizeError::TooManyTokens { at_least, max });
        }
        let ids = self.encode(text)?;
        if ids.len() > max {
            return Err(TokenizeError::TooManyTokens {
                at_least: ids.len(),
                max,
            });
        }
        Ok(ids)
    }

    /// The fewest tokens a text of `bytes` bytes can have, from the longest text one token
    /// stands for; 0 when the tokenizer's pipeline gives no such bound.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        self.max_token_bytes
            .filter(|&b| b > 0)
            .map_or(0, |b| bytes.div_ceil(b))
    }

    /// [`encode_with_starts`](Self::encode_with_starts) with the limit of
    /// [`encode_within`](Self::encode_within), and how many bytes it tokenized to decide.
    ///
    /// Chunks are cut only at clean splits (see `session::seam`), where tokenizing the two
    /// sides apart gives exactly the tokens of the whole, so the result of a text that fits
    /// is a full tokenization, and the count so far is a true lower bound when it stops.
    pub(crate) fn encode_with_starts_within(&self, text: &str, max: usize) -> Bounded {
        let mut tokenized_bytes = 0;
        let result = self.encode_chunks(text, max, &mut tokenized_bytes);
        Bounded {
            result,
            tokenized_bytes,
        }
    }

    fn encode_chunks(
        &self,
        text: &str,
        max: usize,
        tokenized_bytes: &mut usize,
    ) -> Result<(Vec<TokenId>, Vec<u32>), TokenizeError> {
        let too_many = |at_least| TokenizeError::TooManyTokens { at_least, max };
        let at_least = self.min_tokens(text.len());
        if at_least > max {
            return Err(too_many(at_least));
        }
        let bytes = text.as_bytes();
        let mut ids = Vec::new();
        let mut starts = Vec::new();
        let mut from = 0;
        while from < text.len() {
            let to = self.next_cut(bytes, from + CHUNK_BYTES);
            let chunk = text
                .get(from..to)
                .ok_or(TokenizeError::TextTooLong { bytes: to })?;
            let (chunk_ids, chunk_starts) = self.encode_with_starts(chunk)?;
            *tokenized_bytes += chunk.len();
            let shift = offset_u32(from)?;
            ids.extend_from_slice(&chunk_ids);
            for start in chunk_starts {
                starts.push(
                    start
                        .checked_add(shift)
                        .ok_or(TokenizeError::TextTooLong { bytes: text.len() })?,
                );
            }
            if ids.len() > max {
                return Err(too_many(ids.len()));
            }
            from = to;
        }
        Ok((ids, starts))
    }

    /// The first clean split at or after `target`, or the end of the text when there is none
    /// nearby (or the tokenizer allows none).
    pub(crate) fn next_cut(&self, text: &[u8], target: usize) -> usize {
        if target >= text.len() || self.seam_policy() == SeamPolicy::Disabled {
            return text.len();
        }
        let scan_end = target.saturating_add(CUT_SCAN_BYTES).min(text.len());
        (target..scan_end)
            .find(|&r| self.seam_rules.clean_split(text, r))
            .unwrap_or(text.len())
    }

    pub(crate) fn seam_rules(&self) -> &SeamRules {
        &self.seam_rules
    }

    /// How far incremental tokenization can narrow a seam with this tokenizer.
    pub(crate) fn seam_policy(&self) -> SeamPolicy {
        self.seam_rules.policy()
    }

    /// Turns ids back into text. Bytes that are not valid UTF-8 become U+FFFD; ids the
    /// vocabulary does not know decode to nothing, as Hugging Face tokenizers do.
    pub fn decode(
        &self,
        ids: &[TokenId],
        skip_special_tokens: bool,
    ) -> Result<String, TokenizeError> {
        if let Backend::HuggingFace {
            inner: tok,
            fast_decode: None,
            ..
        } = &self.backend
        {
            return tok
                .decode(ids, skip_special_tokens)
                .map_err(|source| TokenizeError::Decode { source });
        }
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        self.extend_decoded_bytes(&mut bytes, ids, skip_special_tokens);
        Ok(match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(err) => String::from_utf8_lossy(err.as_bytes()).into_owned(),
        })
    }

    /// Whether decoding is the UTF-8 (lossy) reading of the tokens' bytes one after another,
    /// so [`extend_decoded_bytes`](Self::extend_decoded_bytes) appends them.
    pub fn decodes_by_bytes(&self) -> bool {
        matches!(
            &self.backend,
            Backend::HuggingFace {
                fast_decode: Some(_),
                ..
            } | Backend::Builtin(_)
        )
    }

    /// Appends the bytes `ids` decode to and returns true, for a tokenizer whose decode is the
    /// UTF-8 (lossy) reading of its tokens' bytes one after another: the built-in BPE and a
    /// `ByteLevel` decoder read from its table. Returns false, appending nothing, for any
    /// other decoder (SentencePiece's `Metaspace` drops a leading space: a token's text
    /// depends on its neighbours).
    pub fn extend_decoded_bytes(
        &self,
        bytes: &mut Vec<u8>,
        ids: &[TokenId],
        skip_special_tokens: bool,
    ) -> bool {
        match &self.backend {
            Backend::HuggingFace {
                fast_decode: Some(fast),
                ..
            } => fast.extend_bytes(bytes, ids, skip_special_tokens),
            Backend::HuggingFace { .. } => return false,
            Backend::Builtin(bpe) => bpe.extend_bytes(bytes, ids, skip_special_tokens),
        }
        true
    }

    /// Number of ids, special tokens included (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::HuggingFace { inner: tok, .. } => tok.get_vocab_size(true),
            Backend::Builtin(bpe) => bpe.vocab_size(),
        }
    }

    /// The id of a token given by its text (`"<|im_end|>"`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        match &self.backend {
            Backend::HuggingFace { inner: tok, .. } => tok.token_to_id(token),
            Backend::Builtin(bpe) => bpe.special_id(token),
        }
    }

    /// Whether `id` is a special (control) token, e.g. for counting or filtering.
    pub fn is_special(&self, id: TokenId) -> bool {
        match &self.backend {
            Backend::HuggingFace { special_ids, .. } => special_ids.contains(&id),
            Backend::Builtin(bpe) => bpe.special_text(id).is_some(),
        }
    }
}

/// Offsets are kept as `u32`: a prompt of 4 GiB is refused long before it gets here.
pub(crate) fn offset_u32(offset: usize) -> Result<u32, TokenizeError> {
    u32::try_from(offset).map_err(|_| TokenizeError::TextTooLong { bytes: offset })
}
