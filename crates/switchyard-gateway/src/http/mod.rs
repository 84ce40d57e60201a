//! The HTTP surface: OpenAI API ([`completions`], answered by `answer` over `choices` and
//! `assemble`, with the request's fields read by `asks` and its prompts by `prompts`; the
//! Responses API, [`responses`], translated onto the same path), vLLM's `/tokenize` and
//! `/detokenize` ([`tokenize`]), Anthropic's Messages API ([`anthropic`], a translation onto the
//! chat path), admin API ([`admin`]), health, readiness, metrics and the model list.

pub mod admin;
mod answer;
pub mod anthropic;
mod asks;
mod assemble;
mod choices;
pub mod completions;
pub mod fields;
mod guided;
mod prompts;
pub mod responses;
pub mod server;
pub mod tokenize;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::access::ClientAccess;
use crate::admission::Admission;
use crate::config::GatewayConfig;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{ModelCard, ModelList};
use crate::pool::WorkerPool;
use crate::preprocess::Tokenizers;

/// Everything a handler needs.
#[derive(Debug)]
pub struct AppState {
    pub config: GatewayConfig,
    pub pool: Arc<WorkerPool>,
    pub tokenizers: Tokenizers,
    pub metrics: Arc<Metrics>,
    pub admission: Admission,
    /// Fleet-wide per-tenant quotas, checked before admission.
    pub quota: Arc<crate::quota::Quotas>,
    pub extensions: Extensions,
    /// API keys, the metrics token, HTTPS.
    pub access: ClientAccess,
    /// Sessions' think times, for the retention hints of their turns.
    pub retention: Arc<crate::retention::SessionRetention>,
    /// Stored responses and the reasoning sealer (`/v1/responses`).
    pub responses: Arc<responses::ResponsesState>,
}

/// The tenant of the API key a `/v1` request was let in with.
#[derive(Debug, Clone)]
pub struct ApiTenant(pub String);

/// A text exposition of metrics another role exports (OpenMetrics, ending in `# EOF`).
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// What other roles embedded in the same process serve on the gateway's listener.
#[derive(Clone, Default)]
pub struct Extensions {
    /// Routers mounted under `/admin/<path>`, behind the admin token like the gateway's own.
    pub admin: Vec<(&'static str, Router)>,
    /// Metrics appended to `/metrics`.
    pub metrics: Vec<MetricsSource>,
    /// Where this gateway announces itself and finds the other replicas, to share sessions
    /// (`[fleet]`): the registry its workers are in.
    pub replicas: Option<Arc<dyn switchyard_registry::Replicas>>,
}

impl std::fmt::Debug for Extensions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extensions")
            .field(
                "admin",
                &self.admin.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("metrics", &self.metrics.len())
            .field("replicas", &self.replicas.is_some())
            .finish()
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The gateway's HTTP application; with a `fleet`, a session's turns are served at the replica
/// that owns the session.
pub fn router(state: Arc<AppState>, fleet: Option<Arc<crate::fleet::Fleet>>) -> Router {
    let body_limit = state.config.max_body_bytes;
    let mut api = Router::new()
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize));
    // Inside the API key check: a turn is let in by the replica it reached, and again by its
    // owner (the key travels with it).
    if let Some(fleet) = fleet {
        api = api.layer(axum::middleware::from_fn_with_state(
            fleet,
            crate::fleet::forward::forward_session,
        ));
    }
    let api =
        api.layer(DefaultBodyLimit::max(body_limit))
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&state),
                require_api_key,
            ));
    Router::new()
        .merge(api)
        .merge(anthropic::router(&state))
        .nest("/admin", admin::router(Arc::clone(&state)))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

/// The operator's surface alone (admin API, health, readiness, metrics): what the endpoint
/// picker (`switchyard epp`) serves over HTTP, where a proxy carries the OpenAI API.
pub fn operations_router(state: Arc<AppState>) -> Router {
    Router::new()
        .nest("/admin", admin::router(Arc::clone(&state)))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint".into())
}

async fn health() -> &'static str {
    "ok"
}

/// Ready when at least one worker can take a generation (one the pool can deliver to). The body's first line says so; each
/// further line names a worker whose KV events cannot be trusted, or one refused for routing
/// (it stays ready: those workers still serve, but routing around them is blind).
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let workers = state.pool.workers();
    let serving = workers.iter().any(|w| {
        let info = w.info();
        info.role.serves_decode()
            && state.pool.deliverable(&info)
            && !w.is_draining()
            && w.health.is_answering()
    });
    let mut body = if serving {
        "ready".to_owned()
    } else {
        "no worker available".to_owned()
    };
    for worker in &workers {
        let id = worker.id();
        if let Some(silent) = worker.kv.silent() {
            body.push_str(&format!(
                "\nwarning: worker {id} kv events silent: it {silent}"
            ));
        }
        if let Some(mismatch) = worker.kv.identity_mismatch() {
            body.push_str(&format!(
                "\nwarning: worker {id} kv identity mismatch: {mismatch}"
            ));
        }
        if worker.kv.diverged() {
            body.push_str(&format!(
                "\nwarning: worker {id} index diverged from the worker's own view; resyncing"
            ));
        }
    }
    for (id, reason) in state.pool.refused() {
        body.push_str(&format!("\nwarning: worker {id} refused: {reason}"));
    }
    let status = if serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body).into_response()
}

/// With an API key file, `/v1` takes only requests carrying one of its keys (401 in OpenAI's
/// shape otherwise) and shares the slots by the key's tenant. The key comes as
/// `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key: <key>`.
async fn require_api_key(
    State(state): State<Arc<AppState>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(keys) = &state.access.api_keys else {
        return next.run(request).await;
    };
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let x_api_key = request
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let refused = match crate::api_keys::bearer(authorization).or(x_api_key) {
        None => ApiError::MissingApiKey,
        Some(key) => match keys.tenant(key) {
            Some(tenant) => {
                request.extensions_mut().insert(ApiTenant(tenant));
                return next.run(request).await;
            }
            None => ApiError::InvalidApiKey,
        },
    };
    state.metrics.api_key_refused(refused.metric_label());
    refused.into_response()
}

async fn metrics(State(state): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    if let Some(token) = &state.access.metrics_token {
        let authorization = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if !switchyard_config::admin_authorized(Some(token), authorization) {
            return ApiError::Unauthorized.into_response();
        }
    }
    state
        .metrics
        .observe_sessions(state.tokenizers.session_stats());
    state
        .metrics
        .observe_prefix(state.tokenizers.prefix_stats());
    state
        .metrics
        .observe_cores(switchyard_tokenize::CoreBudget::process());
    let mut text = state.metrics.encode();
    for source in &state.extensions.metrics {
        // One exposition has one `# EOF`, at its very end.
        if let Some(body) = text.strip_suffix("# EOF\n") {
            text.truncate(body.len());
        }
        text.push_str(&source());
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Models with at least one worker, then the LoRA adapters their workers serve (each with its
/// base model as `parent`, as vLLM lists them).
async fn models(State(state): State<Arc<AppState>>) -> axum::Json<ModelList> {
    let mut data = Vec::new();
    let mut adapters = std::collections::BTreeMap::new();
    for (name, routes) in state.pool.models() {
        let workers = state.pool.workers_of(&name);
        if workers.is_empty() {
            continue;
        }
        for w in &workers {
            for adapter in w.info().adapters {
                adapters.insert((adapter, name.clone()), Arc::clone(&routes));
            }
        }
        data.push(card(name, &routes, None));
    }
    for ((adapter, base), routes) in adapters {
        data.push(card(adapter, &routes, Some(base)));
    }
    axum::Json(ModelList {
        object: "list",
        data,
    })
}

fn card(id: String, routes: &crate::pool::ModelRoutes, parent: Option<String>) -> ModelCard {
    ModelCard {
        id,
        object: "model",
        created: unix_now(),
        owned_by: "switchyard",
        max_model_len: routes.max_context_tokens,
        parent,
    }
}

/// GET /v1/models/{id}: the model's card, or a 404 OpenAI error when no worker serves it.
async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match completions::served_model(&state, &id) {
        Ok(served) if !state.pool.workers_of(&served.routes.model).is_empty() => {
            let parent = served
                .adapter
                .is_some()
                .then(|| served.routes.model.clone());
            axum::Json(card(id, &served.routes, parent)).into_response()
        }
        Ok(_) => ApiError::ModelNotFound(id).into_response(),
        Err(err) => err.into_response(),
    }
}
