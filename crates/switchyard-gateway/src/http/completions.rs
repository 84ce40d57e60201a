//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Both share one path: parse and validate, admit, tokenize off the reactor, check the context,
//! dispatch, then answer as one JSON body or as server-sent events. The HTTP status is decided
//! by the first dispatch event, so a request no worker could start gets a real error status,
//! not a 200 with an error inside.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use switchyard_core::{Sampling, TokenId};
use switchyard_telemetry::GATEWAY_SPANS;
use switchyard_tokenize::{ChatMessage, ModelDir};
use tracing::Instrument;
use tracing::field::Empty;

use super::AppState;
use crate::admission::FlowKey;
use crate::error::ApiError;
use crate::http::server::BodyTimeout;
use crate::metrics::RequestLabels;
use crate::openai::{ChatCompletionRequest, CompletionRequest, PromptInput, SamplingFields};
use crate::pool::ModelRoutes;
use crate::preprocess::{self, Sessions};

use super::answer::respond;

/// Which API shape to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Text,
}

impl Kind {
    pub(super) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat_completions",
            Kind::Text => "completions",
        }
    }

    /// The route, as the request's trace span names it.
    fn route(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Text => "/v1/completions",
        }
    }

    fn span_name(self) -> &'static str {
        match self {
            Kind::Chat => "POST /v1/chat/completions",
            Kind::Text => "POST /v1/completions",
        }
    }
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

fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad_request("request body is not valid UTF-8"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

fn session_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

pub(super) fn record(state: &AppState, kind: Kind, status: &'static str) {
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            endpoint: kind.endpoint(),
            status,
        })
        .inc();
}

/// Answers with `err`. Runs inside the request's span: a server error marks it failed (a client
/// error is the client's, as OpenTelemetry's HTTP conventions have it).
pub(super) fn fail(state: &AppState, kind: Kind, err: ApiError) -> Response {
    record(state, kind, err.metric_label());
    if err.status().is_server_error() {
        switchyard_telemetry::record_error(&tracing::Span::current(), err.to_string());
    }
    err.into_response()
}

/// Everything decided before dispatch.
pub(super) struct Prepared {
    pub(super) kind: Kind,
    pub(super) request_id: String,
    pub(super) model: String,
    pub(super) model_dir: Arc<ModelDir>,
    pub(super) routes: Arc<ModelRoutes>,
    pub(super) prompt: Vec<TokenId>,
    /// Validated, with `max_tokens` settled against the context.
    pub(super) sampling: Sampling,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// OpenAI's `user`: the fairness tenant, and the session when no `x-session-id` names one.
    pub(super) user: Option<String>,
    pub(super) session: Option<String>,
    pub(super) arrived: Instant,
    /// The request's trace span, held until the answer (a whole stream) is written.
    pub(super) span: tracing::Span,
}

/// The request's sampling, validated once (`switchyard_core::Sampling::validate`), with the
/// fields the gateway cannot honour yet refused by name.
fn sampling_of(s: &SamplingFields, max_tokens: u32) -> Result<Sampling, ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_param("n", "only n = 1 is supported"));
    }
    let logprobs_on = match &s.logprobs {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
        Some(_) => true,
    };
    if logprobs_on || s.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::bad_param(
            if logprobs_on {
                "logprobs"
            } else {
                "top_logprobs"
            },
            "log probabilities are not returned yet",
        ));
    }
    let top_k = match s.top_k {
        // vLLM's and SGLang's "disabled".
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(_) => {
            return Err(ApiError::bad_param(
                "top_k",
                "`top_k` must be at least 1 (or -1 to disable it)",
            ));
        }
    };
    let mut logit_bias = std::collections::BTreeMap::new();
    for (token, bias) in s.logit_bias.iter().flatten() {
        let token: TokenId = token.parse().map_err(|_| {
            ApiError::bad_param(
                "logit_bias",
                format!("`logit_bias` keys are token ids; {token:?} is not one"),
            )
        })?;
        logit_bias.insert(token, *bias);
    }
    let sampling = Sampling {
        max_tokens,
        temperature: s.temperature,
        top_p: s.top_p,
        top_k,
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty,
        logit_bias,
        seed: s.seed,
        stop: s.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
        min_tokens: s.min_tokens,
        ignore_eos: s.ignore_eos,
        skip_special_tokens: s.skip_special_tokens,
        include_stop_str_in_output: s.include_stop_str_in_output,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::bad_param(e.field, e.to_string()))?;
    Ok(sampling)
}

/// A field the gateway does not take is refused by name rather than dropped.
fn refuse_unknown(
    unknown: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Result<(), ApiError> {
    match unknown.keys().next() {
        None => Ok(()),
        Some(field) => Err(ApiError::bad_param(
            field.clone(),
            format!(
                "unsupported field `{field}` (docs/openai-api.md lists the fields the gateway takes)"
            ),
        )),
    }
}

fn model_routes(state: &AppState, model: &str) -> Result<Arc<ModelRoutes>, ApiError> {
    match state.pool.model(model) {
        Some(routes) => Ok(routes),
        None => Err(ApiError::ModelNotFound(model.to_owned())),
    }
}

/// How a request gives its prompt: the only thing the two endpoints do differently.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    Chat {
        messages: Vec<ChatMessage>,
        tools: Option<Vec<serde_json::Value>>,
    },
    Text(String),
    Tokens(Vec<TokenId>),
}

/// A request body as parsed and checked before admission: everything about it that can be
/// refused without the model's state (tokenizer, context length, workers).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub model: String,
    pub sampling: SamplingFields,
    pub prompt: PromptSource,
}

/// Parses and validates a `/v1/chat/completions` body, as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_chat_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    chat_parts(body).and_then(checked)
}

/// Parses and validates a `/v1/completions` body, as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_completion_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    completion_parts(body).and_then(checked)
}

/// A chat body taken apart (its sampling not checked yet: [`checked`]).
fn chat_parts(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let request: ChatCompletionRequest = parse_body(body)?;
    refuse_unknown(&request.unknown)?;
    let messages = preprocess::parse_messages(request.messages)?;
    Ok(ParsedRequest {
        model: request.model,
        sampling: request.sampling,
        prompt: PromptSource::Chat {
            messages,
            tools: request.tools,
        },
    })
}

/// A text completion body taken apart (its sampling not checked yet: [`checked`]).
fn completion_parts(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let request: CompletionRequest = parse_body(body)?;
    refuse_unknown(&request.unknown)?;
    if request.echo {
        return Err(ApiError::bad_param("echo", "echo is not supported"));
    }
    let prompt = match request.prompt {
        PromptInput::Text(text) => PromptSource::Text(text),
        PromptInput::Tokens(tokens) => PromptSource::Tokens(tokens),
        PromptInput::TextBatch(_) | PromptInput::TokenBatch(_) => {
            return Err(ApiError::bad_param(
                "prompt",
                "only one prompt per request is supported",
            ));
        }
    };
    Ok(ParsedRequest {
        model: request.model,
        sampling: request.sampling,
        prompt,
    })
}

/// The sampling checks that need no model: done before admission and tokenization (max_tokens
/// is settled after them, against the prompt's length, in [`prepare`]).
fn checked(request: ParsedRequest) -> Result<ParsedRequest, ApiError> {
    let asked = request
        .sampling
        .max_completion_tokens
        .or(request.sampling.max_tokens);
    sampling_of(&request.sampling, asked.unwrap_or(u32::MAX))?;
    Ok(request)
}

/// The client's address, when the server was started with connection info.
type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// POST /v1/chat/completions
pub async fn chat(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Kind::Chat, peer, headers, body, chat_parts).await
}

/// POST /v1/completions
pub async fn completions(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Kind::Text, peer, headers, body, completion_parts).await
}

/// Runs [`serve`] in the request's trace span (the root of the request's trace).
async fn handle(
    state: Arc<AppState>,
    kind: Kind,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    parse: fn(&[u8]) -> Result<ParsedRequest, ApiError>,
) -> Response {
    let span = tracing::info_span!(
        target: GATEWAY_SPANS,
        "request",
        otel.name = kind.span_name(),
        otel.kind = "server",
        http.request.method = "POST",
        http.route = kind.route(),
        http.response.status_code = Empty,
        gen_ai.request.model = Empty,
        request_id = Empty,
        stream = Empty,
    );
    let response = serve(state, kind, peer, headers, body, parse)
        .instrument(span.clone())
        .await;
    span.record(
        "http.response.status_code",
        i64::from(response.status().as_u16()),
    );
    response
}

/// The shared path: read and parse the body, validate, admit, tokenize, check the context,
/// then answer. `parse` is the endpoint's: it takes the request apart into model, sampling and
/// prompt, whose sampling is then [`checked`].
async fn serve(
    state: Arc<AppState>,
    kind: Kind,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    parse: fn(&[u8]) -> Result<ParsedRequest, ApiError>,
) -> Response {
    let arrived = Instant::now();
    let prepared = async {
        let parts = parse(&read_body(&state, body)?)?;
        let span = tracing::Span::current();
        span.record("gen_ai.request.model", parts.model.as_str());
        span.record("stream", parts.sampling.stream);
        let ParsedRequest {
            model,
            sampling,
            prompt: source,
        } = checked(parts)?;
        let routes = model_routes(&state, &model)?;
        let session = session_of(&headers);
        let client = peer.map(|Extension(ConnectInfo(addr))| addr.ip());
        let flow = FlowKey::of_request(session.clone(), sampling.user.as_deref(), &headers, client);
        let admission = tracing::info_span!(target: GATEWAY_SPANS, "admission");
        let permit = state
            .admission
            .admit(flow, client, &state.metrics)
            .instrument(admission)
            .await?;
        let tokenizer = state.tokenizers.for_model(&model);
        let track = Sessions::Track(session.clone());
        let max_prompt = preprocess::prompt_limit(routes.max_context_tokens);
        let preprocess_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            "preprocess",
            input = Empty,
            prompt_tokens = Empty,
            session_cache_hit = Empty,
            reused_tokens = Empty,
        );
        let prompt = async {
            let span = tracing::Span::current();
            match source {
                PromptSource::Chat { messages, tools } => {
                    span.record("input", "chat");
                    let tokenizer = Arc::clone(&tokenizer);
                    preprocess::encode_chat(
                        &state.metrics,
                        tokenizer,
                        messages,
                        tools,
                        track,
                        max_prompt,
                    )
                    .await
                }
                PromptSource::Text(text) => {
                    span.record("input", "text");
                    let tokenizer = Arc::clone(&tokenizer);
                    preprocess::encode_text(&state.metrics, tokenizer, text, track, max_prompt)
                        .await
                }
                PromptSource::Tokens(tokens) => {
                    span.record("input", "tokens");
                    Ok(tokens)
                }
            }
        }
        .instrument(preprocess_span.clone())
        .await
        // The request span follows HTTP's rule (only a 5xx is its failure); this step failed
        // whoever's fault it was, and the trace should show where.
        .inspect_err(|err| switchyard_telemetry::record_error(&preprocess_span, err.to_string()))?;
        preprocess_span.record("prompt_tokens", prompt.len() as i64);
        drop(preprocess_span);
        let model_dir = Arc::clone(&tokenizer.dir);
        let prepared = prepare(
            &state, kind, model, model_dir, routes, prompt, sampling, session, arrived,
        )?;
        Ok::<_, ApiError>((permit, prepared))
    }
    .await;
    match prepared {
        Ok((permit, prepared)) => respond(state, prepared, permit).await,
        Err(err) => fail(&state, kind, err),
    }
}

#[allow(clippy::too_many_arguments)]
fn prepare(
    state: &AppState,
    kind: Kind,
    model: String,
    model_dir: Arc<ModelDir>,
    routes: Arc<ModelRoutes>,
    prompt: Vec<TokenId>,
    sampling: SamplingFields,
    session: Option<String>,
    arrived: Instant,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    let context = routes.max_context_tokens;
    let prompt_len = prompt.len() as u64;
    if prompt_len >= context {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {context} tokens. However, your prompt has {prompt_len} tokens."
        )));
    }
    let max_tokens = match sampling.max_completion_tokens.or(sampling.max_tokens) {
        Some(asked) => {
            if prompt_len + u64::from(asked) > context {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {asked} for the completion).",
                        prompt_len + u64::from(asked)
                    ),
                ));
            }
            asked
        }
        None => (context - prompt_len).min(u64::from(state.config.default_max_tokens)) as u32,
    };
    let checked = sampling_of(&sampling, max_tokens)?;
    let request_id = format!(
        "{}-{:016x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        rand_id()
    );
    // `serve` runs in the request's span.
    let span = tracing::Span::current();
    span.record("request_id", request_id.as_str());
    Ok(Prepared {
        kind,
        request_id,
        model,
        model_dir,
        routes,
        prompt,
        sampling: checked,
        stream: sampling.stream,
        include_usage: sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        user: sampling.user,
        session,
        arrived,
        span,
    })
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
