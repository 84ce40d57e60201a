//! `POST /v1/chat/completions` and `POST /v1/completions`: their bodies taken apart for the
//! shared pipeline ([`super::pipeline`]), and their answers written by [`ChatRenderer`] and
//! [`TextRenderer`] as one JSON body or as chunks of server-sent events (`data: [DONE]` last;
//! the request's usage before it with `stream_options.include_usage`). A request may carry
//! several prompts (text completions) and ask for `n` choices of each; every choice is its own
//! routed generation, and each chunk names its choice's index.

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::pipeline::{Api, Incoming, Peer, Shape, checked, handle, parse_body};
pub use super::pipeline::{ParsedRequest, ServedModel, salted_identity, served_model};
pub use super::prompts::PromptSource;
use super::render::{Answering, Delta, Frame, Renderer, Whole};
use super::state::{ApiTenant, AppState, unix_now};
use crate::api::chat_output::{Piece, ToolCallOut};
use crate::api::openai::fields::{Endpoint, notes_of};
use crate::api::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatDelta, Completion, CompletionChoice, CompletionRequest, LogprobsOut, PromptInput, Usage,
};
use crate::error::ApiError;
use crate::serving::preprocess;

/// `/v1/chat/completions`.
pub const CHAT: Api = Api {
    endpoint: "chat_completions",
    route: "/v1/chat/completions",
    span_name: "POST /v1/chat/completions",
    docs: "docs/openai-api.md",
    id_prefix: "chatcmpl-",
    shape: Shape::Chat,
    error: IntoResponse::into_response,
};

/// `/v1/completions`.
pub const TEXT: Api = Api {
    endpoint: "completions",
    route: "/v1/completions",
    span_name: "POST /v1/completions",
    docs: "docs/openai-api.md",
    id_prefix: "cmpl-",
    shape: Shape::Text,
    error: IntoResponse::into_response,
};

/// POST /v1/chat/completions
pub async fn chat(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming {
        tenant: tenant.map(|Extension(t)| t),
        peer,
        headers,
        body,
    };
    let split = |r| Ok((chat_split(r)?, ChatRenderer::default()));
    handle(state, &CHAT, incoming, split).await
}

/// POST /v1/completions
pub async fn completions(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let incoming = Incoming {
        tenant: tenant.map(|Extension(t)| t),
        peer,
        headers,
        body,
    };
    let split = |r| Ok((completion_split(r)?, TextRenderer::default()));
    handle(state, &TEXT, incoming, split).await
}

/// Parses and checks a `/v1/chat/completions` body as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_chat_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    chat_split(parse_body(body)?).and_then(|r| checked(&CHAT, r))
}

/// Parses and checks a `/v1/completions` body as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_completion_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    completion_split(parse_body(body)?).and_then(|r| checked(&TEXT, r))
}

/// A chat body taken apart.
fn chat_split(request: ChatCompletionRequest) -> Result<ParsedRequest, ApiError> {
    let logprobs = request
        .sampling
        .logprobs
        .as_ref()
        .is_some_and(|l| l.as_bool() != Some(false) && !l.is_null());
    let notes = notes_of(Endpoint::Chat, &request.unknown, logprobs)?;
    let messages = preprocess::parse_messages(request.messages)?;
    Ok(ParsedRequest {
        model: request.model,
        sampling: request.sampling,
        source: PromptSource::Chat {
            messages,
            tools: request.tools,
            tool_choice: request.tool_choice,
            parallel_tool_calls: request.parallel_tool_calls,
        },
        echo: false,
        notes,
    })
}

/// A text completion body taken apart.
fn completion_split(request: CompletionRequest) -> Result<ParsedRequest, ApiError> {
    let logprobs = request
        .sampling
        .logprobs
        .as_ref()
        .is_some_and(|l| !l.is_null());
    let notes = notes_of(Endpoint::Completions, &request.unknown, logprobs)?;
    let source = match request.prompt {
        PromptInput::Text(text) => PromptSource::Texts(vec![text]),
        PromptInput::Tokens(tokens) => PromptSource::Tokens(vec![tokens]),
        PromptInput::TextBatch(texts) => PromptSource::Texts(texts),
        PromptInput::TokenBatch(lists) => PromptSource::Tokens(lists),
    };
    if source.count() == 0 {
        return Err(ApiError::bad_param(
            "prompt",
            "the list of prompts is empty",
        ));
    }
    Ok(ParsedRequest {
        model: request.model,
        sampling: request.sampling,
        source,
        echo: request.echo,
        notes,
    })
}

/// What one streamed chunk says about one choice.
#[derive(Default)]
struct ChunkPiece {
    content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Vec<ToolCallOut>>,
    role: bool,
    finish: Option<&'static str>,
    logprobs: Option<LogprobsOut>,
}

impl ChunkPiece {
    /// The chunk of one answer piece.
    fn of(piece: Piece) -> Self {
        match piece {
            Piece::Content(text) => Self {
                content: Some(text),
                ..Self::default()
            },
            Piece::Reasoning(text) => Self {
                reasoning: Some(text),
                ..Self::default()
            },
            Piece::ToolCall(call) => Self {
                tool_calls: Some(vec![call]),
                ..Self::default()
            },
        }
    }

    /// A chunk with only log probabilities: of tokens whose text is still held back.
    fn logprobs(logprobs: LogprobsOut) -> Self {
        Self {
            content: Some(String::new()),
            logprobs: Some(logprobs),
            ..Self::default()
        }
    }

    /// The chunk that ends a choice.
    fn finish(finish: &'static str) -> Self {
        Self {
            finish: Some(finish),
            ..Self::default()
        }
    }
}

/// The chunks of a delta: one per piece, the first carrying the log probabilities; with no
/// piece, one empty chunk when there are log probabilities to send.
fn chunk_pieces(delta: Delta) -> Vec<ChunkPiece> {
    let Delta {
        pieces,
        mut logprobs,
    } = delta;
    if pieces.is_empty() {
        return logprobs.map(ChunkPiece::logprobs).into_iter().collect();
    }
    pieces
        .into_iter()
        .map(|piece| ChunkPiece {
            logprobs: logprobs.take(),
            ..ChunkPiece::of(piece)
        })
        .collect()
}

/// A delta's chunks ([`chunk_pieces`]), each written by `chunk` (the API's chunk shape).
fn delta_frames(delta: Delta, chunk: impl Fn(ChunkPiece) -> Frame) -> Vec<Frame> {
    chunk_pieces(delta).into_iter().map(chunk).collect()
}

/// A chunk as its data, or the error object when it cannot be serialized.
fn frame_of<T: serde::Serialize>(chunk: &T) -> Frame {
    Frame::data(
        serde_json::to_string(chunk)
            .unwrap_or_else(|e| ApiError::Internal(e.to_string()).to_json().to_string()),
    )
}

/// The end of an OpenAI stream that failed after its 200: the error object, then `[DONE]`.
fn failed_frames(err: &ApiError) -> Vec<Frame> {
    vec![
        Frame::data(err.to_json().to_string()),
        Frame::data("[DONE]"),
    ]
}

/// Writes chat completions: `chat.completion` bodies and `chat.completion.chunk` events (a
/// role chunk opens each choice).
#[derive(Debug, Default)]
pub(crate) struct ChatRenderer {
    created: u64,
}

impl ChatRenderer {
    fn chunk(&self, a: &Answering, index: u32, piece: ChunkPiece) -> Frame {
        frame_of(&ChatCompletionChunk {
            id: a.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: a.model.clone(),
            choices: vec![ChatChunkChoice {
                index,
                delta: ChatDelta {
                    role: piece.role.then_some("assistant"),
                    content: piece.content,
                    reasoning_content: piece.reasoning.clone(),
                    reasoning: piece.reasoning,
                    tool_calls: piece.tool_calls,
                },
                finish_reason: piece.finish,
                logprobs: piece.logprobs,
            }],
            usage: None,
        })
    }
}

impl Renderer for ChatRenderer {
    fn open(&mut self, _a: &Answering) -> Vec<Frame> {
        self.created = unix_now();
        Vec::new()
    }

    fn started(&mut self, a: &Answering, index: u32, _prompt: &Usage) -> Vec<Frame> {
        let role = ChunkPiece {
            content: Some(String::new()),
            role: true,
            ..ChunkPiece::default()
        };
        vec![self.chunk(a, index, role)]
    }

    fn delta(&mut self, a: &Answering, index: u32, delta: Delta) -> Vec<Frame> {
        delta_frames(delta, |piece| self.chunk(a, index, piece))
    }

    fn finished(&mut self, a: &Answering, index: u32, finish: &'static str) -> Vec<Frame> {
        vec![self.chunk(a, index, ChunkPiece::finish(finish))]
    }

    async fn ended(&mut self, a: &Answering, usage: &Usage) -> Vec<Frame> {
        let mut frames = Vec::new();
        if a.include_usage {
            frames.push(frame_of(&ChatCompletionChunk {
                id: a.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: a.model.clone(),
                choices: Vec::new(),
                usage: Some(usage.clone()),
            }));
        }
        frames.push(Frame::data("[DONE]"));
        frames
    }

    fn failed(&mut self, _a: &Answering, err: &ApiError) -> Vec<Frame> {
        failed_frames(err)
    }

    async fn whole(self, a: Answering, answer: Whole) -> Response {
        axum::Json(ChatCompletion {
            id: a.id,
            object: "chat.completion",
            created: unix_now(),
            model: a.model,
            choices: answer
                .choices
                .into_iter()
                .enumerate()
                .map(|(index, choice)| ChatChoice {
                    index: index as u32,
                    message: choice.answer.message(),
                    finish_reason: choice.finish,
                    logprobs: choice.logprobs,
                })
                .collect(),
            usage: answer.usage,
        })
        .into_response()
    }
}

/// Writes text completions: `text_completion` bodies and chunks (an echoed prompt opens its
/// choices' text).
#[derive(Debug, Default)]
pub(crate) struct TextRenderer {
    created: u64,
}

impl TextRenderer {
    fn chunk(&self, a: &Answering, index: u32, piece: ChunkPiece) -> Frame {
        frame_of(&Completion {
            id: a.id.clone(),
            object: "text_completion",
            created: self.created,
            model: a.model.clone(),
            choices: vec![CompletionChoice {
                index,
                text: piece.content.unwrap_or_default(),
                finish_reason: piece.finish,
                logprobs: piece.logprobs,
            }],
            usage: None,
        })
    }
}

impl Renderer for TextRenderer {
    fn open(&mut self, _a: &Answering) -> Vec<Frame> {
        self.created = unix_now();
        Vec::new()
    }

    fn started(&mut self, a: &Answering, index: u32, _prompt: &Usage) -> Vec<Frame> {
        let Some(echo) = a.echo_of(index).filter(|e| !e.is_empty()) else {
            return Vec::new();
        };
        let piece = ChunkPiece {
            content: Some(echo.to_owned()),
            ..ChunkPiece::default()
        };
        vec![self.chunk(a, index, piece)]
    }

    fn delta(&mut self, a: &Answering, index: u32, delta: Delta) -> Vec<Frame> {
        delta_frames(delta, |piece| self.chunk(a, index, piece))
    }

    fn finished(&mut self, a: &Answering, index: u32, finish: &'static str) -> Vec<Frame> {
        vec![self.chunk(a, index, ChunkPiece::finish(finish))]
    }

    async fn ended(&mut self, a: &Answering, usage: &Usage) -> Vec<Frame> {
        let mut frames = Vec::new();
        if a.include_usage {
            frames.push(frame_of(&Completion {
                id: a.id.clone(),
                object: "text_completion",
                created: self.created,
                model: a.model.clone(),
                choices: Vec::new(),
                usage: Some(usage.clone()),
            }));
        }
        frames.push(Frame::data("[DONE]"));
        frames
    }

    fn failed(&mut self, _a: &Answering, err: &ApiError) -> Vec<Frame> {
        failed_frames(err)
    }

    async fn whole(self, a: Answering, answer: Whole) -> Response {
        axum::Json(Completion {
            id: a.id,
            object: "text_completion",
            created: unix_now(),
            model: a.model,
            choices: answer
                .choices
                .into_iter()
                .enumerate()
                .map(|(index, choice)| CompletionChoice {
                    index: index as u32,
                    text: choice.answer.content,
                    finish_reason: Some(choice.finish),
                    logprobs: choice.logprobs,
                })
                .collect(),
            usage: Some(answer.usage),
        })
        .into_response()
    }
}
