//! The HTTP listeners beside the cluster's gRPC (the worker's `--metrics-listen`, the planner's
//! `--admin-listen`) and the gateway's HTTPS share one way of turning TLS on: a certificate
//! chain and key from files, re-read when they change ([`https_config`]). The side listeners are
//! served by [`serve`], plain or over TLS with each handshake off the accept loop and bounded by
//! [`HANDSHAKE_TIMEOUT`](crate::incoming::HANDSHAKE_TIMEOUT) ([`TlsListener`]), with at most
//! [`SIDE_MAX_CONNECTIONS`] connections open at once ([`Capped`]: past it, new connections wait
//! in the listen backlog until one closes); the gateway runs its own connection-capped server
//! over the same configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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

/// Connections a side listener (metrics, planner admin) keeps open at once: scrapers and
/// operators need a handful, so a client that opens thousands holds only these.
pub const SIDE_MAX_CONNECTIONS: usize = 256;

/// A listener that keeps at most `max` connections open: each accepted connection holds a slot
/// until it closes, and the next accept waits for a free slot (the kernel's backlog holds the
/// connections in between).
#[derive(Debug)]
pub struct Capped<L> {
    inner: L,
    slots: Arc<Semaphore>,
}

impl<L> Capped<L> {
    pub fn new(inner: L, max: usize) -> Self {
        Self {
            inner,
            slots: Arc::new(Semaphore::new(max.max(1))),
        }
    }
}

impl<L: axum::serve::Listener> axum::serve::Listener for Capped<L> {
    type Io = Held<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let Ok(slot) = Arc::clone(&self.slots).acquire_owned().await else {
            // The semaphore is never closed; should it be, accept nothing more.
            return std::future::pending().await;
        };
        let (io, addr) = self.inner.accept().await;
        (Held { io, _slot: slot }, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection holding its slot of a [`Capped`] listener until it is dropped.
#[derive(Debug)]
pub struct Held<Io> {
    io: Io,
    _slot: OwnedSemaphorePermit,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Held<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Held<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Serves `app` on `listener`, over TLS when `tls` is given, until `stop` fires, with at most
/// [`SIDE_MAX_CONNECTIONS`] connections open.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<HttpsConfig>>,
    app: axum::Router,
    stop: CancellationToken,
) -> std::io::Result<()> {
    serve_capped(listener, tls, app, stop, SIDE_MAX_CONNECTIONS).await
}

/// [`serve`] with `max` connections open at most.
pub async fn serve_capped(
    listener: TcpListener,
    tls: Option<Arc<HttpsConfig>>,
    app: axum::Router,
    stop: CancellationToken,
    max: usize,
) -> std::io::Result<()> {
    match tls {
        None => {
            axum::serve(Capped::new(listener, max), app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
        Some(config) => {
            let listener = TlsListener::new(listener, config, stop.clone())?;
            axum::serve(Capped::new(listener, max), app)
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

    /// Two idle connections fill a listener capped at two: a third client is not served until
    /// one of them closes, then it is.
    #[tokio::test]
    async fn a_capped_listener_serves_no_more_connections_than_its_cap() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(serve_capped(listener, None, app, stop.clone(), 2));
        let ask = || async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        };
        // Served while there is room.
        assert!(ask().await.ends_with("ok"));
        let first = TcpStream::connect(addr).await.unwrap();
        let second = TcpStream::connect(addr).await.unwrap();
        let third = tokio::spawn(ask());
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(
            !third.is_finished(),
            "a third connection was served past the cap"
        );
        drop(first);
        let answer = tokio::time::timeout(std::time::Duration::from_secs(20), third)
            .await
            .expect("served once a slot is free")
            .unwrap();
        assert!(answer.ends_with("ok"), "{answer}");
        drop(second);
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}
