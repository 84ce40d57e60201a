//! A stand-in for the Kubernetes API server as worker discovery uses it, over loopback HTTP:
//! pods of one namespace (list, and watch as a stream of JSON lines from a resourceVersion),
//! and one InferencePool. The test changes pods and the server tells its watchers, as the API
//! server would; it can also end every watch with `410 Gone` (a too-old version), change
//! pods silently meanwhile, and count the lists, so a re-list can be seen.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub const NAMESPACE: &str = "serving";

#[derive(Default)]
struct State {
    version: u64,
    pods: BTreeMap<String, Value>,
    pool: Option<Value>,
    watchers: Vec<mpsc::UnboundedSender<Result<Bytes, Infallible>>>,
    lists: usize,
    selectors: Vec<String>,
}

/// The fake API server; stops with the test's runtime.
#[derive(Clone)]
pub struct FakeKube {
    pub url: String,
    state: Arc<Mutex<State>>,
}

/// A pod of the pool: its IP, its containers' named ports, whether it is ready.
pub fn pod(name: &str, ip: &str, ports: &[(&str, u16)], ready: bool) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(name, port)| json!({"name": name, "containerPort": port, "protocol": "TCP"}))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "engine"}},
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

impl FakeKube {
    pub async fn start() -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let shared = Arc::clone(&state);
        let app = axum::Router::new().fallback(
            move |Query(query): Query<BTreeMap<String, String>>, request: Request| {
                let state = Arc::clone(&shared);
                async move { answer(&state, request.uri().path(), &query) }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { url, state }
    }

    /// Serves an InferencePool `name` selecting `app=engine`, its target port `port`.
    pub fn pool(&self, name: &str, port: u16) {
        self.state.lock().unwrap().pool = Some(json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": {"app": "engine"}},
                "targetPorts": [{"number": port}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}
            }
        }));
    }

    /// Creates or replaces a pod and tells the watchers.
    pub fn put(&self, pod: Value) {
        let mut state = self.state.lock().unwrap();
        let kind = if state.pods.contains_key(&name_of(&pod)) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let pod = store(&mut state, pod);
        notify(&mut state, kind, pod);
    }

    /// Deletes a pod and tells the watchers.
    pub fn delete(&self, name: &str) {
        let mut state = self.state.lock().unwrap();
        if let Some(mut pod) = state.pods.remove(name) {
            state.version += 1;
            pod["metadata"]["resourceVersion"] = json!(state.version.to_string());
            notify(&mut state, "DELETED", pod);
        }
    }

    /// Changes a pod without telling anyone (what a client misses while its version is stale).
    pub fn put_silently(&self, pod: Value) {
        store(&mut self.state.lock().unwrap(), pod);
    }

    /// Ends every watch with `410 Gone`, as the API server does for a version it no longer has.
    pub fn expire_watches(&self) {
        let mut state = self.state.lock().unwrap();
        let gone = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
            "message": "too old resource version", "code": 410
        }});
        for watcher in state.watchers.drain(..) {
            let _ = watcher.send(Ok(line(&gone)));
        }
    }

    /// How many times the pods were listed.
    pub fn lists(&self) -> usize {
        self.state.lock().unwrap().lists
    }

    /// The label selectors the lists and watches asked for.
    pub fn selectors(&self) -> Vec<String> {
        self.state.lock().unwrap().selectors.clone()
    }
}

fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap().to_owned()
}

fn store(state: &mut State, mut pod: Value) -> Value {
    state.version += 1;
    pod["metadata"]["resourceVersion"] = json!(state.version.to_string());
    state.pods.insert(name_of(&pod), pod.clone());
    pod
}

fn notify(state: &mut State, kind: &str, pod: Value) {
    let event = line(&json!({"type": kind, "object": pod}));
    state
        .watchers
        .retain(|watcher| watcher.send(Ok(event.clone())).is_ok());
}

fn line(value: &Value) -> Bytes {
    Bytes::from(format!("{value}\n"))
}

fn answer(state: &Mutex<State>, path: &str, query: &BTreeMap<String, String>) -> Response {
    let mut state = state.lock().unwrap();
    let pods = format!("/api/v1/namespaces/{NAMESPACE}/pods");
    let pools =
        format!("/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools/");
    if path == pods {
        if let Some(selector) = query.get("labelSelector") {
            state.selectors.push(selector.clone());
        }
        if query.get("watch").map(String::as_str) == Some("true") {
            // Events after the version asked for only: this fake keeps no history, so a watch
            // starts from now (what the client's version is, unless it missed something).
            let (events_tx, events_rx) = mpsc::unbounded_channel();
            state.watchers.push(events_tx);
            let body = Body::from_stream(tokio_stream::wrappers::UnboundedReceiverStream::new(
                events_rx,
            ));
            return ([("content-type", "application/json")], body).into_response();
        }
        state.lists += 1;
        let items: Vec<Value> = state.pods.values().cloned().collect();
        return axum::Json(json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": state.version.to_string()},
            "items": items
        }))
        .into_response();
    }
    if let Some(name) = path.strip_prefix(&pools)
        && let Some(pool) = &state.pool
        && pool["metadata"]["name"] == name
    {
        return axum::Json(pool.clone()).into_response();
    }
    (
        axum::http::StatusCode::NOT_FOUND,
        axum::Json(json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "reason": "NotFound", "code": 404, "message": format!("{path} not found")})),
    )
        .into_response()
}
