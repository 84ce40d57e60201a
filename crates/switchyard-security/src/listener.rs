//! The HTTP listeners beside the cluster's gRPC (the worker's `--metrics-listen`, the planner's
//! `--admin-listen`) and the gateway's HTTPS share one way of turning TLS on: a certificate
//! chain and key from files, re-read when they change ([`https_config`]). The side listeners are
//! served by [`serve`], plain or over TLS with each handshake off the accept loop and bounded by
//! [`HANDSHAKE_TIMEOUT`](crate::incoming::HANDSHAKE_TIMEOUT) ([`TlsListener`]); the gateway runs
//! its own connection-capped server over the same configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::error::SecurityError;
use crate::incoming::TlsIncoming;
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

/// A TLS listener for `axum::serve`: yields connections whose handshake finished.
#[derive(Debug)]
pub struct TlsListener {
    established: TlsIncoming,
    local_addr: SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener` until `stop` fires or the listener is dropped.
    pub fn new(
        listener: TcpListener,
        config: Arc<HttpsConfig>,
        stop: CancellationToken,
    ) -> std::io::Result<Self> {
        let local_addr = listener.local_addr()?;
        Ok(Self {
            established: TlsIncoming::new(listener, config, stop),
            local_addr,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.established.next().await {
                Some(Ok(stream)) => {
                    let peer = stream
                        .get_ref()
                        .0
                        .peer_addr()
                        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                    return (stream, peer);
                }
                // Failed handshakes are logged where they happen and never reach here.
                Some(Err(_)) => continue,
                // The accept task stopped (shutdown): no more connections, ever.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

/// Serves `app` on `listener`, over TLS when `tls` is given, until `stop` fires.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<HttpsConfig>>,
    app: axum::Router,
    stop: CancellationToken,
) -> std::io::Result<()> {
    match tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
        Some(config) => {
            let listener = TlsListener::new(listener, config, stop.clone())?;
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
    }
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
