//! Preprocessing for Switchyard: from an OpenAI request to token ids, and from generated
//! token ids back to text. No network code, so the gateway and offline replay share it.
//!
//! - [`tokenizer`]: [`Tokenizer`], one type over a Hugging Face `tokenizer.json` and the
//!   built-in BPE ([`builtin`]: `cl100k_base` with ChatML tokens, the offline default).
//!   A `tokenizer.json` of the common byte-level BPE shape encodes through `fast`, an exact
//!   hand-written pre-tokenizer and merge loop; anything else through `tokenizers`.
//! - [`chat`]: OpenAI-style messages ([`ChatMessage`], [`ChatRequest`]) and
//!   [`ChatTemplate`], Jinja chat templates rendered with minijinja as `transformers` does;
//!   `pyjson` supplies Python's `tojson`.
//! - [`model_dir`]: [`ModelDir`], a model loaded from a Hugging Face directory (tokenizer,
//!   template, eos ids, context length) or built in.
//! - [`decode`]: [`IncrementalDecoder`], streaming detokenization that never splits a
//!   character.
//! - [`preprocess`]: [`Preprocessor`], the async API the gateway calls; heavy work runs on
//!   tokio's blocking pool under a concurrency limit.
//! - [`session`]: [`SessionTokenizer`], incremental tokenization of a session's growing
//!   history: only the text after (a little before) the seam with the previous turn is
//!   tokenized, and the result always equals a full tokenization.
//! - `parallel`: one long text cut at clean splits (the seams of [`session`]) and its pieces
//!   tokenized at once on tokio's blocking pool, identical to one pass; the session tokenizer
//!   uses it for long fresh prompts and long new tails, with one piece per core no other
//!   long tokenization of the process is using ([`CoreBudget`]).
//! - [`prefix`]: [`PrefixCache`], openings of prompts (system prompts, tool definitions)
//!   tokenized once and reused by every request that starts with them, whatever its session;
//!   the session tokenizer consults it for turns with no earlier turn of their own.
//! - [`output`]: [`OutputParser`], generated text split into content, reasoning and tool calls
//!   in the model family's own formats.
//! - [`error`]: [`TokenizeError`] and whose [`Fault`] it is.

pub mod builtin;
pub mod chat;
pub mod decode;
pub mod error;
mod fast;
pub mod model_dir;
pub mod output;
mod parallel;
pub mod prefix;
pub mod preprocess;
mod pyjson;
pub mod session;
pub mod tokenizer;

pub use chat::{
    ChatMessage, ChatRequest, ChatTemplate, ContentPart, MessageContent, OutputFormats,
};
pub use decode::IncrementalDecoder;
pub use error::{Fault, TokenizeError};
pub use model_dir::ModelDir;
pub use output::{OutputEvent, OutputParser, ReasoningFormat, ToolCall, ToolCallFormat};
pub use parallel::{CoreBudget, Occupied};
pub use prefix::{PrefixCache, PrefixStats};
pub use preprocess::{EncodedPrompt, Preprocessor};
pub use session::{
    DEFAULT_PREFIX_CACHE_BYTES, SessionConfig, SessionEncoding, SessionStats, SessionTokenizer,
};
pub use switchyard_core::TokenId;
pub use tokenizer::Tokenizer;
