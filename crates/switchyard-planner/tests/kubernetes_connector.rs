#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The Kubernetes connector against a fake API server on loopback that answers the
//! `deployments/{name}/scale` subresource the way the real API server does (autoscaling/v1
//! Scale objects, v1 Status objects for errors) and records every request it gets.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use switchyard_planner::connector::kubernetes::{KubernetesConnector, KubernetesSettings};
use switchyard_planner::{Connector, PoolSizes};

const NAMESPACE: &str = "inference";
const PREFILL: &str = "sy-switchyard-worker-prefill";
const DECODE: &str = "sy-switchyard-worker-decode";
const MERGE_PATCH: &str = "application/merge-patch+json";

#[derive(Debug, Clone, PartialEq)]
struct Recorded {
    method: Method,
    path: String,
    content_type: Option<String>,
    authorization: Option<String>,
    body: String,
}

/// The API server's state: replicas per Deployment in NAMESPACE, and answers to force.
#[derive(Default)]
struct FakeApi {
    replicas: HashMap<String, i32>,
    /// (method, deployment) → the HTTP code to answer with instead of doing the request.
    failures: HashMap<(Method, String), u16>,
    requests: Vec<Recorded>,
}

type Shared = Arc<Mutex<FakeApi>>;

struct Server {
    url: String,
    state: Shared,
}

impl Server {
    async fn start(deployments: &[(&str, i32)]) -> Self {
        let state: Shared = Arc::default();
        state.lock().unwrap().replicas = deployments
            .iter()
            .map(|(name, n)| (name.to_string(), *n))
            .collect();
        let app = Router::new()
            .route(
                "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale",
                get(scale).patch(scale),
            )
            .fallback(unknown_path)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url, state }
    }

    fn fail(&self, method: Method, deployment: &str, code: u16) {
        self.state
            .lock()
            .unwrap()
            .failures
            .insert((method, deployment.to_string()), code);
    }

    fn requests(&self) -> Vec<Recorded> {
        self.state.lock().unwrap().requests.clone()
    }

    fn replicas(&self, deployment: &str) -> i32 {
        self.state.lock().unwrap().replicas[deployment]
    }

    async fn connector(&self) -> KubernetesConnector {
        KubernetesConnector::new(settings(Some(self.url.clone())))
            .await
            .unwrap()
    }
}

fn settings(api_url: Option<String>) -> KubernetesSettings {
    KubernetesSettings {
        namespace: NAMESPACE.to_string(),
        prefill_deployment: PREFILL.to_string(),
        decode_deployment: DECODE.to_string(),
        api_url,
    }
}

fn record(state: &Shared, method: &Method, uri: &Uri, headers: &HeaderMap, body: &Bytes) {
    let header = |name| {
        headers
            .get(name)
            .map(|v: &axum::http::HeaderValue| v.to_str().unwrap().to_string())
    };
    state.lock().unwrap().requests.push(Recorded {
        method: method.clone(),
        path: uri.path_and_query().unwrap().to_string(),
        content_type: header("content-type"),
        authorization: header("authorization"),
        body: String::from_utf8(body.to_vec()).unwrap(),
    });
}

/// A v1 Status as the API server sends it with an error code.
fn status(code: u16, reason: &str, message: String, name: &str) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": { "name": name, "group": "apps", "kind": "deployments" },
        "code": code,
    });
    (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response()
}

fn error_for(code: u16, method: &Method, namespace: &str, name: &str) -> Response {
    let verb = method.as_str().to_lowercase();
    match code {
        404 => status(
            404,
            "NotFound",
            format!("deployments.apps \"{name}\" not found"),
            name,
        ),
        403 => status(
            403,
            "Forbidden",
            format!(
                "deployments.apps \"{name}\" is forbidden: User \
                 \"system:serviceaccount:{namespace}:sy-switchyard-planner\" cannot {verb} \
                 resource \"deployments/scale\" in API group \"apps\" in the namespace \
                 \"{namespace}\""
            ),
            name,
        ),
        409 => status(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on deployments.apps \"{name}\": the object has \
                 been modified; please apply your changes to the latest version and try again"
            ),
            name,
        ),
        code => status(
            code,
            "InternalError",
            "etcdserver: request timed out".into(),
            name,
        ),
    }
}

fn scale_object(namespace: &str, name: &str, replicas: i32) -> Response {
    let mut spec = json!({});
    // Like the API server (Go's omitempty), a zero count is left out.
    if replicas != 0 {
        spec = json!({ "replicas": replicas });
    }
    axum::Json(json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": "0b5c1c7e-6f0e-4c4b-9d8e-3f1f2a8d0c11",
            "resourceVersion": "4242",
        },
        "spec": spec,
        "status": { "replicas": replicas, "selector": format!("app.kubernetes.io/name={name}") },
    }))
    .into_response()
}

/// GET and PATCH of `deployments/{name}/scale`; PATCH takes a JSON merge patch.
async fn scale(
    State(state): State<Shared>,
    Path((namespace, name)): Path<(String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    record(&state, &method, &uri, &headers, &body);
    let mut api = state.lock().unwrap();
    if let Some(code) = api.failures.get(&(method.clone(), name.clone())) {
        return error_for(*code, &method, &namespace, &name);
    }
    if namespace != NAMESPACE || !api.replicas.contains_key(&name) {
        return error_for(404, &method, &namespace, &name);
    }
    if method == Method::PATCH {
        let content_type = headers.get("content-type").and_then(|v| v.to_str().ok());
        if content_type != Some(MERGE_PATCH) {
            return status(
                415,
                "UnsupportedMediaType",
                format!("{content_type:?}"),
                &name,
            );
        }
        let patch: Value = match serde_json::from_slice(&body) {
            Ok(patch) => patch,
            Err(e) => return status(400, "BadRequest", e.to_string(), &name),
        };
        match patch["spec"]["replicas"].as_i64() {
            Some(n) => {
                api.replicas.insert(name.clone(), n as i32);
            }
            None => return status(422, "Invalid", "no spec.replicas".into(), &name),
        }
    }
    scale_object(&namespace, &name, api.replicas[&name])
}

async fn unknown_path(
    State(state): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    record(&state, &method, &uri, &headers, &body);
    status(
        404,
        "NotFound",
        "the server could not find the requested resource".into(),
        "",
    )
}

fn scale_path(name: &str) -> String {
    format!("/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/scale")
}

fn get_of(name: &str) -> Recorded {
    Recorded {
        method: Method::GET,
        path: scale_path(name),
        content_type: None,
        authorization: None,
        body: String::new(),
    }
}

fn patch_of(name: &str, replicas: i32) -> Recorded {
    Recorded {
        method: Method::PATCH,
        // kube-rs sends an empty query for default PatchParams.
        path: format!("{}?", scale_path(name)),
        content_type: Some(MERGE_PATCH.to_string()),
        authorization: None,
        body: json!({ "spec": { "replicas": replicas } }).to_string(),
    }
}

#[tokio::test]
async fn current_reads_the_scale_of_both_deployments() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    let connector = server.connector().await;
    assert_eq!(connector.name(), "kubernetes");
    assert_eq!(
        connector.current().await.unwrap(),
        PoolSizes {
            prefill: 2,
            decode: 3
        }
    );
    assert_eq!(server.requests(), vec![get_of(PREFILL), get_of(DECODE)]);
}

#[tokio::test]
async fn a_deployment_scaled_to_zero_reads_as_zero() {
    let server = Server::start(&[(PREFILL, 0), (DECODE, 4)]).await;
    let connector = server.connector().await;
    assert_eq!(
        connector.current().await.unwrap(),
        PoolSizes {
            prefill: 0,
            decode: 4
        }
    );
}

#[tokio::test]
async fn scale_to_patches_only_the_pool_that_changes() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    let connector = server.connector().await;
    let target = PoolSizes {
        prefill: 2,
        decode: 5,
    };
    connector.scale_to(target).await.unwrap();
    assert_eq!(
        server.requests(),
        vec![get_of(PREFILL), get_of(DECODE), patch_of(DECODE, 5)]
    );
    assert_eq!(server.replicas(PREFILL), 2);
    assert_eq!(server.replicas(DECODE), 5);
    assert_eq!(connector.current().await.unwrap(), target);
}

#[tokio::test]
async fn scale_to_the_current_sizes_patches_nothing() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    let connector = server.connector().await;
    connector
        .scale_to(PoolSizes {
            prefill: 2,
            decode: 3,
        })
        .await
        .unwrap();
    assert_eq!(server.requests(), vec![get_of(PREFILL), get_of(DECODE)]);
}

#[tokio::test]
async fn moving_a_worker_between_pools_shrinks_the_giving_pool_first() {
    let server = Server::start(&[(PREFILL, 1), (DECODE, 4)]).await;
    let connector = server.connector().await;
    connector
        .scale_to(PoolSizes {
            prefill: 2,
            decode: 3,
        })
        .await
        .unwrap();
    assert_eq!(
        server.requests(),
        vec![
            get_of(PREFILL),
            get_of(DECODE),
            patch_of(DECODE, 3),
            patch_of(PREFILL, 2)
        ]
    );
}

#[tokio::test]
async fn scaling_a_pool_to_zero_sends_zero() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    let connector = server.connector().await;
    connector
        .scale_to(PoolSizes {
            prefill: 0,
            decode: 3,
        })
        .await
        .unwrap();
    assert_eq!(server.requests().last(), Some(&patch_of(PREFILL, 0)));
    assert_eq!(server.replicas(PREFILL), 0);
}

#[tokio::test]
async fn a_missing_deployment_is_not_retryable_and_named() {
    let server = Server::start(&[(PREFILL, 2)]).await;
    let connector = server.connector().await;
    let error = connector.current().await.unwrap_err();
    assert!(!error.retryable());
    let text = error.to_string();
    assert!(
        text.contains(&format!("deployment {DECODE} not found")),
        "{text}"
    );
    assert!(text.contains(&format!("namespace {NAMESPACE}")), "{text}");
}

#[tokio::test]
async fn a_forbidden_patch_says_which_verb_the_role_lacks() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    server.fail(Method::PATCH, PREFILL, 403);
    let connector = server.connector().await;
    let error = connector
        .scale_to(PoolSizes {
            prefill: 3,
            decode: 3,
        })
        .await
        .unwrap_err();
    assert!(!error.retryable());
    let text = error.to_string();
    assert!(
        text.contains(&format!(
            "forbidden to patch deployments/scale of {PREFILL}"
        )),
        "{text}"
    );
    assert!(
        text.contains("verb \"patch\" on resource \"deployments/scale\""),
        "{text}"
    );
    assert_eq!(server.replicas(PREFILL), 2);
}

#[tokio::test]
async fn a_forbidden_read_says_get() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    server.fail(Method::GET, DECODE, 403);
    let connector = server.connector().await;
    let error = connector.current().await.unwrap_err();
    assert!(!error.retryable());
    let text = error.to_string();
    assert!(
        text.contains("verb \"get\" on resource \"deployments/scale\""),
        "{text}"
    );
    assert!(text.contains(DECODE), "{text}");
}

#[tokio::test]
async fn conflicts_and_server_errors_are_retryable() {
    for code in [409, 500, 503] {
        let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
        server.fail(Method::PATCH, DECODE, code);
        let connector = server.connector().await;
        let error = connector
            .scale_to(PoolSizes {
                prefill: 2,
                decode: 1,
            })
            .await
            .unwrap_err();
        assert!(error.retryable(), "{code}: {error}");
        assert!(error.to_string().contains(&code.to_string()), "{error}");
        // The client itself does not retry: the planner's next interval does.
        assert_eq!(server.requests().len(), 3, "{code}");
    }
}

#[tokio::test]
async fn an_unreachable_api_server_is_retryable() {
    // A port that was just free: nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let connector = KubernetesConnector::new(settings(Some(url))).await.unwrap();
    let error = connector.current().await.unwrap_err();
    assert!(error.retryable(), "{error}");
    assert!(
        error
            .to_string()
            .contains("cannot reach the Kubernetes API"),
        "{error}"
    );
}

/// The in-cluster API server is https: the rustls client (ring provider) must build without a
/// process-wide crypto provider installed, and a refused connection is still retryable.
#[tokio::test]
async fn an_https_api_server_gets_a_tls_client() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    drop(listener);
    let connector = KubernetesConnector::new(settings(Some(url))).await.unwrap();
    let error = connector.current().await.unwrap_err();
    assert!(error.retryable(), "{error}");
}

#[tokio::test]
async fn bad_settings_are_refused_before_any_request() {
    let server = Server::start(&[(PREFILL, 2), (DECODE, 3)]).await;
    let url = Some(server.url.clone());
    let cases = [
        KubernetesSettings {
            namespace: String::new(),
            ..settings(url.clone())
        },
        KubernetesSettings {
            decode_deployment: " ".into(),
            ..settings(url.clone())
        },
        KubernetesSettings {
            prefill_deployment: "workers/prefill".into(),
            ..settings(url.clone())
        },
        KubernetesSettings {
            decode_deployment: PREFILL.into(),
            ..settings(url.clone())
        },
        settings(Some("not a url at all".into())),
        settings(Some("127.0.0.1:8001".into())),
        settings(Some("ftp://127.0.0.1:8001".into())),
    ];
    for case in cases {
        let error = KubernetesConnector::new(case.clone()).await.unwrap_err();
        assert!(!error.retryable(), "{case:?}");
    }
    assert_eq!(server.requests(), vec![]);
}

/// Outside a cluster the connector reads the kubeconfig: its server and its bearer token. The
/// environment (KUBECONFIG) is per process, so the connector runs in a child process: this same
/// test binary, running this same test, with the child's marker set.
#[tokio::test]
async fn without_an_api_url_the_kubeconfig_is_used() {
    const CHILD: &str = "SWITCHYARD_KUBECONFIG_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let connector = KubernetesConnector::new(settings(None)).await.unwrap();
        let sizes = connector.current().await.unwrap();
        println!("child sizes {} {}", sizes.prefill, sizes.decode);
        return;
    }
    let server = Server::start(&[(PREFILL, 1), (DECODE, 6)]).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n\
             clusters:\n- name: test\n  cluster:\n    server: {}\n\
             users:\n- name: planner\n  user:\n    token: kubeconfig-token\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: planner\n",
            server.url
        ),
    )
    .unwrap();
    let output = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // Its path in the `it` test binary (tests/it/main.rs).
            "kubernetes_connector::without_an_api_url_the_kubeconfig_is_used",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", dir.path())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("child sizes 1 6"), "{stdout}");
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for request in requests {
        assert_eq!(
            request.authorization.as_deref(),
            Some("Bearer kubeconfig-token")
        );
    }
}
