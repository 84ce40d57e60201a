//! The HTTP listeners beside the cluster's gRPC (the worker's `--metrics-listen`, the planner's
//! `--admin-listen`) and the gateway's HTTPS share one way of turning TLS on: a certificate
//! chain and key from files, re-read when they change ([`https_config`]). The side listeners are
//! served by [`serve`]: the gateway's own server ([`crate::server`]), plain or over TLS, with at
//! most [`SIDE_MAX_CONNECTIONS`] connections open (one more is answered 503) and the header,
//! body and idle timeouts of [`side_limits`], so a client that opens connections and sends
//! nothing, or trickles its headers, cannot hold a scrape endpoint.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::SecurityError;
use crate::server::HttpLimits;
use crate::tls::{Reloading, TlsFiles, http_server_config};

/// An HTTPS listener's configuration, rebuilt when its files change.
pub type HttpsConfig = Reloading<ServerConfig>;

/// HTTPS from `cert` and `key` (PEM files): both or neither; `settings` names the pair in the
/// error (`"metrics_tls_cert and metrics_tls_key"`).
pub fn https_files(
    cert: Option<&PathBuf>,
    key: Option<&PathBuf>,
    settings: &str,
) -> Result<Option<TlsFiles>, SecurityError> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: None,
        })),
        (None, None) => Ok(None),
        _ => Err(SecurityError::Setting(format!(
            "HTTPS needs {settings} together"
        ))),
    }
}

/// Reads the certificate and key (an error here is a configuration error at start) and keeps
/// watching them.
pub fn https_config(files: &TlsFiles) -> Result<Arc<HttpsConfig>, SecurityError> {
    crate::install_crypto_provider();
    let for_build = files.clone();
    Ok(Arc::new(Reloading::new(
        "https certificate",
        files,
        move || http_server_config(&for_build),
    )?))
}

/// Connections a side listener (metrics, planner admin) keeps open at once: scrapers and
/// operators need a handful, so a client that opens thousands holds only these.
pub const SIDE_MAX_CONNECTIONS: usize = 256;

/// The limits of a side listener: its requests are scrapes, probes and small admin calls, so
/// a client gets as long as the gateway's defaults give it for headers and bodies, and one that
/// holds a connection open without asking anything is closed after a minute.
pub fn side_limits(max_connections: usize) -> HttpLimits {
    HttpLimits {
        max_connections,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(60),
        http2_max_streams: 32,
        shutdown_grace: Duration::from_secs(5),
    }
}

/// Serves `app` on `listener`, over TLS when `tls` is given, until `stop` fires, with the
/// limits of [`side_limits`] and at most [`SIDE_MAX_CONNECTIONS`] connections open.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<HttpsConfig>>,
    app: axum::Router,
    stop: CancellationToken,
) {
    serve_with(listener, tls, app, stop, side_limits(SIDE_MAX_CONNECTIONS)).await;
}

/// [`serve`] with other limits.
pub async fn serve_with(
    listener: TcpListener,
    tls: Option<Arc<HttpsConfig>>,
    app: axum::Router,
    stop: CancellationToken,
    limits: HttpLimits,
) {
    crate::server::serve(listener, app, limits, tls, Arc::new(()), stop).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cert_and_key_come_together() {
        let cert = PathBuf::from("/c");
        let key = PathBuf::from("/k");
        assert!(https_files(None, None, "a and b").unwrap().is_none());
        assert_eq!(
            https_files(Some(&cert), Some(&key), "a and b")
                .unwrap()
                .map(|f| (f.cert, f.key, f.ca)),
            Some((cert.clone(), key.clone(), None))
        );
        let err = https_files(Some(&cert), None, "a and b").unwrap_err();
        assert!(
            err.to_string().contains("HTTPS needs a and b together"),
            "{err}"
        );
        assert!(https_files(None, Some(&key), "a and b").is_err());
    }
}
