//! The built-in OpenAI vocabularies, compiled into `tiktoken-rs`: `cl100k_base` (the offline
//! default) and `o200k_base` (GPT-4o, GPT-4.1, the o-series), each with the ChatML special
//! tokens and a ChatML chat template.
//!
//! `cl100k_base` is the default rather than `o200k_base`: its rank table is half the size
//! (100k vs 200k entries, so half the start-up parse and memory). The ChatML ids are the ones
//! OpenAI's tiktoken documents for cl100k (100264/100265) and the ones GPT-4o clients pass to
//! tiktoken for o200k (200264/200265).
//!
//! Text is encoded by the fast path (`crate::fast`, built from the rank table at first use);
//! `tiktoken-rs` itself decodes, and encodes for [`crate::Tokenizer::builtin_without_fast_path`],
//! the reference the fast path is checked and measured against.

use std::collections::HashMap;
use std::sync::OnceLock;

use switchyard_core::TokenId;
use tiktoken_rs::CoreBPE;

use crate::error::TokenizeError;
use crate::fast::{FastBpe, NotRecognised, O200K_REGEX, Pattern};
use crate::session::seam::{SeamPolicy, SeamRules};
use crate::tokenizer::offset_u32;

/// Name of the built-in tokenizer (the default one, `cl100k_base`).
pub const BUILTIN_TOKENIZER_NAME: &str = "builtin:cl100k";
/// Name of the built-in simulated model that uses it.
pub const BUILTIN_MODEL_NAME: &str = "sim-8b";
/// Context length announced for the built-in model.
pub const BUILTIN_CONTEXT_LENGTH: u64 = 131_072;

/// ChatML: `<|im_start|>role\ncontent<|im_end|>\n` per message, then the generation prompt.
/// Text parts are already flattened to a string by the caller (see `chat`).
pub const BUILTIN_CHAT_TEMPLATE: &str = "\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call these functions:\\n' }}
{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// `cl100k_base` special tokens plus ChatML's, at the ids tiktoken's documentation gives.
const CL100K_SPECIAL_TOKENS: [(&str, TokenId); 8] = [
    ("<|endoftext|>", 100_257),
    ("<|fim_prefix|>", 100_258),
    ("<|fim_middle|>", 100_259),
    ("<|fim_suffix|>", 100_260),
    ("<|im_start|>", 100_264),
    ("<|im_end|>", 100_265),
    ("<|im_sep|>", 100_266),
    ("<|endofprompt|>", 100_276),
];

/// `o200k_base` special tokens (tiktoken's) plus ChatML's at GPT-4o's ids.
const O200K_SPECIAL_TOKENS: [(&str, TokenId); 5] = [
    ("<|endoftext|>", 199_999),
    ("<|endofprompt|>", 200_018),
    ("<|im_start|>", 200_264),
    ("<|im_end|>", 200_265),
    ("<|im_sep|>", 200_266),
];

/// Ids that end generation for the built-in model (`cl100k_base`).
pub const BUILTIN_EOS_TOKEN_IDS: [TokenId; 2] = [100_265, 100_257];

/// A vocabulary compiled into the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltinVocab {
    Cl100k,
    O200k,
}

impl BuiltinVocab {
    /// Every built-in vocabulary.
    pub const ALL: [Self; 2] = [Self::Cl100k, Self::O200k];

    /// The vocabulary a tokenizer setting names: `builtin` or `builtin:cl100k`, or
    /// `builtin:o200k`; `None` for anything else (a model directory).
    pub fn from_spec(spec: &str) -> Option<Self> {
        match spec {
            "builtin" | "builtin:cl100k" => Some(Self::Cl100k),
            "builtin:o200k" => Some(Self::O200k),
            _ => None,
        }
    }

    /// The tokenizer's name, as a setting spells it: `builtin:cl100k`, `builtin:o200k`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cl100k => BUILTIN_TOKENIZER_NAME,
            Self::O200k => "builtin:o200k",
        }
    }

    /// Ids that end generation: `<|im_end|>`, then `<|endoftext|>`.
    pub fn eos_token_ids(self) -> [TokenId; 2] {
        match self {
            Self::Cl100k => BUILTIN_EOS_TOKEN_IDS,
            Self::O200k => [200_265, 199_999],
        }
    }

    fn core(self) -> &'static CoreBPE {
        match self {
            Self::Cl100k => tiktoken_rs::cl100k_base_singleton(),
            Self::O200k => tiktoken_rs::o200k_base_singleton(),
        }
    }

    fn special_tokens(self) -> &'static [(&'static str, TokenId)] {
        match self {
            Self::Cl100k => &CL100K_SPECIAL_TOKENS,
            Self::O200k => &O200K_SPECIAL_TOKENS,
        }
    }

    /// Ordinary tokens have ids below this (the first special token's).
    fn ordinary_end(self) -> TokenId {
        match self {
            Self::Cl100k => 100_257,
            Self::O200k => 199_999,
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Cl100k => 0,
            Self::O200k => 1,
        }
    }

    /// tiktoken's split pattern for this vocabulary, as the fast path runs it; `None` if
    /// `tiktoken-rs` ever publishes an o200k pattern other than the one implemented.
    pub(crate) fn pattern(self) -> Option<Pattern> {
        match self {
            Self::Cl100k => Some(Pattern::tiktoken_cl100k()),
            Self::O200k => {
                (tiktoken_rs::O200K_BASE_PAT_STR == O200K_REGEX).then_some(Pattern::O200k)
            }
        }
    }

    /// The bytes of every ordinary token with its id (= its rank), read from the rank table.
    pub(crate) fn ordinary_tokens(self) -> Vec<(Vec<u8>, TokenId)> {
        let bpe = self.core();
        (0..self.ordinary_end())
            .filter_map(|id| {
                let bytes = bpe.decode_bytes(std::slice::from_ref(&id)).ok()?;
                Some((bytes, id))
            })
            .collect()
    }
}

/// A built-in vocabulary with its special tokens handled here, so ChatML's tokens (absent
/// from tiktoken-rs's tables) are single ids like the others.
pub(crate) struct BuiltinBpe {
    vocab: BuiltinVocab,
    bpe: &'static CoreBPE,
    special_by_id: HashMap<TokenId, &'static str>,
    /// The fast encoder, `None` for the reference or when it could not be built.
    fast: Option<&'static FastBpe>,
}

impl std::fmt::Debug for BuiltinBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltinBpe")
            .field("name", &self.vocab.name())
            .field("fast", &self.fast.is_some())
            .finish()
    }
}

/// The fast encoder of each vocabulary, built once per process at first use.
fn fast_bpe(vocab: BuiltinVocab) -> Option<&'static FastBpe> {
    static FAST: [OnceLock<Option<FastBpe>>; 2] = [OnceLock::new(), OnceLock::new()];
    FAST[vocab.index()]
        .get_or_init(|| {
            let tokens = vocab.ordinary_tokens();
            let built = vocab
                .pattern()
                .ok_or(NotRecognised("split regex not recognised"))
                .and_then(|pattern| FastBpe::from_ranks(pattern, &tokens, vocab.special_tokens()));
            match built {
                Ok(fast) => Some(fast),
                Err(why) => {
                    tracing::warn!(tokenizer = vocab.name(), %why, "fast tokenizer path not used");
                    None
                }
            }
        })
        .as_ref()
}

impl BuiltinBpe {
    /// `vocab`, encoding through the fast path when `fast` (and it builds).
    pub(crate) fn new(vocab: BuiltinVocab, fast: bool) -> Self {
        Self {
            vocab,
            bpe: vocab.core(),
            special_by_id: vocab
                .special_tokens()
                .iter()
                .map(|&(text, id)| (id, text))
                .collect(),
            fast: if fast { fast_bpe(vocab) } else { None },
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        self.vocab.name()
    }

    pub(crate) fn uses_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    pub(crate) fn encode(&self, text: &str) -> Vec<TokenId> {
        if let Some(ids) = self.fast.and_then(|fast| fast.encode(text)) {
            return ids;
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut rest = text;
        while let Some((at, text, id)) = self.next_special(rest) {
            ids.extend(self.bpe.encode_ordinary(&rest[..at]));
            ids.push(id);
            rest = &rest[at + text.len()..];
        }
        ids.extend(self.bpe.encode_ordinary(rest));
        ids
    }

    /// [`encode`](Self::encode) plus each token's start byte (the start of the character for
    /// a token that begins inside one). tiktoken's tokens are exact byte strings of the
    /// text, so their lengths add up to offsets.
    pub(crate) fn encode_with_starts(
        &self,
        text: &str,
    ) -> Result<(Vec<TokenId>, Vec<u32>), TokenizeError> {
        if let Some(result) = self.fast.and_then(|fast| fast.encode_with_starts(text)) {
            return result;
        }
        let ids = self.encode(text);
        let lengths = self.token_lengths();
        let mut starts = Vec::with_capacity(ids.len());
        let mut at = 0usize;
        for &id in &ids {
            let mut start = at;
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            starts.push(offset_u32(start)?);
            at += match self.special_by_id.get(&id) {
                Some(special) => special.len(),
                None => lengths.get(id as usize).map_or(0, |&len| usize::from(len)),
            };
        }
        Ok((ids, starts))
    }

    /// Byte length of every ordinary token, read once from the rank table.
    fn token_lengths(&self) -> &'static [u16] {
        static LENGTHS: [OnceLock<Vec<u16>>; 2] = [OnceLock::new(), OnceLock::new()];
        LENGTHS[self.vocab.index()].get_or_init(|| {
            (0..self.vocab.ordinary_end())
                .map(|id| {
                    self.bpe
                        .decode_bytes(std::slice::from_ref(&id))
                        .map_or(0, |bytes| u16::try_from(bytes.len()).unwrap_or(u16::MAX))
                })
                .collect()
        })
    }

    /// The most bytes of text one token stands for (the longest ordinary token or special
    /// token).
    pub(crate) fn max_token_bytes(&self) -> usize {
        let ordinary = self.token_lengths().iter().copied().max().unwrap_or(0);
        self.vocab
            .special_tokens()
            .iter()
            .map(|(text, _)| text.len())
            .fold(usize::from(ordinary), usize::max)
    }

    /// cl100k's regex is the GPT-4 one (digits in runs of three); o200k's also groups digits
    /// by three and keeps a contraction with the word before it. No normaliser.
    pub(crate) fn seam_rules(&self) -> SeamRules {
        SeamRules::new(
            SeamPolicy::Words {
                digit_runs: true,
                contractions_attach: self.vocab == BuiltinVocab::O200k,
            },
            self.vocab
                .special_tokens()
                .iter()
                .map(|&(text, id)| (text.to_owned(), id)),
        )
    }

    /// Appends the bytes `ids` decode to; the bytes of a sequence are the concatenation of
    /// its parts' (tiktoken's byte pieces and the special tokens' text).
    pub(crate) fn extend_bytes(
        &self,
        bytes: &mut Vec<u8>,
        ids: &[TokenId],
        skip_special_tokens: bool,
    ) {
        // Ordinary ids are decoded in runs between special tokens, one call per run.
        for run in ids.split_inclusive(|id| self.special_by_id.contains_key(id)) {
            let (ordinary, special) = match run.split_last() {
                Some((last, head)) if self.special_by_id.contains_key(last) => (head, Some(*last)),
                _ => (run, None),
            };
            self.extend_ordinary(bytes, ordinary);
            if let Some(text) = special.and_then(|id| self.special_by_id.get(&id))
                && !skip_special_tokens
            {
                bytes.extend_from_slice(text.as_bytes());
            }
        }
    }

    fn extend_ordinary(&self, bytes: &mut Vec<u8>, ids: &[TokenId]) {
        // Only ordinary ids reach tiktoken: it knows some special ids of its own.
        let known = |id: &TokenId| *id < self.vocab.ordinary_end();
        match ids.iter().all(known).then(|| self.bpe.decode_bytes(ids)) {
            Some(Ok(piece)) => bytes.extend_from_slice(&piece),
            // Some id is unknown: keep the known ones, drop the rest.
            _ => {
                for id in ids.iter().filter(|id| known(id)) {
                    if let Ok(piece) = self.bpe.decode_bytes(std::slice::from_ref(id)) {
                        bytes.extend_from_slice(&piece);
                    }
                }
            }
        }
    }

    /// One more than the largest id, special tokens included.
    pub(crate) fn vocab_size(&self) -> usize {
        let largest = self.vocab.special_tokens().iter().map(|&(_, id)| id).max();
        largest.map_or(0, |id| id as usize + 1)
    }

    pub(crate) fn special_id(&self, text: &str) -> Option<TokenId> {
        self.vocab
            .special_tokens()
            .iter()
            .find(|(t, _)| *t == text)
            .map(|&(_, id)| id)
    }

    pub(crate) fn special_text(&self, id: TokenId) -> Option<&'static str> {
        self.special_by_id.get(&id).copied()
    }

    /// The leftmost special token in `text`: (byte offset, its text, its id).
    fn next_special(&self, text: &str) -> Option<(usize, &'static str, TokenId)> {
        // Every special token starts with "<|", so look only there instead of scanning for each.
        let mut from = 0;
        while let Some(found) = text[from..].find("<|") {
            let at = from + found;
            if let Some(&(special, id)) = self
                .vocab
                .special_tokens()
                .iter()
                .find(|(t, _)| text[at..].starts_with(t))
            {
                return Some((at, special, id));
            }
            from = at + 2;
        }
        None
    }
}
