//! The admin API under `/admin`: what the router knows and why it decides what it decides.
//!
//! | method | path | does |
//! |---|---|---|
//! | GET | `/admin/workers` | workers with role, drain state, load and index size |
//! | POST | `/admin/explain` | the routing decision for a prompt, without running it |
//! | GET, POST | `/admin/explain?request_id=…&policy=…` | what another policy would have chosen for a logged decision ([`crate::observe::audit::counterfactual`]) |
//! | GET | `/admin/decisions?limit=N&request_id=…` | decisions, newest first, filtered by request, session, tenant, worker, model, time, outcome ([`crate::observe::audit::decisions`]) |
//! | GET | `/admin/index` | prefix-index statistics per model |
//! | GET | `/admin/subscriptions` | how many workers the gateway follows in full (snapshot and load in), streams opening ([`crate::cluster::pool::subscriptions`]) |
//! | GET, PUT | `/admin/policy` | the routing policy; PUT `{"policy": "round-robin"}` switches it |
//! | POST | `/admin/workers/{id}/drain`, `/resume` | stop or restart sending work to a worker |
//! | GET | `/admin/recording` | the KV recording's status |
//! | POST | `/admin/recording/start`, `/stop` | record the router's inputs to a file ([`crate::observe::recorder`]) |
//!
//! When an admin token is configured every call needs `Authorization: Bearer <token>`.

use std::path::{Component, Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use switchyard_config::admin_authorized;
use switchyard_core::{Role, WorkerId};
use switchyard_proto::v1::{self, ControlRequest, control_request::Command};
use switchyard_router::serve::{DecodeFilter, aggregated_only};
use switchyard_router::{IndexStats, PolicyKind, WorkerLoad};

use super::state::AppState;
use crate::api::openai::PromptInput;
use crate::error::ApiError;
use crate::observe::audit::DecisionQuery;
use crate::observe::audit::counterfactual::{
    CounterfactualQuery, Counterfactuals, counterfactuals,
};
use crate::observe::audit::kv::KvAuditView;
use crate::observe::recorder::{FORMAT, Header, Limits, RecordingError, RecordingStatus, VERSION};
use crate::serving::preprocess::{self, Sessions};
use crate::serving::routing;

pub fn router(state: Arc<AppState>) -> Router<Arc<AppState>> {
    let mut admin = Router::new();
    for (path, extension) in &state.extensions.admin {
        admin = admin.nest(&format!("/{path}"), extension.clone().with_state(()));
    }
    admin
        .route("/workers", get(workers))
        .route("/workers/{id}/drain", post(drain))
        .route("/workers/{id}/resume", post(resume))
        .route("/explain", get(counterfactual).post(explain))
        .route("/decisions", get(decisions))
        .route("/index", get(index))
        .route("/subscriptions", get(subscriptions))
        .route("/policy", get(get_policy).put(set_policy).post(set_policy))
        .route("/recording", get(recording_status))
        .route("/recording/start", post(start_recording))
        .route("/recording/stop", post(stop_recording))
        .layer(middleware::from_fn_with_state(state, require_token))
}

async fn require_token(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !admin_authorized(state.config.admin_token.as_deref(), authorization) {
        return ApiError::Unauthorized.into_response();
    }
    next.run(request).await
}

#[derive(Debug, Serialize)]
struct WorkerView {
    id: String,
    address: String,
    model: String,
    /// The LoRA adapters it serves (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    adapters: Vec<String>,
    role: Role,
    draining: bool,
    /// False while the worker is out of routing because it stopped answering.
    responsive: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    unresponsive_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unresponsive_for_secs: Option<f64>,
    block_size: u32,
    kv_capacity_blocks: u64,
    incarnation: u64,
    load: WorkerLoad,
    indexed_blocks: usize,
    /// Whether its KV events arrive and agree with its own view of its cache.
    kv: KvAuditView,
}

async fn workers(State(state): State<Arc<AppState>>) -> axum::Json<Vec<WorkerView>> {
    let mut out = Vec::new();
    for worker in state.pool.workers() {
        let info = worker.info();
        let (load, indexed_blocks) = match state.pool.model(&info.model) {
            Some(routes) => {
                let core = routes.lock();
                (
                    core.serving.load.get(&info.id),
                    core.serving.index.worker_entries(&info.id),
                )
            }
            None => (WorkerLoad::default(), 0),
        };
        let (responsive, unresponsive_reason, unresponsive_for_secs) =
            match worker.health.liveness() {
                crate::cluster::health::Liveness::Answering => (true, None, None),
                crate::cluster::health::Liveness::Unresponsive { reason, since } => {
                    (false, Some(reason), Some(since.elapsed().as_secs_f64()))
                }
            };
        out.push(WorkerView {
            id: info.id.to_string(),
            address: info.address,
            model: info.model,
            adapters: info.adapters,
            role: info.role,
            draining: worker.is_draining(),
            responsive,
            unresponsive_reason,
            unresponsive_for_secs,
            block_size: info.block_size.get(),
            kv_capacity_blocks: info.kv_capacity_blocks,
            incarnation: info.incarnation,
            load,
            indexed_blocks,
            kv: worker.kv.view(),
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
    /// The request's cache salt: its blocks are looked up as a salted request's are.
    cache_salt: Option<String>,
}

#[derive(Debug, Serialize)]
struct ExplainResponse {
    model: String,
    prompt_tokens: usize,
    block_size: u32,
    /// The decode worker decision (the worker that generates).
    decision: switchyard_router::Decision,
    /// Aggregated or disaggregated, why, and the prefill worker decision when one was made.
    disaggregation: crate::serving::disagg::ModeExplanation,
}

/// `GET /admin/explain?request_id=…&policy=…`: a logged decision re-scored under a policy.
async fn counterfactual(
    State(state): State<Arc<AppState>>,
    query: Result<Query<CounterfactualQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<Counterfactuals>, ApiError> {
    let Query(query) =
        query.map_err(|e| ApiError::bad_request(format!("invalid counterfactual query: {e}")))?;
    let answer = counterfactuals(
        &state.observers.decisions,
        &query,
        state.pool.policy_settings(),
    )?;
    Ok(axum::Json(answer))
}

/// `POST /admin/explain`: a prompt's decision, or — when the body names a logged decision
/// (`request_id` or `decision_id`) — that decision re-scored under `policy`.
async fn explain(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid explain request: {e}")))?;
    let names_decision = ["request_id", "decision_id"]
        .iter()
        .any(|key| value.get(key).is_some());
    if names_decision {
        let query: CounterfactualQuery = serde_json::from_value(value)
            .map_err(|e| ApiError::bad_request(format!("invalid counterfactual request: {e}")))?;
        let answer = counterfactuals(
            &state.observers.decisions,
            &query,
            state.pool.policy_settings(),
        )?;
        return Ok(axum::Json(answer).into_response());
    }
    Ok(explain_prompt(&state, value).await?.into_response())
}

async fn explain_prompt(
    state: &AppState,
    value: serde_json::Value,
) -> Result<axum::Json<ExplainResponse>, ApiError> {
    let request: ExplainRequest = serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("invalid explain request: {e}")))?;
    let super::pipeline::ServedModel { routes, adapter } =
        super::pipeline::served_model(&state.pool, &request.model)?;
    let model_dir = state.tokenizers.for_model(&routes.model);
    let max = preprocess::prompt_limit(routes.max_context_tokens);
    let tokens = match (request.prompt, request.messages) {
        (Some(PromptInput::Text(text)), None) => {
            preprocess::encode_text(
                &state.observers.metrics,
                model_dir,
                text,
                Sessions::Bypass,
                max,
            )
            .await?
        }
        (Some(PromptInput::Tokens(tokens)), None) => tokens,
        (None, Some(messages)) => {
            let messages = preprocess::parse_messages(messages)?;
            preprocess::encode_chat(
                &state.observers.metrics,
                model_dir,
                switchyard_tokenize::ChatRequest::new(messages),
                Sessions::Bypass,
                max,
            )
            .await?
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` (text or token ids) or `messages`",
            ));
        }
    };
    let settings = state.config.disagg();
    // As dispatch routes a first attempt: with disaggregation off no request gets a prefill
    // worker, so none goes to a worker that needs one.
    let mut identity = super::pipeline::salted_identity(request.cache_salt)?;
    identity.adapter = adapter;
    let route_request =
        routing::route_request(&state.pool, &routes, &tokens, &identity, request.session_id);
    let filter = DecodeFilter {
        exclude: &[],
        aggregated_only: aggregated_only(&settings.serve, false, false),
        adapter: route_request.adapter.as_deref(),
    };
    let decision = routing::explain(&state.pool, &routes, &route_request, filter)
        .map_err(|e| ApiError::Unavailable(e.to_string()))?;
    let uncached = decision
        .chosen()
        .map_or(tokens.len() as u64, |c| c.uncached_prompt_tokens);
    // As dispatch serves it: a priced copy from a peer makes it a placement, whatever the mode.
    let candidates = routing::candidates(&state.pool, &routes, filter);
    let disaggregation = match decision.peer_source(candidates.ids()) {
        Some(peer) => crate::serving::disagg::explain_placement(&decision.worker, peer),
        None => crate::serving::disagg::explain(
            &state.pool,
            &routes,
            &settings,
            &decision.worker,
            &route_request,
            uncached,
        ),
    };
    Ok(axum::Json(ExplainResponse {
        model: request.model,
        prompt_tokens: tokens.len(),
        block_size: routes.block_size.get(),
        decision,
        disaggregation,
    }))
}

async fn decisions(
    State(state): State<Arc<AppState>>,
    query: Result<Query<DecisionQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<Vec<serde_json::Value>>, ApiError> {
    let Query(query) =
        query.map_err(|e| ApiError::bad_request(format!("invalid decisions query: {e}")))?;
    query.validate().map_err(ApiError::bad_request)?;
    Ok(axum::Json(state.observers.decisions.query(&query).await))
}

#[derive(Debug, Serialize)]
struct ModelIndex {
    model: String,
    block_size: u32,
    policy: PolicyKind,
    stats: IndexStats,
}

async fn index(
    State(state): State<Arc<AppState>>,
) -> Result<axum::Json<Vec<ModelIndex>>, ApiError> {
    // Each model's lock is held while its blocks are copied; the distinct ones are counted
    // afterwards, off the runtime's threads, so routing waits for a copy, not a count.
    let drafts: Vec<_> = state
        .pool
        .models()
        .into_iter()
        .map(|(model, routes)| {
            let core = routes.lock();
            (
                model,
                routes.block_size.get(),
                core.serving.policy_kind(),
                core.serving.index.stats_draft(),
            )
        })
        .collect();
    let out = tokio::task::spawn_blocking(move || {
        drafts
            .into_iter()
            .map(|(model, block_size, policy, draft)| ModelIndex {
                model,
                block_size,
                policy,
                stats: draft.finish(),
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("index statistics: {e}")))?;
    Ok(axum::Json(out))
}

async fn subscriptions(
    State(state): State<Arc<AppState>>,
) -> axum::Json<crate::cluster::pool::subscriptions::SubscriptionProgress> {
    axum::Json(state.followers.subscription_progress())
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
    let mut client = state
        .followers
        .context()
        .connections
        .client(&id)
        .ok_or_else(|| ApiError::NotFound(format!("no worker {id}")))?;
    let response = client
        .control(ControlRequest {
            command: Some(command),
        })
        .await
        .map_err(|s| ApiError::Upstream(format!("worker {id}: {}", s.message())))?
        .into_inner();
    worker.set_draining(response.draining);
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartRecording {
    /// Where to write; relative paths are taken inside `recording_dir`.
    path: Option<PathBuf>,
    max_records: Option<u64>,
    max_bytes: Option<u64>,
}

impl From<RecordingError> for ApiError {
    fn from(err: RecordingError) -> Self {
        match err {
            RecordingError::PathRefused(_) => ApiError::bad_param("path", err.to_string()),
            RecordingError::Writer(_) => ApiError::Internal(err.to_string()),
            RecordingError::AlreadyRecording(_)
            | RecordingError::NotRecording
            | RecordingError::Io { .. } => ApiError::bad_request(err.to_string()),
        }
    }
}

/// Where a recording may go: inside `dir` (a server-chosen name when the caller names none).
/// Without a `recording_dir` recordings are off, so the admin API cannot write wherever the
/// gateway's user may. `..` is refused, and the file itself is created fresh (never
/// overwritten, never through an existing symlink).
fn recording_path(
    dir: Option<&FsPath>,
    requested: Option<&FsPath>,
) -> Result<PathBuf, RecordingError> {
    let refused = |m: String| RecordingError::PathRefused(m);
    if let Some(p) = requested
        && p.components().any(|c| matches!(c, Component::ParentDir))
    {
        return Err(refused(format!("{} contains `..`", p.display())));
    }
    let Some(dir) = dir else {
        return Err(refused(
            "recordings are off: the gateway has no recording_dir (--recording-dir)".into(),
        ));
    };
    let root = dir
        .canonicalize()
        .map_err(|e| refused(format!("recording_dir {} is unusable: {e}", dir.display())))?;
    let path = match requested {
        Some(p) => root.join(p),
        None => root.join(format!("kv-recording-{}.jsonl", super::state::unix_now())),
    };
    let root = Some(root);
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(refused(format!("{} names no file", path.display())));
    };
    let parent = parent
        .canonicalize()
        .map_err(|e| refused(format!("{}: {e}", parent.display())))?;
    if let Some(root) = root
        && !parent.starts_with(&root)
    {
        return Err(refused(format!(
            "{} is outside recording_dir {}",
            path.display(),
            root.display()
        )));
    }
    Ok(parent.join(name))
}

async fn start_recording(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<axum::Json<RecordingStatus>, ApiError> {
    let request: StartRecording = if body.iter().all(u8::is_ascii_whitespace) {
        StartRecording::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid recording request: {e}")))?
    };
    let path = recording_path(
        state.config.recording_dir.as_deref(),
        request.path.as_deref(),
    )?;
    // The cap holds whatever the request asks: a recording cannot fill the disk.
    let cap = state.config.recording_max_bytes;
    let max_bytes = Some(request.max_bytes.map_or(cap, |asked| asked.min(cap)));
    let pool = &state.pool;
    let header = Header {
        format: FORMAT.to_owned(),
        version: VERSION,
        gateway_version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at_unix_ms: super::state::unix_now() * 1000,
        start_tick: pool.now_tick(),
        policy: pool.policy_kind().as_str().to_owned(),
        policy_settings: state.config.policy_settings.clone(),
        serve: state.config.disagg().serve,
        workers: pool.workers().iter().map(|w| w.info()).collect(),
        max_records: request.max_records,
        max_bytes,
    };
    let limits = Limits {
        max_records: request.max_records,
        max_bytes,
        ..Limits::default()
    };
    Ok(axum::Json(state.observers.recorder.start(
        path,
        &header,
        limits,
        &state.tasks,
    )?))
}

async fn stop_recording(
    State(state): State<Arc<AppState>>,
) -> Result<axum::Json<RecordingStatus>, ApiError> {
    Ok(axum::Json(state.observers.recorder.stop().await?))
}

async fn recording_status(State(state): State<Arc<AppState>>) -> axum::Json<RecordingStatus> {
    axum::Json(state.observers.recorder.status())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn recording_paths_stay_inside_the_recording_dir() {
        let dir = std::env::temp_dir().join(format!("switchyard-admin-rec-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let root = dir.canonicalize().unwrap();
        let ok = |p: &str| recording_path(Some(&dir), Some(FsPath::new(p)));
        assert_eq!(ok("a.jsonl").unwrap(), root.join("a.jsonl"));
        assert_eq!(ok("sub/a.jsonl").unwrap(), root.join("sub/a.jsonl"));
        assert!(ok("../a.jsonl").is_err());
        assert!(ok("sub/../../a.jsonl").is_err());
        assert!(ok("/etc/a.jsonl").is_err());
        assert!(ok(root.join("b.jsonl").to_str().unwrap()).is_ok());
        assert!(recording_path(Some(&dir), None).unwrap().starts_with(&root));
        // Without a recording_dir: recordings are off, whatever the path.
        assert!(recording_path(None, Some(FsPath::new("a.jsonl"))).is_err());
        assert!(recording_path(None, None).is_err());
        let off = recording_path(None, Some(&root.join("c.jsonl"))).unwrap_err();
        assert!(off.to_string().contains("recordings are off"), "{off}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
