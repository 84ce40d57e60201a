//! The one HTTP server of every Switchyard listener (the gateway's OpenAI API, the endpoint
//! picker's, the worker's metrics, the planner's admin API): accepts connections within a cap
//! and serves each over HTTP/1.1 or HTTP/2 (prior knowledge) with limits on everything a
//! careless or hostile client can hold.
//!
//! - **Connections**: at most [`HttpLimits::max_connections`] open; one more is answered
//!   `503` with the body its [`ConnectionEvents`] writes (the gateway's is an OpenAI error
//!   object, `code: too_many_connections`) and closed.
//! - **Headers**: an HTTP/1.1 request's headers must arrive within `header_timeout`, counted
//!   from when the connection starts waiting for them (so this also bounds how long a kept-alive
//!   connection waits for its next request); hyper closes the connection otherwise.
//! - **Bodies**: a request's whole body must arrive within `body_timeout` of its headers, else
//!   `408` ([`DeadlineBody`]).
//! - **Idle**: a connection with no request in flight for `idle_timeout` is closed (both
//!   protocols, and a client that never finishes its first bytes).
//! - **HTTP/2**: at most `http2_max_streams` concurrent streams per connection, a bounded
//!   number of streams a client may reset before they are accepted (the rapid-reset attack)
//!   and keep-alive pings that close a connection whose peer stopped answering.
//! - **TLS** (when a certificate is configured): the handshake runs in the connection's own task,
//!   under the connection cap, and must finish within `header_timeout`; the certificate is
//!   re-read when its files change, for the next connections.
//! - **Shutdown**: when `shutdown` fires the listener closes, every connection is asked to
//!   finish (HTTP/1.1 after its current response, HTTP/2 with GOAWAY), and whatever is still
//!   open `shutdown_grace` later is cut.

mod body;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::incoming::accept_tls;
use crate::listener::HttpsConfig;
pub use body::BodyTimeout;
use body::{Activity, DeadlineBody, HeldBody, InFlight};

/// What a server reports about its connections, and how it answers one over its cap. Every
/// method has a default that does nothing (or answers a plain JSON error), so a side listener
/// with no connection metrics passes `()`.
pub trait ConnectionEvents: Send + Sync + 'static {
    /// A connection is being served.
    fn opened(&self) {}
    /// A served connection closed.
    fn closed(&self) {}
    /// A connection over the cap was answered 503 (or closed unanswered).
    fn refused(&self) {}
    /// A connection was closed for a timeout (TLS handshake, headers, idle).
    fn timed_out(&self) {}
    /// The JSON body of the 503 a connection over the cap of `max` connections gets.
    fn refusal_body(&self, max: usize) -> String {
        format!(
            r#"{{"error":"too many connections: this listener serves at most {max} at once; retry shortly"}}"#
        )
    }
}

impl ConnectionEvents for () {}

/// The limits of the HTTP listener (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub idle_timeout: Duration,
    pub http2_max_streams: u32,
    pub shutdown_grace: Duration,
}

/// Refusals of connections over the cap are written by at most this many tasks at once; beyond
/// that a connection over the cap is closed without a word (it would cost more to answer it).
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// How long a refusal may take to write and drain.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 streams a client may reset before the server accepts them (hyper's default too);
/// more and the connection is closed with `ENHANCE_YOUR_CALM`.
const HTTP2_MAX_PENDING_RESETS: usize = 20;
/// HTTP/2 streams the server may reset for a client's protocol errors before closing.
const HTTP2_MAX_LOCAL_RESETS: usize = 1024;
/// Largest HTTP/2 header block accepted.
const HTTP2_MAX_HEADER_LIST: u32 = 64 << 10;
/// HTTP/2 keep-alive: a ping this often on a quiet connection, closed if unanswered as long.
const HTTP2_KEEP_ALIVE: Duration = Duration::from_secs(20);
/// A connection asked to close while idle gets this long before it is dropped.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` until `shutdown` fires and the connections are done (or cut).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    tls: Option<Arc<HttpsConfig>>,
    events: Arc<dyn ConnectionEvents>,
    shutdown: CancellationToken,
) {
    let limits = Arc::new(limits);
    let builder = Arc::new(builder(&limits));
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let cut = CancellationToken::new();
    let mut tasks = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                if !is_connection_error(&err) {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::warn!(error = %err, "cannot accept a connection; pausing accepts");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
            events.refused();
            if let Ok(refusal) = Arc::clone(&refusals).try_acquire_owned() {
                let body = events.refusal_body(limits.max_connections);
                tasks.spawn(async move {
                    refuse(tcp, &body).await;
                    drop(refusal);
                });
            }
            continue;
        };
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        let connection = Connection {
            builder: Arc::clone(&builder),
            app: app.clone(),
            limits: Arc::clone(&limits),
            events: Arc::clone(&events),
            peer,
        };
        let (shutdown, cut) = (shutdown.clone(), cut.clone());
        let tls = tls.clone();
        tasks.spawn(async move {
            match tls {
                None => connection.run(tcp, shutdown, cut).await,
                Some(tls) => {
                    // A client that opens a connection and stalls the handshake holds a slot
                    // no longer than one that stalls its headers.
                    let handshake = accept_tls(&tls, tcp, connection.limits.header_timeout);
                    let established = tokio::select! {
                        established = handshake => established,
                        () = cut.cancelled() => return,
                    };
                    match established {
                        Ok(stream) => connection.run(stream, shutdown, cut).await,
                        Err(err) => {
                            if err.kind() == std::io::ErrorKind::TimedOut {
                                connection.events.timed_out();
                            }
                            tracing::debug!(peer = %peer, error = %err, "tls handshake failed");
                        }
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    let open = tasks.len();
    if open > 0 {
        tracing::info!(
            connections = open,
            grace_secs = limits.shutdown_grace.as_secs_f64(),
            "finishing open connections"
        );
    }
    let finished = tokio::time::timeout(limits.shutdown_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!(
            connections = tasks.len(),
            "connections still open after the shutdown grace; cutting them"
        );
        cut.cancel();
        while tasks.join_next().await.is_some() {}
    }
}

/// File descriptors kept free of connections: etcd, workers, log files, the tokenizer's files.
const RESERVED_FDS: u64 = 256;

/// The connection cap the process can hold: `wanted`, lowered to what the open-files limit
/// leaves after [`RESERVED_FDS`]. The soft limit is first raised to the hard one, as servers
/// commonly do (many systems start processes at a soft limit of 1024).
pub fn connection_cap(wanted: usize) -> usize {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit = getrlimit(Resource::Nofile),
            Err(err) => tracing::debug!(error = %err, "cannot raise the open-files limit"),
        }
    }
    let Some(current) = limit.current else {
        return wanted;
    };
    let room = usize::try_from(current.saturating_sub(RESERVED_FDS).max(1)).unwrap_or(usize::MAX);
    if room < wanted {
        tracing::warn!(
            wanted,
            open_files_limit = current,
            max_connections = room,
            "the open-files limit allows fewer connections than configured; raise it (ulimit -n)"
        );
    }
    wanted.min(room)
}

fn builder(limits: &HttpLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.http2_max_streams)
        .max_pending_accept_reset_streams(HTTP2_MAX_PENDING_RESETS)
        .max_local_error_reset_streams(HTTP2_MAX_LOCAL_RESETS)
        .max_header_list_size(HTTP2_MAX_HEADER_LIST)
        .keep_alive_interval(HTTP2_KEEP_ALIVE)
        .keep_alive_timeout(HTTP2_KEEP_ALIVE);
    builder
}

/// Errors of `accept` that concern one connection only (it went away before we took it).
fn is_connection_error(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        err.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

/// Answers a connection over the cap with a 503 and closes it, reading what the client sent
/// meanwhile so the close does not reset the connection before the answer is read.
async fn refuse(mut tcp: TcpStream, body: &str) {
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, async {
        tcp.write_all(response.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 64 << 10 {
            match tcp.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// One accepted connection and what serving it needs.
struct Connection {
    builder: Arc<auto::Builder<TokioExecutor>>,
    app: Router,
    limits: Arc<HttpLimits>,
    events: Arc<dyn ConnectionEvents>,
    peer: SocketAddr,
}

impl Connection {
    async fn run<IO>(self, io: IO, shutdown: CancellationToken, cut: CancellationToken)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        self.events.opened();
        let activity = Arc::new(Activity::new());
        let service = {
            let (app, activity, peer) = (self.app.clone(), Arc::clone(&activity), self.peer);
            let body_timeout = self.limits.body_timeout;
            hyper::service::service_fn(move |request: Request<Incoming>| {
                let (app, activity) = (app.clone(), Arc::clone(&activity));
                async move {
                    let in_flight = InFlight::start(activity);
                    let mut request =
                        request.map(|body| DeadlineBody::new(body, Instant::now() + body_timeout));
                    request.extensions_mut().insert(ConnectInfo(peer));
                    let response = app.oneshot(request).await?;
                    Ok::<_, std::convert::Infallible>(
                        response.map(|body| HeldBody::new(body, in_flight)),
                    )
                }
            })
        };
        let conn = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(conn);
        let idle = self.limits.idle_timeout;
        let mut check = tokio::time::interval(
            (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5)),
        );
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut closing_by: Option<Instant> = None;
        let mut asked_to_finish = false;
        loop {
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(err) = result {
                        let timeout = err
                            .downcast_ref::<hyper::Error>()
                            .is_some_and(hyper::Error::is_timeout);
                        if timeout {
                            self.events.timed_out();
                        }
                        tracing::debug!(peer = %self.peer, error = %err, "connection ended");
                    }
                    break;
                }
                () = shutdown.cancelled(), if !asked_to_finish => {
                    conn.as_mut().graceful_shutdown();
                    asked_to_finish = true;
                }
                () = cut.cancelled() => break,
                _ = check.tick(), if closing_by.is_none() => {
                    if activity.idle_for() >= idle {
                        self.events.timed_out();
                        conn.as_mut().graceful_shutdown();
                        asked_to_finish = true;
                        closing_by = Some(Instant::now() + IDLE_CLOSE_GRACE);
                    }
                }
                () = sleep_until(closing_by) => break,
            }
        }
        self.events.closed();
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
