//! The HTTP surface. Four generation APIs share one request pipeline and one answer driver:
//! chat and text completions ([`completions`]), OpenAI's Responses API ([`responses`]) and
//! Anthropic's Messages API ([`anthropic`]) each take their body apart for the pipeline
//! ([`pipeline`]: read, validate, admit, tokenize, prepare; counting and refusing) and write
//! their answer through their own [`render::Renderer`], which `render`'s driver feeds from the
//! dispatch events of the request's choices (`choices`, read into text, reasoning and tool
//! calls by `assemble`). The request's fields are read by `asks` and [`fields`], its prompts by
//! `prompts`. Besides: vLLM's `/tokenize` and `/detokenize` ([`tokenize`]), the admin API
//! ([`admin`]), health, readiness, metrics and the model list.

pub mod admin;
pub mod anthropic;
mod asks;
mod assemble;
mod choices;
pub mod completions;
pub mod fields;
mod guided;
mod keys;
pub mod pipeline;
mod prompts;
pub(crate) mod render;
pub mod responses;
pub mod server;
pub mod state;
pub mod tokenize;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::api::openai::{ModelCard, ModelList};
use crate::error::ApiError;
use keys::{KeyCheck, require_api_key};
use state::unix_now;
pub use state::{ApiTenant, AppState, Extensions, MetricsSource};

/// The gateway's HTTP application; with a `fleet`, a session's turns are served at the replica
/// that owns the session.
pub fn router(state: Arc<AppState>, fleet: Option<Arc<crate::cluster::fleet::Fleet>>) -> Router {
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
            crate::api::forward::forward_session,
        ));
    }
    let api =
        api.layer(DefaultBodyLimit::max(body_limit))
            .layer(axum::middleware::from_fn_with_state(
                KeyCheck {
                    state: Arc::clone(&state),
                    refuse: IntoResponse::into_response,
                },
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
        .observers
        .metrics
        .observe_sessions(state.tokenizers.session_stats());
    state
        .observers
        .metrics
        .observe_prefix(state.tokenizers.prefix_stats());
    state
        .observers
        .metrics
        .observe_cores(switchyard_tokenize::CoreBudget::process());
    let mut text = state.observers.metrics.encode();
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
        let list = routes.members.snapshot();
        if list.members.is_empty() {
            continue;
        }
        for member in &list.members {
            for adapter in &member.info.adapters {
                adapters.insert((adapter.clone(), name.clone()), Arc::clone(&routes));
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

fn card(
    id: String,
    routes: &crate::cluster::pool::ModelRoutes,
    parent: Option<String>,
) -> ModelCard {
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
    match pipeline::served_model(&state.pool, &id) {
        Ok(served) if state.pool.serves(&served.routes.model) => {
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
