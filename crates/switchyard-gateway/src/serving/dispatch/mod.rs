//! Dispatch: run a generation on workers and stream its tokens back, hiding worker failures.
//!
//! The sequence — route, the serving mode, the prefill pool and its retries, generation, and
//! what an attempt's end leads to (`done | retry | migrate | reroute | fail`) — is the router's
//! serving machine ([`Serving`]); this module is its driver over the pool's
//! [`WorkerTransport`](crate::serving::transport::WorkerTransport): each [`Step`] is carried out here
//! (routing under the model's lock with bookings held by guards, the Prefill and Generate
//! calls, the decision log, spans and metrics) and its outcome is handed back. A worker that
//! fails before the first token is replaced by another (up to `max_retries`); a worker that
//! fails mid-stream is replaced by another that continues from the prompt plus the tokens
//! generated so far (up to `max_migrations`). When the consumer drops its receiver (the client
//! went away, or a stop string matched) the task ends, which drops the worker stream, which
//! aborts the request on the worker. Every generation ends with `Finished` or `Failed` before
//! the deadline: none hangs.

mod classify;
mod prefill;
mod stream;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use switchyard_core::{KvIdentity, Sampling, TokenId, TokenLogprob, WorkerId};
use switchyard_proto::v1;
use switchyard_router::RouteRequest;
use switchyard_router::serve::{
    After, DecodeFilter, Plan, PrefillAsk, PrefillPick, RouteAsk, RouteFailure, Routed, ServeError,
    Serving, Step,
};
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::cluster::pool::{ModelRoutes, WorkerPool};
use crate::error::ApiError;
use crate::observe::Observers;
use crate::observe::audit::{DecisionEntry, DecisionLog, OutcomeStatus, RequestTags};
use crate::serving::disagg::DisaggSettings;
use crate::serving::routing::{self, PrefillRoute, RoutedRequest, needs_prefill};
use crate::serving::transport::WorkerTransport;

pub use switchyard_router::serve::Finish;
/// One generation to run.
#[derive(Debug, Clone)]
pub struct GenerateJob {
    /// The id the worker sees (the HTTP request's, with the choice's index when it has several).
    pub request_id: String,
    /// What its decisions are logged under.
    pub tags: Arc<RequestTags>,
    pub routes: Arc<ModelRoutes>,
    pub prompt: Vec<TokenId>,
    /// The prompt's block hashes, computed with its tokens (see
    /// [`crate::serving::routing::PromptHashes`]); `None`: each attempt hashes its context whole.
    pub prompt_hashes: Option<crate::serving::routing::PromptHashes>,
    /// How to sample, validated; its `max_tokens` is the whole request's.
    pub sampling: Sampling,
    /// The adapter and cache salt the prompt's KV is named by: its blocks are hashed under
    /// them and the workers (and their engines) receive them.
    pub identity: KvIdentity,
    /// The turn of its session it is (`x-session-id`), with the retention hint its worker
    /// receives; the turn ends when the last clone of the job is dropped.
    pub retention: Arc<crate::serving::retention::SessionTurn>,
    /// The request's scheduling priority (lower is earlier; `None`: the engine's default),
    /// sent to the worker, which passes it to an engine that schedules by it.
    pub priority: Option<i32>,
    pub session: Option<String>,
    pub deadline: Instant,
    pub max_retries: u32,
    pub max_migrations: u32,
    pub disagg: DisaggSettings,
    /// The request's trace span: the parent of each attempt's `route`, `prefill` and `decode`.
    pub span: tracing::Span,
}

/// What the consumer receives, in order: `Started`, any number of `Tokens`, then `Finished`;
/// or `Failed` at any point.
#[derive(Debug, Clone)]
pub enum DispatchEvent {
    Started {
        worker: WorkerId,
        prompt_tokens: u32,
        cached_prompt_tokens: u32,
    },
    /// Generated tokens, with one log probability per token when the request asked for them.
    Tokens {
        ids: Vec<TokenId>,
        logprobs: Vec<TokenLogprob>,
    },
    /// The worker reported more cached prompt tokens than `Started` said: engines that count
    /// them only in their final usage (vLLM) report them with the last message.
    Cached(u32),
    Finished(Finish),
    Failed(ApiError),
}

/// Starts `job` on `tasks` (the gateway's task tracker), routing among the pool's workers,
/// calling them through `transport` and writing its decisions, metrics and records to
/// `observers`; events arrive on the returned receiver.
pub fn start(
    pool: &Arc<WorkerPool>,
    observers: &Arc<Observers>,
    transport: &Arc<dyn WorkerTransport>,
    tasks: &TaskTracker,
    job: GenerateJob,
) -> mpsc::Receiver<DispatchEvent> {
    let (tx, rx) = mpsc::channel(64);
    let pool = Arc::clone(pool);
    let observers = Arc::clone(observers);
    let transport = Arc::clone(transport);
    // Its warnings (a retry, a migration) are events of the request's span.
    let span = job.span.clone();
    tasks.spawn(
        async move {
            let deadline = job.deadline;
            let timeout = deadline.saturating_duration_since(Instant::now()).as_secs();
            tokio::select! {
                _ = run(&pool, &observers, transport.as_ref(), job, &tx) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let _ = tx.send(DispatchEvent::Failed(ApiError::Timeout(timeout.max(1)))).await;
                }
                _ = tx.closed() => {}
            }
        }
        .instrument(span),
    );
    rx
}

/// Ends a `decode` span whose attempt was cut off: [`start`] drops the whole dispatch, mid
/// attempt, at the request's deadline or when the consumer goes away, and the span would
/// otherwise end looking like a success. Which of the two it was is told by the clock: the
/// deadline's timer fires only once it has passed.
struct UnfinishedAttempt {
    span: tracing::Span,
    deadline: Instant,
    armed: bool,
}

impl Drop for UnfinishedAttempt {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if Instant::now() >= self.deadline {
            record_error(
                &self.span,
                "the request's deadline passed during this attempt",
            );
        } else {
            self.span.record("finish_reason", "cancelled");
        }
    }
}

/// Ends a decode decision's outcome as `cancelled` when the dispatch is dropped before the
/// attempt's end was written (deadline, client gone): every decision gets an end.
struct OutcomeGuard {
    decisions: Arc<DecisionLog>,
    entry: Arc<DecisionEntry>,
    /// The decision's worker, for the logs of what follows it.
    worker: WorkerId,
}

impl OutcomeGuard {
    fn end(&self, status: OutcomeStatus, detail: Option<String>) {
        self.decisions.end(&self.entry, status, detail);
    }
}

impl Drop for OutcomeGuard {
    fn drop(&mut self) {
        self.decisions.end(
            &self.entry,
            OutcomeStatus::Cancelled,
            Some(
                "the request ended during this attempt (deadline, or the client went away)".into(),
            ),
        );
    }
}

/// Drives the request's [`Serving`] machine until it finishes or fails.
async fn run(
    pool: &Arc<WorkerPool>,
    observers: &Observers,
    transport: &dyn WorkerTransport,
    job: GenerateJob,
    tx: &mpsc::Sender<DispatchEvent>,
) {
    let mut driver = Driver {
        pool,
        observers,
        transport,
        serving: Serving::new(Plan {
            model: job.routes.model.clone(),
            settings: job.disagg.serve,
            max_tokens: job.sampling.max_tokens,
            max_retries: job.max_retries,
            max_migrations: job.max_migrations,
            logprobs: job.sampling.logprobs.is_some(),
        }),
        job: &job,
        tx,
        attempt: None,
        outcome: None,
    };
    let mut step = driver.serving.start();
    loop {
        step = match step {
            Step::Route(ask) => driver.route(ask),
            Step::ChoosePrefill(ask) => driver.choose_prefill(&ask),
            Step::Prefill {
                worker,
                try_number,
                why,
            } => driver.prefill(&worker, try_number, &why).await,
            Step::Generate { mode, .. } => driver.generate(mode).await,
            Step::Finish(finish) => {
                driver.end_outcome(OutcomeStatus::Completed, None);
                let _ = tx.send(DispatchEvent::Finished(finish)).await;
                return;
            }
            Step::Fail(err) => {
                driver.fail(err).await;
                return;
            }
            Step::Stop => return,
        };
    }
}

/// One request's dispatch: the machine, and what its current attempt holds.
struct Driver<'a> {
    pool: &'a Arc<WorkerPool>,
    /// Where its decisions, metrics and records go.
    observers: &'a Observers,
    /// How the workers are called.
    transport: &'a dyn WorkerTransport,
    job: &'a GenerateJob,
    tx: &'a mpsc::Sender<DispatchEvent>,
    serving: Serving,
    /// The current attempt, from its route until its generation starts.
    attempt: Option<Attempt>,
    /// The current decode decision, until its outcome is written.
    outcome: Option<OutcomeGuard>,
}

/// What one attempt holds between the machine's steps.
struct Attempt {
    number: u32,
    kind: switchyard_router::serve::AttemptKind,
    /// The attempt's route request (its context's block hashes).
    request: RouteRequest,
    /// The prompt plus what earlier attempts generated.
    context: Vec<TokenId>,
    /// The `route` span, open until the serving mode is decided.
    route_span: Option<Span>,
    /// The decode worker's route; dropping it releases its booking.
    decode: RoutedRequest,
    /// The prefill worker booked for the attempt, until its Prefill ran.
    prefill: Option<RoutedRequest>,
    /// Where the decode worker's prompt KV comes from.
    source: KvSource,
    /// The KV source is the peer holding the prompt's prefix (sub-agent placement), not a
    /// prefill-pool worker.
    placement: bool,
}

impl Driver<'_> {
    /// [`Step::Route`]: writes what ended the previous attempt, then routes and books this
    /// one's decode worker.
    fn route(&mut self, ask: RouteAsk) -> Step {
        if let Some(after) = &ask.after {
            self.previous_ended(after);
        }
        // A rerouted attempt's decode worker is let go here: its booking ends.
        self.attempt = None;
        let (pool, job) = (self.pool, self.job);
        let route_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "route",
            attempt = i64::from(ask.attempt),
            attempt.kind = ask.kind.as_str(),
            policy = Empty,
            worker = Empty,
            overlap_blocks = Empty,
            uncached_prompt_tokens = Empty,
            mode = Empty,
            mode_reason = Empty,
            prefill_worker = Empty,
        );
        let context = self.serving.context(&job.prompt);
        // Outside the model's lock; only the tokens after the prompt's hashed blocks are hashed
        // here (a migrated attempt's generated tokens).
        let request = routing::route_request_from(
            pool,
            &job.routes,
            &context,
            job.prompt_hashes.as_ref(),
            &job.identity,
            job.session.clone(),
        );
        let filter = DecodeFilter {
            exclude: &ask.exclude,
            aggregated_only: ask.aggregated_only,
            adapter: request.adapter.as_deref(),
        };
        let routed = route_span.in_scope(|| {
            routing::route(
                pool,
                self.observers,
                &job.routes,
                routing::DecodeAsk {
                    request: &request,
                    max_tokens: ask.max_tokens,
                    filter,
                    tags: &job.tags,
                    attempt: ask.attempt,
                    note: ask.note.as_deref(),
                    prefill_pool: ask.prefill_pool,
                },
            )
        });
        let decode = match routed {
            Ok(decode) => decode,
            Err(error) => {
                record_error(&route_span, error.to_string());
                return self.serving.routed(Err(RouteFailure {
                    error,
                    needs_prefill_registered: any_needs_prefill(pool, &job.routes.model),
                }));
            }
        };
        self.outcome = Some(OutcomeGuard {
            decisions: Arc::clone(&self.observers.decisions),
            entry: Arc::clone(&decode.audit),
            worker: decode.worker_id.clone(),
        });
        route_span.record("policy", decode.decision.explanation.policy);
        route_span.record("worker", decode.worker_id.as_str());
        route_span.record("overlap_blocks", i64::from(decode.cached_blocks));
        route_span.record(
            "uncached_prompt_tokens",
            decode.uncached_prompt_tokens() as i64,
        );
        tracing::debug!(request = %job.request_id, worker = %decode.worker_id, attempt = ask.attempt, "dispatching");
        let info = decode.worker.info();
        let routed = Routed {
            worker: decode.worker_id.clone(),
            uncached_prompt_tokens: decode.uncached_prompt_tokens(),
            engine: info.engine,
            needs_prefill: needs_prefill(&info),
            peer: decode.peer.clone(),
        };
        self.attempt = Some(Attempt {
            number: ask.attempt,
            kind: ask.kind,
            request,
            context,
            route_span: Some(route_span),
            decode,
            prefill: None,
            source: KvSource::default(),
            placement: false,
        });
        self.serving.routed(Ok(routed))
    }

    /// The previous attempt's decision ends with what the machine made of it.
    fn previous_ended(&mut self, after: &After) {
        let (status, reason) = match after {
            After::Retry(reason) => (OutcomeStatus::Retried, reason),
            After::Migrate(reason) => (OutcomeStatus::Migrated, reason),
            After::Reroute(why) => (OutcomeStatus::Rerouted, why),
        };
        let worker = self.outcome.as_ref().map(|o| o.worker.clone());
        let worker = worker.as_ref().map_or("", WorkerId::as_str);
        self.end_outcome(status, Some(reason.clone()));
        let request = &self.job.request_id;
        match after {
            After::Retry(reason) => {
                self.observers.metrics.retries.inc();
                tracing::warn!(%request, worker, %reason, "worker failed before the first token; retrying elsewhere");
            }
            After::Migrate(reason) => {
                self.observers.metrics.migrations.inc();
                let generated = self.serving.generated().len();
                tracing::warn!(%request, worker, generated, %reason, "worker failed mid-stream; migrating");
            }
            After::Reroute(why) => {
                if let Some(attempt) = &mut self.attempt {
                    decided(&mut attempt.route_span, "rerouted", why, None);
                }
                tracing::warn!(%request, worker, %why, "rerouting to a worker that serves without a prefill worker");
            }
        }
    }

    /// [`Step::ChoosePrefill`]: a prefill worker for the attempt's decode worker, booked (the
    /// decode worker's booking then counts no prefill): the peer the ask names (sub-agent
    /// placement), or the prefill pool's choice.
    fn choose_prefill(&mut self, ask: &PrefillAsk) -> Step {
        let Some(attempt) = self.attempt.as_mut() else {
            return self.serving.prefill_picked(PrefillPick::Unavailable(
                switchyard_router::RouteError::NoCandidates,
            ));
        };
        let (pool, observers, job) = (self.pool, self.observers, self.job);
        let Attempt {
            request,
            decode,
            route_span,
            ..
        } = attempt;
        // Sub-agent placement books the peer holding the prefix; otherwise the prefill pool.
        attempt.placement = ask.peer.is_some();
        let mut route = || match &ask.peer {
            Some(source) => routing::placement::route_peer(
                pool,
                observers,
                &job.routes,
                routing::placement::PeerRouteAsk {
                    request,
                    source,
                    tags: &job.tags,
                },
                decode,
            ),
            None => routing::route_prefill(
                pool,
                observers,
                &job.routes,
                routing::PrefillRouteAsk {
                    settings: &job.disagg.serve,
                    request,
                    ask,
                    tags: &job.tags,
                },
                decode,
            ),
        };
        let routed = match route_span {
            Some(span) => span.in_scope(route),
            None => route(),
        };
        let pick = match routed {
            PrefillRoute::Routed(prefill) => {
                let worker = prefill.worker_id.clone();
                attempt.prefill = Some(prefill);
                PrefillPick::Chosen(worker)
            }
            PrefillRoute::Saturated(why) => PrefillPick::Saturated(why),
            PrefillRoute::Unavailable(err) => PrefillPick::Unavailable(err),
        };
        self.serving.prefill_picked(pick)
    }

    /// Writes the current decode decision's outcome (once).
    fn end_outcome(&mut self, status: OutcomeStatus, detail: Option<String>) {
        if let Some(outcome) = self.outcome.take() {
            outcome.end(status, detail);
        }
    }

    /// [`Step::Fail`]: the request fails with `err`.
    async fn fail(&mut self, err: ServeError) {
        if let Some(span) = self.attempt.as_ref().and_then(|a| a.route_span.as_ref()) {
            record_error(span, err.message());
        }
        let err = ApiError::from(err);
        self.end_outcome(OutcomeStatus::Failed, Some(err.to_string()));
        let _ = self.tx.send(DispatchEvent::Failed(err)).await;
    }
}

/// Closes the attempt's `route` span with the serving mode it chose, the first time only: later
/// prefill retries (and a fall back after them) show on their own spans and on `decode`.
fn decided(route_span: &mut Option<Span>, mode: &str, why: &str, prefill_worker: Option<&str>) {
    if let Some(span) = route_span.take() {
        span.record("mode", mode);
        span.record("mode_reason", why);
        if let Some(worker) = prefill_worker {
            span.record("prefill_worker", worker);
        }
    }
}

/// Where an attempt's prompt KV comes from: nowhere (aggregated), or a prefill worker.
#[derive(Default)]
struct KvSource {
    source: Option<v1::KvSource>,
    prefill_worker: Option<WorkerId>,
    /// A pipelined prefill still running: booked on its worker until the decode worker's first
    /// token says it finished.
    running: Option<Box<RoutedRequest>>,
}

/// Whether a worker of `model` that serves only with a prefill worker is registered (what a 503
/// for want of an aggregated worker should then explain).
fn any_needs_prefill(pool: &WorkerPool, model: &str) -> bool {
    pool.members_of(model)
        .is_some_and(|list| list.members.iter().any(|m| needs_prefill(&m.info)))
}
