//! The metrics listener: `GET /metrics` (OpenMetrics text) on its own port, apart from the gRPC
//! server, so Prometheus scrapes over plain HTTP and a busy or draining gRPC server never stalls
//! a scrape.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::WorkerMetrics;

async fn get_metrics(State(metrics): State<Arc<WorkerMetrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.encode(),
    )
}

/// Serves `/metrics` on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<WorkerMetrics>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(get_metrics))
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}
