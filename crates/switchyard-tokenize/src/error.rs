//! The one error type of this crate, and whose fault each error is.

use std::path::PathBuf;

/// Who caused an error, so the gateway can pick a status and know whether a retry helps.
///
/// Nothing in this crate is retryable: tokenizing the same input with the same model gives the
/// same answer, so every error is final for that request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request is at fault (a message the chat template rejects, an unsupported content
    /// part): answer 400.
    Request,
    /// The model's files are at fault (missing, malformed, a template that does not compile):
    /// an operator must fix the model directory.
    ModelFiles,
    /// Switchyard itself failed (a tokenization task panicked or was cancelled).
    Internal,
}

/// Errors of loading tokenizers and chat templates, tokenizing and rendering.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("model directory {dir} has no {file}")]
    MissingFile { dir: PathBuf, file: &'static str },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} is not valid JSON for this purpose: {source}")]
    InvalidJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path} is not a tokenizer the tokenizers library can load: {source}")]
    InvalidTokenizer {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },

    #[error("{path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },

    #[error("chat template {name:?} does not compile: {source}")]
    TemplateSyntax {
        name: String,
        #[source]
        source: minijinja::Error,
    },

    #[error("chat template failed to render: {source}")]
    TemplateRender {
        #[source]
        source: minijinja::Error,
    },

    /// The render ran out of its work budget ([`crate::chat::render_fuel`]): the template loops
    /// or builds strings far out of proportion to the conversation.
    #[error(
        "chat template used up its budget of {fuel} fuel units rendering {messages} messages of {bytes} bytes; the template loops or builds far more text than the conversation holds"
    )]
    TemplateBudget {
        fuel: u64,
        messages: usize,
        bytes: usize,
    },

    #[error("model {model} has no chat template; send a completion prompt instead")]
    NoChatTemplate { model: String },

    #[error(
        "message {index} has a content part of type {kind:?}; only \"text\" parts are supported"
    )]
    UnsupportedContentPart { index: usize, kind: String },

    #[error("message {index} has a text content part without \"text\"")]
    MissingPartText { index: usize },

    #[error("tokenizer failed to encode: {source}")]
    Encode {
        #[source]
        source: tokenizers::Error,
    },

    #[error("tokenizer failed to decode: {source}")]
    Decode {
        #[source]
        source: tokenizers::Error,
    },

    #[error("tokenization task did not finish: {source}")]
    TaskFailed {
        #[source]
        source: tokio::task::JoinError,
    },

    #[error("tokenization pool is closed")]
    PoolClosed,

    /// A piece of a text tokenized in parallel never came back (its blocking task panicked,
    /// or the runtime is shutting down).
    #[error("a piece of a parallel tokenization was lost")]
    PieceLost,

    #[error("text of {bytes} bytes is too long to tokenize")]
    TextTooLong { bytes: usize },

    /// The text has more tokens than the caller allows (a prompt longer than the model's
    /// context). Found before tokenizing all of it when possible, so `at_least` is a lower
    /// bound, not the exact count.
    #[error("the text has at least {at_least} tokens, more than the {max} allowed")]
    TooManyTokens { at_least: usize, max: usize },
}

impl TokenizeError {
    /// Whose fault this error is.
    pub fn fault(&self) -> Fault {
        match self {
            Self::TemplateRender { .. }
            | Self::NoChatTemplate { .. }
            | Self::UnsupportedContentPart { .. }
            | Self::MissingPartText { .. }
            | Self::TextTooLong { .. }
            | Self::TooManyTokens { .. } => Fault::Request,
            Self::MissingFile { .. }
            | Self::Io { .. }
            | Self::InvalidJson { .. }
            | Self::InvalidTokenizer { .. }
            | Self::InvalidConfig { .. }
            | Self::TemplateSyntax { .. }
            | Self::TemplateBudget { .. } => Fault::ModelFiles,
            Self::Encode { .. }
            | Self::Decode { .. }
            | Self::TaskFailed { .. }
            | Self::PoolClosed
            | Self::PieceLost => Fault::Internal,
        }
    }
}
