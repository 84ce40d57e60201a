//! The gateway's HTTP listener: the cluster's one hardened server
//! ([`switchyard_security::server`]: connection cap, header, body and idle timeouts, HTTP/2
//! limits, TLS, phased shutdown) with the gateway's connection metrics and its OpenAI-shaped
//! answer to a connection over the cap.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::observe::metrics::Metrics;

use switchyard_security::listener::HttpsConfig;
pub use switchyard_security::server::{BodyTimeout, HttpLimits, connection_cap};

impl switchyard_security::server::ConnectionEvents for Metrics {
    fn opened(&self) {
        self.connections_open.inc();
    }

    fn closed(&self) {
        self.connections_open.dec();
    }

    fn refused(&self) {
        self.connections_refused.inc();
    }

    fn timed_out(&self) {
        self.connections_timed_out.inc();
    }

    fn refusal_body(&self, max: usize) -> String {
        ApiError::TooManyConnections(max).to_json().to_string()
    }
}

/// Serves `app` on `listener` until `shutdown` fires and the connections are done (or cut).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    tls: Option<Arc<HttpsConfig>>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    switchyard_security::server::serve(listener, app, limits, tls, metrics, shutdown).await;
}
