//! The planner's admin API and its own HTTP listener.
//!
//! | method | path | does |
//! |---|---|---|
//! | GET | `/admin/planner` | settings, the current plan and the last decisions (`?limit=N`, default 20) |
//! | GET | `/admin/planner/decisions?limit=N` | the last decisions, newest first (default 50) |
//! | GET | `/metrics` | `switchyard_planner_*` metrics |
//! | GET | `/health` | `ok` |
//!
//! [`router`] is the `/admin/planner` part without authentication: the gateway mounts it
//! under its own admin routes (and its bearer-token check) when `switchyard up --planner`
//! embeds the planner. [`serve`] runs the planner's own listener with the same bearer-token
//! scheme as the gateway's admin API, a token on `/metrics` when one is set (as the gateway's),
//! and HTTPS when a certificate is configured (the gateway's reloading configuration).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use switchyard_config::admin_authorized;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::PlannerMetrics;
use crate::planner::PlannerState;

#[derive(Debug, Deserialize)]
struct Limit {
    limit: Option<usize>,
}

/// `/admin/planner` and `/admin/planner/decisions`, relative to where it is mounted.
pub fn router(state: Arc<PlannerState>) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/decisions", get(decisions))
        .with_state(state)
}

async fn overview(
    State(state): State<Arc<PlannerState>>,
    Query(q): Query<Limit>,
) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "settings": state.settings,
        "plan": state.plan(),
        "decisions": state.decisions(q.limit.unwrap_or(20)),
    }))
}

async fn decisions(
    State(state): State<Arc<PlannerState>>,
    Query(q): Query<Limit>,
) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!(state.decisions(q.limit.unwrap_or(50))))
}

/// Why the admin listener could not run.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot bind the planner admin listener {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Binds `listen`; the returned server runs until `shutdown` once awaited.
pub async fn bind(listen: SocketAddr) -> Result<(TcpListener, SocketAddr), AdminError> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| AdminError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| AdminError::Bind {
        addr: listen,
        source,
    })?;
    Ok((listener, addr))
}

/// Who may use the admin listener: the admin token on `/admin`, a token on `/metrics`, TLS on
/// the port (`/health` stays open for probes).
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    pub admin_token: Option<String>,
    pub metrics_token: Option<String>,
    pub tls: Option<Arc<switchyard_security::listener::HttpsConfig>>,
}

/// Serves the planner's admin API and metrics on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    access: AdminAccess,
    state: Arc<PlannerState>,
    metrics: Arc<PlannerMetrics>,
    shutdown: CancellationToken,
) {
    let admin =
        Router::new()
            .nest("/admin/planner", router(state))
            .layer(middleware::from_fn_with_state(
                Arc::new(access.admin_token),
                require_token,
            ));
    let scrape = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                }
            }),
        )
        .layer(middleware::from_fn_with_state(
            Arc::new(access.metrics_token),
            require_token,
        ));
    let app = admin.merge(scrape).route("/health", get(|| async { "ok" }));
    switchyard_security::listener::serve(listener, access.tls, app, shutdown).await;
}

async fn require_token(
    State(token): State<Arc<Option<String>>>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !admin_authorized(token.as_deref(), authorization) {
        let body = serde_json::json!({"error": {
            "message": "missing or wrong token",
            "type": "authentication_error",
            "param": null,
            "code": "unauthorized",
        }});
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            axum::Json(body),
        )
            .into_response();
    }
    next.run(request).await
}
