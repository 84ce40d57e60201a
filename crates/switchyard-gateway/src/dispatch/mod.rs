//! Dispatch: run a generation on a worker and stream its tokens back, hiding worker failures.
//!
//! Each attempt goes `route → prefill? → stream`, and its end decides what follows
//! (`done | retry | migrate | reroute | fail`): a worker that fails before the first token is
//! replaced by another (up to `max_retries`); a worker that fails mid-stream is replaced by
//! another that continues from the prompt plus the tokens generated so far (up to
//! `max_migrations`). The transitions are pure ([`attempts`]); this module runs them over the
//! pool's [`WorkerTransport`](crate::transport::WorkerTransport). When the consumer drops its
//! receiver (the client went away, or a stop string matched) the task ends, which drops the
//! worker stream, which aborts the request on the worker. Every generation ends with
//! `Finished` or `Failed` before the deadline: none hangs.

mod attempts;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use futures::StreamExt;
use switchyard_core::{KvIdentity, Sampling, TokenId, TokenLogprob, WorkerId};
use switchyard_proto::v1::{self, GenerateRequest, SamplingParams};
use switchyard_router::RouteError;
use switchyard_router::serve::DecodeFilter;
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

use crate::audit::realized::{Realized, realize};
use crate::audit::{DecisionEntry, DecisionLog, OutcomeStatus, RequestTags};
use crate::disagg::{
    DisaggSettings, Disaggregation, PrefillAsk, Prefilled, prefill_stage, serves_only_with_prefill,
};
use crate::error::ApiError;
use crate::health::{Liveness, is_transport_failure};
use crate::pool::{ModelRoutes, WorkerPool};
use crate::routing::{self, RoutedRequest, needs_prefill};
use attempts::{AttemptEnd, AttemptKind, Attempts, Next, classify};

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
    /// [`crate::routing::PromptHashes`]); `None`: each attempt hashes its context whole.
    pub prompt_hashes: Option<crate::routing::PromptHashes>,
    /// How to sample, validated; its `max_tokens` is the whole request's.
    pub sampling: Sampling,
    /// The adapter and cache salt the prompt's KV is named by: its blocks are hashed under
    /// them and the workers (and their engines) receive them.
    pub identity: KvIdentity,
    /// The turn of its session it is (`x-session-id`), with the retention hint its worker
    /// receives; the turn ends when the last clone of the job is dropped.
    pub retention: Arc<crate::retention::SessionTurn>,
    pub session: Option<String>,
    pub deadline: Instant,
    pub max_retries: u32,
    pub max_migrations: u32,
    pub disagg: DisaggSettings,
    /// The request's trace span: the parent of each attempt's `route`, `prefill` and `decode`.
    pub span: tracing::Span,
}

/// Why generation ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Length,
    Stop,
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

/// Starts `job` on the pool's task tracker; events arrive on the returned receiver.
pub fn start(pool: &Arc<WorkerPool>, job: GenerateJob) -> mpsc::Receiver<DispatchEvent> {
    let (tx, rx) = mpsc::channel(64);
    let pool = Arc::clone(pool);
    // Its warnings (a retry, a migration) are events of the request's span.
    let span = job.span.clone();
    pool.clone().tasks.spawn(
        async move {
            let deadline = job.deadline;
            let timeout = deadline.saturating_duration_since(Instant::now()).as_secs();
            tokio::select! {
                _ = run(&pool, job, &tx) => {}
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

/// Runs attempts until one finishes the generation or the request fails.
async fn run(pool: &Arc<WorkerPool>, job: GenerateJob, tx: &mpsc::Sender<DispatchEvent>) {
    let mut attempts = Attempts::new(job.sampling.max_tokens, job.max_retries, job.max_migrations);
    loop {
        let attempt = attempts.begin();
        let kind = attempts.kind();
        let context = attempts.context(&job.prompt);
        // Log probabilities are computed where the tokens are: a prefill worker's first token
        // comes without one, so such a request is served aggregated.
        let logprobs = job.sampling.logprobs.is_some();
        let aggregated_only = logprobs || attempts.aggregated_only(&job.disagg.serve);
        let prefill_pool = attempts.may_use_prefill_pool() && !logprobs;
        let route_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "route",
            attempt = i64::from(attempt),
            attempt.kind = kind.as_str(),
            policy = Empty,
            worker = Empty,
            overlap_blocks = Empty,
            uncached_prompt_tokens = Empty,
            mode = Empty,
            mode_reason = Empty,
            prefill_worker = Empty,
        );
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
            exclude: &attempts.excluded,
            aggregated_only,
            adapter: request.adapter.as_deref(),
        };
        let routed = route_span.in_scope(|| {
            routing::route_attempt(
                pool,
                &job.routes,
                &request,
                attempts.remaining(),
                filter,
                &job.tags,
                attempt,
                attempts.rerouted.as_deref(),
                prefill_pool && job.disagg.mode() != Disaggregation::Off,
            )
        });
        let mut routed = match routed {
            Ok(routed) => routed,
            Err(err) => {
                record_error(&route_span, err.to_string());
                let err = match err {
                    RouteError::NoCandidates => attempts.no_candidates(
                        &job.routes.model,
                        aggregated_only,
                        any_needs_prefill(pool, &job.routes.model),
                    ),
                    err => ApiError::Internal(err.to_string()),
                };
                let _ = tx.send(DispatchEvent::Failed(err)).await;
                return;
            }
        };
        let worker_id = routed.worker_id.clone();
        let outcome = OutcomeGuard {
            decisions: Arc::clone(&pool.decisions),
            entry: Arc::clone(&routed.audit),
        };
        route_span.record("policy", routed.decision.explanation.policy);
        route_span.record("worker", worker_id.as_str());
        route_span.record("overlap_blocks", i64::from(routed.cached_blocks));
        route_span.record(
            "uncached_prompt_tokens",
            routed.uncached_prompt_tokens() as i64,
        );
        tracing::debug!(request = %job.request_id, worker = %worker_id, attempt, "dispatching");

        let source = if prefill_pool {
            let prefilled = prefill_stage(
                pool,
                &job.routes,
                &job.disagg,
                &request,
                PrefillAsk {
                    request_id: &job.request_id,
                    prompt: &context,
                    identity: &job.identity,
                    retention: job.retention.hint(),
                },
                &mut routed,
                &job.tags,
                job.max_retries + 1,
                &mut attempts.excluded_prefill,
                route_span,
            )
            .await;
            match prefilled {
                Prefilled::Aggregated(why) => {
                    tracing::debug!(request = %job.request_id, worker = %worker_id, %why, "aggregated");
                    KvSource::default()
                }
                Prefilled::Source {
                    source,
                    worker,
                    running,
                } => {
                    tracing::debug!(request = %job.request_id, prefill = %worker, decode = %worker_id, pipelined = source.pipelined, "disaggregated");
                    KvSource {
                        source: Some(source),
                        prefill_worker: Some(worker),
                        running,
                    }
                }
                Prefilled::Fail(err) => {
                    outcome.end(OutcomeStatus::Failed, Some(err.to_string()));
                    let _ = tx.send(DispatchEvent::Failed(err)).await;
                    return;
                }
                Prefilled::Reroute(why) => {
                    let why = format!("{}, and {why}", serves_only_with_prefill(&worker_id));
                    outcome.end(OutcomeStatus::Rerouted, Some(why.clone()));
                    tracing::warn!(request = %job.request_id, worker = %worker_id, %why, "rerouting to a worker that serves without a prefill worker");
                    attempts.reroute(why);
                    // Dropping `routed` releases the load booked on the decode worker.
                    continue;
                }
            }
        } else {
            route_span.record("mode", "aggregated");
            route_span.record(
                "mode_reason",
                if logprobs {
                    "log probabilities are computed where the tokens are generated"
                } else {
                    "a migration continues on one worker"
                },
            );
            drop(route_span);
            KvSource::default()
        };
        let prefill_worker = source.prefill_worker.clone();
        let end = stream_attempt(
            pool,
            &job,
            &mut attempts,
            attempt,
            kind,
            routed,
            context,
            &request.block_hashes,
            source,
            tx,
        )
        .await;
        match &end {
            AttemptEnd::Done => outcome.end(OutcomeStatus::Completed, None),
            AttemptEnd::ConsumerGone => outcome.end(
                OutcomeStatus::Cancelled,
                Some(
                    "the answer stopped being read (client gone, or a stop string matched)".into(),
                ),
            ),
            _ => {}
        }
        match attempts.ended(end, &worker_id, prefill_worker) {
            Next::Stop => return,
            Next::Fail(err) => {
                outcome.end(OutcomeStatus::Failed, Some(err.to_string()));
                let _ = tx.send(DispatchEvent::Failed(err)).await;
                return;
            }
            Next::Finish(finish) => {
                outcome.end(OutcomeStatus::Completed, None);
                let _ = tx.send(DispatchEvent::Finished(finish)).await;
                return;
            }
            Next::Retry { reason } => {
                outcome.end(OutcomeStatus::Retried, Some(reason.clone()));
                pool.metrics.retries.inc();
                tracing::warn!(request = %job.request_id, worker = %worker_id, %reason, "worker failed before the first token; retrying elsewhere");
            }
            Next::Migrate { reason } => {
                outcome.end(OutcomeStatus::Migrated, Some(reason.clone()));
                pool.metrics.migrations.inc();
                tracing::warn!(request = %job.request_id, worker = %worker_id, generated = attempts.generated.len(), %reason, "worker failed mid-stream; migrating");
            }
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

/// The `stream` stage of one attempt: `Generate` on the routed worker through the pool's
/// transport, relaying tokens to the consumer and appending them to `attempts.generated`.
#[allow(clippy::too_many_arguments)]
async fn stream_attempt(
    pool: &WorkerPool,
    job: &GenerateJob,
    attempts: &mut Attempts,
    attempt: u32,
    kind: AttemptKind,
    mut routed: RoutedRequest,
    context: Vec<TokenId>,
    prompt_blocks: &[switchyard_core::BlockHash],
    source: KvSource,
    tx: &mpsc::Sender<DispatchEvent>,
) -> AttemptEnd {
    let KvSource {
        source: kv_source,
        prefill_worker,
        mut running,
    } = source;
    let worker_id = routed.worker_id.clone();
    let disaggregated = kv_source.is_some();
    routed.audit.update(|o| {
        o.mode = Some(if disaggregated {
            "disaggregated"
        } else {
            "aggregated"
        });
        o.prefill_worker = prefill_worker.as_ref().map(ToString::to_string);
        o.retention = Some(job.retention.hint()).filter(switchyard_core::Retention::is_some);
    });
    let decode_span = tracing::info_span!(
        target: GATEWAY_SPANS,
        parent: &job.span,
        "decode",
        otel.kind = "client",
        attempt = i64::from(attempt),
        attempt.kind = kind.as_str(),
        worker = worker_id.as_str(),
        mode = if kv_source.is_some() { "disaggregated" } else { "aggregated" },
        prefill_worker = prefill_worker.as_ref().map(WorkerId::as_str),
        cached_prompt_tokens = Empty,
        completion_tokens = Empty,
        finish_reason = Empty,
    );
    let mut unfinished = UnfinishedAttempt {
        span: decode_span.clone(),
        deadline: job.deadline,
        armed: true,
    };
    let generated_before = attempts.generated.len();
    let request = GenerateRequest {
        request_id: job.request_id.clone(),
        prompt_token_ids: context,
        sampling: Some(SamplingParams::from(&attempts.sampling(&job.sampling))),
        kv_source,
        identity: switchyard_proto::identity_to_proto(&job.identity),
        retention: switchyard_proto::retention_to_proto(&job.retention.hint()),
    };
    let mut request = tonic::Request::new(request);
    switchyard_telemetry::inject_context(&decode_span, request.metadata_mut());
    // The attempt gives up on its worker the moment the worker is found unresponsive (its load
    // reports stopped): a frozen worker holds its stream open without a word. A worker routed
    // to while already unresponsive (none of the model answered) gets its chance.
    let worker = Arc::clone(&routed.worker);
    let mut liveness = worker.health.subscribe();
    let watch_liveness = liveness.borrow_and_update().is_answering();
    let stopped_answering = async {
        if !watch_liveness {
            return std::future::pending().await;
        }
        let state = liveness
            .wait_for(|l| !l.is_answering())
            .await
            .map(|state| state.clone());
        let Ok(state) = state else {
            return std::future::pending().await;
        };
        match state {
            Liveness::Unresponsive { reason, .. } => format!("worker stopped answering: {reason}"),
            Liveness::Answering => "worker stopped answering".to_owned(),
        }
    };
    tokio::pin!(stopped_answering);
    let failed = |status: tonic::Status| {
        if is_transport_failure(&status) {
            pool.worker_failed(
                &worker,
                format!("a request to it failed: {}", status.message()),
            );
        }
        classify(status)
    };
    let opened = tokio::select! {
        opened = pool.transport.generate(&routed.worker, request) => opened,
        reason = &mut stopped_answering => {
            pool.metrics.unresponsive_cuts.inc();
            Err(tonic::Status::unavailable(reason))
        }
    };
    let end = match opened {
        Err(status) => failed(status),
        Ok(mut stream) => {
            let mut end = AttemptEnd::worker_failed("worker closed the stream early");
            // The prompt's cached tokens (the engine's realized hit): the simulator and SGLang
            // report them with the first message, vLLM only with its final usage. The audit
            // takes the first nonzero count, or the last when none is (`Realize`).
            let mut first_message = true;
            let mut cached_seen = 0u32;
            let mut realize_pending = false;
            loop {
                let message = tokio::select! {
                    message = stream.next() => message,
                    reason = &mut stopped_answering => {
                        pool.metrics.unresponsive_cuts.inc();
                        end = AttemptEnd::worker_failed(reason);
                        break;
                    }
                };
                let Some(message) = message else { break };
                let message = match message {
                    Ok(message) => message,
                    Err(status) => {
                        end = failed(status);
                        break;
                    }
                };
                if let Some(mut prefill) = running.take() {
                    // The decode worker's first token ends the pipelined prefill.
                    prefill.prefill_done();
                }
                routed.prefill_done();
                let cached_grew = message.cached_prompt_tokens > cached_seen;
                cached_seen = cached_seen.max(message.cached_prompt_tokens);
                if first_message || (realize_pending && cached_seen > 0) {
                    realize_pending = first_message && cached_seen == 0;
                    first_message = false;
                    if !realize_pending {
                        realize(
                            pool,
                            Realized {
                                entry: &routed.audit,
                                worker: &routed.worker,
                                routes: &routed.routes,
                                prompt_blocks,
                                cached_prompt_tokens: u64::from(cached_seen),
                                comparable: !disaggregated,
                            },
                        );
                    }
                }
                if attempts.started
                    && cached_grew
                    && tx.send(DispatchEvent::Cached(cached_seen)).await.is_err()
                {
                    end = AttemptEnd::ConsumerGone;
                    break;
                }
                if !attempts.started {
                    attempts.started = true;
                    decode_span.record(
                        "cached_prompt_tokens",
                        i64::from(message.cached_prompt_tokens),
                    );
                    let event = DispatchEvent::Started {
                        worker: worker_id.clone(),
                        prompt_tokens: job.prompt.len() as u32,
                        cached_prompt_tokens: message.cached_prompt_tokens,
                    };
                    if tx.send(event).await.is_err() {
                        end = AttemptEnd::ConsumerGone;
                        break;
                    }
                }
                if !message.token_ids.is_empty() {
                    let logprobs = match logprobs_of(&job.sampling, &message) {
                        Ok(logprobs) => logprobs,
                        Err(reason) => {
                            end = AttemptEnd::worker_failed(reason);
                            break;
                        }
                    };
                    attempts.generated.extend_from_slice(&message.token_ids);
                    let event = DispatchEvent::Tokens {
                        ids: message.token_ids,
                        logprobs,
                    };
                    if tx.send(event).await.is_err() {
                        end = AttemptEnd::ConsumerGone;
                        break;
                    }
                }
                let finish = match v1::FinishReason::try_from(message.finish_reason) {
                    Ok(v1::FinishReason::Length) => Some(Finish::Length),
                    Ok(v1::FinishReason::Stop) => Some(Finish::Stop),
                    Ok(v1::FinishReason::Aborted) => {
                        end = AttemptEnd::worker_failed("worker aborted the request");
                        break;
                    }
                    _ => None,
                };
                if let Some(finish) = finish {
                    if realize_pending {
                        // The engine never reported a cached token: its hit was 0.
                        realize(
                            pool,
                            Realized {
                                entry: &routed.audit,
                                worker: &routed.worker,
                                routes: &routed.routes,
                                prompt_blocks,
                                cached_prompt_tokens: 0,
                                comparable: !disaggregated,
                            },
                        );
                    }
                    decode_span.record(
                        "finish_reason",
                        match finish {
                            Finish::Length => "length",
                            Finish::Stop => "stop",
                        },
                    );
                    let _ = tx.send(DispatchEvent::Finished(finish)).await;
                    end = AttemptEnd::Done;
                    break;
                }
            }
            end
        }
    };
    // Releases the decode worker's booking (and a pipelined prefill's, if it never finished).
    drop(routed);
    drop(running);
    decode_span.record(
        "completion_tokens",
        (attempts.generated.len() - generated_before) as i64,
    );
    match &end {
        AttemptEnd::Done => {}
        AttemptEnd::ConsumerGone => {
            decode_span.record("finish_reason", "cancelled");
        }
        AttemptEnd::WorkerFailed { reason, .. } => record_error(&decode_span, reason.as_str()),
        AttemptEnd::Refused(err) => record_error(&decode_span, err.to_string()),
    }
    unfinished.armed = false;
    end
}

/// A message's log probabilities: one per token when the request asked for them (a worker that
/// sends another count failed the request), none otherwise.
fn logprobs_of(
    sampling: &Sampling,
    message: &v1::GenerateResponse,
) -> Result<Vec<TokenLogprob>, String> {
    if sampling.logprobs.is_none() {
        return Ok(Vec::new());
    }
    if message.logprobs.len() != message.token_ids.len() {
        return Err(format!(
            "worker sent {} log probabilities for {} tokens",
            message.logprobs.len(),
            message.token_ids.len()
        ));
    }
    Ok(message
        .logprobs
        .iter()
        .cloned()
        .map(TokenLogprob::from)
        .collect())
}

/// Whether a worker of `model` that serves only with a prefill worker is registered (what a 503
/// for want of an aggregated worker should then explain).
fn any_needs_prefill(pool: &WorkerPool, model: &str) -> bool {
    pool.workers_of(model)
        .iter()
        .any(|w| needs_prefill(&w.info()))
}
