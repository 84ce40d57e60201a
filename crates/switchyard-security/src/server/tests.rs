//! The server's limits over real loopback sockets, through the side listeners' entry point.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::listener::{serve_with, side_limits};
use crate::server::HttpLimits;

/// Long enough for a loaded machine to notice a close; the tests wait for an event, never time
/// one.
const PATIENCE: Duration = Duration::from_secs(30);

async fn start(limits: HttpLimits) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let server = tokio::spawn(serve_with(listener, None, app, stop.clone(), limits));
    (addr, stop, server)
}

async fn ask(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer
}

/// Reads until the server closes the connection; what it sent meanwhile.
async fn until_closed(stream: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let closed = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut seen)).await;
    assert!(closed.is_ok(), "the server never closed the connection");
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test]
async fn a_connection_over_the_cap_is_refused_and_the_next_after_a_close_is_served() {
    let (addr, stop, server) = start(side_limits(2)).await;
    assert!(ask(addr).await.ends_with("ok"));
    let first = TcpStream::connect(addr).await.unwrap();
    let _second = TcpStream::connect(addr).await.unwrap();
    // Both are being served once a request on a third connection answers: connections are
    // taken in order.
    let refused = ask(addr).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("too many connections"), "{refused}");
    assert!(refused.contains("at most 2"), "{refused}");
    drop(first);
    let served = tokio::time::timeout(PATIENCE, async {
        loop {
            let answer = ask(addr).await;
            if answer.ends_with("ok") {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(served.is_ok(), "a slot freed by a close was never reused");
    stop.cancel();
    server.await.unwrap();
}

#[tokio::test]
async fn headers_trickled_past_the_header_timeout_close_the_connection() {
    let limits = HttpLimits {
        header_timeout: Duration::from_millis(300),
        ..side_limits(4)
    };
    let (addr, stop, server) = start(limits).await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    // Never finishes its headers: the server gives up on it (and answers nothing).
    let seen = until_closed(&mut slow).await;
    assert!(!seen.contains(" 200 "), "{seen}");
    // The listener still serves others.
    assert!(ask(addr).await.ends_with("ok"));
    stop.cancel();
    server.await.unwrap();
}

#[tokio::test]
async fn a_kept_alive_connection_with_nothing_more_to_ask_is_closed() {
    let limits = HttpLimits {
        idle_timeout: Duration::from_millis(300),
        ..side_limits(4)
    };
    let (addr, stop, server) = start(limits).await;
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let seen = until_closed(&mut idle).await;
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    stop.cancel();
    server.await.unwrap();
}

#[tokio::test]
async fn a_connection_that_never_speaks_is_closed() {
    let limits = HttpLimits {
        header_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(300),
        ..side_limits(1)
    };
    let (addr, stop, server) = start(limits).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert_eq!(until_closed(&mut silent).await, "");
    // Its slot came back: the only one this listener has.
    let served = tokio::time::timeout(PATIENCE, async {
        loop {
            if ask(addr).await.ends_with("ok") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        served.is_ok(),
        "the silent connection's slot never came back"
    );
    stop.cancel();
    server.await.unwrap();
}
