//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Both share one path: parse and validate ([`super::asks`]), admit, tokenize off the reactor,
//! check the context, then answer ([`super::answer`]) as one JSON body or as server-sent
//! events. A request may carry several prompts (text completions) and ask for `n` choices of
//! each; every choice is its own routed generation. The HTTP status is decided by the first
//! dispatch event, so a request no worker could start gets a real error status, not a 200 with
//! an error inside.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use switchyard_core::{KvIdentity, Sampling, TokenId};
use switchyard_telemetry::GATEWAY_SPANS;
use switchyard_tokenize::ModelDir;
use tracing::Instrument;
use tracing::field::Empty;

use super::AppState;
use super::fields::{FieldNotes, SessionSource};
use super::prompts::Template;
use crate::admission::FlowKey;
use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::http::ApiTenant;
use crate::http::server::BodyTimeout;
use crate::metrics::RequestLabels;
use crate::openai::fields::{Endpoint, notes_of};
use crate::openai::{ChatCompletionRequest, CompletionRequest, PromptInput, SamplingFields};
use crate::pool::ModelRoutes;
use crate::preprocess;
use crate::quota::QuotaPass;
use crate::routing::{BlockNaming, PromptHashes};

use super::asks::{Asks, asks_of, sampling_of};
pub use super::prompts::PromptSource;
use super::prompts::{Tokenized, settle_max_tokens, tokenize};

use super::answer::respond;

/// Which API shape to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Text,
    /// `/v1/responses`: a chat request answered in the Responses shape (`super::responses`).
    Responses,
    /// Anthropic's Messages API: a chat request, answered in Anthropic's shapes by
    /// [`super::anthropic`] from the chat answer.
    Messages,
}

impl Kind {
    pub(super) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat_completions",
            Kind::Text => "completions",
            Kind::Responses => "responses",
            Kind::Messages => "messages",
        }
    }

    /// Whether the answer is a chat answer (messages, reasoning and tool calls): every kind but
    /// the text completion; Responses and Messages answers are chat answers rewritten.
    pub(super) fn is_chat(self) -> bool {
        !matches!(self, Kind::Text)
    }

    /// The route, as the request's trace span names it.
    fn route(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Text => "/v1/completions",
            Kind::Responses => "/v1/responses",
            Kind::Messages => "/v1/messages",
        }
    }

    /// The page whose field table covers this API.
    pub(super) fn docs(self) -> &'static str {
        match self {
            Kind::Messages => "docs/anthropic-api.md",
            _ => "docs/openai-api.md",
        }
    }

    fn span_name(self) -> &'static str {
        match self {
            Kind::Chat => "POST /v1/chat/completions",
            Kind::Text => "POST /v1/completions",
            Kind::Responses => "POST /v1/responses",
            Kind::Messages => "POST /v1/messages",
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

pub(super) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad_request("request body is not valid UTF-8"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// The session a request's headers name (`x-session-id`, Claude Code's and Codex's session
/// headers: [`super::fields::session_header`]); the fleet forwards by the same reading.
pub(crate) fn session_of(headers: &HeaderMap) -> Option<String> {
    super::fields::session_header(headers).map(|(_, key)| key)
}

pub(super) fn record(state: &AppState, kind: Kind, model: &str, status: &'static str) {
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            endpoint: kind.endpoint(),
            status,
            model: model.to_owned(),
        })
        .inc();
}

/// Answers with `err`. Runs inside the request's span: a server error marks it failed (a client
/// error is the client's, as OpenTelemetry's HTTP conventions have it). `model` labels the
/// request's metrics: a model the gateway serves, or empty (so no client can make up labels).
pub(super) fn fail(state: &AppState, kind: Kind, model: &str, err: ApiError) -> Response {
    record(state, kind, model, err.metric_label());
    if err.status().is_server_error() {
        switchyard_telemetry::record_error(&tracing::Span::current(), err.to_string());
    }
    err.into_response()
}

/// One prompt of a request, ready to generate from.
pub(super) struct PromptPlan {
    pub(super) tokens: Vec<TokenId>,
    /// Its block hashes, computed with its tokens.
    pub(super) hashes: PromptHashes,
    /// Validated, with `max_tokens` settled against the context.
    pub(super) sampling: Sampling,
    /// With `echo`: the prompt's text, which the answer starts with.
    pub(super) echo: Option<String>,
}

/// Everything decided before dispatch.
pub(super) struct Prepared {
    pub(super) kind: Kind,
    /// The request's id: the client's `x-request-id`, else generated (then the same as
    /// `completion_id`). Decisions are logged under it and the response carries it.
    pub(super) request_id: String,
    /// The answer's `id` (`chatcmpl-…` or `cmpl-…`).
    pub(super) completion_id: String,
    pub(super) model: String,
    pub(super) model_dir: Arc<ModelDir>,
    pub(super) routes: Arc<ModelRoutes>,
    /// One or more prompts; each makes `asks.n` choices.
    pub(super) prompts: Vec<PromptPlan>,
    pub(super) asks: Asks,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// OpenAI's `user`: the fairness tenant, and the session when no `x-session-id` names one.
    pub(super) user: Option<String>,
    pub(super) session: Option<String>,
    /// What named the session (a header, `prompt_cache_key`, ...), shown in the decision log.
    pub(super) session_source: Option<SessionSource>,
    /// The advisory and unknown fields the request carried, shown in the decision log.
    pub(super) ignored: Vec<String>,
    /// The API key's tenant (none on an open gateway): who may read a stored response.
    pub(super) tenant: Option<String>,
    /// What besides its tokens names the prompt's KV (the cache salt).
    pub(super) identity: KvIdentity,
    /// Where each choice after the first waits for admission.
    pub(super) flow: FlowKey,
    pub(super) client: Option<IpAddr>,
    pub(super) arrived: Instant,
    /// The request's trace span, held until the answer (a whole stream) is written.
    pub(super) span: tracing::Span,
    /// How a chat answer's reasoning and tool calls are read from the text.
    pub(super) output: ChatOutput,
    /// `/v1/responses`: the settings its answer repeats.
    pub(super) responses: Option<Arc<super::responses::Echo>>,
    /// The tenant's quota, held until the answer is written; each choice charges its tokens.
    pub(super) quota: Arc<QuotaPass>,
}

impl Prepared {
    /// Choices of the whole request: prompts × n.
    pub(super) fn choices(&self) -> u32 {
        self.prompts.len() as u32 * self.asks.n
    }
}

pub(crate) fn model_routes(state: &AppState, model: &str) -> Result<Arc<ModelRoutes>, ApiError> {
    served_model(state, model).map(|served| served.routes)
}

/// What a request's `model` names: a base model the workers serve, or a LoRA adapter some of
/// them serve, which runs on its base model's routes (tokenizer, context, index) with the
/// adapter's KV, on the workers that serve it.
#[derive(Debug)]
pub struct ServedModel {
    pub routes: Arc<ModelRoutes>,
    pub adapter: Option<String>,
}

/// Resolves `model` (see [`ServedModel`]); an unknown name is a 404, an adapter that workers
/// of two base models claim a 400 naming both.
pub fn served_model(state: &AppState, model: &str) -> Result<ServedModel, ApiError> {
    if let Some(routes) = state.pool.model(model) {
        return Ok(ServedModel {
            routes,
            adapter: None,
        });
    }
    match &state.pool.adapter_models(model)[..] {
        [base] => match state.pool.model(base) {
            Some(routes) => Ok(ServedModel {
                routes,
                adapter: Some(model.to_owned()),
            }),
            None => Err(ApiError::ModelNotFound(model.to_owned())),
        },
        [] => Err(ApiError::ModelNotFound(model.to_owned())),
        several => Err(ApiError::bad_param(
            "model",
            format!(
                "LoRA adapter `{model}` is served on more than one base model ({}); name a base model",
                several.join(", ")
            ),
        )),
    }
}

/// What an endpoint's request comes apart into.
#[derive(Debug)]
pub struct ParsedRequest {
    pub model: String,
    pub sampling: SamplingFields,
    pub source: PromptSource,
    pub echo: bool,
    /// `/v1/responses`: the request's settings, which its answer repeats.
    pub responses: Option<Arc<super::responses::Echo>>,
    /// What the request carried besides what it is served from ([`super::fields`]).
    pub notes: FieldNotes,
}

/// Parses and checks a `/v1/chat/completions` body as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_chat_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    chat_split(parse_body(body)?).and_then(|r| checked(Kind::Chat, r))
}

/// Parses and checks a `/v1/completions` body as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_completion_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    completion_split(parse_body(body)?).and_then(|r| checked(Kind::Text, r))
}

/// The checks `serve` makes before admission: the choices asked and the sampling.
pub(super) fn checked(kind: Kind, r: ParsedRequest) -> Result<ParsedRequest, ApiError> {
    let asks = asks_of(kind, &r.sampling, r.echo, r.source.count())?;
    let asked = r.sampling.max_completion_tokens.or(r.sampling.max_tokens);
    sampling_of(&r.sampling, asked.unwrap_or(u32::MAX), asks.logprobs)?;
    Ok(r)
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
        responses: None,
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
        responses: None,
        notes,
    })
}

/// The client's address, when the server was started with connection info.
pub(super) type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// POST /v1/chat/completions
pub async fn chat(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(
        state,
        tenant.map(|Extension(t)| t),
        Kind::Chat,
        peer,
        headers,
        body,
        chat_split,
    )
    .await
}

/// POST /v1/completions
pub async fn completions(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(
        state,
        tenant.map(|Extension(t)| t),
        Kind::Text,
        peer,
        headers,
        body,
        completion_split,
    )
    .await
}

/// The header naming a request, taken from the client when it sends one and always answered.
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// The client's `x-request-id` when it sent a valid one; `Ok(None)` when it sent none.
fn client_request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(REQUEST_ID_HEADER) else {
        return Ok(None);
    };
    let id = value
        .to_str()
        .map_err(|_| ApiError::bad_request("x-request-id is not visible ASCII"))?;
    crate::audit::check_request_id(id).map_err(ApiError::bad_request)?;
    Ok(Some(id.to_owned()))
}

fn completion_id(kind: Kind) -> String {
    match kind {
        Kind::Chat => format!("chatcmpl-{:016x}", rand_id()),
        Kind::Text => format!("cmpl-{:016x}", rand_id()),
        Kind::Responses => format!("resp_{:016x}", rand_id()),
        Kind::Messages => format!("msg_{:016x}", rand_id()),
    }
}

/// Runs [`serve`] in the request's trace span (the root of the request's trace).
pub(super) async fn handle<T: DeserializeOwned>(
    state: Arc<AppState>,
    tenant: Option<ApiTenant>,
    kind: Kind,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    split: impl FnOnce(T) -> Result<ParsedRequest, ApiError>,
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
    let completion_id = completion_id(kind);
    let (mut response, request_id) = match client_request_id(&headers) {
        Ok(client_id) => {
            let request_id = client_id.unwrap_or_else(|| completion_id.clone());
            let ids = Ids {
                request_id: request_id.clone(),
                completion_id,
                tenant,
            };
            let response = serve(state, kind, peer, headers, body, ids, split)
                .instrument(span.clone())
                .await;
            (response, request_id)
        }
        Err(err) => {
            let response = span.in_scope(|| fail(&state, kind, "", err));
            (response, completion_id)
        }
    };
    if let Ok(value) = axum::http::HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    span.record(
        "http.response.status_code",
        i64::from(response.status().as_u16()),
    );
    response
}

/// Who a request is: its ids, and the tenant its API key names.
struct Ids {
    request_id: String,
    completion_id: String,
    tenant: Option<ApiTenant>,
}

/// The shared path: read and parse the body, validate, admit, tokenize, check the context,
/// then answer. `split` takes the endpoint's request apart into model, sampling and prompts.
async fn serve<T: DeserializeOwned>(
    state: Arc<AppState>,
    kind: Kind,
    peer: Peer,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ids: Ids,
    split: impl FnOnce(T) -> Result<ParsedRequest, ApiError>,
) -> Response {
    let arrived = Instant::now();
    // Labels the request's metrics once the model is known to be served.
    let mut metric_model = String::new();
    let prepared = async {
        let request: T = parse_body(&read_body(&state, body)?)?;
        let ParsedRequest {
            model,
            sampling,
            source,
            echo,
            responses,
            mut notes,
        } = split(request)?;
        notes.check(state.config.api.unknown_fields, kind.docs())?;
        let span = tracing::Span::current();
        span.record("gen_ai.request.model", model.as_str());
        span.record("stream", sampling.stream);
        // Checked before admission and tokenization (max_tokens is settled after them, with
        // the prompt's length).
        let asks = asks_of(kind, &sampling, echo, source.count())?;
        let asked = sampling.max_completion_tokens.or(sampling.max_tokens);
        sampling_of(&sampling, asked.unwrap_or(u32::MAX), asks.logprobs)?;
        let mut identity = salted_identity(sampling.cache_salt.clone())?;
        let ServedModel { routes, adapter } = served_model(&state, &model)?;
        identity.adapter = adapter;
        metric_model.clone_from(&model);
        // An adapter runs on its base model's tokenizer and chat template.
        let base = routes.model.as_str();
        let tokenizer = state.tokenizers.for_model(base);
        let (source, output) = settle_output(&state, base, &tokenizer.dir, source)?;
        if output.guided().is_some() && super::guided::guided_of(&sampling)?.is_some() {
            return Err(ApiError::bad_param(
                "tool_choice",
                "a required or named tool_choice constrains the output already; drop the other constraint",
            ));
        }
        // The session: a header naming it (ours, Claude Code's, Codex's), else the body's
        // (`prompt_cache_key`, Claude Code's `metadata.user_id`).
        let (session_source, session) = match super::fields::session_header(&headers)
            .or_else(|| notes.session.clone())
        {
            Some((source, key)) => (Some(source), Some(key)),
            None => (None, None),
        };
        let template = Template {
            kwargs: notes.settle_template(tokenizer.dir.chat_template()),
            add_generation_prompt: notes.add_generation_prompt.unwrap_or(true),
        };
        count_ignored(&state, kind, &notes);
        let client = peer.map(|Extension(ConnectInfo(addr))| addr.ip());
        // An API key's tenant is the fairness tenant; its users (or sessions) share its slots.
        let flow = match &ids.tenant {
            Some(ApiTenant(tenant)) => {
                FlowKey::of_tenant(tenant, session.clone().or_else(|| sampling.user.clone()))
            }
            None => {
                FlowKey::of_request(session.clone(), sampling.user.as_deref(), &headers, client)
            }
        };
        // The tenant's fleet-wide quota first: a request over it waits for no local slot.
        let quota = Arc::new(state.quota.enter(&flow.tenant).await?);
        let admission = tracing::info_span!(target: GATEWAY_SPANS, "admission");
        let permit = state
            .admission
            .admit(flow.clone(), client, &state.metrics)
            .instrument(admission)
            .await?;
        let naming = BlockNaming {
            block_size: routes.block_size,
            identity: identity.clone(),
        };
        let prompts = tokenize(
            &state,
            &tokenizer,
            source,
            template,
            session.clone(),
            &routes,
            &naming,
        )
        .await?;
        let model_dir = Arc::clone(&tokenizer.dir);
        let prepared = prepare(
            &state,
            Request {
                kind,
                ids,
                model,
                model_dir,
                routes,
                prompts,
                identity,
                sampling,
                asks,
                session,
                session_source,
                ignored: notes.ignored(),
                flow,
                client,
                arrived,
                output,
                responses,
                quota,
            },
        )?;
        Ok::<_, ApiError>((permit, prepared))
    }
    .await;
    match prepared {
        Ok((permit, prepared)) => respond(state, prepared, permit).await,
        Err(err) => fail(&state, kind, &metric_model, err),
    }
}

/// What [`prepare`] decides from.
struct Request {
    kind: Kind,
    ids: Ids,
    model: String,
    model_dir: Arc<ModelDir>,
    routes: Arc<ModelRoutes>,
    prompts: Vec<Tokenized>,
    /// The KV identity the prompts' blocks were hashed under (the adapter and `cache_salt`).
    identity: KvIdentity,
    sampling: SamplingFields,
    asks: Asks,
    session: Option<String>,
    session_source: Option<SessionSource>,
    ignored: Vec<String>,
    flow: FlowKey,
    client: Option<IpAddr>,
    arrived: Instant,
    output: ChatOutput,
    responses: Option<Arc<super::responses::Echo>>,
    quota: Arc<QuotaPass>,
}

/// Counts the fields a request carried without effect (`switchyard_ignored_fields_total`).
fn count_ignored(state: &AppState, kind: Kind, notes: &FieldNotes) {
    let api = kind.endpoint();
    for field in notes.advisory_names() {
        state.metrics.fields.advisory(api, field);
    }
    for field in notes.unknown_names() {
        state.metrics.fields.unknown(api, field);
    }
}

/// The KV identity a request's `cache_salt` names, refused by that field's name when invalid.
pub fn salted_identity(cache_salt: Option<String>) -> Result<KvIdentity, ApiError> {
    KvIdentity::new(None, cache_salt).map_err(|e| ApiError::bad_param("cache_salt", e.to_string()))
}

/// Checks each prompt against the context and settles its `max_tokens`.
fn prepare(state: &AppState, r: Request) -> Result<Prepared, ApiError> {
    let context = r.routes.max_context_tokens;
    let mut prompts = Vec::with_capacity(r.prompts.len());
    for prompt in r.prompts {
        let max_tokens = settle_max_tokens(
            context,
            prompt.tokens.len() as u64,
            r.sampling.max_completion_tokens.or(r.sampling.max_tokens),
            state.config.default_max_tokens,
        )?;
        let mut sampling = sampling_of(&r.sampling, max_tokens, r.asks.logprobs)?;
        if let Some(guided) = r.output.guided() {
            sampling.guided = Some(guided);
        }
        let echo = if r.asks.echo {
            Some(match prompt.text {
                Some(text) => text,
                None => r
                    .model_dir
                    .tokenizer()
                    .decode(
                        &prompt.tokens,
                        r.sampling.skip_special_tokens.unwrap_or(true),
                    )
                    .map_err(|e| ApiError::bad_param("prompt", e.to_string()))?,
            })
        } else {
            None
        };
        prompts.push(PromptPlan {
            tokens: prompt.tokens,
            hashes: prompt.hashes,
            sampling,
            echo,
        });
    }
    let identity = r.identity;
    let Ids {
        request_id,
        completion_id,
        tenant,
    } = r.ids;
    // `serve` runs in the request's span.
    let span = tracing::Span::current();
    span.record("request_id", request_id.as_str());
    Ok(Prepared {
        kind: r.kind,
        request_id,
        completion_id,
        model: r.model,
        model_dir: r.model_dir,
        routes: r.routes,
        prompts,
        asks: r.asks,
        stream: r.sampling.stream,
        include_usage: r
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        user: r.sampling.user,
        session: r.session,
        session_source: r.session_source,
        ignored: r.ignored,
        tenant: tenant.map(|ApiTenant(t)| t),
        identity,
        flow: r.flow,
        client: r.client,
        arrived: r.arrived,
        span,
        output: r.output,
        responses: r.responses,
        quota: r.quota,
    })
}

/// Settles a chat request's tools against the model's output parsers (before admission, so a
/// request that cannot be honoured waits for nothing); other requests read plain text.
fn settle_output(
    state: &AppState,
    model: &str,
    dir: &ModelDir,
    source: PromptSource,
) -> Result<(PromptSource, ChatOutput), ApiError> {
    match source {
        PromptSource::Chat {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls,
        } => {
            let formats = state.config.output.formats(model, dir);
            let (output, tools) =
                ChatOutput::resolve(formats, model, tools, tool_choice, parallel_tool_calls)?;
            let source = PromptSource::Chat {
                messages,
                tools,
                tool_choice: None,
                parallel_tool_calls: None,
            };
            Ok((source, output))
        }
        other => Ok((other, ChatOutput::default())),
    }
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
