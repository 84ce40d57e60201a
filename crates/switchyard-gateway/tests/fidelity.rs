//! Fidelity: the live gateway and the replay lab decide and book alike.
//!
//! One property test drives two routers with the same random sequence of requests, KV events,
//! load reports, drains, first tokens and completions:
//!
//! - the **gateway**: a real [`WorkerPool`] and the real dispatch ([`dispatch::start`]: route,
//!   prefill stage, stream), its workers answered by an in-process transport that prefills at
//!   once and streams only the tokens the test sends;
//! - the **replay lab**: a [`ServingCore`] driven by [`ServingCore::serve`], the call the
//!   replay cluster and the planner's bench make for every request.
//!
//! After every step the decision logs (every decode and prefill decision, explanations
//! included) and the load views' bookings must be identical, for every policy and for
//! disaggregation `off`, `auto` and `enforce`. Time is tokio's paused clock, so both see the
//! same ticks.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use proptest::prelude::*;
use switchyard_core::{
    BlockSize, EngineKind, KvEvent, LoadStats, Role, StorageTier, StoredBlock, TokenId, WorkerId,
    WorkerInfo, block_hashes,
};
use switchyard_gateway::cluster::pool::follow::FollowContext;
use switchyard_gateway::cluster::pool::followers::Followers;
use switchyard_gateway::cluster::pool::{ModelRoutes, WorkerPool};
use switchyard_gateway::observe::Observers;
use switchyard_gateway::observe::metrics::Metrics;
use switchyard_gateway::serving::disagg::{DisaggSettings, KvTransfer};
use switchyard_gateway::serving::dispatch::{self, DispatchEvent, GenerateJob};
use switchyard_gateway::serving::routing::Stage;
use switchyard_gateway::serving::transport::{GenerateStream, WorkerTransport};
use switchyard_proto::v1::{
    FinishReason, GenerateRequest, GenerateResponse, KvHandle, PrefillRequest, PrefillResponse,
};
use switchyard_router::serve::{
    Booking, Disaggregation, ServeSettings, Served, ServingCore, WorkerFacts, route_request,
};
use switchyard_router::{
    BookedRequest, Decision, IndexConfig, LoadConfig, PolicyConfig, PolicyKind,
};
use tokio::sync::mpsc;

const BS: u32 = 4;

fn bs() -> BlockSize {
    BlockSize::new(BS).unwrap()
}

/// The workers of one case: two of role both, one decode and two prefill simulators, plus an
/// SGLang decode worker (which serves only with a prefill worker) and, when `sglang_prefill`,
/// an SGLang prefill worker for it.
fn workers(sglang_prefill: bool) -> Vec<WorkerInfo> {
    let mut out = vec![
        info("b1", Role::Both, EngineKind::Sim),
        info("b2", Role::Both, EngineKind::Sim),
        info("d1", Role::Decode, EngineKind::Sim),
        info("p1", Role::Prefill, EngineKind::Sim),
        info("p2", Role::Prefill, EngineKind::Sim),
        info("sd", Role::Decode, EngineKind::Sglang),
    ];
    if sglang_prefill {
        out.push(info("sp", Role::Prefill, EngineKind::Sglang));
    }
    out
}

fn info(id: &str, role: Role, engine: EngineKind) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).unwrap(),
        // Nothing listens there: every call goes through the in-process transport.
        address: "127.0.0.1:1".into(),
        model: "m".into(),
        role,
        block_size: bs(),
        kv_capacity_blocks: 10_000,
        max_context_tokens: 1_000_000,
        engine,
        incarnation: 1,
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    }
}

/// Prefills answer at once (pipelined); a generation streams what the test sends on its
/// channel, keyed by request id.
#[derive(Debug, Default)]
struct InProcess {
    streams: Mutex<HashMap<String, mpsc::UnboundedSender<Result<GenerateResponse, tonic::Status>>>>,
}

impl WorkerTransport for InProcess {
    fn generate(
        &self,
        _worker: &WorkerId,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.streams
            .lock()
            .insert(request.into_inner().request_id, tx);
        let stream: GenerateStream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
                .boxed();
        Box::pin(async move { Ok(stream) })
    }

    fn prefill(
        &self,
        _worker: &WorkerId,
        _request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>> {
        Box::pin(async {
            Ok(PrefillResponse {
                handle: Some(KvHandle { id: "h".into() }),
                pipelined: true,
                ..PrefillResponse::default()
            })
        })
    }
}

/// One step of a case.
#[derive(Debug, Clone)]
enum Op {
    /// A request: prompt of `blocks` blocks from `family` (families share prefixes) plus
    /// `extra` tokens.
    Request {
        family: u32,
        blocks: u32,
        extra: u32,
        max_tokens: u32,
        session: Option<u8>,
    },
    /// A worker announces the first `blocks` blocks of `family`'s prompt.
    Store {
        worker: usize,
        family: u32,
        blocks: u32,
    },
    Report {
        worker: usize,
        queued: u64,
        running: u64,
    },
    Drain {
        worker: usize,
        draining: bool,
    },
    /// The `nth` live request's first token.
    Token {
        nth: usize,
    },
    /// The `nth` live request ends.
    Finish {
        nth: usize,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 1u32..40, 0u32..4, 1u32..20, proptest::option::of(0u8..3)).prop_map(
            |(family, blocks, extra, max_tokens, session)| Op::Request {
                family,
                blocks,
                extra,
                max_tokens,
                session,
            }
        ),
        2 => (0usize..7, 0u32..4, 1u32..40)
            .prop_map(|(worker, family, blocks)| Op::Store { worker, family, blocks }),
        1 => (0usize..7, 0u64..400, 0u64..8)
            .prop_map(|(worker, queued, running)| Op::Report { worker, queued, running }),
        1 => (0usize..7, any::<bool>()).prop_map(|(worker, draining)| Op::Drain { worker, draining }),
        2 => (0usize..16).prop_map(|nth| Op::Token { nth }),
        2 => (0usize..16).prop_map(|nth| Op::Finish { nth }),
        1 => (0u64..300).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn family_tokens(family: u32, blocks: u32, extra: u32) -> Vec<TokenId> {
    (0..blocks * BS + extra)
        .map(|t| family * 100_000 + t)
        .collect()
}

/// A request both sides are serving.
struct Live {
    id: String,
    /// The gateway's stream for it (`None`: refused before any generation).
    events: mpsc::Receiver<DispatchEvent>,
    decode: Option<Booking>,
    prefill: Option<Booking>,
}

/// The replay side's decision log, in the gateway log's shape.
fn logged(outcome: &switchyard_router::serve::ServeOutcome) -> Vec<(Stage, Decision)> {
    let mut out = Vec::new();
    if let Some(decision) = &outcome.rerouted_from {
        out.push((Stage::Decode, decision.clone()));
    }
    match &outcome.served {
        Served::Aggregated { decision, .. } => out.push((Stage::Decode, decision.clone())),
        Served::Disaggregated {
            decision,
            prefill_decision,
            ..
        } => {
            out.push((Stage::Decode, decision.clone()));
            out.push((Stage::Prefill, prefill_decision.clone()));
        }
        Served::Refused { decision, .. } => out.push((Stage::Decode, decision.clone())),
    }
    out
}

/// Lets the gateway's tasks run until they wait on something the test controls.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

struct Case {
    policy: PolicyKind,
    mode: Disaggregation,
    min_uncached_tokens: u64,
    max_prefill_queue_tokens: u64,
    sglang_prefill: bool,
}

async fn run_case(case: Case, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let transport = Arc::new(InProcess::default());
    let pool = Arc::new(WorkerPool::new(case.policy, PolicyConfig::default()).unwrap());
    let observers = Arc::new(Observers::in_memory(
        100_000,
        Arc::new(Metrics::new()),
        pool.epoch(),
    ));
    let followers = Followers::new(
        Arc::clone(&pool),
        Arc::new(FollowContext::new(&observers, 100)),
    );
    let calls: Arc<dyn WorkerTransport> = Arc::clone(&transport) as Arc<dyn WorkerTransport>;
    let infos = workers(case.sglang_prefill);
    for w in &infos {
        followers.upsert_worker(w.clone());
    }
    let routes: Arc<ModelRoutes> = pool.model("m").unwrap();
    let settings = ServeSettings {
        disaggregation: case.mode,
        min_uncached_tokens: case.min_uncached_tokens,
        max_prefill_queue_tokens: case.max_prefill_queue_tokens,
    };
    let disagg = DisaggSettings {
        serve: settings,
        prefill_timeout: Duration::from_secs(3600),
        kv_transfer: KvTransfer::Pipelined,
    };
    // The replay side: the gateway's index and load settings, its policy settings.
    let mut core = ServingCore::new(
        bs(),
        IndexConfig::new(bs()),
        LoadConfig::default(),
        case.policy,
        &PolicyConfig::default(),
    )
    .unwrap();
    let mut draining = vec![false; infos.len()];
    let mut seqs = vec![0u64; infos.len()];
    let mut replay_log: Vec<(Stage, Decision)> = Vec::new();
    let mut live: Vec<Live> = Vec::new();
    let mut next_id = 0u32;

    for op in ops {
        match op {
            Op::Request {
                family,
                blocks,
                extra,
                max_tokens,
                session,
            } => {
                let tokens = family_tokens(family, blocks, extra);
                let session = session.map(|s| format!("s{s}"));
                let id = format!("r{next_id}");
                next_id += 1;
                let job = GenerateJob {
                    request_id: id.clone(),
                    tags: Arc::new(switchyard_gateway::observe::audit::RequestTags::new(
                        id.clone(),
                    )),
                    routes: Arc::clone(&routes),
                    prompt: tokens.clone(),
                    // As the HTTP path gives them: hashed with the prompt's tokens.
                    prompt_hashes: Some(
                        switchyard_gateway::serving::routing::BlockNaming {
                            block_size: routes.block_size,
                            identity: Default::default(),
                        }
                        .hash(&tokens),
                    ),
                    sampling: switchyard_core::Sampling {
                        max_tokens,
                        temperature: Some(0.0),
                        ignore_eos: true,
                        ..switchyard_core::Sampling::default()
                    },
                    session: session.clone(),
                    deadline: tokio::time::Instant::now() + Duration::from_secs(100_000),
                    max_retries: 2,
                    max_migrations: 0,
                    disagg,
                    span: tracing::Span::none(),
                    identity: Default::default(),
                    retention: Default::default(),
                    priority: None,
                };
                let now = pool.now_tick();
                let events =
                    dispatch::start(&pool, &observers, &calls, &followers.context().tasks, job);
                settle().await;
                let facts: Vec<WorkerFacts<'_>> = infos
                    .iter()
                    .zip(&draining)
                    .map(|(w, &draining)| WorkerFacts {
                        id: &w.id,
                        role: w.role,
                        engine: w.engine,
                        draining,
                        adapters: &w.adapters,
                    })
                    .collect();
                let request = route_request(&tokens, bs(), session, now);
                let outcome = core.serve(&settings, &request, max_tokens, &facts);
                let (decode, prefill) = match &outcome {
                    Ok(o) => {
                        replay_log.extend(logged(o));
                        match &o.served {
                            Served::Aggregated { booking, .. } => (Some(booking.clone()), None),
                            Served::Disaggregated {
                                decode, prefill, ..
                            } => (Some(decode.clone()), Some(prefill.clone())),
                            Served::Refused { .. } => (None, None),
                        }
                    }
                    Err(_) => (None, None),
                };
                let generating = transport.streams.lock().contains_key(&id);
                prop_assert_eq!(
                    generating,
                    decode.is_some(),
                    "request {}: gateway generating {} but replay served {:?}",
                    id,
                    generating,
                    outcome
                );
                live.push(Live {
                    id,
                    events,
                    decode,
                    prefill,
                });
            }
            Op::Store {
                worker,
                family,
                blocks,
            } => {
                let w = worker % infos.len();
                let tokens = family_tokens(family, blocks, 0);
                let hashes = block_hashes(&tokens, bs());
                let event = KvEvent::Stored {
                    parent: None,
                    blocks: (0..blocks as usize)
                        .map(|i| StoredBlock {
                            hash: hashes[i],
                            tokens: tokens[i * BS as usize..(i + 1) * BS as usize].to_vec(),
                        })
                        .collect(),
                    tier: StorageTier::Device,
                };
                let seq = seqs[w];
                seqs[w] += 1;
                let id = &infos[w].id;
                let live_result = routes.lock().serving.index.apply(id, 1, seq, &event);
                let replay_result = core.index.apply(id, 1, seq, &event);
                prop_assert_eq!(live_result.is_ok(), replay_result.is_ok());
            }
            Op::Report {
                worker,
                queued,
                running,
            } => {
                let w = worker % infos.len();
                let stats = LoadStats {
                    queued_prefill_tokens: queued,
                    running_requests: running,
                    ..LoadStats::default()
                };
                let now = pool.now_tick();
                routes.lock().serving.load.report(&infos[w].id, stats, now);
                core.load.report(&infos[w].id, stats, now);
            }
            Op::Drain {
                worker,
                draining: on,
            } => {
                let w = worker % infos.len();
                draining[w] = on;
                pool.worker(&infos[w].id).unwrap().set_draining(on);
            }
            Op::Token { nth } => {
                if live.is_empty() {
                    continue;
                }
                let at = nth % live.len();
                let request = &mut live[at];
                let Some(decode) = &request.decode else {
                    continue;
                };
                let sent = transport.streams.lock().get(&request.id).map(|tx| {
                    tx.send(Ok(GenerateResponse {
                        token_ids: vec![7],
                        ..GenerateResponse::default()
                    }))
                });
                prop_assert!(
                    sent.is_some_and(|r| r.is_ok()),
                    "{} has a stream",
                    request.id
                );
                // What the replay cluster does at a disaggregated request's first token (the
                // pull is done: the prefill's booking ends), and at any first token.
                if let Some(prefill) = request.prefill.take() {
                    core.finished(&prefill);
                }
                core.prefill_done(decode);
                while let Ok(event) = request.events.try_recv() {
                    prop_assert!(!matches!(event, DispatchEvent::Failed(_)), "{event:?}");
                }
            }
            Op::Finish { nth } => {
                if live.is_empty() {
                    continue;
                }
                let request = live.remove(nth % live.len());
                if let Some(tx) = transport.streams.lock().remove(&request.id) {
                    let _ = tx.send(Ok(GenerateResponse {
                        finish_reason: FinishReason::Length as i32,
                        ..GenerateResponse::default()
                    }));
                }
                if let Some(prefill) = &request.prefill {
                    core.finished(prefill);
                }
                if let Some(decode) = &request.decode {
                    core.finished(decode);
                }
                drop(request.events);
            }
            Op::Advance { ms } => {
                tokio::time::advance(Duration::from_millis(ms)).await;
            }
        }
        settle().await;
        let live_log: Vec<(Stage, Decision)> = observers
            .decisions
            .entries()
            .iter()
            .map(|d| (d.stage, (*d.decision).clone()))
            .collect();
        prop_assert_eq!(&live_log, &replay_log, "decision logs diverged");
        let live_bookings: Vec<BookedRequest> = routes.lock().serving.load.bookings();
        prop_assert_eq!(live_bookings, core.load.bookings(), "bookings diverged");
    }
    drop(live);
    followers.shutdown().await;
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Found by the property test: `auto`, every worker that serves aggregated draining, so the
/// SGLang decode worker is chosen, has no SGLang prefill worker, and the reroute finds nobody.
/// The gateway logs the first decision and answers 503; the replay side must too.
#[test]
fn a_reroute_that_finds_nobody_is_refused_alike() {
    let case = Case {
        policy: PolicyKind::Kv,
        mode: Disaggregation::Auto,
        min_uncached_tokens: 0,
        max_prefill_queue_tokens: 0,
        sglang_prefill: false,
    };
    let ops = vec![
        Op::Drain {
            worker: 2,
            draining: true,
        },
        Op::Drain {
            worker: 1,
            draining: true,
        },
        Op::Drain {
            worker: 0,
            draining: true,
        },
        Op::Request {
            family: 0,
            blocks: 1,
            extra: 0,
            max_tokens: 1,
            session: None,
        },
    ];
    runtime().block_on(run_case(case, ops)).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_gateway_and_the_replay_lab_decide_and_book_alike(
        policy in proptest::sample::select(PolicyKind::ALL.to_vec()),
        mode in proptest::sample::select(vec![
            Disaggregation::Off,
            Disaggregation::Auto,
            Disaggregation::Enforce,
        ]),
        min_uncached_tokens in 0u64..120,
        max_prefill_queue_tokens in 0u64..600,
        sglang_prefill in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let case = Case {
            policy,
            mode,
            min_uncached_tokens,
            max_prefill_queue_tokens,
            sglang_prefill,
        };
        runtime().block_on(run_case(case, ops))?;
    }
}
