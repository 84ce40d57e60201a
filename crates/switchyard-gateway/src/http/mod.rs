//! The HTTP surface: OpenAI API ([`completions`]), admin API ([`admin`]), health, readiness,
//! metrics and model list.

pub mod admin;
mod answer;
pub mod completions;
pub mod server;

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
    pub extensions: Extensions,
    /// API keys, the metrics token, HTTPS.
    pub access: ClientAccess,
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
}

impl std::fmt::Debug for Extensions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extensions")
            .field(
                "admin",
                &self.admin.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("metrics", &self.metrics.len())
            .finish()
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The gateway's HTTP application.
pub fn router(state: Arc<AppState>) -> Router {
    let body_limit = state.config.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ));
    Router::new()
        .merge(api)
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

/// Ready when at least one worker can take a generation.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let serving = state
        .pool
        .workers()
        .iter()
        .any(|w| w.info().role.serves_decode() && !w.is_draining() && w.health.is_answering());
    if serving {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no worker available").into_response()
    }
}

/// With an API key file, `/v1` takes only requests carrying one of its keys (401 in OpenAI's
/// shape otherwise) and shares the slots by the key's tenant.
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
    let refused = match crate::api_keys::bearer(authorization) {
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

/// Models with at least one worker.
async fn models(State(state): State<Arc<AppState>>) -> axum::Json<ModelList> {
    let mut data = Vec::new();
    for (name, routes) in state.pool.models() {
        if !state.pool.workers_of(&name).is_empty() {
            data.push(ModelCard {
                id: name,
                object: "model",
                created: unix_now(),
                owned_by: "switchyard",
                max_model_len: routes.max_context_tokens,
            });
        }
    }
    axum::Json(ModelList {
        object: "list",
        data,
    })
}
