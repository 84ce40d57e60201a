//! One tokenizer type over two backends: a Hugging Face `tokenizer.json` and the built-in
//! OpenAI BPE.

use std::collections::HashSet;
use std::path::Path;

use switchyard_core::TokenId;

use crate::builtin::BuiltinBpe;
use crate::error::TokenizeError;
use crate::session::seam::{SeamPolicy, SeamRules};

/// A loaded tokenizer. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Tokenizer {
    name: String,
    backend: Backend,
    /// Where incremental (session) tokenization may restart; see `session::seam`.
    seam_rules: SeamRules,
}

#[derive(Debug)]
enum Backend {
    HuggingFace {
        inner: Box<tokenizers::Tokenizer>,
        /// Ids of added tokens marked special, read once: the library clones its whole
        /// added-token table on every lookup.
        special_ids: HashSet<TokenId>,
    },
    Builtin(BuiltinBpe),
}

impl Tokenizer {
    /// The built-in `cl100k_base` BPE with ChatML special tokens; needs no files.
    pub fn builtin_cl100k() -> Self {
        let bpe = BuiltinBpe::cl100k();
        let seam_rules = bpe.seam_rules();
        Self {
            name: crate::builtin::BUILTIN_TOKENIZER_NAME.to_owned(),
            backend: Backend::Builtin(bpe),
            seam_rules,
        }
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_hf_file(path: &Path) -> Result<Self, TokenizeError> {
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
        let seam_rules = crate::session::hf_rules::seam_rules(&inner);
        Ok(Self {
            name: path.display().to_string(),
            seam_rules,
            backend: Backend::HuggingFace {
                inner: Box::new(inner),
                special_ids,
            },
        })
    }

    /// Where this tokenizer came from: a file path or `builtin:cl100k`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokenizes `text` without adding any special token of the tokenizer's own (the chat
    /// template writes those). Special tokens spelled out in the text, such as
    /// `<|im_start|>`, become their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>, TokenizeError> {
        match &self.backend {
            Backend::HuggingFace { inner: tok, .. } => tok
                .encode_fast(text, false)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|source| TokenizeError::Encode { source }),
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
            Backend::HuggingFace { inner: tok, .. } => {
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
        match &self.backend {
            Backend::HuggingFace { inner: tok, .. } => tok
                .decode(ids, skip_special_tokens)
                .map_err(|source| TokenizeError::Decode { source }),
            Backend::Builtin(bpe) => Ok(bpe.decode(ids, skip_special_tokens)),
        }
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
