//! The offline default: OpenAI's `cl100k_base` BPE (compiled into `tiktoken-rs`) with the
//! ChatML special tokens and a ChatML chat template.
//!
//! `cl100k_base` rather than `o200k_base`: its rank table is half the size (100k vs 200k
//! entries, so half the start-up parse and memory), and the ids of `<|im_start|>` /
//! `<|im_end|>` in it are the ones OpenAI's tiktoken documents for ChatML (100264/100265),
//! where `o200k_base` has no published ChatML ids.

use std::collections::HashMap;
use std::sync::OnceLock;

use switchyard_core::TokenId;
use tiktoken_rs::CoreBPE;

use crate::error::TokenizeError;
use crate::session::seam::{SeamPolicy, SeamRules};
use crate::tokenizer::offset_u32;

/// Name of the built-in tokenizer.
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
const SPECIAL_TOKENS: [(&str, TokenId); 8] = [
    ("<|endoftext|>", 100_257),
    ("<|fim_prefix|>", 100_258),
    ("<|fim_middle|>", 100_259),
    ("<|fim_suffix|>", 100_260),
    ("<|im_start|>", 100_264),
    ("<|im_end|>", 100_265),
    ("<|im_sep|>", 100_266),
    ("<|endofprompt|>", 100_276),
];

/// Ids that end generation for the built-in model.
pub const BUILTIN_EOS_TOKEN_IDS: [TokenId; 2] = [100_265, 100_257];

/// `cl100k_base` with special tokens handled here, so ChatML's two tokens (absent from
/// tiktoken-rs's table) are single ids like the others.
pub(crate) struct BuiltinBpe {
    bpe: &'static CoreBPE,
    special_by_id: HashMap<TokenId, &'static str>,
}

impl std::fmt::Debug for BuiltinBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltinBpe")
            .field("name", &BUILTIN_TOKENIZER_NAME)
            .finish()
    }
}

impl BuiltinBpe {
    pub(crate) fn cl100k() -> Self {
        Self {
            bpe: tiktoken_rs::cl100k_base_singleton(),
            special_by_id: SPECIAL_TOKENS
                .iter()
                .map(|&(text, id)| (id, text))
                .collect(),
        }
    }

    pub(crate) fn encode(&self, text: &str) -> Vec<TokenId> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut rest = text;
        while let Some((at, text, id)) = next_special(rest) {
            ids.extend(self.bpe.encode_ordinary(&rest[..at]));
            ids.push(id);
            rest = &rest[at + text.len()..];
        }
        ids.extend(self.bpe.encode_ordinary(rest));
        ids
    }

    /// [`encode`](Self::encode) plus each token's start byte, from the tokens' byte lengths
    /// (BPE tokens are exact byte strings of the text, so lengths add up to offsets).
    pub(crate) fn encode_with_starts(
        &self,
        text: &str,
    ) -> Result<(Vec<TokenId>, Vec<u32>), TokenizeError> {
        let ids = self.encode(text);
        let lengths = self.token_lengths();
        let mut starts = Vec::with_capacity(ids.len());
        let mut at = 0usize;
        for &id in &ids {
            starts.push(offset_u32(at)?);
            at += match self.special_by_id.get(&id) {
                Some(special) => special.len(),
                None => lengths.get(id as usize).map_or(0, |&len| usize::from(len)),
            };
        }
        Ok((ids, starts))
    }

    /// Byte length of every ordinary token, read once from the rank table.
    fn token_lengths(&self) -> &'static [u16] {
        static LENGTHS: OnceLock<Vec<u16>> = OnceLock::new();
        LENGTHS.get_or_init(|| {
            (0..self.vocab_size())
                .map(|id| {
                    let id = id as TokenId;
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
        SPECIAL_TOKENS
            .iter()
            .map(|(text, _)| text.len())
            .fold(usize::from(ordinary), usize::max)
    }

    /// cl100k's regex is the GPT-4 one (digits in runs of three); no normaliser.
    pub(crate) fn seam_rules(&self) -> SeamRules {
        SeamRules::new(
            SeamPolicy::Words { digit_runs: true },
            SPECIAL_TOKENS
                .iter()
                .map(|&(text, id)| (text.to_owned(), id)),
        )
    }

    pub(crate) fn decode(&self, ids: &[TokenId], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        // Ordinary ids are decoded in runs between special tokens, one call per run.
        for run in ids.split_inclusive(|id| self.special_by_id.contains_key(id)) {
            let (ordinary, special) = match run.split_last() {
                Some((last, head)) if self.special_by_id.contains_key(last) => (head, Some(*last)),
                _ => (run, None),
            };
            self.extend_ordinary(&mut bytes, ordinary);
            if let Some(text) = special.and_then(|id| self.special_by_id.get(&id))
                && !skip_special_tokens
            {
                bytes.extend_from_slice(text.as_bytes());
            }
        }
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(err) => String::from_utf8_lossy(err.as_bytes()).into_owned(),
        }
    }

    fn extend_ordinary(&self, bytes: &mut Vec<u8>, ids: &[TokenId]) {
        match self.bpe.decode_bytes(ids) {
            Ok(piece) => bytes.extend_from_slice(&piece),
            // Some id is unknown: keep the known ones, drop the rest.
            Err(_) => {
                for id in ids {
                    if let Ok(piece) = self.bpe.decode_bytes(std::slice::from_ref(id)) {
                        bytes.extend_from_slice(&piece);
                    }
                }
            }
        }
    }

    pub(crate) fn vocab_size(&self) -> usize {
        100_277
    }

    pub(crate) fn special_id(&self, text: &str) -> Option<TokenId> {
        SPECIAL_TOKENS
            .iter()
            .find(|(t, _)| *t == text)
            .map(|&(_, id)| id)
    }

    pub(crate) fn special_text(&self, id: TokenId) -> Option<&'static str> {
        self.special_by_id.get(&id).copied()
    }
}

/// The leftmost special token in `text`: (byte offset, its text, its id).
fn next_special(text: &str) -> Option<(usize, &'static str, TokenId)> {
    // Every special token starts with "<|", so look only there instead of scanning for each.
    let mut from = 0;
    while let Some(found) = text[from..].find("<|") {
        let at = from + found;
        if let Some(&(special, id)) = SPECIAL_TOKENS
            .iter()
            .find(|(t, _)| text[at..].starts_with(t))
        {
            return Some((at, special, id));
        }
        from = at + 2;
    }
    None
}
