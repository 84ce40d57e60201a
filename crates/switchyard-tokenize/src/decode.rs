//! Incremental detokenization of a generated token stream.
//!
//! Decoding each new token alone is wrong (a multi-byte character can be split across
//! tokens; some decoders strip a word's leading space), and decoding the whole sequence each
//! time is quadratic. As Hugging Face text-generation-inference and vLLM do, this keeps a
//! small window: `window[..read]` is context that was already emitted, `window[read..]` is
//! not yet emitted. The text of the window minus the text of the context is the new text,
//! released only once it does not end in U+FFFD (an unfinished character). When text is
//! released the window slides, so each step decodes a handful of tokens.
//!
//! A tokenizer whose decode is the UTF-8 reading of its tokens' bytes one after another (a
//! byte-level BPE: Qwen, Llama 3, cl100k; [`Tokenizer::extend_decoded_bytes`]) needs no
//! window: each token's bytes are appended to a buffer and every complete character is
//! released at once, holding at most the three bytes of an unfinished one. That is what the
//! window computes for such a tokenizer, without decoding anything twice.

use std::sync::Arc;

use switchyard_core::TokenId;

use crate::error::TokenizeError;
use crate::tokenizer::Tokenizer;

/// After this many held tokens the text is released even if it still ends in U+FFFD: such a
/// tail is not an unfinished character (those span at most four bytes) but invalid bytes,
/// and holding it would let the window, and each step's cost, grow without bound.
const MAX_HELD_TOKENS: usize = 16;

/// How many prompt tokens [`IncrementalDecoder::with_prompt_context`] keeps as context.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Turns generated token ids, fed one at a time, into text pieces.
///
/// The pieces never split a UTF-8 character, and together (with [`finish`](Self::finish))
/// they equal `tokenizer.decode(all ids)`.
#[derive(Debug)]
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    window: Vec<TokenId>,
    /// `window[..read]` has been emitted (or is prompt context).
    read: usize,
    /// Byte length of the decoded `window[..read]`.
    context_len: usize,
    /// For a tokenizer that decodes byte by byte, the bytes not yet released (an unfinished
    /// character's); the window is then unused.
    bytes: Option<Vec<u8>>,
}

impl IncrementalDecoder {
    /// A decoder for a fresh generation.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        let by_bytes = tokenizer.decodes_by_bytes();
        Self {
            tokenizer,
            skip_special_tokens,
            window: if by_bytes {
                Vec::new()
            } else {
                Vec::with_capacity(MAX_HELD_TOKENS)
            },
            read: 0,
            context_len: 0,
            bytes: by_bytes.then(|| Vec::with_capacity(8)),
        }
    }

    /// Seeds the window with the last few prompt tokens, so a first generated token whose
    /// text depends on its left neighbour (a SentencePiece word's leading space) decodes as
    /// it would inside the whole sequence. Byte-level BPEs (Qwen, cl100k) do not need it.
    pub fn with_prompt_context(mut self, prompt: &[TokenId]) -> Result<Self, TokenizeError> {
        if self.bytes.is_some() {
            return Ok(self);
        }
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        self.window = tail.to_vec();
        self.read = self.window.len();
        self.context_len = self.decode_window(self.read)?.len();
        Ok(self)
    }

    /// Feeds one generated id; returns the text it completes (often empty while a character
    /// is unfinished or for a skipped special token).
    pub fn push(&mut self, id: TokenId) -> Result<String, TokenizeError> {
        if let Some(bytes) = &mut self.bytes {
            self.tokenizer
                .extend_decoded_bytes(bytes, &[id], self.skip_special_tokens);
            return Ok(release_complete(bytes));
        }
        self.window.push(id);
        let text = self.decode_window(self.window.len())?;
        let held = self.window.len() - self.read;
        let unfinished = text.ends_with(char::REPLACEMENT_CHARACTER);
        if (unfinished || text.len() <= self.context_len) && held < MAX_HELD_TOKENS {
            return Ok(String::new());
        }
        let Some(piece) = text.get(self.context_len..) else {
            // The context's text is not a prefix at a character boundary: wait for more.
            return if held < MAX_HELD_TOKENS {
                Ok(String::new())
            } else {
                self.slide()?;
                Ok(String::new())
            };
        };
        let piece = piece.to_owned();
        self.slide()?;
        Ok(piece)
    }

    /// Feeds several ids; returns the text they complete.
    pub fn push_all(&mut self, ids: &[TokenId]) -> Result<String, TokenizeError> {
        let mut out = String::new();
        for &id in ids {
            out.push_str(&self.push(id)?);
        }
        Ok(out)
    }

    /// Ends the stream: returns whatever is still held (an unfinished character becomes
    /// U+FFFD, as in a full decode).
    pub fn finish(self) -> Result<String, TokenizeError> {
        if let Some(bytes) = &self.bytes {
            return Ok(String::from_utf8_lossy(bytes).into_owned());
        }
        if self.window.len() == self.read {
            return Ok(String::new());
        }
        let text = self.decode_window(self.window.len())?;
        Ok(text.get(self.context_len..).unwrap_or_default().to_owned())
    }

    /// Whether this decoder appends each token's bytes and releases whole characters (a
    /// byte-level tokenizer) rather than decoding a sliding window of tokens.
    pub fn decodes_by_bytes(&self) -> bool {
        self.bytes.is_some()
    }

    /// Tokens currently held (context plus unemitted; none when decoding byte by byte); stays
    /// small, which keeps each step cheap.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// Makes the just-emitted tokens the new context and forgets the old context.
    fn slide(&mut self) -> Result<(), TokenizeError> {
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.context_len = self.decode_window(self.read)?.len();
        Ok(())
    }

    fn decode_window(&self, end: usize) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(&self.window[..end], self.skip_special_tokens)
    }
}

/// Takes every complete character off the front of `bytes` (a byte sequence that cannot begin
/// a valid character as one U+FFFD each, as a lossy decode does) and leaves an unfinished
/// character's bytes, at most three, for the next token.
fn release_complete(bytes: &mut Vec<u8>) -> String {
    let mut text = String::new();
    let mut start = 0;
    while start < bytes.len() {
        match std::str::from_utf8(&bytes[start..]) {
            Ok(valid) => {
                text.push_str(valid);
                start = bytes.len();
            }
            Err(err) => {
                let valid_end = start + err.valid_up_to();
                text.push_str(std::str::from_utf8(&bytes[start..valid_end]).unwrap_or_default());
                match err.error_len() {
                    Some(invalid) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        start = valid_end + invalid;
                    }
                    None => {
                        start = valid_end;
                        break;
                    }
                }
            }
        }
    }
    bytes.drain(..start);
    text
}
