//! `POST /v1/responses`, OpenAI's Responses API over the shared pipeline. [`request`] turns the
//! body into a chat request (its input items through `items`; so routing, sessions, admission,
//! tenants and metrics apply unchanged, under the `responses` endpoint label) and the settings
//! its answer repeats; the
//! pipeline generates and reads reasoning and tool calls as for `/v1/chat/completions`; the
//! [`ResponsesRenderer`] writes the answer from the dispatch events, as a response object
//! ([`output`]) or as the Responses event stream ([`events`]). [`store`] keeps
//! responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`,
//! `input_items`) and seals reasoning for clients that keep it themselves.

mod events;
mod items;
mod output;
pub(crate) mod request;
pub mod store;

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use switchyard_tokenize::Tokenizer;

use super::pipeline::{self, Api, Incoming, ParsedRequest, Peer, Shape, checked, fail, handle};
use super::render::{Answering, Delta, Frame, Renderer, Whole};
use super::state::{ApiTenant, AppState, unix_now};
use crate::api::openai::Usage;
use crate::error::ApiError;
use events::Writer;
use output::{Item, Outcome, Status, Tokens, response};
pub use request::{Echo, ResponsesRequest};
pub use store::{ResponseStore, ResponsesArgs, ResponsesConfig, ResponsesState, Sealer, Stored};

/// `/v1/responses`.
pub const RESPONSES: Api = Api {
    endpoint: "responses",
    route: "/v1/responses",
    span_name: "POST /v1/responses",
    docs: "docs/openai-api.md",
    id_prefix: "resp_",
    shape: Shape::Chat,
    error: IntoResponse::into_response,
};

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
                return fail(&state, &RESPONSES, "", err);
            }
            Err(err) => return fail(&state, &RESPONSES, "", err),
        },
    };
    let responses = Arc::clone(&state.responses);
    let split = move |r: ResponsesRequest| {
        let context = request::Context {
            previous,
            sealer: &responses.sealer,
        };
        let (parsed, echo) = request::split(r, context)?;
        Ok((parsed, ResponsesRenderer::new(echo, responses.clone())))
    };
    let incoming = Incoming {
        tenant,
        peer,
        headers,
        body,
    };
    handle(state, &RESPONSES, incoming, split).await
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
pub fn parse_responses_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    static SEALER: std::sync::OnceLock<Sealer> = std::sync::OnceLock::new();
    let sealer = SEALER.get_or_init(Sealer::random);
    let context = request::Context {
        previous: None,
        sealer,
    };
    request::split(pipeline::parse_body(body)?, context)
        .and_then(|(parsed, _)| checked(&RESPONSES, parsed))
}

/// The record a finished response is stored as: its object, its input, and the conversation
/// a later turn continues from (earlier turns, this input, this output).
fn record_of(owner: Option<String>, echo: &Echo, response: &serde_json::Value) -> Stored {
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
        owner,
    }
}

/// Tokens of the reasoning items, as the model's tokenizer counts their text.
fn reasoning_tokens(tokenizer: &Tokenizer, items: &[Item]) -> u32 {
    items
        .iter()
        .filter_map(|item| match item {
            Item::Reasoning { text, .. } => tokenizer.encode(text).ok(),
            _ => None,
        })
        .map(|tokens| tokens.len() as u32)
        .sum()
}

fn tokens_of(tokenizer: &Tokenizer, usage: &Usage, items: &[Item]) -> Tokens {
    Tokens {
        input: usage.prompt_tokens,
        cached: usage.prompt_tokens_details.cached_tokens,
        output: usage.completion_tokens,
        reasoning: reasoning_tokens(tokenizer, items),
    }
}

/// Writes the Responses API's answers: a response object, or its event stream (each item opens,
/// streams and closes in order; `response.completed`, `response.incomplete` or
/// `response.failed` last). A finished response is stored, when the request asked, before its
/// last event goes out, so a client continuing from it at once finds it.
pub(crate) struct ResponsesRenderer {
    echo: Echo,
    responses: Arc<ResponsesState>,
    /// Streams: set when the stream opens.
    writer: Option<Writer>,
    created_at: u64,
    /// The finish reason of the answer's one choice, once it finished.
    finish: Option<&'static str>,
}

impl ResponsesRenderer {
    pub(crate) fn new(echo: Echo, responses: Arc<ResponsesState>) -> Self {
        Self {
            echo,
            responses,
            writer: None,
            created_at: 0,
            finish: None,
        }
    }

    /// The sealer of reasoning items, when the request asked for them sealed.
    fn sealer(&self) -> Option<&Sealer> {
        self.echo.seal_reasoning.then_some(&*self.responses.sealer)
    }

    /// Stores a finished response when its request asked to; a store that fails is logged, the
    /// answer still goes out (it was generated), and a later turn naming it gets a clear 400.
    async fn keep(&self, a: &Answering, object: &serde_json::Value) {
        if !self.echo.store {
            return;
        }
        let stored = record_of(a.tenant.clone(), &self.echo, object);
        if let Err(err) = self.responses.store.put(&a.id, &stored).await {
            tracing::warn!(response = %a.id, error = %err, "response not stored");
        }
    }

    /// The stream's event writer, made when the stream opens.
    fn writer(&mut self, a: &Answering) -> &mut Writer {
        let sealer = self
            .echo
            .seal_reasoning
            .then(|| Arc::clone(&self.responses.sealer));
        self.writer
            .get_or_insert_with(|| Writer::new(&a.id).sealing(sealer))
    }
}

fn frames(events: Vec<events::Event>) -> Vec<Frame> {
    events
        .iter()
        .map(|event| Frame::named(event.name, &event.data))
        .collect()
}

impl Renderer for ResponsesRenderer {
    fn open(&mut self, a: &Answering) -> Vec<Frame> {
        self.created_at = unix_now();
        let start = response(
            &Outcome {
                id: &a.id,
                model: &a.model,
                created_at: self.created_at,
                status: Status::InProgress,
                output: &[],
                tokens: None,
            },
            &self.echo,
            None,
        );
        frames(self.writer(a).started(&start))
    }

    fn started(&mut self, _a: &Answering, _index: u32, _prompt: &Usage) -> Vec<Frame> {
        Vec::new()
    }

    fn delta(&mut self, a: &Answering, _index: u32, delta: Delta) -> Vec<Frame> {
        let writer = self.writer(a);
        let events = delta
            .pieces
            .into_iter()
            .flat_map(|piece| writer.push(piece))
            .collect();
        frames(events)
    }

    fn finished(&mut self, a: &Answering, _index: u32, finish: &'static str) -> Vec<Frame> {
        self.finish = Some(finish);
        let incomplete = Status::of_finish(finish) == Status::Incomplete;
        frames(self.writer(a).finish(incomplete))
    }

    async fn ended(&mut self, a: &Answering, usage: &Usage) -> Vec<Frame> {
        let status = Status::of_finish(self.finish.unwrap_or("stop"));
        let name = match status {
            Status::Incomplete => "response.incomplete",
            _ => "response.completed",
        };
        let items = self.writer(a).items();
        let outcome = Outcome {
            id: &a.id,
            model: &a.model,
            created_at: self.created_at,
            status,
            tokens: Some(tokens_of(&a.tokenizer, usage, &items)),
            output: &items,
        };
        let object = response(&outcome, &self.echo, self.sealer());
        let last = self.writer(a).ended(name, &object);
        self.keep(a, &object).await;
        frames(vec![last])
    }

    fn failed(&mut self, a: &Answering, err: &ApiError) -> Vec<Frame> {
        let items = self.writer(a).items();
        let outcome = Outcome {
            id: &a.id,
            model: &a.model,
            created_at: self.created_at,
            status: Status::Failed(err.to_string()),
            tokens: None,
            output: &items,
        };
        let object = response(&outcome, &self.echo, None);
        frames(vec![self.writer(a).ended("response.failed", &object)])
    }

    async fn whole(self, a: Answering, answer: Whole) -> Response {
        // One prompt, one choice.
        let Some(choice) = answer.choices.into_iter().next() else {
            return ApiError::Internal("a response without its choice".into()).into_response();
        };
        let gathered = choice.answer;
        let items = output::items(
            &a.id,
            gathered.reasoning,
            gathered.content,
            gathered.tool_calls,
        );
        let outcome = Outcome {
            id: &a.id,
            model: &a.model,
            created_at: unix_now(),
            status: Status::of_finish(choice.finish),
            tokens: Some(tokens_of(&a.tokenizer, &answer.usage, &items)),
            output: &items,
        };
        let object = response(&outcome, &self.echo, self.sealer());
        self.keep(&a, &object).await;
        axum::Json(object).into_response()
    }
}
