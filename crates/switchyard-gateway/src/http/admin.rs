//! The admin API under `/admin`: what the router knows and why it decides what it decides.
//!
//! | method | path | does |
//! |---|---|---|
//! | GET | `/admin/workers` | workers with role, drain state, load and index size |
//! | POST | `/admin/explain` | the routing decision for a prompt, without running it |
//! | GET | `/admin/decisions?limit=N` | the most recent decisions, newest first |
//! | GET | `/admin/index` | prefix-index statistics per model |
//! | GET, PUT | `/admin/policy` | the routing policy; PUT `{"policy": "round-robin"}` switches it |
//! | POST | `/admin/workers/{id}/drain`, `/resume` | stop or restart sending work to a worker |
//!
//! When an admin token is configured every call needs `Authorization: Bearer <token>`.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use switchyard_core::{Role, WorkerId};
use switchyard_proto::v1::{self, ControlRequest, control_request::Command};
use switchyard_router::{IndexStats, PolicyKind, WorkerLoad};

use super::AppState;
use crate::error::ApiError;
use crate::openai::PromptInput;
use crate::pool::DecisionRecord;
use crate::preprocess::{self, Sessions};
use crate::routing;

pub fn router(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/workers", get(workers))
        .route("/workers/{id}/drain", post(drain))
        .route("/workers/{id}/resume", post(resume))
        .route("/explain", post(explain))
        .route("/decisions", get(decisions))
        .route("/index", get(index))
        .route("/policy", get(get_policy).put(set_policy).post(set_policy))
        .layer(middleware::from_fn_with_state(state, require_token))
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_token(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(token) = &state.config.admin_token {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !same(given.trim().as_bytes(), token.as_bytes()) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

#[derive(Debug, Serialize)]
struct WorkerView {
    id: String,
    address: String,
    model: String,
    role: Role,
    draining: bool,
    block_size: u32,
    kv_capacity_blocks: u64,
    incarnation: u64,
    load: WorkerLoad,
    indexed_blocks: usize,
}

async fn workers(State(state): State<Arc<AppState>>) -> axum::Json<Vec<WorkerView>> {
    let mut out = Vec::new();
    for worker in state.pool.workers() {
        let info = worker.info();
        let (load, indexed_blocks) = match state.pool.model(&info.model) {
            Some(routes) => {
                let core = routes.lock();
                (core.load.get(&info.id), core.index.worker_entries(&info.id))
            }
            None => (WorkerLoad::default(), 0),
        };
        out.push(WorkerView {
            id: info.id.to_string(),
            address: info.address,
            model: info.model,
            role: info.role,
            draining: worker.is_draining(),
            block_size: info.block_size.get(),
            kv_capacity_blocks: info.kv_capacity_blocks,
            incarnation: info.incarnation,
            load,
            indexed_blocks,
        });
    }
    axum::Json(out)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplainRequest {
    model: String,
    /// A completion prompt (text or token ids).
    prompt: Option<PromptInput>,
    /// Or chat messages, rendered with the model's template.
    messages: Option<Vec<serde_json::Value>>,
    session_id: Option<String>,
}

#[derive(Debug, Serialize)]
struct ExplainResponse {
    model: String,
    prompt_tokens: usize,
    block_size: u32,
    decision: switchyard_router::Decision,
}

async fn explain(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<axum::Json<ExplainResponse>, ApiError> {
    let request: ExplainRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid explain request: {e}")))?;
    let routes = state
        .pool
        .model(&request.model)
        .ok_or_else(|| ApiError::ModelNotFound(request.model.clone()))?;
    let model_dir = state.tokenizers.for_model(&request.model);
    let tokens = match (request.prompt, request.messages) {
        (Some(PromptInput::Text(text)), None) => {
            preprocess::encode_text(&state.metrics, model_dir, text, Sessions::Bypass).await?
        }
        (Some(PromptInput::Tokens(tokens)), None) => tokens,
        (None, Some(messages)) => {
            let messages = preprocess::parse_messages(messages)?;
            preprocess::encode_chat(&state.metrics, model_dir, messages, None, Sessions::Bypass)
                .await?
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` (text or token ids) or `messages`",
            ));
        }
    };
    let decision = routing::explain(&state.pool, &routes, &tokens, request.session_id)
        .map_err(|e| ApiError::Unavailable(e.to_string()))?;
    Ok(axum::Json(ExplainResponse {
        model: request.model,
        prompt_tokens: tokens.len(),
        block_size: routes.block_size.get(),
        decision,
    }))
}

#[derive(Debug, Deserialize)]
struct DecisionsQuery {
    limit: Option<usize>,
}

async fn decisions(
    State(state): State<Arc<AppState>>,
    Query(query): Query<DecisionsQuery>,
) -> axum::Json<Vec<DecisionRecord>> {
    let limit = query.limit.unwrap_or(50).min(10_000);
    let mut all: Vec<DecisionRecord> = Vec::new();
    for routes in state.pool.models().values() {
        all.extend(routes.lock().log.iter().cloned());
    }
    all.sort_by_key(|d| std::cmp::Reverse(d.at_unix_ms));
    all.truncate(limit);
    axum::Json(all)
}

#[derive(Debug, Serialize)]
struct ModelIndex {
    model: String,
    block_size: u32,
    policy: PolicyKind,
    stats: IndexStats,
}

async fn index(State(state): State<Arc<AppState>>) -> axum::Json<Vec<ModelIndex>> {
    let out = state
        .pool
        .models()
        .into_iter()
        .map(|(model, routes)| {
            let core = routes.lock();
            ModelIndex {
                model,
                block_size: routes.block_size.get(),
                policy: core.policy_kind,
                stats: core.index.stats(),
            }
        })
        .collect();
    axum::Json(out)
}

#[derive(Debug, Serialize, Deserialize)]
struct PolicyBody {
    policy: String,
}

async fn get_policy(State(state): State<Arc<AppState>>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "policy": state.pool.policy_kind().as_str(),
        "available": PolicyKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>(),
    }))
}

async fn set_policy(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let body: PolicyBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("expected {{\"policy\": NAME}}: {e}")))?;
    let kind: PolicyKind = body
        .policy
        .parse()
        .map_err(|e: switchyard_router::RouteError| ApiError::bad_param("policy", e.to_string()))?;
    state
        .pool
        .set_policy(kind)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(axum::Json(serde_json::json!({ "policy": kind.as_str() })))
}

async fn control(
    state: &AppState,
    id: &str,
    command: Command,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let id = WorkerId::new(id).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let worker = state
        .pool
        .worker(&id)
        .ok_or_else(|| ApiError::NotFound(format!("no worker {id}")))?;
    let mut client = worker.client.clone();
    let response = client
        .control(ControlRequest {
            command: Some(command),
        })
        .await
        .map_err(|s| ApiError::Upstream(format!("worker {id}: {}", s.message())))?
        .into_inner();
    worker
        .draining
        .store(response.draining, std::sync::atomic::Ordering::Relaxed);
    let role = switchyard_proto::convert::role_from_wire(response.role)
        .map(|r| r.as_str())
        .unwrap_or("unknown");
    Ok(axum::Json(serde_json::json!({
        "id": id.as_str(),
        "draining": response.draining,
        "role": role,
        "in_flight": response.in_flight,
    })))
}

async fn drain(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    control(&state, &id, Command::Drain(v1::Drain { wait_ms: 0 })).await
}

async fn resume(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    control(&state, &id, Command::Resume(v1::Resume {})).await
}
