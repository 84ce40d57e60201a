//! One tokenizer type over two backends: a Hugging Face `tokenizer.json` and the built-in
//! OpenAI BPE.

use std::collections::HashSet;
use std::path::Path;

use switchyard_core::TokenId;

use crate::builtin::BuiltinBpe;
use crate::error::TokenizeError;

/// A loaded tokenizer. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Tokenizer {
    name: String,
    backend: Backend,
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
        Self {
            name: crate::builtin::BUILTIN_TOKENIZER_NAME.to_owned(),
            backend: Backend::Builtin(BuiltinBpe::cl100k()),
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
        Ok(Self {
            name: path.display().to_string(),
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
