//! What the pipeline knows of a request: the API it came by ([`Api`]), the request taken apart
//! ([`ParsedRequest`]), everything decided before dispatch ([`Prepared`]), and how its outcome
//! is counted ([`record`]) or refused ([`fail`]). The renderers and the driver read these; none
//! of it knows any one API.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::de::DeserializeOwned;
use switchyard_core::{KvIdentity, Sampling, TokenId};
use switchyard_tokenize::ModelDir;

use crate::access::admission::FlowKey;
use crate::access::quota::QuotaPass;
use crate::api::chat_output::ChatOutput;
pub use crate::api::http::asks::Shape;
use crate::api::http::asks::{Asks, asks_of, sampling_of};
use crate::api::http::fields::{FieldNotes, SessionSource};
use crate::api::http::prompts::PromptSource;
use crate::api::http::server::BodyTimeout;
use crate::api::http::state::AppState;
use crate::api::openai::SamplingFields;
use crate::cluster::pool::ModelRoutes;
use crate::error::ApiError;
use crate::observe::metrics::RequestLabels;
pub use crate::serving::model::{ServedModel, salted_identity, served_model};
use crate::serving::routing::PromptHashes;

/// What the shared pipeline knows of an API: its names, what its answers are read into, and how
/// it words a refusal. Each API defines one; nothing in the pipeline asks which API it is.
#[derive(Debug)]
pub struct Api {
    /// The `endpoint` label of the request metrics.
    pub endpoint: &'static str,
    /// The route, as the request's trace span names it.
    pub route: &'static str,
    /// The request span's OpenTelemetry name.
    pub span_name: &'static str,
    /// The page whose field table covers this API.
    pub docs: &'static str,
    /// How the answer's id starts (`chatcmpl-`, `cmpl-`, `resp_`, `msg_`).
    pub id_prefix: &'static str,
    pub shape: Shape,
    /// A refusal in the API's own shape, with the error's status and headers.
    pub error: fn(ApiError) -> Response,
}

/// The body, or the error a client should see when it could not be read (too large, cut off).
pub(crate) fn read_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(state.config.max_body_bytes)
        } else if let Some(BodyTimeout(secs)) = BodyTimeout::find(&rejection) {
            ApiError::BodyTimeout(secs)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {rejection}"))
        }
    })
}

pub(crate) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad_request("request body is not valid UTF-8"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// The session a request's headers name (`x-session-id`, Claude Code's and Codex's session
/// headers: [`crate::api::http::fields::session_header`]); the fleet forwards by the same reading.
pub(crate) fn session_of(headers: &HeaderMap) -> Option<String> {
    crate::api::http::fields::session_header(headers).map(|(_, key)| key)
}

/// Counts one request of `api` by how it ended.
pub(crate) fn record(state: &AppState, api: &Api, model: &str, status: &'static str) {
    state
        .observers
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            endpoint: api.endpoint,
            status,
            model: model.to_owned(),
        })
        .inc();
}

/// Answers with `err`, in `api`'s shape. Runs inside the request's span: a server error marks it
/// failed (a client error is the client's, as OpenTelemetry's HTTP conventions have it).
/// `model` labels the request's metrics: a model the gateway serves, or empty (so no client can
/// make up labels).
pub(crate) fn fail(state: &AppState, api: &Api, model: &str, err: ApiError) -> Response {
    record(state, api, model, err.metric_label());
    if err.status().is_server_error() {
        switchyard_telemetry::record_error(&tracing::Span::current(), err.to_string());
    }
    (api.error)(err)
}

/// One prompt of a request, ready to generate from.
pub(crate) struct PromptPlan {
    pub(crate) tokens: Vec<TokenId>,
    /// Its block hashes, computed with its tokens.
    pub(crate) hashes: PromptHashes,
    /// Validated, with `max_tokens` settled against the context.
    pub(crate) sampling: Sampling,
    /// With `echo`: the prompt's text, which the answer starts with.
    pub(crate) echo: Option<String>,
}

/// Everything decided before dispatch.
pub(crate) struct Prepared {
    pub(crate) api: &'static Api,
    /// The request's id: the client's `x-request-id`, else generated (then the same as
    /// `completion_id`). Decisions are logged under it and the response carries it.
    pub(crate) request_id: String,
    /// The answer's `id` (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`).
    pub(crate) completion_id: String,
    pub(crate) model: String,
    pub(crate) model_dir: Arc<ModelDir>,
    pub(crate) routes: Arc<ModelRoutes>,
    /// One or more prompts; each makes `asks.n` choices.
    pub(crate) prompts: Vec<PromptPlan>,
    pub(crate) asks: Asks,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// OpenAI's `user`: the fairness tenant, and the session when no `x-session-id` names one.
    pub(crate) user: Option<String>,
    pub(crate) session: Option<String>,
    /// What named the session (a header, `prompt_cache_key`, ...), shown in the decision log.
    pub(crate) session_source: Option<SessionSource>,
    /// The advisory and unknown fields the request carried, shown in the decision log.
    pub(crate) ignored: Vec<String>,
    /// The request's scheduling priority (lower is earlier), sent to its workers.
    pub(crate) priority: Option<i32>,
    /// The API key's tenant (none on an open gateway): who may read a stored response.
    pub(crate) tenant: Option<String>,
    /// What besides its tokens names the prompt's KV (the cache salt).
    pub(crate) identity: KvIdentity,
    /// Where each choice after the first waits for admission.
    pub(crate) flow: FlowKey,
    pub(crate) client: Option<IpAddr>,
    pub(crate) arrived: Instant,
    /// The request's trace span, held until the answer (a whole stream) is written.
    pub(crate) span: tracing::Span,
    /// How a chat answer's reasoning and tool calls are read from the text.
    pub(crate) output: ChatOutput,
    /// The tenant's quota, held until the answer is written; each choice charges its tokens.
    pub(crate) quota: Arc<QuotaPass>,
}

impl Prepared {
    /// Choices of the whole request: prompts × n.
    pub(crate) fn choices(&self) -> u32 {
        self.prompts.len() as u32 * self.asks.n
    }
}

pub(crate) fn model_routes(state: &AppState, model: &str) -> Result<Arc<ModelRoutes>, ApiError> {
    served_model(&state.pool, model).map(|served| served.routes)
}

/// What an endpoint's request comes apart into.
#[derive(Debug)]
pub struct ParsedRequest {
    pub model: String,
    pub sampling: SamplingFields,
    pub source: PromptSource,
    pub echo: bool,
    /// What the request carried besides what it is served from ([`crate::api::http::fields`]).
    pub notes: FieldNotes,
}

/// The checks the pipeline makes before admission: the choices asked and the sampling.
pub(crate) fn checked(api: &Api, r: ParsedRequest) -> Result<ParsedRequest, ApiError> {
    let asks = asks_of(api.shape, &r.sampling, r.echo, r.source.count())?;
    let asked = r.sampling.max_completion_tokens.or(r.sampling.max_tokens);
    sampling_of(&r.sampling, asked.unwrap_or(u32::MAX), asks.logprobs)?;
    Ok(r)
}
