//! The endpoint picker protocol, end to end over real gRPC on loopback: the picker (in-process,
//! over a gateway state whose workers are registered in the in-memory registry) driven by the
//! Envoy stand-in (`tests/support/envoy_proxy.rs`) in each body mode, in front of small HTTP
//! model servers. What a worker holds is put in the index directly, and the load view is read
//! directly, so each check is exact.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../../../tests/support/envoy_proxy.rs"]
mod envoy_proxy;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::post;
use envoy_proxy::{ClientRequest, EnvoyProxy, ProxyConfig};
use parking_lot::Mutex;
use serde_json::json;
use switchyard_core::{
    BlockSize, EngineKind, KvIdentity, Role, SnapshotBlock, StorageTier, WorkerId, WorkerInfo,
};
use switchyard_epp::proto::mode::processing_mode::BodySendMode;
use switchyard_epp::{EppConfig, FailureMode};
use switchyard_gateway::GatewayConfig;
use switchyard_gateway::api::http::AppState;
use switchyard_gateway::cluster::pool::Delivery;
use switchyard_registry::{MemoryRegistry, Registration, Registry};
use switchyard_router::BookedRequest;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "m";
const BLOCK: u32 = 4;

/// A model server stand-in: answers `POST /v1/completions` with which engine it is, after the
/// gate lets the body through (the headers go at once).
struct Engine {
    endpoint: String,
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    gate: Arc<Semaphore>,
    _task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct EngineState {
    name: String,
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    gate: Arc<Semaphore>,
}

impl Engine {
    /// `gated`: each answer's body waits for one [`Engine::release`].
    async fn start(name: &str, gated: bool) -> Engine {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Arc::new(Semaphore::new(if gated {
            0
        } else {
            Semaphore::MAX_PERMITS
        }));
        let state = EngineState {
            name: name.to_owned(),
            received: Arc::default(),
            gate: Arc::clone(&gate),
        };
        let received = Arc::clone(&state.received);
        let app = axum::Router::new()
            .route("/v1/completions", post(answer))
            .with_state(state);
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Engine {
            endpoint: addr.to_string(),
            received,
            gate,
            _task: task,
        }
    }

    fn release(&self) {
        self.gate.add_permits(1);
    }
}

async fn answer(State(state): State<EngineState>, body: Bytes) -> axum::response::Response {
    state.received.lock().push(body.to_vec());
    // Like an OpenAI server's whole answer, it reports its usage: 3 completion tokens.
    let text = json!({"engine": state.name, "usage": {"completion_tokens": 3}}).to_string();
    let gate = Arc::clone(&state.gate);
    let chunks = futures::stream::once(async move {
        gate.acquire().await.unwrap().forget();
        Ok::<_, std::convert::Infallible>(Bytes::from(text))
    });
    axum::response::Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(chunks))
        .unwrap()
}

/// An endpoint nothing listens on.
fn dead_endpoint() -> String {
    format!("127.0.0.1:{}", switchyard_testkit::free_port())
}

fn info(id: &str, endpoint: Option<&str>) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).unwrap(),
        // The worker's gRPC is never reached: no load reports, no events.
        address: dead_endpoint(),
        model: MODEL.into(),
        role: Role::Both,
        block_size: BlockSize::new(BLOCK).unwrap(),
        kv_capacity_blocks: 10_000,
        max_context_tokens: 8192,
        engine: EngineKind::Vllm,
        incarnation: 1,
        engine_endpoint: endpoint.map(str::to_owned),
        kv_tiers: None,
        kv_peer: None,
    }
}

struct Picker {
    state: Arc<AppState>,
    grpc: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _registrations: Vec<Registration>,
}

impl Picker {
    async fn start(
        workers: Vec<WorkerInfo>,
        gateway: impl FnOnce(&mut GatewayConfig),
        epp: EppConfig,
    ) -> Picker {
        let registry = Arc::new(MemoryRegistry::new());
        let mut registrations = Vec::new();
        for worker in workers {
            registrations.push(
                registry
                    .register(worker, Duration::from_secs(600))
                    .await
                    .unwrap(),
            );
        }
        let mut config = GatewayConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..GatewayConfig::default()
        };
        gateway(&mut config);
        let shutdown = CancellationToken::new();
        let state = switchyard_gateway::start(
            config,
            registry,
            &shutdown,
            Default::default(),
            Delivery::EngineHttp,
        )
        .await
        .unwrap()
        .unwrap();
        let epp = EppConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..epp
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let serving = switchyard_epp::serve(
            Arc::clone(&state),
            epp,
            shutdown.clone(),
            move |listening| {
                let _ = ready_tx.send(listening.grpc);
            },
        );
        let task = tokio::spawn(async move { serving.await.unwrap() });
        let grpc = ready_rx.await.unwrap();
        Picker {
            state,
            grpc,
            shutdown,
            task,
            _registrations: registrations,
        }
    }

    fn proxy(&self, request_body: BodySendMode, response_body: BodySendMode) -> EnvoyProxy {
        EnvoyProxy::new(
            &self.grpc.to_string(),
            ProxyConfig {
                request_body,
                response_body,
                ..ProxyConfig::default()
            },
        )
    }

    /// `worker` holds the first `blocks` blocks of `tokens` on device.
    fn holds(&self, worker: &str, tokens: &[u32], blocks: usize) {
        self.holds_as(worker, tokens, blocks, &KvIdentity::PLAIN);
    }

    /// `worker` holds the first `blocks` blocks of `tokens`, keyed by `identity`, on device.
    fn holds_as(&self, worker: &str, tokens: &[u32], blocks: usize, identity: &KvIdentity) {
        let hashes = identity.block_hashes(tokens, BlockSize::new(BLOCK).unwrap());
        let snapshot: Vec<SnapshotBlock> = hashes[..blocks]
            .iter()
            .map(|&hash| SnapshotBlock {
                hash,
                parent: None,
                tier: StorageTier::Device,
            })
            .collect();
        let routes = self.state.pool.model(MODEL).unwrap();
        routes
            .lock()
            .serving
            .index
            .apply_snapshot(&WorkerId::new(worker).unwrap(), 1, 0, &snapshot)
            .unwrap();
    }

    fn bookings(&self) -> Vec<BookedRequest> {
        let routes = self.state.pool.model(MODEL).unwrap();
        routes.lock().serving.load.bookings()
    }

    async fn bookings_become(&self, want: impl Fn(&[BookedRequest]) -> bool) -> bool {
        for _ in 0..200 {
            if want(&self.bookings()) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the picker stops")
            .unwrap();
    }
}

fn tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

fn completion(prompt: &[u32]) -> ClientRequest {
    ClientRequest::post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 8}),
    )
}

fn engine_of(outcome: &envoy_proxy::Outcome) -> String {
    outcome.json()["engine"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_body_mode_routes_a_prefix_to_its_holder_with_fallbacks() {
    let a = Engine::start("a", false).await;
    let b = Engine::start("b", false).await;
    let c_sim = info("sim", None);
    let picker = Picker::start(
        vec![
            info("a", Some(&a.endpoint)),
            info("b", Some(&b.endpoint)),
            c_sim,
        ],
        |_| {},
        EppConfig::default(),
    )
    .await;
    let prompt = tokens(1, 64);
    picker.holds("b", &prompt, 16);
    for (request_mode, response_mode) in [
        (
            BodySendMode::FullDuplexStreamed,
            BodySendMode::FullDuplexStreamed,
        ),
        (BodySendMode::Buffered, BodySendMode::Streamed),
        (BodySendMode::BufferedPartial, BodySendMode::None),
        (BodySendMode::FullDuplexStreamed, BodySendMode::Buffered),
    ] {
        let proxy = picker.proxy(request_mode, response_mode);
        let request = completion(&prompt).header("x-request-id", &format!("req-{request_mode:?}"));
        let outcome = proxy.send(request.clone()).await;
        assert_eq!(outcome.status, 200, "{request_mode:?}: {outcome:?}");
        // The simulator worker has no HTTP endpoint: never a candidate.
        assert_eq!(
            outcome.destination,
            [b.endpoint.clone(), a.endpoint.clone()],
            "{request_mode:?}: the holder first, the other as fallback"
        );
        assert_eq!(outcome.served.as_deref(), Some(b.endpoint.as_str()));
        assert_eq!(engine_of(&outcome), "b", "{request_mode:?}");
        assert_eq!(
            outcome.forwarded, request.body,
            "the body reaches the engine unchanged"
        );
        assert_eq!(b.received.lock().last().unwrap(), &request.body);
    }
    // `streamed`: chosen at the headers, before the prompt: a destination all the same.
    let proxy = picker.proxy(BodySendMode::Streamed, BodySendMode::Streamed);
    let outcome = proxy.send(completion(&prompt)).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    assert_eq!(outcome.destination.len(), 2);
    // Without protocol_config the configured modes (full duplex) apply.
    let mut proxy = picker.proxy(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    );
    proxy.config.protocol_config = false;
    let outcome = proxy.send(completion(&prompt)).await;
    assert_eq!(engine_of(&outcome), "b");
    // Every request ended: nothing stays booked.
    assert!(
        picker.bookings_become(|b| b.is_empty()).await,
        "{:?}",
        picker.bookings()
    );
    // The decisions are in the admin API's log, under the proxy's request ids.
    let logged: Vec<String> = picker
        .state
        .observers
        .decisions
        .entries()
        .iter()
        .filter(|d| d.model == MODEL)
        .map(|d| d.tags.request_id.clone())
        .collect();
    assert!(
        logged.contains(&"req-FullDuplexStreamed".to_owned()),
        "{logged:?}"
    );
    assert!(logged.contains(&"req-Buffered".to_owned()), "{logged:?}");
    picker.stop().await;
}

/// The engine keys a salted prompt's blocks by its `cache_salt`; the picker must hash the prompt
/// the same way, or it sends salted requests to holders of the unsalted prefix (which the engine
/// will not reuse) and away from the worker holding the salted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_goes_to_the_holder_of_its_salted_blocks() {
    let a = Engine::start("a", false).await;
    let b = Engine::start("b", false).await;
    let picker = Picker::start(
        vec![info("a", Some(&a.endpoint)), info("b", Some(&b.endpoint))],
        |_| {},
        EppConfig::default(),
    )
    .await;
    let prompt = tokens(2, 64);
    let salted = KvIdentity::new(None, Some("tenant-7".into())).unwrap();
    picker.holds_as("a", &prompt, 16, &salted);
    picker.holds("b", &prompt, 16);
    let proxy = picker.proxy(BodySendMode::Buffered, BodySendMode::Buffered);
    let with_salt = ClientRequest::post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "cache_salt": "tenant-7"}),
    );
    let outcome = proxy.send(with_salt.clone()).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    assert_eq!(engine_of(&outcome), "a", "the salted blocks' holder");
    assert_eq!(
        outcome.forwarded, with_salt.body,
        "the salt reaches the engine"
    );
    let outcome = proxy.send(completion(&prompt)).await;
    assert_eq!(engine_of(&outcome), "b", "the plain blocks' holder");
    let other_salt = ClientRequest::post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "cache_salt": "tenant-8"}),
    );
    let outcome = proxy.send(other_salt).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    // Per the index, the chosen worker held every block of the salted and the plain prompt, and
    // nothing of the prompt under another salt.
    let predicted: Vec<u64> = picker
        .state
        .observers
        .decisions
        .entries()
        .iter()
        .filter(|d| d.model == MODEL)
        .map(|d| d.predicted_cached_tokens)
        .collect();
    assert_eq!(predicted, [16 * u64::from(BLOCK), 16 * u64::from(BLOCK), 0]);
    for (salt, says) in [
        (json!(""), "cache_salt"),
        (json!(3), "cache_salt must be a string"),
    ] {
        let bad = ClientRequest::post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "cache_salt": salt}),
        );
        let outcome = proxy.send(bad).await;
        assert_eq!(outcome.status, 400, "{outcome:?}");
        let error = outcome.json()["error"]["message"].to_string();
        assert!(error.contains(says), "{error}");
    }
    picker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_prompt_goes_to_a_server_of_the_adapter_holding_its_blocks() {
    let a = Engine::start("a", false).await;
    let b = Engine::start("b", false).await;
    let c = Engine::start("c", false).await;
    let serving = |id: &str, endpoint: &str| WorkerInfo {
        adapters: vec!["sql-lora".into()],
        ..info(id, Some(endpoint))
    };
    let picker = Picker::start(
        vec![
            serving("a", &a.endpoint),
            info("b", Some(&b.endpoint)),
            serving("c", &c.endpoint),
        ],
        |_| {},
        EppConfig::default(),
    )
    .await;
    let prompt = tokens(4, 64);
    let lora = KvIdentity::new(Some("sql-lora".into()), None).unwrap();
    picker.holds("a", &prompt, 16);
    // b holds the adapter's blocks but does not serve the adapter: never picked for it.
    picker.holds_as("b", &prompt, 16, &lora);
    picker.holds_as("c", &prompt, 16, &lora);
    let proxy = picker.proxy(BodySendMode::Buffered, BodySendMode::Buffered);
    let adapter = ClientRequest::post(
        "/v1/completions",
        &json!({"model": "sql-lora", "prompt": prompt, "max_tokens": 8}),
    );
    for _ in 0..3 {
        let outcome = proxy.send(adapter.clone()).await;
        assert_eq!(outcome.status, 200, "{outcome:?}");
        assert_eq!(engine_of(&outcome), "c", "the adapter's blocks' holder");
        assert_eq!(
            outcome.forwarded, adapter.body,
            "the engine gets the adapter"
        );
    }
    let outcome = proxy.send(completion(&prompt)).await;
    assert_eq!(engine_of(&outcome), "a", "the base model's blocks' holder");
    let unknown = ClientRequest::post(
        "/v1/completions",
        &json!({"model": "nope-lora", "prompt": prompt, "max_tokens": 8}),
    );
    assert_eq!(proxy.send(unknown).await.status, 404);
    picker.stop().await;
}

/// A tenant's quota holds behind the picker as in the gateway: prompt tokens are charged at the
/// pick, completion tokens as the engine reports them in the response streaming through the
/// picker, or the request's `max_tokens` when the picker does not see the response; over the
/// limit the proxy answers 429 with `Retry-After` and the limit's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_token_quotas_hold_behind_the_picker() {
    let a = Engine::start("a", false).await;
    let picker = Picker::start(
        vec![info("a", Some(&a.endpoint))],
        |config| {
            config.quota.default.tokens_per_window = 90;
            config.quota.window_secs = 3600;
        },
        EppConfig::default(),
    )
    .await;
    let ask = |user: &str| {
        ClientRequest::post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": tokens(3, 40), "max_tokens": 8, "user": user}),
        )
    };
    // The response passes through the picker: each request costs 40 + 3 tokens, so a third one
    // still finds 86 < 90 used.
    let through = picker.proxy(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    );
    for n in 0..3 {
        let outcome = through.send(ask("reads")).await;
        assert_eq!(outcome.status, 200, "request {n}: {outcome:?}");
        picker.state.quota.settled().await;
    }
    let over = through.send(ask("reads")).await;
    assert_eq!(over.status, 429, "{over:?}");
    assert!(over.immediate_header("retry-after").is_some(), "{over:?}");
    assert_eq!(
        over.immediate_header("x-switchyard-quota-limit"),
        Some("tokens_per_window")
    );
    assert_eq!(over.json()["error"]["code"], "quota_exceeded");
    // The picker never sees the response: each request costs 40 + max_tokens 8, so the third
    // finds 96 used.
    let blind = picker.proxy(BodySendMode::FullDuplexStreamed, BodySendMode::None);
    for n in 0..2 {
        let outcome = blind.send(ask("blind")).await;
        assert_eq!(outcome.status, 200, "request {n}: {outcome:?}");
        picker.state.quota.settled().await;
    }
    assert_eq!(blind.send(ask("blind")).await.status, 429);
    picker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_endpoint_settles_the_booking_and_the_end_releases_it() {
    let b = Engine::start("b", true).await;
    let dead = dead_endpoint();
    let picker = Picker::start(
        vec![info("a", Some(&dead)), info("b", Some(&b.endpoint))],
        |_| {},
        EppConfig::default(),
    )
    .await;
    let prompt = tokens(2, 64);
    // a holds the prompt, but its engine cannot be reached: the proxy goes to the fallback.
    picker.holds("a", &prompt, 16);
    let proxy = picker.proxy(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    );
    let request = tokio::spawn({
        let proxy = proxy.clone();
        let request = completion(&prompt);
        async move { proxy.send(request).await }
    });
    // The response headers came back from b with the served endpoint: the booking moved.
    let moved = picker
        .bookings_become(|bookings| {
            bookings.len() == 1 && bookings[0].worker == WorkerId::new("b").unwrap()
        })
        .await;
    assert!(
        moved,
        "booked on the serving fallback: {:?}",
        picker.bookings()
    );
    b.release();
    let outcome = request.await.unwrap();
    assert_eq!(outcome.destination, [dead.clone(), b.endpoint.clone()]);
    assert_eq!(outcome.served.as_deref(), Some(b.endpoint.as_str()));
    assert_eq!(engine_of(&outcome), "b");
    assert!(
        picker.bookings_become(|b| b.is_empty()).await,
        "{:?}",
        picker.bookings()
    );

    // A proxy that goes away after the pick (the client cancelled): the booking goes too.
    let destination = proxy.send_and_cancel(completion(&prompt)).await;
    assert_eq!(destination[0], dead);
    assert!(
        picker.bookings_become(|b| b.is_empty()).await,
        "{:?}",
        picker.bookings()
    );
    picker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_immediate_responses_with_openai_errors() {
    let a = Engine::start("a", true).await;
    let b = Engine::start("b", false).await;
    let picker = Picker::start(
        vec![info("a", Some(&a.endpoint)), info("b", Some(&b.endpoint))],
        |config| {
            config.max_body_bytes = 4096;
            config.max_concurrent_requests = 1;
            config.max_queued_requests = 0;
        },
        EppConfig::default(),
    )
    .await;
    let proxy = picker.proxy(BodySendMode::Buffered, BodySendMode::FullDuplexStreamed);
    let refused = |outcome: &envoy_proxy::Outcome, status: u16, says: &str| {
        assert!(outcome.immediate, "{outcome:?}");
        assert_eq!(outcome.status, status, "{outcome:?}");
        let message = outcome.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.contains(says), "{message}");
    };
    let not_json = ClientRequest {
        path: "/v1/completions".into(),
        body: b"{nope".to_vec(),
        ..ClientRequest::default()
    };
    refused(&proxy.send(not_json.clone()).await, 400, "not JSON");
    let unknown = ClientRequest::post("/v1/completions", &json!({"model": "other", "prompt": [1]}));
    refused(&proxy.send(unknown).await, 404, "other");
    let big = ClientRequest::post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x".repeat(5000)}),
    );
    refused(&proxy.send(big).await, 413, "4096");
    let nowhere = completion(&tokens(3, 8)).subset(&["10.9.9.9:8000"]);
    refused(&proxy.send(nowhere).await, 503, "subset");
    // A subset is honoured: only a, even for a prompt b holds.
    let prompt = tokens(4, 32);
    picker.holds("b", &prompt, 8);
    let only_a = completion(&prompt).subset(&[a.endpoint.as_str()]);
    let held = tokio::spawn({
        let proxy = proxy.clone();
        async move { proxy.send(only_a).await }
    });
    assert!(picker.bookings_become(|b| b.len() == 1).await);
    // The one slot is taken and nothing may queue: admission refuses with 429.
    refused(&proxy.send(completion(&prompt)).await, 429, "saturated");
    a.release();
    let outcome = held.await.unwrap();
    assert_eq!(outcome.destination, std::slice::from_ref(&a.endpoint));
    assert_eq!(engine_of(&outcome), "a");
    picker.stop().await;

    // Failure mode open: a body without a readable prompt is routed by load.
    let picker = Picker::start(
        vec![info("b", Some(&b.endpoint))],
        |_| {},
        EppConfig {
            failure_mode: FailureMode::Open,
            ..EppConfig::default()
        },
    )
    .await;
    let proxy = picker.proxy(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    );
    let outcome = proxy.send(not_json).await;
    assert!(!outcome.immediate, "{outcome:?}");
    assert_eq!(outcome.destination, std::slice::from_ref(&b.endpoint));
    assert_eq!(b.received.lock().last().unwrap(), b"{nope");
    // A chat body is read and rendered with the model's template (builtin here).
    let chat = ClientRequest::post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}),
    );
    let picked = proxy.send_and_cancel(chat).await;
    assert_eq!(picked, std::slice::from_ref(&b.endpoint));
    picker.stop().await;
}
