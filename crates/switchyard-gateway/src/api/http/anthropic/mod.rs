//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
//! shared pipeline, so routing, sessions, admission and tenants apply unchanged: the request
//! becomes a chat request ([`request`]) that runs through the pipeline under the [`MESSAGES`]
//! descriptor, and the [`MessagesRenderer`] writes the answer from the dispatch events as an
//! Anthropic message ([`message`]) or as Anthropic's events ([`events`]). Every error on these
//! routes leaves in Anthropic's shape: the pipeline's and the API-key check's refusals are
//! written so, and axum's own rejections (a method other than POST) are wrapped by
//! [`anthropic_errors`].

mod blocks;
mod events;
mod message;
mod request;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::KeepAlive;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use serde_json::json;
use switchyard_tokenize::{ChatRequest, ModelDir};

use super::keys::{KeyCheck, require_api_key};
use super::pipeline::{
    self, Api, Incoming, ParsedRequest, Peer, Shape, checked, handle, model_routes, read_body,
};
use super::prompts::PromptSource;
use super::render::{Answering, Delta, Frame, Renderer, Whole};
use super::state::{ApiTenant, AppState};
use crate::api::chat_output::ChatOutput;
use crate::api::openai::Usage;
use crate::error::ApiError;
use crate::serving::preprocess;
use events::{Event, EventWriter};
use request::{CountTokensRequest, MessagesRequest, Thinking};

/// `/v1/messages`.
pub const MESSAGES: Api = Api {
    endpoint: "messages",
    route: "/v1/messages",
    span_name: "POST /v1/messages",
    docs: "docs/anthropic-api.md",
    id_prefix: "msg_",
    shape: Shape::Chat,
    error: error_response,
};

/// A refusal in Anthropic's shape, with the error's status and headers.
fn error_response(err: ApiError) -> Response {
    let status = err.status();
    let body = message::error_body(&err.to_json(), Some(status));
    let mut response = (status, axum::Json(body)).into_response();
    response.headers_mut().extend(err.headers());
    response
}

/// The routes, behind the API-key check like the rest of `/v1`, answering errors in
/// Anthropic's shape.
pub(super) fn router(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            KeyCheck {
                state: Arc::clone(state),
                refuse: MESSAGES.error,
            },
            require_api_key,
        ))
        .layer(axum::middleware::map_response(anthropic_errors))
}

/// The `anthropic-beta` header's betas, noted ([`request::note_betas`]).
fn betas(headers: &HeaderMap, notes: &mut crate::api::http::fields::FieldNotes) {
    let header = headers.get("anthropic-beta").and_then(|v| v.to_str().ok());
    request::note_betas(header, notes);
}

/// `thinking` against the model's reasoning parser and template: thinking asked of a model
/// whose reasoning cannot be told from its answer, or switched off for one that always reasons
/// (its template has no switch for it), cannot be honoured.
fn check_thinking(
    state: &AppState,
    model: &str,
    dir: &ModelDir,
    thinking: Thinking,
) -> Result<(), ApiError> {
    let reasons = state.config.output.formats(model, dir).reasoning.is_some();
    let switchable = dir
        .chat_template()
        .is_some_and(|t| t.reads("enable_thinking") || t.reads("thinking"));
    thinking_for(model, reasons, switchable, thinking)
}

/// `thinking` for a model that has (`reasons`) or lacks a reasoning parser, whose template can
/// (`switchable`) or cannot switch thinking off.
fn thinking_for(
    model: &str,
    reasons: bool,
    switchable: bool,
    thinking: Thinking,
) -> Result<(), ApiError> {
    let refuse = |message: String| Err(ApiError::bad_param("thinking", message));
    match (thinking, reasons) {
        (Thinking::Enabled, false) => refuse(format!(
            "thinking: model `{model}` has no reasoning parser, so its thinking cannot be told from its answer (set output.reasoning_parsers: --reasoning-parser {model}=NAME)"
        )),
        (Thinking::Disabled, true) if !switchable => refuse(format!(
            "thinking: model `{model}` reasons (its reasoning parser is on) and its chat template has no switch to turn that off; leave `thinking` out"
        )),
        _ => Ok(()),
    }
}

/// POST /v1/messages
async fn messages(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let split_state = Arc::clone(&state);
    let split_headers = headers.clone();
    let split = move |r: MessagesRequest| {
        let model = r.model.clone();
        let mut ask = request::chat_ask(r)?;
        betas(&split_headers, &mut ask.notes);
        // A LoRA adapter thinks as its base model does (an unknown name is refused later).
        if let Ok(routes) = model_routes(&split_state, &model) {
            let tokenizer = split_state.tokenizers.for_model(&routes.model);
            check_thinking(&split_state, &routes.model, &tokenizer.dir, ask.thinking)?;
        }
        let renderer = MessagesRenderer::new(ask.stop_sequences.clone(), ask.omit_thinking);
        Ok((parsed(model, ask), renderer))
    };
    let incoming = Incoming {
        tenant: tenant.map(|Extension(t)| t),
        peer,
        headers,
        body,
    };
    handle(state, &MESSAGES, incoming, split).await
}

/// The chat request of `ask`, as the pipeline takes it apart.
fn parsed(model: String, ask: request::ChatAsk) -> ParsedRequest {
    ParsedRequest {
        model,
        sampling: ask.sampling,
        source: PromptSource::Chat {
            messages: ask.messages,
            tools: ask.tools,
            tool_choice: ask.tool_choice,
            parallel_tool_calls: ask.parallel_tool_calls,
        },
        echo: false,
        notes: ask.notes,
    }
}

/// Parses and checks a `/v1/messages` body as the handler does before admission (the
/// model-dependent `thinking` check aside). Public so that the fuzz targets
/// (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_messages_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let request: MessagesRequest = pipeline::parse_body(body)?;
    let model = request.model.clone();
    let ask = request::chat_ask(request)?;
    checked(&MESSAGES, parsed(model, ask))
}

/// Writes Messages answers: a message, or its events (a quiet stream is kept open with `ping`
/// events). The answer has one choice.
pub(crate) struct MessagesRenderer {
    /// The request's stop sequences: the one that ended the answer is named, and cut from the
    /// text.
    stops: Vec<String>,
    /// `thinking.display: "omitted"`.
    omit_thinking: bool,
    writer: EventWriter,
}

impl MessagesRenderer {
    pub(crate) fn new(stops: Vec<String>, omit_thinking: bool) -> Self {
        let writer = EventWriter::new(stops.clone()).omitting_thinking(omit_thinking);
        Self {
            stops,
            omit_thinking,
            writer,
        }
    }
}

fn frames(events: Vec<Event>) -> Vec<Frame> {
    events
        .iter()
        .map(|event| Frame::named(event.name, &event.data))
        .collect()
}

impl Renderer for MessagesRenderer {
    fn started(&mut self, a: &Answering, _index: u32, prompt: &Usage) -> Vec<Frame> {
        frames(self.writer.start(&a.id, &a.model, prompt))
    }

    fn delta(&mut self, _a: &Answering, _index: u32, delta: Delta) -> Vec<Frame> {
        let events = delta
            .pieces
            .into_iter()
            .flat_map(|piece| self.writer.piece(piece))
            .collect();
        frames(events)
    }

    fn finished(&mut self, _a: &Answering, _index: u32, finish: &'static str) -> Vec<Frame> {
        frames(self.writer.finish(finish))
    }

    async fn ended(&mut self, _a: &Answering, usage: &Usage) -> Vec<Frame> {
        frames(self.writer.end(usage))
    }

    fn failed(&mut self, _a: &Answering, err: &ApiError) -> Vec<Frame> {
        frames(vec![Event::error(err)])
    }

    fn keep_alive(&self) -> KeepAlive {
        let ping = Event::ping();
        KeepAlive::default().event(Frame::named(ping.name, &ping.data).event())
    }

    async fn whole(self, a: Answering, answer: Whole) -> Response {
        // One prompt, one choice.
        let Some(choice) = answer.choices.into_iter().next() else {
            return error_response(ApiError::Internal("a message without its choice".into()));
        };
        let message = message::message(
            &a.id,
            &a.model,
            choice,
            &answer.usage,
            &self.stops,
            self.omit_thinking,
        );
        axum::Json(message).into_response()
    }
}

/// Axum's own rejections on these routes (405 for a method other than POST, with an empty
/// body) in Anthropic's shape, the status kept. The gateway's refusals are JSON in Anthropic's
/// shape already and pass through.
async fn anthropic_errors(response: Response) -> Response {
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if response.status().is_success() || json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let body = json!({"type": "error", "error": {"type": message::error_type(parts.status),
        "message": String::from_utf8_lossy(&bytes)}});
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// POST /v1/messages/count_tokens: `{"input_tokens"}`, the prompt's tokens as a Messages
/// request with the same fields counts them (its usage's `input_tokens` plus
/// `cache_read_input_tokens`).
async fn count_tokens(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match count(&state, &headers, body).await {
        Ok(tokens) => (StatusCode::OK, axum::Json(json!({"input_tokens": tokens}))).into_response(),
        Err(err) => error_response(err),
    }
}

async fn count(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<usize, ApiError> {
    let body = read_body(state, body)?;
    let r: CountTokensRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    // The same policy as the Messages request's (nothing here is counted: no request runs).
    let mut notes = crate::api::http::fields::FieldNotes::default();
    betas(headers, &mut notes);
    request::note_rest(&r.unknown, &mut notes)?;
    notes.check(state.config.api.unknown_fields, MESSAGES.docs)?;
    let messages = r
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::bad_param("messages", "messages: Field required"))?;
    let mut messages = request::chat_messages(r.system.as_ref(), messages)?;
    if let Some(keep) = request::context_edits(r.context_management.as_ref())? {
        request::clear_thinking(&mut messages, keep);
    }
    let tools = request::chat_tools(r.tools.as_deref(), &mut notes)?;
    let (tool_choice, parallel) = request::chat_tool_choice(r.tool_choice.as_ref())?;
    let (thinking, _) = request::thinking_of(r.thinking.as_ref(), u32::MAX)?;
    request::ask_reasoning(thinking, r.output_config.as_ref(), &mut notes)?;
    request::response_format(r.output_config.as_ref())?;
    request::top_cache_control(r.cache_control)?;
    let routes = model_routes(state, &r.model)?;
    // A LoRA adapter counts with its base model's tokenizer and template.
    let base = routes.model.as_str();
    let tokenizer = state.tokenizers.for_model(base);
    check_thinking(state, base, &tokenizer.dir, thinking)?;
    // The tools the chat path would render (none with `tool_choice: none`).
    let formats = state.config.output.formats(base, &tokenizer.dir);
    let (_, tools) = ChatOutput::resolve(formats, base, tools, tool_choice, parallel)?;
    let mut chat = ChatRequest::new(messages);
    chat.tools = tools;
    chat.template_kwargs = notes.settle_template(tokenizer.dir.chat_template());
    let max = preprocess::prompt_limit(routes.max_context_tokens);
    let tokens =
        preprocess::encode_chat_request(&state.observers.metrics, tokenizer, chat, max).await?;
    Ok(tokens.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinking_is_refused_only_where_it_cannot_be_honoured() {
        use Thinking::*;
        for (thinking, reasons, ok) in [
            (Unset, false, true),
            (Unset, true, true),
            (Adaptive, false, true),
            (Adaptive, true, true),
            (Enabled, true, true),
            (Enabled, false, false),
            (Disabled, false, true),
            (Disabled, true, false),
        ] {
            let answer = thinking_for("m", reasons, false, thinking);
            assert_eq!(answer.is_ok(), ok, "{thinking:?} with parser {reasons}");
            if let Err(ApiError::BadRequest { param, message }) = answer {
                assert_eq!(param.as_deref(), Some("thinking"));
                assert!(message.starts_with("thinking: model `m`"), "{message}");
            }
        }
        // A template with a switch turns a reasoning model's thinking off.
        assert!(thinking_for("m", true, true, Disabled).is_ok());
    }

    async fn body(response: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn refusals_leave_in_anthropics_shape_and_axums_are_wrapped() {
        // The pipeline's own: written in Anthropic's shape, with the error's status and headers.
        let own = error_response(ApiError::Saturated {
            retry_after_secs: 3,
        });
        assert_eq!(own.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(own.headers()[header::RETRY_AFTER], "3");
        let passed = anthropic_errors(own).await;
        assert_eq!(passed.headers()[header::RETRY_AFTER], "3");
        assert_eq!(body(passed).await["error"]["type"], "rate_limit_error");
        let own = error_response(ApiError::bad_param("max_tokens", "Field required"));
        assert_eq!(
            body(anthropic_errors(own).await).await,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                   "message": "max_tokens: Field required"}})
        );
        // Axum's 405 (an empty text body) is wrapped, its status kept.
        let rejected = (StatusCode::METHOD_NOT_ALLOWED, "").into_response();
        let wrapped = anthropic_errors(rejected).await;
        assert_eq!(wrapped.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            body(wrapped).await,
            json!({"type": "error", "error": {"type": "api_error", "message": ""}})
        );
    }
}
