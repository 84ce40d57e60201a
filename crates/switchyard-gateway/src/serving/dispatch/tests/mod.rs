//! Dispatch's transitions over a scripted transport: every path of `route → prefill? → stream →
//! (done | retry | migrate | reroute | fail)` with the failures scripted, on a real pool whose
//! workers listen nowhere (nothing here reaches the network).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use switchyard_core::{BlockSize, EngineKind, Role, WorkerId, WorkerInfo};
use switchyard_proto::fault::kv_source_unavailable;
use switchyard_proto::v1::{
    FinishReason, GenerateRequest, GenerateResponse, KvHandle, PrefillRequest, PrefillResponse,
};
use switchyard_router::serve::{Disaggregation, ServeSettings};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::*;
use crate::cluster::pool::followers::Followers;
use crate::observe::Observers;
use crate::serving::disagg::DisaggSettings;
use crate::serving::transport::{GenerateStream, WorkerTransport};

mod logprobs;

/// How a scripted stream ends after its tokens.
#[derive(Debug, Clone)]
enum End {
    Finish(FinishReason),
    Fail(tonic::Status),
    /// Never: the worker goes quiet.
    Hang,
}

/// What the next `Generate` call does.
#[derive(Debug, Clone)]
enum Gen {
    Refuse(tonic::Status),
    Stream { tokens: Vec<Vec<u32>>, end: End },
}

/// What the next `Prefill` call does.
#[derive(Debug, Clone)]
enum Pre {
    Ok { pipelined: bool },
    Fail(tonic::Status),
    Hang,
}

/// One call the transport received.
#[derive(Debug, Clone)]
struct Call {
    worker: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    /// The KV source's address, for a disaggregated `Generate`.
    kv_source: Option<String>,
    /// `SamplingParams.logprobs` of a `Generate`.
    logprobs: Option<u32>,
}

/// A transport that plays scripted outcomes in call order, whichever worker is called.
#[derive(Debug, Default)]
struct Scripted {
    generate: Mutex<VecDeque<Gen>>,
    prefill: Mutex<VecDeque<Pre>>,
    generate_calls: Mutex<Vec<Call>>,
    prefill_calls: Mutex<Vec<Call>>,
    /// Streams dropped before their end (the request aborted on the worker).
    aborted: Arc<AtomicUsize>,
}

impl Scripted {
    fn new(generate: Vec<Gen>, prefill: Vec<Pre>) -> Arc<Self> {
        Arc::new(Self {
            generate: Mutex::new(generate.into()),
            prefill: Mutex::new(prefill.into()),
            ..Self::default()
        })
    }

    fn generate_calls(&self) -> Vec<Call> {
        self.generate_calls.lock().clone()
    }

    fn prefill_calls(&self) -> Vec<Call> {
        self.prefill_calls.lock().clone()
    }
}

/// Counts a stream dropped before it ended.
struct AbortGuard {
    ended: bool,
    aborted: Arc<AtomicUsize>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A scripted worker's log probability of `token`: made up from the id, so a test can tell
/// whose it is.
fn scripted_logprob(token: u32) -> switchyard_proto::v1::TokenLogprob {
    switchyard_proto::v1::TokenLogprob {
        token_id: token,
        logprob: -(token as f32) / 100.0,
        top: Vec::new(),
    }
}

fn message(tokens: Vec<u32>, finish: FinishReason) -> GenerateResponse {
    GenerateResponse {
        token_ids: tokens,
        finish_reason: finish as i32,
        ..GenerateResponse::default()
    }
}

impl WorkerTransport for Scripted {
    fn generate(
        &self,
        worker: &WorkerId,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>> {
        let request = request.into_inner();
        let logprobs = request.sampling.as_ref().and_then(|s| s.logprobs);
        self.generate_calls.lock().push(Call {
            worker: worker.to_string(),
            max_tokens: request.sampling.map_or(0, |s| s.max_tokens),
            prompt: request.prompt_token_ids,
            kv_source: request.kv_source.map(|s| s.address),
            logprobs,
        });
        let next = self.generate.lock().pop_front();
        let aborted = Arc::clone(&self.aborted);
        Box::pin(async move {
            let (tokens, end) = match next {
                None => return Err(tonic::Status::internal("no scripted generate left")),
                Some(Gen::Refuse(status)) => return Err(status),
                Some(Gen::Stream { tokens, end }) => (tokens, end),
            };
            let mut items: Vec<Result<GenerateResponse, tonic::Status>> = tokens
                .into_iter()
                .map(|t| {
                    let mut m = message(t, FinishReason::Unspecified);
                    if logprobs.is_some() {
                        m.logprobs = m.token_ids.iter().map(|&t| scripted_logprob(t)).collect();
                    }
                    Ok(m)
                })
                .collect();
            let hang = matches!(end, End::Hang);
            match end {
                End::Finish(reason) => items.push(Ok(message(Vec::new(), reason))),
                End::Fail(status) => items.push(Err(status)),
                End::Hang => {}
            }
            let guard = AbortGuard {
                ended: !hang,
                aborted,
            };
            let tail = if hang {
                futures::stream::pending().boxed()
            } else {
                futures::stream::empty().boxed()
            };
            let stream: GenerateStream = futures::stream::iter(items)
                .chain(tail)
                .map(move |item| {
                    let _held_until_the_stream_drops = &guard;
                    item
                })
                .boxed();
            Ok(stream)
        })
    }

    fn prefill(
        &self,
        worker: &WorkerId,
        request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>> {
        let request = request.into_inner();
        self.prefill_calls.lock().push(Call {
            worker: worker.to_string(),
            prompt: request.prompt_token_ids,
            max_tokens: 0,
            kv_source: None,
            logprobs: None,
        });
        let next = self.prefill.lock().pop_front();
        Box::pin(async move {
            match next {
                None => Err(tonic::Status::internal("no scripted prefill left")),
                Some(Pre::Fail(status)) => Err(status),
                Some(Pre::Hang) => futures::future::pending().await,
                Some(Pre::Ok { pipelined }) => Ok(PrefillResponse {
                    handle: Some(KvHandle { id: "h".into() }),
                    first_token_id: 99,
                    pipelined,
                    ..PrefillResponse::default()
                }),
            }
        })
    }
}

fn info(id: &str, port: u16, role: Role, engine: EngineKind) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).unwrap(),
        // Nothing listens there: the pool's subscribers fail and retry quietly, and every call
        // dispatch makes goes through the scripted transport instead.
        address: format!("127.0.0.1:{port}"),
        model: "m".into(),
        role,
        block_size: BlockSize::new(4).unwrap(),
        kv_capacity_blocks: 1000,
        max_context_tokens: 100_000,
        engine,
        incarnation: 1,
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    }
}

fn both(id: &str, port: u16) -> WorkerInfo {
    info(id, port, Role::Both, EngineKind::Sim)
}

/// A pool, its followers and observers, and the scripted transport its dispatches call.
struct Dispatching {
    pool: Arc<WorkerPool>,
    followers: Followers,
    observers: Arc<Observers>,
    transport: Arc<dyn WorkerTransport>,
}

impl Dispatching {
    async fn shutdown(&self) {
        self.followers.shutdown().await;
    }
}

impl std::ops::Deref for Dispatching {
    type Target = Arc<WorkerPool>;
    fn deref(&self) -> &Arc<WorkerPool> {
        &self.pool
    }
}

/// Dispatch's [`super::start`] over the scripted transport.
fn start(d: &Dispatching, job: GenerateJob) -> mpsc::Receiver<DispatchEvent> {
    super::start(
        &d.pool,
        &d.observers,
        &d.transport,
        &d.followers.context().tasks,
        job,
    )
}

fn pool(workers: &[WorkerInfo], transport: Arc<Scripted>) -> (Dispatching, Arc<ModelRoutes>) {
    let crate::cluster::pool::test_pool::TestPool {
        pool,
        followers,
        observers,
    } = crate::cluster::pool::test_pool::TestPool::new(64, workers);
    let routes = pool.model("m").unwrap();
    (
        Dispatching {
            pool,
            followers,
            observers,
            transport,
        },
        routes,
    )
}

const PROMPT: [u32; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

fn job(routes: &Arc<ModelRoutes>, disagg: DisaggSettings) -> GenerateJob {
    GenerateJob {
        // As the HTTP path gives them: hashed with the prompt, extended by each migration.
        prompt_hashes: Some(
            crate::serving::routing::BlockNaming {
                block_size: routes.block_size,
                identity: switchyard_core::KvIdentity::PLAIN,
            }
            .hash(&PROMPT),
        ),
        request_id: "req".into(),
        tags: Arc::new(crate::observe::audit::RequestTags::new("req")),
        routes: Arc::clone(routes),
        prompt: PROMPT.to_vec(),
        identity: switchyard_core::KvIdentity::PLAIN,
        sampling: switchyard_core::Sampling {
            max_tokens: 4,
            temperature: Some(0.0),
            ignore_eos: true,
            ..switchyard_core::Sampling::default()
        },
        session: None,
        deadline: Instant::now() + Duration::from_secs(30),
        max_retries: 2,
        max_migrations: 2,
        disagg,
        span: tracing::Span::none(),
        retention: Default::default(),
        priority: None,
    }
}

fn disagg(mode: Disaggregation) -> DisaggSettings {
    DisaggSettings {
        serve: ServeSettings {
            disaggregation: mode,
            min_uncached_tokens: 1,
            ..ServeSettings::default()
        },
        prefill_timeout: Duration::from_secs(1),
        ..DisaggSettings::default()
    }
}

async fn events(mut rx: mpsc::Receiver<DispatchEvent>) -> Vec<DispatchEvent> {
    let mut out = Vec::new();
    while let Some(event) = rx.recv().await {
        out.push(event);
    }
    out
}

fn tokens_of(events: &[DispatchEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            DispatchEvent::Tokens { ids, .. } => Some(ids.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn finished(events: &[DispatchEvent]) -> Option<Finish> {
    match events.last() {
        Some(DispatchEvent::Finished(finish)) => Some(*finish),
        _ => None,
    }
}

fn failed(events: &[DispatchEvent]) -> Option<&ApiError> {
    match events.last() {
        Some(DispatchEvent::Failed(err)) => Some(err),
        _ => None,
    }
}

fn ok_stream(tokens: &[u32]) -> Gen {
    Gen::Stream {
        tokens: tokens.iter().map(|t| vec![*t]).collect(),
        end: End::Finish(FinishReason::Length),
    }
}

/// Every booking a request made is released once it has ended.
async fn bookings_released(routes: &ModelRoutes) {
    for _ in 0..100 {
        if routes.lock().serving.load.bookings().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("bookings left: {:?}", routes.lock().serving.load.bookings());
}

#[tokio::test]
async fn a_failure_before_the_first_token_is_retried_on_another_worker() {
    let script = Scripted::new(
        vec![
            Gen::Refuse(tonic::Status::unavailable("connection refused")),
            ok_stream(&[7, 8, 9, 10]),
        ],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11), both("b", 12)], Arc::clone(&script));
    let events = events(start(&pool, job(&routes, DisaggSettings::default()))).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    assert_eq!(tokens_of(&events), [7, 8, 9, 10]);
    let calls = script.generate_calls();
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].worker, calls[1].worker, "the retry goes elsewhere");
    assert_eq!(calls[1].prompt, PROMPT, "a retry starts from the prompt");
    assert_eq!(pool.observers.metrics.retries.get(), 1);
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test]
async fn a_failure_after_tokens_migrates_with_prompt_plus_generated() {
    let script = Scripted::new(
        vec![
            Gen::Stream {
                tokens: vec![vec![7], vec![8]],
                end: End::Fail(tonic::Status::unavailable("worker went away")),
            },
            ok_stream(&[9, 10]),
        ],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11), both("b", 12)], Arc::clone(&script));
    let events = events(start(&pool, job(&routes, DisaggSettings::default()))).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    assert_eq!(tokens_of(&events), [7, 8, 9, 10], "continuous at the seam");
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, DispatchEvent::Started { .. }))
            .count(),
        1,
        "one Started for the whole request"
    );
    let calls = script.generate_calls();
    assert_ne!(calls[0].worker, calls[1].worker);
    let mut context = PROMPT.to_vec();
    context.extend([7, 8]);
    assert_eq!(calls[1].prompt, context);
    assert_eq!(calls[1].max_tokens, 2);
    assert_eq!(pool.observers.metrics.migrations.get(), 1);
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_then_hung_prefill_pool_leaves_auto_serving_aggregated() {
    let script = Scripted::new(
        vec![ok_stream(&[1, 2, 3, 4])],
        vec![
            Pre::Fail(tonic::Status::unavailable("prefill worker restarting")),
            Pre::Hang,
        ],
    );
    let (pool, routes) = pool(
        &[
            info("d", 11, Role::Decode, EngineKind::Sim),
            info("p1", 21, Role::Prefill, EngineKind::Sim),
            info("p2", 22, Role::Prefill, EngineKind::Sim),
        ],
        Arc::clone(&script),
    );
    let mut job = job(&routes, disagg(Disaggregation::Auto));
    job.max_retries = 1;
    let events = events(start(&pool, job)).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    let prefills = script.prefill_calls();
    assert_eq!(prefills.len(), 2);
    assert_ne!(prefills[0].worker, prefills[1].worker);
    let generates = script.generate_calls();
    assert_eq!(generates.len(), 1);
    assert_eq!(generates[0].worker, "d");
    assert_eq!(
        generates[0].kv_source, None,
        "aggregated after the pool failed"
    );
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_hung_prefill_pool_fails_an_enforced_request() {
    let script = Scripted::new(vec![], vec![Pre::Hang, Pre::Hang]);
    let (pool, routes) = pool(
        &[
            info("d", 11, Role::Decode, EngineKind::Sim),
            info("p1", 21, Role::Prefill, EngineKind::Sim),
            info("p2", 22, Role::Prefill, EngineKind::Sim),
        ],
        Arc::clone(&script),
    );
    let mut job = job(&routes, disagg(Disaggregation::Enforce));
    job.max_retries = 1;
    let events = events(start(&pool, job)).await;
    match failed(&events) {
        Some(ApiError::Upstream(message)) => assert!(
            message.contains("enforced and 2 prefill attempts failed"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(script.generate_calls().is_empty());
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test]
async fn a_kv_source_fault_retries_with_another_prefill_worker_on_the_same_decode_worker() {
    let script = Scripted::new(
        vec![
            Gen::Refuse(kv_source_unavailable(
                "pulling kv: the prefill worker went away",
            )),
            ok_stream(&[1, 2, 3, 4]),
        ],
        vec![Pre::Ok { pipelined: true }, Pre::Ok { pipelined: true }],
    );
    let (pool, routes) = pool(
        &[
            info("d", 11, Role::Decode, EngineKind::Sim),
            info("p1", 21, Role::Prefill, EngineKind::Sim),
            info("p2", 22, Role::Prefill, EngineKind::Sim),
        ],
        Arc::clone(&script),
    );
    let events = events(start(&pool, job(&routes, disagg(Disaggregation::Auto)))).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    let generates = script.generate_calls();
    assert_eq!(generates.len(), 2);
    assert!(
        generates.iter().all(|c| c.worker == "d"),
        "the decode worker stays eligible"
    );
    let sources: Vec<_> = generates.iter().map(|c| c.kv_source.clone()).collect();
    assert!(sources.iter().all(Option::is_some), "{sources:?}");
    assert_ne!(sources[0], sources[1], "another prefill worker");
    let prefills = script.prefill_calls();
    assert_ne!(prefills[0].worker, prefills[1].worker);
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn the_deadline_fails_a_hung_stream_with_a_timeout_and_releases_its_booking() {
    let script = Scripted::new(
        vec![Gen::Stream {
            tokens: vec![vec![5]],
            end: End::Hang,
        }],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11)], Arc::clone(&script));
    let mut job = job(&routes, DisaggSettings::default());
    job.deadline = Instant::now() + Duration::from_secs(5);
    let events = events(start(&pool, job)).await;
    assert_eq!(tokens_of(&events), [5]);
    assert!(
        matches!(failed(&events), Some(ApiError::Timeout(5))),
        "{events:?}"
    );
    bookings_released(&routes).await;
    assert_eq!(
        script.aborted.load(Ordering::SeqCst),
        1,
        "the stream was cut"
    );
    pool.shutdown().await;
}

#[tokio::test]
async fn a_gone_client_aborts_the_worker_stream_and_releases_its_booking() {
    let script = Scripted::new(
        vec![Gen::Stream {
            tokens: vec![vec![5]],
            end: End::Hang,
        }],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11)], Arc::clone(&script));
    let mut rx = start(&pool, job(&routes, DisaggSettings::default()));
    assert!(matches!(
        rx.recv().await,
        Some(DispatchEvent::Started { .. })
    ));
    assert!(matches!(
        rx.recv().await,
        Some(DispatchEvent::Tokens { .. })
    ));
    drop(rx);
    for _ in 0..100 {
        if script.aborted.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        script.aborted.load(Ordering::SeqCst),
        1,
        "the stream was cut"
    );
    bookings_released(&routes).await;
    pool.shutdown().await;
}

#[tokio::test]
async fn a_refused_prompt_is_a_bad_request_without_retry() {
    let script = Scripted::new(
        vec![Gen::Refuse(tonic::Status::invalid_argument(
            "prompt longer than the context",
        ))],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11), both("b", 12)], Arc::clone(&script));
    let events = events(start(&pool, job(&routes, DisaggSettings::default()))).await;
    assert!(
        matches!(failed(&events), Some(ApiError::BadRequest { .. })),
        "{events:?}"
    );
    assert_eq!(script.generate_calls().len(), 1);
    pool.shutdown().await;
}

#[tokio::test]
async fn retries_are_bounded() {
    let refuse = || Gen::Refuse(tonic::Status::unavailable("down"));
    let script = Scripted::new(vec![refuse(), refuse(), refuse()], vec![]);
    let (pool, routes) = pool(
        &[both("a", 11), both("b", 12), both("c", 13)],
        Arc::clone(&script),
    );
    let mut job = job(&routes, DisaggSettings::default());
    job.max_retries = 1;
    let events = events(start(&pool, job)).await;
    match failed(&events) {
        Some(ApiError::Upstream(message)) => assert!(
            message.starts_with("2 workers failed before the first token"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(script.generate_calls().len(), 2);
    pool.shutdown().await;
}

#[tokio::test]
async fn a_decode_worker_that_needs_a_prefill_worker_and_gets_none_is_rerouted() {
    let script = Scripted::new(vec![ok_stream(&[1, 2, 3, 4])], vec![]);
    let (pool, routes) = pool(
        &[
            info("sglang-decode", 11, Role::Decode, EngineKind::Sglang),
            info("vllm-both", 12, Role::Both, EngineKind::Vllm),
        ],
        Arc::clone(&script),
    );
    // Make the vLLM worker look busy, so the first choice is the SGLang decode worker.
    let busy = WorkerId::new("vllm-both").unwrap();
    routes
        .lock()
        .serving
        .load
        .on_routed(&busy, u64::MAX, 1_000_000, 0, 0);
    let events = events(start(&pool, job(&routes, disagg(Disaggregation::Auto)))).await;
    assert_eq!(finished(&events), Some(Finish::Length), "{events:?}");
    let generates = script.generate_calls();
    assert_eq!(
        generates.len(),
        1,
        "the SGLang decode worker is never sent a bare prompt"
    );
    assert_eq!(generates[0].worker, "vllm-both");
    let log = pool.observers.decisions.entries();
    let note = log
        .iter()
        .find_map(|d| d.note.clone())
        .expect("the rerouted decision says why");
    assert!(note.contains("serves only"), "{note}");
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_stream_whose_worker_stops_answering_moves_on_and_the_worker_gets_no_more() {
    let script = Scripted::new(
        vec![
            Gen::Stream {
                tokens: vec![vec![5]],
                end: End::Hang,
            },
            Gen::Stream {
                tokens: vec![vec![6], vec![7], vec![8]],
                end: End::Finish(FinishReason::Length),
            },
            Gen::Stream {
                tokens: vec![vec![1], vec![2], vec![3], vec![4]],
                end: End::Finish(FinishReason::Length),
            },
        ],
        vec![],
    );
    let (pool, routes) = pool(&[both("a", 11), both("b", 12)], Arc::clone(&script));
    let mut rx = start(&pool, job(&routes, DisaggSettings::default()));
    // The first token arrives; the worker then hangs until it is found unresponsive.
    let mut events = Vec::new();
    while tokens_of(&events).is_empty() {
        events.push(rx.recv().await.expect("an event"));
    }
    let first = script.generate_calls()[0].worker.clone();
    let hung = pool
        .worker(&WorkerId::new(first.as_str()).unwrap())
        .unwrap();
    hung.mark_failed(&pool.observers.metrics, "no load report for 2s");
    while let Some(event) = rx.recv().await {
        events.push(event);
    }
    assert_eq!(tokens_of(&events), [5, 6, 7, 8]);
    assert_eq!(finished(&events), Some(Finish::Length));
    let calls = script.generate_calls();
    assert_ne!(
        calls[1].worker, first,
        "the stream moved to the other worker"
    );
    assert_eq!(pool.observers.metrics.unresponsive_cuts.get(), 1);
    assert_eq!(
        script.aborted.load(Ordering::SeqCst),
        1,
        "the hung stream was cut"
    );
    // Routing leaves the unresponsive worker out while another answers...
    let events = events_of(start(&pool, job(&routes, DisaggSettings::default()))).await;
    assert_eq!(finished(&events), Some(Finish::Length));
    assert_ne!(script.generate_calls()[2].worker, first);
    // ...and takes it back once it answers.
    hung.mark_answered(&pool.observers.metrics);
    assert!(hung.health.is_answering());
    pool.shutdown().await;
}

async fn events_of(rx: mpsc::Receiver<DispatchEvent>) -> Vec<DispatchEvent> {
    events(rx).await
}
