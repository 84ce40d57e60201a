//! `POST /v1/responses`, OpenAI's Responses API: a thin translation onto the chat path.
//! [`request`] turns the body into a chat request (so routing, sessions, admission, tenants and
//! metrics apply unchanged, under the `responses` endpoint label); the chat pipeline generates
//! and parses reasoning and tool calls as for `/v1/chat/completions`; [`output`] writes the
//! answer as a response object and [`events`] as the Responses event stream. [`store`] keeps
//! responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`,
//! `input_items`) and seals reasoning for clients that keep it themselves.

mod events;
mod output;
mod request;
pub mod store;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};

use super::answer::Answer;
use super::assemble::{Gathered, request_usage};
use super::completions::{self, Kind, Peer, Prepared, record};
use super::{ApiTenant, AppState, unix_now};
use crate::dispatch::DispatchEvent;
use crate::error::ApiError;
use crate::openai::Usage;
use events::{Event, Writer};
use output::{Item, Outcome, Status, Tokens, response};
pub use request::{Echo, ResponsesRequest};
pub use store::{ResponseStore, ResponsesArgs, ResponsesConfig, Sealer, Stored};

/// The stored responses and the reasoning sealer, shared by the handlers.
#[derive(Debug)]
pub struct ResponsesState {
    pub store: ResponseStore,
    pub sealer: Arc<Sealer>,
}

impl ResponsesState {
    /// The store `config` names; the sealing key from its key file, else the cluster secret
    /// (every replica of a cluster reads every other's sealed reasoning), else made now.
    pub fn new(config: &ResponsesConfig, cluster_secret: Option<&[u8]>) -> Result<Self, String> {
        let sealer = match (&config.key_file, cluster_secret) {
            (Some(path), _) => {
                let secret = std::fs::read(path).map_err(|e| {
                    format!("cannot read responses.key_file {}: {e}", path.display())
                })?;
                Sealer::from_secret(&secret)
            }
            (None, Some(secret)) => Sealer::from_secret(secret),
            (None, None) => Sealer::random(),
        };
        Ok(Self {
            store: ResponseStore::new(config)?,
            sealer: Arc::new(sealer),
        })
    }
}

/// Who may read a stored response: the API-key tenant that made it (none on an open gateway).
fn owner(tenant: Option<&ApiTenant>) -> Option<String> {
    tenant.map(|ApiTenant(t)| t.clone())
}

/// The stored response `id` as `tenant` may see it: another tenant's is as absent as a
/// missing one.
async fn stored_for(
    state: &AppState,
    id: &str,
    tenant: Option<&ApiTenant>,
) -> Result<Option<Stored>, ApiError> {
    let stored = state.responses.store.get(id).await?;
    Ok(stored.filter(|s| s.owner == owner(tenant)))
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound(format!("Response with id '{id}' not found."))
}

/// The body's `previous_response_id`, read ahead of the request so its conversation can be
/// fetched before the request is taken apart (an unreadable body is the pipeline's to refuse).
#[derive(serde::Deserialize)]
struct Ahead {
    previous_response_id: Option<String>,
}

/// POST /v1/responses
pub async fn create(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let tenant = tenant.map(|Extension(t)| t);
    let previous = match body
        .as_ref()
        .ok()
        .and_then(|b| serde_json::from_slice::<Ahead>(b).ok())
        .and_then(|a| a.previous_response_id)
    {
        None => None,
        Some(id) => match stored_for(&state, &id, tenant.as_ref()).await {
            Ok(Some(stored)) => Some(stored.conversation),
            // Counted as the pipeline counts its refusals (no model label: none was read).
            Ok(None) => {
                let err = ApiError::bad_param(
                    "previous_response_id",
                    format!("Previous response with id '{id}' not found."),
                );
                return completions::fail(&state, Kind::Responses, "", err);
            }
            Err(err) => return completions::fail(&state, Kind::Responses, "", err),
        },
    };
    let sealer = Arc::clone(&state.responses.sealer);
    let split = move |r: ResponsesRequest| {
        request::split(
            r,
            request::Context {
                previous,
                sealer: &sealer,
            },
        )
    };
    completions::handle(state, tenant, Kind::Responses, peer, headers, body, split).await
}

/// GET /v1/responses/{id}
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<ApiTenant>>,
    Path(id): Path<String>,
) -> Response {
    let tenant = tenant.map(|Extension(t)| t);
    match stored_for(&state, &id, tenant.as_ref()).await {
        Ok(Some(stored)) => axum::Json(stored.response).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(err) => err.into_response(),
    }
}

/// DELETE /v1/responses/{id}
pub async fn delete(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<ApiTenant>>,
    Path(id): Path<String>,
) -> Response {
    let tenant = tenant.map(|Extension(t)| t);
    let deleted = async {
        if stored_for(&state, &id, tenant.as_ref()).await?.is_none() {
            return Err(not_found(&id));
        }
        state.responses.store.delete(&id).await
    };
    match deleted.await {
        Ok(_) => axum::Json(serde_json::json!({"id": id, "object": "response", "deleted": true}))
            .into_response(),
        Err(err) => err.into_response(),
    }
}

/// GET /v1/responses/{id}/input_items: the input items of the response's request, in order.
pub async fn input_items(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<ApiTenant>>,
    Path(id): Path<String>,
) -> Response {
    let tenant = tenant.map(|Extension(t)| t);
    match stored_for(&state, &id, tenant.as_ref()).await {
        Ok(Some(stored)) => {
            let id_of = |item: Option<&serde_json::Value>| {
                item.and_then(|i| i.get("id").cloned())
                    .unwrap_or(serde_json::Value::Null)
            };
            axum::Json(serde_json::json!({
                "object": "list",
                "first_id": id_of(stored.input.first()),
                "last_id": id_of(stored.input.last()),
                "has_more": false,
                "data": stored.input,
            }))
            .into_response()
        }
        Ok(None) => not_found(&id).into_response(),
        Err(err) => err.into_response(),
    }
}

/// Parses, translates and checks a `/v1/responses` body as the handler does before admission
/// (with no previous response). Public so that the fuzz targets (`crates/switchyard-fuzz`)
/// drive exactly this code.
pub fn parse_responses_request(body: &[u8]) -> Result<completions::ParsedRequest, ApiError> {
    static SEALER: std::sync::OnceLock<Sealer> = std::sync::OnceLock::new();
    let sealer = SEALER.get_or_init(Sealer::random);
    let context = request::Context {
        previous: None,
        sealer,
    };
    request::split(completions::parse_body(body)?, context)
        .and_then(|r| completions::checked(Kind::Responses, r))
}

/// The record a finished response is stored as: its object, its input, and the conversation
/// a later turn continues from (earlier turns, this input, this output).
fn record_of(p: &Prepared, echo: &Echo, response: &serde_json::Value) -> Stored {
    let output = response["output"].as_array().cloned().unwrap_or_default();
    Stored {
        response: response.clone(),
        input: echo.input.clone(),
        conversation: echo
            .previous
            .iter()
            .chain(&echo.input)
            .chain(&output)
            .cloned()
            .collect(),
        owner: p.tenant.clone(),
    }
}

/// Stores a finished response when its request asked to; a store that fails is logged, the
/// answer still goes out (it was generated), and a later turn naming it gets a clear 400.
async fn keep(state: &AppState, p: &Prepared, echo: &Echo, response: &serde_json::Value) {
    if !echo.store {
        return;
    }
    let stored = record_of(p, echo, response);
    if let Err(err) = state.responses.store.put(&p.completion_id, &stored).await {
        tracing::warn!(response = %p.completion_id, error = %err, "response not stored");
    }
}

/// Tokens of the reasoning items, as the model's tokenizer counts their text.
fn reasoning_tokens(p: &Prepared, items: &[Item]) -> u32 {
    items
        .iter()
        .filter_map(|item| match item {
            Item::Reasoning { text, .. } => p.model_dir.tokenizer().encode(text).ok(),
            _ => None,
        })
        .map(|tokens| tokens.len() as u32)
        .sum()
}

fn tokens_of(p: &Prepared, usage: &Usage, items: &[Item]) -> Tokens {
    Tokens {
        input: usage.prompt_tokens,
        cached: usage.prompt_tokens_details.cached_tokens,
        output: usage.completion_tokens,
        reasoning: reasoning_tokens(p, items),
    }
}

fn missing_echo() -> Response {
    ApiError::Internal("a /v1/responses request without its settings".into()).into_response()
}

/// A whole answer (its one choice, with its finish reason) as a response object, stored first
/// when asked.
pub(super) async fn whole(
    state: &AppState,
    p: &Prepared,
    answer: Option<(Gathered, &'static str)>,
    usage: &Usage,
) -> Response {
    let (Some(echo), Some((gathered, finish))) = (&p.responses, answer) else {
        return missing_echo();
    };
    let items = output::items(
        &p.completion_id,
        gathered.reasoning,
        gathered.content,
        gathered.tool_calls,
    );
    let outcome = Outcome {
        id: &p.completion_id,
        model: &p.model,
        created_at: unix_now(),
        status: Status::of_finish(finish),
        tokens: Some(tokens_of(p, usage, &items)),
        output: &items,
    };
    let sealer = echo.seal_reasoning.then_some(&*state.responses.sealer);
    let object = response(&outcome, echo, sealer);
    keep(state, p, echo, &object).await;
    axum::Json(object).into_response()
}

/// A streamed answer as Responses events.
pub(super) fn stream(answer: Answer) -> Response {
    let Some(echo) = answer.p.responses.clone() else {
        return missing_echo();
    };
    let created_at = unix_now();
    let sealer = echo
        .seal_reasoning
        .then(|| Arc::clone(&answer.state.responses.sealer));
    let mut writer = Writer::new(&answer.p.completion_id).sealing(sealer.clone());
    let start = response(
        &Outcome {
            id: &answer.p.completion_id,
            model: &answer.p.model,
            created_at,
            status: Status::InProgress,
            output: &[],
            tokens: None,
        },
        &echo,
        None,
    );
    let queue = writer.started(&start).into();
    let s = Streamed {
        a: answer,
        echo,
        writer,
        created_at,
        queue,
        done: false,
        sealer,
        finished: None,
    };
    let events = futures::stream::unfold(s, |mut s| async move {
        loop {
            // Stored before the final event goes out, so a client continuing from it at once
            // finds it.
            if let Some(object) = s.finished.take() {
                keep(&s.a.state, &s.a.p, &s.echo, &object).await;
            }
            if let Some(event) = s.queue.pop_front() {
                let sse = SseEvent::default()
                    .event(event.name)
                    .data(event.data.to_string());
                return Some((Ok::<_, Infallible>(sse), s));
            }
            if s.done {
                return None;
            }
            let next = match s.a.first.take() {
                Some(first) => Some(first),
                None => s.a.choices.next().await,
            };
            match next {
                Some((index, event)) => s.on_event(index, event),
                None => s.fail("the generation ended unexpectedly".into()),
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A Responses stream in progress. It owns the choice's events: when the client disconnects,
/// axum drops the stream and the worker is told to stop.
struct Streamed {
    a: Answer,
    echo: Arc<Echo>,
    writer: Writer,
    created_at: u64,
    queue: VecDeque<Event>,
    done: bool,
    sealer: Option<Arc<Sealer>>,
    /// The final response object, to store before its event is sent.
    finished: Option<serde_json::Value>,
}

impl Streamed {
    fn on_event(&mut self, index: u32, event: DispatchEvent) {
        let Answer {
            state,
            p,
            labels,
            choices,
            texts,
            ..
        } = &mut self.a;
        let Some(text) = texts.get_mut(index as usize) else {
            return;
        };
        if text.finish.is_some() {
            // Sent before the choice was stopped.
            return;
        }
        let pieces = match event {
            DispatchEvent::Started {
                cached_prompt_tokens,
                ..
            } => {
                text.cached_tokens = text.cached_tokens.max(cached_prompt_tokens);
                return;
            }
            DispatchEvent::Cached(cached) => {
                text.cached_tokens = text.cached_tokens.max(cached);
                return;
            }
            DispatchEvent::Tokens { ids, logprobs } => {
                let content = text.tokens(state, labels, p.arrived, &ids, &logprobs);
                if text.finish.is_some() {
                    // A stop string matched: stop the worker now.
                    choices.stop(index);
                }
                text.shape(content, text.finish.is_some())
            }
            DispatchEvent::Finished(finish) => {
                let tail = text.finished(finish);
                text.shape(tail, true)
            }
            DispatchEvent::Failed(err) => return self.fail(err.to_string()),
        };
        let ended = text.finish.is_some();
        for piece in pieces {
            self.queue.extend(self.writer.push(piece));
        }
        if ended {
            self.end();
        }
    }

    /// The answer is whole: close its items and send the final response.
    fn end(&mut self) {
        let a = &self.a;
        let Some(text) = a.texts.first() else {
            return self.fail("a response without its choice".into());
        };
        let status = Status::of_finish(text.finish_reason());
        self.queue
            .extend(self.writer.finish(status == Status::Incomplete));
        text.count(&a.state, &a.labels);
        a.state
            .metrics
            .request_duration
            .get_or_create(&a.labels)
            .observe(a.p.arrived.elapsed().as_secs_f64());
        let items = self.writer.items();
        let usage = request_usage(&a.texts, 1);
        let name = match status {
            Status::Incomplete => "response.incomplete",
            _ => "response.completed",
        };
        let outcome = Outcome {
            id: &a.p.completion_id,
            model: &a.p.model,
            created_at: self.created_at,
            status,
            tokens: Some(tokens_of(&a.p, &usage, &items)),
            output: &items,
        };
        let object = response(&outcome, &self.echo, self.sealer.as_deref());
        let last = self.writer.ended(name, &object);
        self.finished = Some(object);
        self.queue.push_back(last);
        self.done = true;
    }

    /// The generation failed after the 200 went out: `response.failed`, with what was written.
    fn fail(&mut self, message: String) {
        let a = &self.a;
        switchyard_telemetry::record_error(&a.p.span, message.clone());
        record(&a.state, Kind::Responses, &a.p.model, "stream_error");
        let items = self.writer.items();
        let outcome = Outcome {
            id: &a.p.completion_id,
            model: &a.p.model,
            created_at: self.created_at,
            status: Status::Failed(message),
            tokens: None,
            output: &items,
        };
        let last = self
            .writer
            .ended("response.failed", &response(&outcome, &self.echo, None));
        self.queue.push_back(last);
        self.done = true;
    }
}
