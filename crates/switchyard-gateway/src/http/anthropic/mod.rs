//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a thin
//! translation onto the chat pipeline, so routing, sessions, admission and tenants apply
//! unchanged: the request becomes a chat request ([`request`]) that runs through
//! `completions::handle` as `Kind::Messages`, and its chat answer is read back as an
//! Anthropic message ([`message`]) or, streamed, as Anthropic's events ([`events`]). Every
//! error on these routes (the API-key check's included) leaves in Anthropic's shape.

mod blocks;
mod events;
mod message;
mod request;

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use futures::{Stream, StreamExt};
use serde_json::{Value as Json, json};
use switchyard_core::sse::SseDecoder;
use switchyard_tokenize::{ChatRequest, ModelDir};

use super::completions::{self, Kind, ParsedRequest, Peer, PromptSource, model_routes, read_body};
use super::{ApiTenant, AppState};
use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::preprocess;
use events::{Event, EventWriter};
use request::{CountTokensRequest, MessagesRequest, Thinking};

/// The routes, behind the API-key check like the rest of `/v1`, answering errors in
/// Anthropic's shape.
pub(super) fn router(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(state),
            super::require_api_key,
        ))
        .layer(axum::middleware::map_response(anthropic_errors))
}

/// The `anthropic-beta` header's betas, noted ([`request::note_betas`]).
fn betas(headers: &HeaderMap, notes: &mut crate::http::fields::FieldNotes) {
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
    let mut stops: Vec<String> = Vec::new();
    let mut omit_thinking = false;
    let split_state = Arc::clone(&state);
    let split_headers = headers.clone();
    let split = |r: MessagesRequest| {
        let model = r.model.clone();
        let mut ask = request::chat_ask(r)?;
        betas(&split_headers, &mut ask.notes);
        // A LoRA adapter thinks as its base model does (an unknown name is refused later).
        if let Ok(routes) = model_routes(&split_state, &model) {
            let tokenizer = split_state.tokenizers.for_model(&routes.model);
            check_thinking(&split_state, &routes.model, &tokenizer.dir, ask.thinking)?;
        }
        stops.clone_from(&ask.stop_sequences);
        omit_thinking = ask.omit_thinking;
        Ok(parsed(model, ask))
    };
    let tenant = tenant.map(|Extension(t)| t);
    let response =
        completions::handle(state, tenant, Kind::Messages, peer, headers, body, split).await;
    answer(response, stops, omit_thinking).await
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
        responses: None,
        notes: ask.notes,
    }
}

/// Parses and checks a `/v1/messages` body as the handler does before admission (the
/// model-dependent `thinking` check aside). Public so that the fuzz targets
/// (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_messages_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let request: MessagesRequest = completions::parse_body(body)?;
    let model = request.model.clone();
    let ask = request::chat_ask(request)?;
    completions::checked(Kind::Messages, parsed(model, ask))
}

/// The chat answer in Anthropic's shape: a message, or its events. Errors pass through to
/// [`anthropic_errors`].
async fn answer(response: Response, stops: Vec<String>, omit_thinking: bool) -> Response {
    if !response.status().is_success() {
        return response;
    }
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    if streamed {
        let writer = EventWriter::new(stops).omitting_thinking(omit_thinking);
        return Response::from_parts(parts, Body::from_stream(event_stream(body, writer)));
    }
    let chat: Json = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(chat) => chat,
            Err(e) => {
                return ApiError::Internal(format!("unreadable chat answer: {e}")).into_response();
            }
        },
        Err(e) => return ApiError::Internal(format!("chat answer cut off: {e}")).into_response(),
    };
    Response::from_parts(
        parts,
        Body::from(message::message(&chat, &stops, omit_thinking).to_string()),
    )
}

/// The chat stream's body as Anthropic's events. The chat stream's keep-alive comments become
/// `ping` events. Dropping this stream (the client went away) drops the chat stream, which
/// stops the generation.
fn event_stream(
    body: Body,
    writer: EventWriter,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    struct S {
        data: axum::body::BodyDataStream,
        decoder: SseDecoder,
        writer: EventWriter,
        finished: bool,
    }
    let s = S {
        data: body.into_data_stream(),
        decoder: SseDecoder::new(),
        writer,
        finished: false,
    };
    futures::stream::unfold(s, |mut s| async move {
        while !s.finished {
            let mut events = Vec::new();
            match s.data.next().await {
                Some(Ok(bytes)) => {
                    let datas = s.decoder.push(&bytes);
                    if datas.is_empty() && bytes.starts_with(b":") {
                        events.push(Event::ping());
                    }
                    for data in datas {
                        events.extend(s.writer.push(&data));
                    }
                }
                Some(Err(_)) | None => {
                    if let Some(data) = s.decoder.finish() {
                        events.extend(s.writer.push(&data));
                    }
                    events.extend(s.writer.end());
                }
            }
            s.finished = s.writer.is_done();
            if !events.is_empty() {
                let text: String = events.iter().map(Event::to_sse).collect();
                return Some((Ok(Bytes::from(text)), s));
            }
        }
        None
    })
}

/// Every error response of these routes in Anthropic's shape (the status kept).
async fn anthropic_errors(response: Response) -> Response {
    if response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let openai: Json = serde_json::from_slice(&bytes).unwrap_or(Json::Null);
    if openai["type"] == "error" {
        return Response::from_parts(parts, Body::from(bytes));
    }
    let body = if openai["error"].is_object() {
        message::error_body(&openai, Some(parts.status))
    } else {
        json!({"type": "error", "error": {"type": message::error_type(parts.status),
            "message": String::from_utf8_lossy(&bytes)}})
    };
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
        Err(err) => err.into_response(),
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
    let mut notes = crate::http::fields::FieldNotes::default();
    betas(headers, &mut notes);
    request::note_rest(&r.unknown, &mut notes)?;
    notes.check(state.config.api.unknown_fields, Kind::Messages.docs())?;
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
    let tokens = preprocess::encode_chat_request(&state.metrics, tokenizer, chat, max).await?;
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
}
