//! TLS on the accepting side: handshakes run in their own tasks with a deadline, so a client
//! that connects and says nothing (or says it slowly) holds no accept loop and no slot for
//! longer than [`HANDSHAKE_TIMEOUT`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::tls::Reloading;

/// Longest a TLS handshake may take on the server side.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most handshakes in progress at once; beyond it new connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 1024;

/// Runs a server-side handshake on `tcp` with the current configuration, within `timeout`.
pub async fn accept_tls(
    config: &Reloading<ServerConfig>,
    tcp: TcpStream,
    timeout: Duration,
) -> std::io::Result<TlsStream<TcpStream>> {
    let acceptor = TlsAcceptor::from(config.get());
    tokio::time::timeout(timeout, acceptor.accept(tcp))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "tls handshake timed out"))?
}

/// The established TLS connections of a listener, for `serve_with_incoming_shutdown`.
///
/// Owns its accept task: dropping the stream (the server stopped) stops accepting. A failed
/// handshake is logged and skipped, never ends the stream.
#[derive(Debug)]
pub struct TlsIncoming {
    established_rx: mpsc::Receiver<std::io::Result<TlsStream<TcpStream>>>,
    _accept: AbortOnDropHandle<()>,
}

impl TlsIncoming {
    pub fn new(
        listener: TcpListener,
        config: Arc<Reloading<ServerConfig>>,
        stop: CancellationToken,
    ) -> Self {
        let (established_tx, established_rx) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(listener, config, stop, established_tx));
        Self {
            established_rx,
            _accept: AbortOnDropHandle::new(accept),
        }
    }
}

impl Stream for TlsIncoming {
    type Item = std::io::Result<TlsStream<TcpStream>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.established_rx.poll_recv(cx)
    }
}

async fn accept_loop(
    listener: TcpListener,
    config: Arc<Reloading<ServerConfig>>,
    stop: CancellationToken,
    established_tx: mpsc::Sender<std::io::Result<TlsStream<TcpStream>>>,
) {
    let mut handshakes = JoinSet::new();
    loop {
        while handshakes.try_join_next().is_some() {}
        if handshakes.len() >= MAX_HANDSHAKES {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = handshakes.join_next() => continue,
            }
        }
        let (tcp, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            _ = established_tx.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let config = Arc::clone(&config);
        let established_tx = established_tx.clone();
        handshakes.spawn(async move {
            match accept_tls(&config, tcp, HANDSHAKE_TIMEOUT).await {
                Ok(tls) => {
                    let _ = established_tx.send(Ok(tls)).await;
                }
                Err(err) => tracing::debug!(%peer, error = %err, "tls handshake failed"),
            }
        });
    }
}
