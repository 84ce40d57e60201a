//! Who may use the gateway's listener (issue 22), end to end over HTTPS with the real binary:
//! `/v1` takes only the API keys of its key file (401 in OpenAI's error shape otherwise, the key
//! never echoed) and follows the file as keys are added and revoked; `/metrics` wants its token;
//! the admin API its token; KV recordings stay inside `recording_dir` and under the size cap;
//! plain HTTP gets nothing from the TLS port. Bad access settings exit 64 with a sentence.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Launch, eventually, refused_at_start, tokens};
use switchyard_security::secret::sha256_hex;
use switchyard_testkit::EtcdServer;
use switchyard_testkit::certs::TestCa;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ADMIN: &str = "admin-token-0123456789";
const METRICS: &str = "metrics-token-0123456789";
const KEY_A: &str = "sk-team-a-0123456789abcdef";
const KEY_B: &str = "sk-team-b-0123456789abcdef";

/// A minimal HTTPS/1.1 client: one request per connection, trusting only the test CA.
struct Https {
    address: String,
    tls: tokio_rustls::TlsConnector,
}

/// A response: status, headers (lower-case names) and the body as JSON (or a JSON string).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Https {
    fn new(address: &str, ca_pem: &str) -> Self {
        use rustls_pki_types::CertificateDer;
        use rustls_pki_types::pem::PemObject;
        switchyard_security::install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Self {
            address: address.to_owned(),
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        }
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Answer {
        let tcp = tokio::net::TcpStream::connect(&self.address).await.unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let mut tls = self.tls.connect(name, tcp).await.expect("tls handshake");
        let body = body.map(Value::to_string).unwrap_or_default();
        let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        // A close_notify-less end is fine here: the whole response came with connection: close.
        let _ = tls.read_to_end(&mut raw).await;
        parse_response(&String::from_utf8_lossy(&raw))
    }

    async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        self.send("GET", path, token, None).await
    }

    async fn post(&self, path: &str, token: Option<&str>, body: &Value) -> Answer {
        self.send("POST", path, token, Some(body)).await
    }
}

fn parse_response(text: &str) -> Answer {
    let (head, body) = text.split_once("\r\n\r\n").expect("a whole response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        unchunk(body)
    } else {
        body.to_owned()
    };
    Answer {
        status,
        headers,
        body: serde_json::from_str(&body).unwrap_or(Value::String(body)),
    }
}

fn unchunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

fn key_line(key: &str, tenant: &str) -> String {
    format!("{} {tenant}\n", sha256_hex(key.as_bytes()))
}

fn completion() -> Value {
    json!({"model": "sim-8b", "prompt": tokens(3, 64), "max_tokens": 2})
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_keys_tokens_and_the_recording_dir_get_in_over_https() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("access-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("https test ca").unwrap();
    let cert = ca.issue(dir.path(), "gateway-https", None).unwrap();
    let keys = dir.path().join("api-keys");
    std::fs::write(&keys, format!("# team a\n{}", key_line(KEY_A, "team-a"))).unwrap();
    let recordings = dir.path().join("recordings");
    std::fs::create_dir(&recordings).unwrap();

    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "20")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--api-keys-file", &path(&keys))
        .arg("--metrics-token", METRICS)
        .arg("--admin-token", ADMIN)
        .arg("--recording-dir", &path(&recordings))
        .arg("--recording-max-bytes", "4000")
        .arg("--http-tls-cert", &path(&cert.cert))
        .arg("--http-tls-key", &path(&cert.key))
        .start()
        .await;
    let https = Https::new(&gateway.address, &ca.cert_pem);
    assert!(
        eventually(Duration::from_secs(10), || async {
            https
                .get("/admin/workers", Some(ADMIN))
                .await
                .body
                .as_array()
                .is_some_and(|w| w.len() == 1)
        })
        .await,
        "the gateway sees its worker"
    );

    // /v1 without a key, with a wrong one, and with the right one.
    let missing = https.post("/v1/completions", None, &completion()).await;
    assert_eq!(missing.status, 401, "{}", missing.body);
    assert_eq!(missing.body["error"]["type"], "invalid_request_error");
    assert_eq!(missing.body["error"]["code"], Value::Null);
    assert!(
        missing.body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("You didn't provide an API key"),
        "{}",
        missing.body
    );
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    let wrong = https
        .post("/v1/completions", Some("sk-guess-1234"), &completion())
        .await;
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.body["error"]["code"], "invalid_api_key");
    assert!(
        !wrong.body.to_string().contains("sk-guess"),
        "{}",
        wrong.body
    );
    assert_eq!(https.get("/v1/models", None).await.status, 401);
    let served = https
        .post("/v1/completions", Some(KEY_A), &completion())
        .await;
    assert_eq!(served.status, 200, "{}", served.body);
    assert_eq!(served.body["usage"]["completion_tokens"], 2);
    // The admin token is not an API key, nor the other way round.
    assert_eq!(
        https
            .post("/v1/completions", Some(ADMIN), &completion())
            .await
            .status,
        401
    );
    assert_eq!(https.get("/admin/workers", Some(KEY_A)).await.status, 401);

    // /metrics wants its token, and counts the refusals.
    assert_eq!(https.get("/metrics", None).await.status, 401);
    assert_eq!(https.get("/metrics", Some(KEY_A)).await.status, 401);
    let metrics = https.get("/metrics", Some(METRICS)).await;
    assert_eq!(metrics.status, 200);
    let text = metrics.body.as_str().unwrap().to_owned();
    assert!(
        text.contains(
            r#"switchyard_requests_total{endpoint="v1",status="missing_api_key",model=""} 2"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"switchyard_requests_total{endpoint="v1",status="invalid_api_key",model=""} 2"#
        ),
        "{text}"
    );

    // Keys are revoked and added by editing the file, without a restart.
    std::fs::write(&keys, key_line(KEY_B, "team-b")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            https
                .post("/v1/completions", Some(KEY_A), &completion())
                .await
                .status
                == 401
        })
        .await,
        "team a's key was revoked"
    );
    assert_eq!(
        https
            .post("/v1/completions", Some(KEY_B), &completion())
            .await
            .status,
        200
    );
    // A broken edit keeps the keys that were there.
    std::fs::write(&keys, "not a key line\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        https
            .post("/v1/completions", Some(KEY_B), &completion())
            .await
            .status,
        200
    );

    // Recordings: only inside recording_dir, and never past the cap whatever the request says.
    let outside = path(&dir.path().join("outside.jsonl"));
    for bad in [json!({"path": outside}), json!({"path": "../escape.jsonl"})] {
        let refused = https
            .post("/admin/recording/start", Some(ADMIN), &bad)
            .await;
        assert_eq!(refused.status, 400, "{}", refused.body);
    }
    assert!(!dir.path().join("outside.jsonl").exists());
    assert!(!dir.path().join("escape.jsonl").exists());
    let started = https
        .post(
            "/admin/recording/start",
            Some(ADMIN),
            &json!({"path": "run.jsonl", "max_bytes": 1_000_000_000_000u64}),
        )
        .await;
    assert_eq!(started.status, 200, "{}", started.body);
    for _ in 0..20 {
        let served = https
            .post("/v1/completions", Some(KEY_B), &completion())
            .await;
        assert_eq!(served.status, 200);
        let status = https.get("/admin/recording", Some(ADMIN)).await.body;
        if status["ended_by"] == "max_bytes" {
            break;
        }
    }
    let status = https.get("/admin/recording", Some(ADMIN)).await.body;
    assert_eq!(status["ended_by"], "max_bytes", "{status}");
    let written = std::fs::metadata(recordings.join("run.jsonl"))
        .unwrap()
        .len();
    assert!(
        written <= 4000 + 4096,
        "{written} bytes written under a 4000-byte cap"
    );

    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(&gateway.address)
        .await
        .unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut raw)).await;
    assert!(
        !String::from_utf8_lossy(&raw).contains("HTTP/1.1 200"),
        "{raw:?}"
    );
    assert_eq!(https.get("/health", None).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_access_settings_exit_64_with_a_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca").unwrap();
    let cert = ca.issue(dir.path(), "gw", None).unwrap();
    let bad_keys = dir.path().join("keys");
    std::fs::write(&bad_keys, "sk-plain-key-not-hashed team\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--http".into(), "0.0.0.0:0".into()],
            "needs an admin_token",
        ),
        (
            vec!["--http-tls-cert".into(), path(&cert.cert)],
            "tls_cert and tls_key together",
        ),
        (vec!["--api-keys-file".into(), path(&bad_keys)], "line 1"),
        (
            vec!["--api-keys-file".into(), path(&dir.path().join("none"))],
            "cannot read API key file",
        ),
    ];
    for (args, expected) in cases {
        let mut command: Vec<String> = ["gateway", "--etcd", "http://127.0.0.1:1"]
            .map(String::from)
            .to_vec();
        command.extend(args);
        refused_at_start(&command, expected).await;
    }
}
