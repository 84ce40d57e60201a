//! The metrics listener: `GET /metrics` (OpenMetrics text) on its own port, apart from the gRPC
//! server, so a busy or draining gRPC server never stalls a scrape. Plain HTTP and open by
//! default; HTTPS (`metrics_tls_cert`/`metrics_tls_key`, re-read when they change) and a bearer
//! token (`metrics_token`) when configured, as the gateway's `/metrics`.
//!
//! `GET /health` (the process serves) and `GET /ready` (503 once the worker drains) answer
//! without a token: the kubelet cannot speak the mTLS the gRPC port requires once it is on, so
//! its probes come here (Kubernetes' HTTPS probes do not check the certificate).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use switchyard_security::listener::HttpsConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::WorkerMetrics;
use crate::state::WorkerState;

/// Who may scrape: a bearer token, and TLS on the port.
#[derive(Debug, Clone, Default)]
pub struct MetricsAccess {
    pub token: Option<String>,
    pub tls: Option<Arc<HttpsConfig>>,
}

struct Scrape {
    metrics: Arc<WorkerMetrics>,
    token: Option<String>,
}

async fn get_metrics(State(scrape): State<Arc<Scrape>>, headers: HeaderMap) -> Response {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !switchyard_config::admin_authorized(scrape.token.as_deref(), authorization) {
        let body = serde_json::json!({"error": {
            "message": "missing or wrong metrics token",
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
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        scrape.metrics.encode(),
    )
        .into_response()
}

async fn get_ready(State(state): State<WorkerState>) -> Response {
    if state.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        "ok".into_response()
    }
}

/// Serves `/metrics`, `/health` and `/ready` on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    access: MetricsAccess,
    metrics: Arc<WorkerMetrics>,
    state: WorkerState,
    stop: CancellationToken,
) {
    let probes = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(get_ready))
        .with_state(state);
    let app = Router::new()
        .route("/metrics", get(get_metrics))
        .with_state(Arc::new(Scrape {
            metrics,
            token: access.token,
        }))
        .merge(probes);
    switchyard_security::listener::serve(listener, access.tls, app, stop).await
}
