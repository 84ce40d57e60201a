//! What a careless or hostile client can hold of the gateway, end to end through the real
//! binary over raw TCP: idle and slow (slowloris) connections are cut, a body that never
//! arrives is a 408, connections over the cap get a clear 503, one client cannot take every
//! request slot, a stuck client cannot keep a SIGTERMed gateway alive, HTTP/2 announces its
//! stream limit, and an over-long prompt is refused before it is tokenized in full and leaves
//! nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, chat, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Whether the server closes `tcp` within `limit` (reads until EOF or a reset, keeping
/// whatever the server sent).
async fn closed_within(tcp: &mut TcpStream, limit: Duration) -> (bool, String) {
    let mut got = Vec::new();
    let result = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (result.is_ok(), String::from_utf8_lossy(&got).into_owned())
}

async fn connect(address: &str) -> TcpStream {
    TcpStream::connect(address).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_clients_are_cut_off() {
    let up = Launch::up(1)
        .args([
            "--header-timeout-secs",
            "1",
            "--body-timeout-secs",
            "1",
            "--idle-timeout-secs",
            "2",
        ])
        .start()
        .await;
    let api = Api::new(&up);
    let limit = Duration::from_secs(20);

    // A connection that never says anything.
    let mut silent = connect(&up.address).await;
    let (closed, _) = closed_within(&mut silent, limit).await;
    assert!(closed, "a silent connection is closed");

    // Headers trickled a byte at a time (slowloris): the header timeout counts from the start,
    // whatever arrives meanwhile.
    let mut trickle = connect(&up.address).await;
    let headers = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    let mut cut_off = false;
    for byte in headers {
        if trickle.write_all(&[*byte]).await.is_err() {
            cut_off = true;
            break;
        }
        let (closed, _) = closed_within(&mut trickle, Duration::from_millis(300)).await;
        if closed {
            cut_off = true;
            break;
        }
    }
    assert!(
        cut_off,
        "a client trickling its headers is cut off before it finishes"
    );

    // A body declared at 1000 bytes of which 9 arrive.
    let mut short = connect(&up.address).await;
    short
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":")
        .await
        .unwrap();
    let (closed, answer) = closed_within(&mut short, limit).await;
    assert!(closed, "a body that never arrives ends the connection");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");

    // A kept-alive connection that served a request and then went quiet.
    let mut kept = connect(&up.address).await;
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let (closed, _) = closed_within(&mut kept, limit).await;
    assert!(closed, "an idle kept-alive connection is closed");

    assert!(api.metric("switchyard_http_connections_timed_out").await >= 3.0);
    let requests = api
        .metric("switchyard_requests{status=\"body_timeout\"}")
        .await;
    assert_eq!(requests, 1.0);
    // Served as before.
    assert_eq!(
        api.post("/v1/chat/completions", &chat("hi", 2)).await.0,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_clearly() {
    let up = Launch::up(1).arg("--max-connections", "8").start().await;
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut tcp = connect(&up.address).await;
        // A request answered proves the gateway accepted (and counts) the connection.
        tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        held.push(tcp);
    }
    let mut ninth = connect(&up.address).await;
    ninth
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (closed, answer) = closed_within(&mut ninth, Duration::from_secs(20)).await;
    assert!(closed, "the refused connection is closed");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "too_many_connections");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_connections"),
        "{body}"
    );
    // A freed place is taken again.
    held.pop();
    let api = Api::new(&up);
    let served = eventually(Duration::from_secs(10), || async {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        http.get(format!("{}/health", api.base))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(served);
    drop(held);
    // The scrape itself may be refused until the gateway notices the closed connections.
    let refused = eventually(Duration::from_secs(10), || async {
        api.try_metric("switchyard_http_connections_refused")
            .await
            .is_some_and(|v| v >= 1.0)
    })
    .await;
    assert!(refused);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_every_slot() {
    let up = Launch::up(1)
        .args(["--speedup", "1", "--max-requests-per-client", "2"])
        .start()
        .await;
    let api = Api::new(&up);
    let mut streams = Vec::new();
    for i in 0..2 {
        let mut long = chat(&format!("hold {i}"), 300);
        long["stream"] = json!(true);
        let mut response = api
            .http
            .post(format!("{}/v1/chat/completions", api.base))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.chunk().await.unwrap().expect("first chunk");
        streams.push(response);
    }
    let response = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&chat("a third", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let err: Value = response.json().await.unwrap();
    assert_eq!(err["error"]["code"], "too_many_concurrent_requests");
    // When one of its requests ends, the client may send another.
    streams.pop();
    let served = eventually(Duration::from_secs(10), || async {
        api.post("/v1/chat/completions", &chat("now?", 2)).await.0 == 200
    })
    .await;
    assert!(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_client_cannot_keep_the_gateway_from_stopping() {
    let mut up = Launch::up(1)
        .args([
            "--speedup",
            "1",
            "--shutdown-grace-secs",
            "2",
            "--header-timeout-secs",
            "3600",
            "--idle-timeout-secs",
            "3600",
        ])
        .start()
        .await;
    let api = Api::new(&up);
    // One client stopped mid-header, one stream that outlasts the grace.
    let mut stuck = connect(&up.address).await;
    stuck
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut long = chat("a long one", 5000);
    long["stream"] = json!(true);
    let mut stream = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap().expect("first chunk");
    let status = up.terminate().await;
    assert!(status.success(), "{status:?}");
    let (closed, _) = closed_within(&mut stuck, Duration::from_secs(5)).await;
    assert!(closed);
}

/// A raw HTTP/2 frame: (type, flags, stream, payload).
type Frame = (u8, u8, u32, Vec<u8>);

async fn read_frame(tcp: &mut TcpStream) -> Option<Frame> {
    let mut header = [0u8; 9];
    tcp.read_exact(&mut header).await.ok()?;
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    tcp.read_exact(&mut payload).await.ok()?;
    Some((header[3], header[4], stream, payload))
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

const SETTINGS: u8 = 0x4;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;

/// HPACK for `GET /health` over http with authority `x`, from the static table.
fn get_health() -> Vec<u8> {
    let mut block = vec![0x82, 0x86]; // :method GET, :scheme http
    block.extend_from_slice(&[0x44, 7]); // :path, literal "/health"
    block.extend_from_slice(b"/health");
    block.extend_from_slice(&[0x41, 1, b'x']); // :authority x
    block
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_announces_its_stream_limit_and_stops_rapid_resets() {
    let up = Launch::up(1).arg("--http2-max-streams", "7").start().await;
    let mut tcp = connect(&up.address).await;
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    tcp.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let (kind, _, _, payload) = read_frame(&mut tcp).await.expect("server settings");
    assert_eq!(kind, SETTINGS);
    let max_streams = payload.chunks(6).find_map(|entry| {
        (u16::from_be_bytes([entry[0], entry[1]]) == 0x3)
            .then(|| u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]))
    });
    assert_eq!(max_streams, Some(7));
    tcp.write_all(&frame(SETTINGS, 0x1, 0, &[])).await.unwrap();
    // One request is served over HTTP/2 (`:status 200` is static-table entry 8).
    tcp.write_all(&frame(HEADERS, 0x5, 1, &get_health()))
        .await
        .unwrap();
    let status = loop {
        let (kind, _, stream, payload) = read_frame(&mut tcp).await.expect("response");
        if kind == HEADERS && stream == 1 {
            break payload[0];
        }
    };
    assert_eq!(status, 0x88);
    // Open-and-reset streams as fast as possible (CVE-2023-44487): the server hangs up.
    let mut burst = Vec::new();
    for i in 0..500u32 {
        let stream = 3 + 2 * i;
        burst.extend(frame(HEADERS, 0x5, stream, &get_health()));
        burst.extend(frame(RST_STREAM, 0, stream, &8u32.to_be_bytes()));
    }
    let _ = tcp.write_all(&burst).await;
    let goaway = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some((kind, _, _, payload)) = read_frame(&mut tcp).await {
            if kind == GOAWAY {
                return Some(u32::from_be_bytes([
                    payload[4], payload[5], payload[6], payload[7],
                ]));
            }
        }
        None
    })
    .await
    .expect("the server answers the burst");
    assert_eq!(goaway, Some(0xb), "GOAWAY with ENHANCE_YOUR_CALM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_prompt_is_refused_early_and_leaves_nothing_behind() {
    let up = Launch::up(1).start().await;
    let api = Api::new(&up);
    let session = |body: &Value| {
        api.http
            .post(format!("{}/v1/chat/completions", api.base))
            .header("x-session-id", "agent-1")
            .json(body)
    };
    let (status, _) = api.send(session(&chat("the first turn", 2))).await;
    assert_eq!(status, 200);
    let sessions = api.metric("switchyard_tokenizer_sessions").await;
    let held = api.metric("switchyard_tokenizer_session_bytes").await;
    assert_eq!(sessions, 1.0);
    let tokenized = api.metric("switchyard_tokenizer_tokenized_bytes").await;

    // 20 MB: more tokens than the context holds, which its length alone proves.
    let huge = "lorem ipsum dolor sit amet ".repeat(750_000);
    let (status, body) = api.send(session(&chat(&huge, 2))).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("maximum context length"), "{message}");
    assert!(message.contains("at least"), "{message}");
    // 2 MB of varied words: over the context, found after tokenizing a part of it.
    let mut long = String::new();
    let mut i = 0u64;
    while long.len() < 2_000_000 {
        long.push_str(&format!("w{} {} ", i * 7919 % 100_003, i % 97));
        i += 1;
    }
    let (status, body) = api.send(session(&chat(&long, 2))).await;
    assert_eq!(status, 400, "{body}");
    let spent = api.metric("switchyard_tokenizer_tokenized_bytes").await - tokenized;
    assert!(
        spent < 1_500_000.0,
        "{spent} bytes tokenized for 22 MB of refused prompts"
    );
    // Nothing of the refused turns is kept: the session is still its first turn.
    assert_eq!(api.metric("switchyard_tokenizer_sessions").await, sessions);
    assert_eq!(api.metric("switchyard_tokenizer_session_bytes").await, held);
    let (status, _) = api
        .send(session(&chat("the first turn, and more", 2)))
        .await;
    assert_eq!(status, 200);
}
