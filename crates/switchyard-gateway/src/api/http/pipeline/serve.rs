//! The request pipeline every API runs: read and parse the body, take it apart (the API's
//! `split`, which also makes its renderer), validate, admit (quota, then a fair slot), tokenize
//! off the reactor, check the context, then answer through the API's renderer
//! ([`crate::api::http::render`]). A refusal at any step leaves in the API's own shape
//! ([`super::prepared::fail`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::de::DeserializeOwned;
use switchyard_core::KvIdentity;
use switchyard_telemetry::GATEWAY_SPANS;
use switchyard_tokenize::ModelDir;
use tracing::Instrument;
use tracing::field::Empty;

use super::prepared::{
    Api, ParsedRequest, Prepared, PromptPlan, ServedModel, fail, parse_body, read_body,
    salted_identity, served_model,
};
use crate::access::admission::FlowKey;
use crate::access::quota::QuotaPass;
use crate::api::chat_output::ChatOutput;
use crate::api::http::asks::{Asks, asks_of, sampling_of};
use crate::api::http::fields::{FieldNotes, SessionSource, session_header};
use crate::api::http::prompts::{PromptSource, Template, Tokenized, settle_max_tokens, tokenize};
use crate::api::http::render::{Renderer, respond};
use crate::api::http::state::{ApiTenant, AppState};
use crate::api::openai::SamplingFields;
use crate::cluster::pool::ModelRoutes;
use crate::error::ApiError;
use crate::serving::preprocess::ModelTokenizer;
use crate::serving::routing::BlockNaming;

/// The client's address, when the server was started with connection info.
pub(crate) type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// The header naming a request, taken from the client when it sends one and always answered.
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// A request as its API's handler received it.
pub(crate) struct Incoming {
    /// The tenant of the API key it was let in with.
    pub(crate) tenant: Option<ApiTenant>,
    pub(crate) peer: Peer,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Result<Bytes, BytesRejection>,
}

/// Serves one request of `api` in the request's trace span (the root of the request's trace).
/// `split` takes the API's body apart into the pipeline's request and the renderer that
/// answers it.
pub(crate) async fn handle<T: DeserializeOwned, R: Renderer>(
    state: Arc<AppState>,
    api: &'static Api,
    incoming: Incoming,
    split: impl FnOnce(T) -> Result<(ParsedRequest, R), ApiError>,
) -> Response {
    let span = tracing::info_span!(
        target: GATEWAY_SPANS,
        "request",
        otel.name = api.span_name,
        otel.kind = "server",
        http.request.method = "POST",
        http.route = api.route,
        http.response.status_code = Empty,
        gen_ai.request.model = Empty,
        request_id = Empty,
        stream = Empty,
    );
    let completion_id = format!("{}{:016x}", api.id_prefix, rand_id());
    let (mut response, request_id) = match client_request_id(&incoming.headers) {
        Ok(client_id) => {
            let request_id = client_id.unwrap_or_else(|| completion_id.clone());
            let ids = Ids {
                request_id: request_id.clone(),
                completion_id,
            };
            let response = serve(state, api, incoming, ids, split)
                .instrument(span.clone())
                .await;
            (response, request_id)
        }
        Err(err) => {
            let response = span.in_scope(|| fail(&state, api, "", err));
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

/// The client's `x-request-id` when it sent a valid one; `Ok(None)` when it sent none.
fn client_request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(REQUEST_ID_HEADER) else {
        return Ok(None);
    };
    let id = value
        .to_str()
        .map_err(|_| ApiError::bad_request("x-request-id is not visible ASCII"))?;
    crate::observe::audit::check_request_id(id).map_err(ApiError::bad_request)?;
    Ok(Some(id.to_owned()))
}

/// A request's ids.
struct Ids {
    request_id: String,
    completion_id: String,
}

/// The pipeline: prepare and admit, then answer through the renderer; a refusal is counted
/// under the model once the model is known to be served.
async fn serve<T: DeserializeOwned, R: Renderer>(
    state: Arc<AppState>,
    api: &'static Api,
    incoming: Incoming,
    ids: Ids,
    split: impl FnOnce(T) -> Result<(ParsedRequest, R), ApiError>,
) -> Response {
    let arrived = Instant::now();
    let mut metric_model = String::new();
    let admitted = async {
        let (parsed, renderer) = read(&state, api, incoming.body, split)?;
        let client = incoming.peer.map(|Extension(ConnectInfo(addr))| addr.ip());
        let settled = settle(&state, api, parsed, &incoming.headers, &mut metric_model)?;
        let flow = flow_of(
            &settled,
            incoming.tenant.as_ref(),
            &incoming.headers,
            client,
        );
        // The tenant's fleet-wide quota first: a request over it waits for no local slot.
        let quota = Arc::new(state.quota.enter(&flow.tenant).await?);
        let admission = tracing::info_span!(target: GATEWAY_SPANS, "admission");
        let permit = state
            .admission
            .admit(
                flow.clone(),
                settled.priority,
                client,
                &state.observers.metrics,
            )
            .instrument(admission)
            .await?;
        let who = Who {
            ids,
            tenant: incoming.tenant,
            flow,
            client,
            arrived,
            quota,
        };
        let prepared = tokenize_and_prepare(&state, api, settled, who).await?;
        Ok::<_, ApiError>((prepared, permit, renderer))
    }
    .await;
    match admitted {
        Ok((prepared, permit, renderer)) => respond(state, prepared, permit, renderer).await,
        Err(err) => fail(&state, api, &metric_model, err),
    }
}

/// Reads the body and takes it apart as the API does; checks its fields against the policy for
/// unknown ones.
fn read<T: DeserializeOwned, R>(
    state: &AppState,
    api: &Api,
    body: Result<Bytes, BytesRejection>,
    split: impl FnOnce(T) -> Result<(ParsedRequest, R), ApiError>,
) -> Result<(ParsedRequest, R), ApiError> {
    let request: T = parse_body(&read_body(state, body)?)?;
    let (parsed, renderer) = split(request)?;
    parsed
        .notes
        .check(state.config.api.unknown_fields, api.docs)?;
    let span = tracing::Span::current();
    span.record("gen_ai.request.model", parsed.model.as_str());
    span.record("stream", parsed.sampling.stream);
    Ok((parsed, renderer))
}

/// A request checked and resolved before admission: what it asks, the model that serves it,
/// its output parsers, its session and its chat template's settings.
struct Settled {
    model: String,
    routes: Arc<ModelRoutes>,
    tokenizer: Arc<ModelTokenizer>,
    source: PromptSource,
    output: ChatOutput,
    sampling: SamplingFields,
    asks: Asks,
    identity: KvIdentity,
    session: Option<String>,
    session_source: Option<SessionSource>,
    template: Template,
    ignored: Vec<String>,
    priority: Option<i32>,
}

/// Checks what `parsed` asks (before admission and tokenization; `max_tokens` is settled after
/// them, with the prompt's length) and resolves its model, output and session. `metric_model`
/// is set once the model is known to be served.
fn settle(
    state: &AppState,
    api: &Api,
    parsed: ParsedRequest,
    headers: &HeaderMap,
    metric_model: &mut String,
) -> Result<Settled, ApiError> {
    let ParsedRequest {
        model,
        sampling,
        source,
        echo,
        mut notes,
    } = parsed;
    let asks = asks_of(api.shape, &sampling, echo, source.count())?;
    let asked = sampling.max_completion_tokens.or(sampling.max_tokens);
    sampling_of(&sampling, asked.unwrap_or(u32::MAX), asks.logprobs)?;
    let mut identity = salted_identity(sampling.cache_salt.clone())?;
    let ServedModel { routes, adapter } = served_model(&state.pool, &model)?;
    identity.adapter = adapter;
    metric_model.clone_from(&model);
    // An adapter runs on its base model's tokenizer and chat template.
    let base = routes.model.as_str();
    let tokenizer = state.tokenizers.for_model(base);
    let (source, output) = settle_output(state, base, &tokenizer.dir, source)?;
    if output.guided().is_some() && crate::api::http::guided::guided_of(&sampling)?.is_some() {
        return Err(ApiError::bad_param(
            "tool_choice",
            "a required or named tool_choice constrains the output already; drop the other constraint",
        ));
    }
    // The session: a header naming it (ours, Claude Code's, Codex's), else the body's
    // (`prompt_cache_key`, Claude Code's `metadata.user_id`).
    let (session_source, session) = match session_header(headers).or_else(|| notes.session.clone())
    {
        Some((source, key)) => (Some(source), Some(key)),
        None => (None, None),
    };
    let template = Template {
        kwargs: notes.settle_template(tokenizer.dir.chat_template()),
        add_generation_prompt: notes.add_generation_prompt.unwrap_or(true),
    };
    count_ignored(state, api, &notes);
    Ok(Settled {
        model,
        routes,
        tokenizer,
        source,
        output,
        sampling,
        asks,
        identity,
        session,
        session_source,
        template,
        ignored: notes.ignored(),
        priority: notes.priority,
    })
}

/// Where the request waits for a slot: an API key's tenant is the fairness tenant, and its
/// users (or sessions) share its slots; without one, the request's own session, user or client.
fn flow_of(
    settled: &Settled,
    tenant: Option<&ApiTenant>,
    headers: &HeaderMap,
    client: Option<IpAddr>,
) -> FlowKey {
    let session = settled.session.clone();
    let user = &settled.sampling.user;
    match tenant {
        Some(ApiTenant(tenant)) => FlowKey::of_tenant(tenant, session.or_else(|| user.clone())),
        None => FlowKey::of_request(session, user.as_deref(), headers, client),
    }
}

/// Who a request is and what it holds once admitted.
struct Who {
    ids: Ids,
    tenant: Option<ApiTenant>,
    flow: FlowKey,
    client: Option<IpAddr>,
    arrived: Instant,
    quota: Arc<QuotaPass>,
}

/// Tokenizes an admitted request's prompts and prepares it for dispatch.
async fn tokenize_and_prepare(
    state: &AppState,
    api: &'static Api,
    settled: Settled,
    who: Who,
) -> Result<Prepared, ApiError> {
    let naming = BlockNaming {
        block_size: settled.routes.block_size,
        identity: settled.identity.clone(),
    };
    let prompts = tokenize(
        state,
        &settled.tokenizer,
        settled.source,
        settled.template,
        settled.session.clone(),
        &settled.routes,
        &naming,
    )
    .await?;
    let plans = plan_prompts(
        state,
        &settled.sampling,
        settled.asks,
        &settled.output,
        (&settled.routes, &settled.tokenizer.dir),
        prompts,
    )?;
    let Ids {
        request_id,
        completion_id,
    } = who.ids;
    // The pipeline runs in the request's span.
    let span = tracing::Span::current();
    span.record("request_id", request_id.as_str());
    let sampling = settled.sampling;
    Ok(Prepared {
        api,
        request_id,
        completion_id,
        model: settled.model,
        model_dir: Arc::clone(&settled.tokenizer.dir),
        routes: settled.routes,
        prompts: plans,
        asks: settled.asks,
        stream: sampling.stream,
        include_usage: sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        user: sampling.user,
        session: settled.session,
        session_source: settled.session_source,
        ignored: settled.ignored,
        priority: settled.priority,
        tenant: who.tenant.map(|ApiTenant(t)| t),
        identity: settled.identity,
        flow: who.flow,
        client: who.client,
        arrived: who.arrived,
        span,
        output: settled.output,
        quota: who.quota,
    })
}

/// Checks each prompt against the model's context and settles its `max_tokens`, its sampling
/// and, with `echo`, the text it starts its answer with.
fn plan_prompts(
    state: &AppState,
    fields: &SamplingFields,
    asks: Asks,
    output: &ChatOutput,
    (routes, model_dir): (&ModelRoutes, &ModelDir),
    prompts: Vec<Tokenized>,
) -> Result<Vec<PromptPlan>, ApiError> {
    let mut plans = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let max_tokens = settle_max_tokens(
            routes.max_context_tokens,
            prompt.tokens.len() as u64,
            fields.max_completion_tokens.or(fields.max_tokens),
            state.config.default_max_tokens,
        )?;
        let mut sampling = sampling_of(fields, max_tokens, asks.logprobs)?;
        if let Some(guided) = output.guided() {
            sampling.guided = Some(guided);
        }
        let echo = if asks.echo {
            Some(match prompt.text {
                Some(text) => text,
                None => model_dir
                    .tokenizer()
                    .decode(&prompt.tokens, fields.skip_special_tokens.unwrap_or(true))
                    .map_err(|e| ApiError::bad_param("prompt", e.to_string()))?,
            })
        } else {
            None
        };
        plans.push(PromptPlan {
            tokens: prompt.tokens,
            hashes: prompt.hashes,
            sampling,
            echo,
        });
    }
    Ok(plans)
}

/// Counts the fields a request carried without effect (`switchyard_ignored_fields_total`).
fn count_ignored(state: &AppState, api: &Api, notes: &FieldNotes) {
    for field in notes.advisory_names() {
        state.observers.metrics.fields.advisory(api.endpoint, field);
    }
    for field in notes.unknown_names() {
        state.observers.metrics.fields.unknown(api.endpoint, field);
    }
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
