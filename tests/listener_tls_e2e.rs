//! The side listeners (issue 22): the worker's `--metrics-listen` and the planner's
//! `--admin-listen` take HTTPS (certificate files re-read when they change, as the gateway's)
//! and bearer tokens, with the real binary. Plain HTTP to a TLS port gets no answer, a missing
//! or wrong token 401, the right one 200; a rotated certificate is served without a restart; the
//! planner reads an HTTPS gateway's `/metrics` with the gateway's CA and token. Bad settings
//! exit 64 with a sentence.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use support::{Launch, eventually, refused_at_start};
use switchyard_testkit::EtcdServer;
use switchyard_testkit::certs::TestCa;

const METRICS: &str = "metrics-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";
const GATEWAY_METRICS: &str = "gateway-metrics-token-0123456789";

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// An HTTPS client trusting only `ca_pem`.
fn https_client(ca_pem: &str) -> reqwest::Client {
    switchyard_security::install_crypto_provider();
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        // Every request on a new connection, so each one sees the certificate served now.
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Status of `GET url` with an optional bearer token; None when no HTTP answer came.
async fn status(client: &reqwest::Client, url: &str, token: Option<&str>) -> Option<u16> {
    let mut request = client.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.ok().map(|r| r.status().as_u16())
}

async fn body(client: &reqwest::Client, url: &str, token: &str) -> String {
    let response = client.get(url).bearer_auth(token).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200, "{url}");
    response.text().await.unwrap()
}

/// Plain HTTP to a TLS port: no HTTP answer at all.
async fn plain_gets_nothing(https_url: &str) {
    let plain_url = https_url.replacen("https://", "http://", 1);
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let answer = plain.get(&plain_url).bearer_auth(METRICS).send().await;
    assert!(answer.is_err(), "plain HTTP answered: {answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_metrics_over_https_want_their_token_and_follow_a_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("metrics test ca").unwrap();
    let cert = ca.issue(dir.path(), "worker-metrics", None).unwrap();
    let worker = Launch::new("worker")
        .arg("--metrics-listen", "127.0.0.1:0")
        .arg("--metrics-tls-cert", &path(&cert.cert))
        .arg("--metrics-tls-key", &path(&cert.key))
        .arg("--metrics-token", METRICS)
        .start()
        .await;
    let url = worker.ready["metrics"].as_str().unwrap().to_owned();
    assert!(url.starts_with("https://"), "{url}");
    let https = https_client(&ca.cert_pem);

    assert_eq!(status(&https, &url, None).await, Some(401));
    assert_eq!(status(&https, &url, Some("not-the-token")).await, Some(401));
    let text = body(&https, &url, METRICS).await;
    assert!(text.contains("switchyard_worker_"), "{text}");
    // The kubelet's probes need no token (and cannot speak the gRPC port's mTLS).
    let ready = url.replace("/metrics", "/ready");
    assert_eq!(status(&https, &ready, None).await, Some(200));
    assert_eq!(
        status(&https, &url.replace("/metrics", "/health"), None).await,
        Some(200)
    );
    plain_gets_nothing(&url).await;

    // cert-manager rotates the Secret: a certificate of another CA lands in the same files, and
    // the next connections get it without a restart (the old CA's clients then fail).
    let other = TestCa::new("rotated ca").unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let rotated = other
        .issue(other_dir.path(), "worker-metrics", None)
        .unwrap();
    std::fs::copy(&rotated.key, &cert.key).unwrap();
    std::fs::copy(&rotated.cert, &cert.cert).unwrap();
    let rotated_client = https_client(&other.cert_pem);
    assert!(
        eventually(Duration::from_secs(15), || async {
            status(&rotated_client, &url, Some(METRICS)).await == Some(200)
        })
        .await,
        "the rotated certificate is served"
    );
    assert_eq!(status(&https, &url, Some(METRICS)).await, None);
    assert_eq!(status(&rotated_client, &url, None).await, Some(401));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planner_admin_over_https_wants_its_tokens_and_reads_an_https_gateway() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("listener-tls-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("listener test ca").unwrap();
    let gateway_cert = ca.issue(dir.path(), "gateway-https", None).unwrap();
    let planner_cert = ca.issue(dir.path(), "planner-https", None).unwrap();

    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "20")
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--http-tls-cert", &path(&gateway_cert.cert))
        .arg("--http-tls-key", &path(&gateway_cert.key))
        .arg("--metrics-token", GATEWAY_METRICS)
        .start()
        .await;
    let port = gateway.address.rsplit(':').next().unwrap();
    let planner = Launch::new("planner")
        .arg("--etcd", &endpoint)
        .arg("--cluster", &cluster)
        // The gateway's certificate names localhost: checked by host name, as any HTTPS client.
        .arg("--gateway", &format!("https://localhost:{port}"))
        .arg("--gateway-ca", &path(&gateway_cert.ca))
        .arg("--gateway-metrics-token", GATEWAY_METRICS)
        .arg("--interval", "1")
        .arg("--admin-listen", "127.0.0.1:0")
        .arg("--admin-token", ADMIN)
        .arg("--metrics-token", METRICS)
        .arg("--admin-tls-cert", &path(&planner_cert.cert))
        .arg("--admin-tls-key", &path(&planner_cert.key))
        .start()
        .await;
    let base = format!("https://{}", planner.address);
    let https = https_client(&ca.cert_pem);

    let admin = format!("{base}/admin/planner");
    let metrics = format!("{base}/metrics");
    assert_eq!(status(&https, &admin, None).await, Some(401));
    assert_eq!(status(&https, &admin, Some(METRICS)).await, Some(401));
    assert_eq!(status(&https, &metrics, None).await, Some(401));
    assert_eq!(status(&https, &metrics, Some(ADMIN)).await, Some(401));
    let text = body(&https, &metrics, METRICS).await;
    assert!(text.contains("switchyard_planner_"), "{text}");
    assert_eq!(
        status(&https, &format!("{base}/health"), None).await,
        Some(200)
    );
    plain_gets_nothing(&admin).await;

    // The planner reads the gateway over HTTPS with the gateway's token: its decisions count
    // the gateway as answered.
    let answered = || async {
        let Ok(response) = https.get(&admin).bearer_auth(ADMIN).send().await else {
            return false;
        };
        let overview: Value = response.json().await.unwrap_or_default();
        overview["decisions"]
            .as_array()
            .and_then(|d| d.first())
            .is_some_and(|d| d["observed"]["gateways_answered"] == 1)
    };
    assert!(
        eventually(Duration::from_secs(20), answered).await,
        "the planner reads the HTTPS gateway's /metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_listener_settings_exit_64_with_a_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca").unwrap();
    let cert = ca.issue(dir.path(), "side", None).unwrap();
    let missing = path(&dir.path().join("missing.crt"));
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        (
            "worker",
            vec![
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
                "--metrics-tls-cert".into(),
                path(&cert.cert),
            ],
            "metrics_tls_cert and metrics_tls_key together",
        ),
        (
            "worker",
            vec!["--metrics-token".into(), METRICS.into()],
            "set metrics_listen too",
        ),
        (
            "worker",
            vec![
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
                "--metrics-tls-cert".into(),
                missing.clone(),
                "--metrics-tls-key".into(),
                path(&cert.key),
            ],
            "cannot read certificate file",
        ),
        (
            "planner",
            vec![
                "--etcd".into(),
                "http://127.0.0.1:1".into(),
                "--gateway".into(),
                "https://gw:8000".into(),
            ],
            "--gateway-ca",
        ),
        (
            "planner",
            vec![
                "--etcd".into(),
                "http://127.0.0.1:1".into(),
                "--gateway".into(),
                "http://gw:8000".into(),
                "--admin-listen".into(),
                "127.0.0.1:0".into(),
                "--admin-tls-key".into(),
                path(&cert.key),
            ],
            "admin_tls_cert and admin_tls_key together",
        ),
    ];
    for (subcommand, args, expected) in cases {
        let mut command = vec![subcommand.to_string()];
        command.extend(args);
        refused_at_start(&command, expected).await;
    }
}
