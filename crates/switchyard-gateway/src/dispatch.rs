//! Dispatch: run a generation on a worker and stream its tokens back, hiding worker failures.
//!
//! A worker that fails before the first token is replaced by another (up to `max_retries`); a
//! worker that fails mid-stream is replaced by another that continues from the prompt plus the
//! tokens generated so far (up to `max_migrations`). When the consumer drops its receiver (the
//! client went away, or a stop string matched) the task ends, which drops the worker stream,
//! which aborts the request on the worker. Every generation ends with `Finished` or `Failed`
//! before the deadline: none hangs.

use std::sync::Arc;

use futures::StreamExt;
use switchyard_core::{TokenId, WorkerId};
use switchyard_proto::fault::{Fault, fault_of};
use switchyard_proto::v1::{self, GenerateRequest, SamplingParams};
use switchyard_router::RouteError;
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use tracing::Instrument;
use tracing::field::Empty;

use crate::disagg::{
    DisaggSettings, Disaggregation, Prefilled, prefill_stage, serves_only_with_prefill,
};
use crate::error::ApiError;
use crate::pool::{ModelRoutes, WorkerPool};
use crate::routing::{needs_prefill, route};

/// One generation to run.
#[derive(Debug, Clone)]
pub struct GenerateJob {
    pub request_id: String,
    pub routes: Arc<ModelRoutes>,
    pub prompt: Vec<TokenId>,
    pub max_tokens: u32,
    pub temperature: f32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<TokenId>,
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
    Tokens(Vec<TokenId>),
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

/// How an attempt ended, when it did not finish the generation.
enum AttemptEnd {
    /// The consumer is gone; stop quietly.
    ConsumerGone,
    /// A worker failed; another may succeed. `blame` says which one to avoid next.
    WorkerFailed {
        reason: String,
        blame: Blame,
    },
    /// The request itself is bad; no worker will take it.
    Refused(ApiError),
    Done,
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

/// Which worker a failed attempt is held against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blame {
    /// The worker that answered (the decode worker, or the only one when aggregated).
    Answering,
    /// The KV source: the decode worker could not get the prompt's KV from the prefill worker,
    /// so the prefill worker is excluded and the decode worker stays eligible.
    KvSource,
}

impl AttemptEnd {
    fn worker_failed(reason: impl Into<String>) -> Self {
        AttemptEnd::WorkerFailed {
            reason: reason.into(),
            blame: Blame::Answering,
        }
    }
}

async fn run(pool: &Arc<WorkerPool>, job: GenerateJob, tx: &mpsc::Sender<DispatchEvent>) {
    let mut generated: Vec<TokenId> = Vec::new();
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut excluded_prefill: Vec<WorkerId> = Vec::new();
    let mut retries = 0u32;
    let mut migrations = 0u32;
    let mut started = false;
    let mut attempt = 0u32;
    // Set when a decode worker that serves only with a prefill worker's KV could get none:
    // from then on the request goes only to workers that serve aggregated.
    let mut rerouted: Option<String> = None;
    loop {
        attempt += 1;
        // Workers that cannot serve without a prefill worker (SGLang decode servers) are left
        // out whenever this attempt cannot give them one: with disaggregation off, for a
        // migration (which continues aggregated), and after a reroute.
        let aggregated_only =
            job.disagg.mode == Disaggregation::Off || !generated.is_empty() || rerouted.is_some();
        let attempt_kind = if attempt == 1 {
            "first"
        } else if generated.is_empty() {
            "retry"
        } else {
            "migration"
        };
        let mut context = job.prompt.clone();
        context.extend_from_slice(&generated);
        let remaining = job.max_tokens.saturating_sub(generated.len() as u32);
        let route_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "route",
            attempt = i64::from(attempt),
            attempt.kind = attempt_kind,
            policy = Empty,
            worker = Empty,
            overlap_blocks = Empty,
            uncached_prompt_tokens = Empty,
            mode = Empty,
            mode_reason = Empty,
            prefill_worker = Empty,
        );
        let routed = route_span.in_scope(|| {
            route(
                pool,
                &job.routes,
                &context,
                remaining,
                job.session.clone(),
                &excluded,
                &job.request_id,
                attempt,
                aggregated_only,
                rerouted.as_deref(),
            )
        });
        if let Err(err) = &routed {
            record_error(&route_span, err.to_string());
        }
        let routed = match routed {
            Ok(routed) => routed,
            Err(RouteError::NoCandidates) => {
                let message = if let Some(why) = &rerouted {
                    format!(
                        "{why}, and no worker that serves without a prefill worker (role both, or \
                         a vllm or sim decode worker) is available for model `{}`",
                        job.routes.model
                    )
                } else if aggregated_only
                    && excluded.is_empty()
                    && any_needs_prefill(pool, &job.routes.model)
                {
                    format!(
                        "no worker that serves without a prefill worker is available for model \
                         `{}` ({}; its sglang decode workers serve only with one)",
                        job.routes.model,
                        if generated.is_empty() {
                            "disaggregation is off"
                        } else {
                            "a migration continues on one worker"
                        }
                    )
                } else if excluded.is_empty() {
                    format!("no worker is available for model `{}`", job.routes.model)
                } else {
                    format!(
                        "no other worker is available for model `{}` after {} failed",
                        job.routes.model,
                        excluded.len()
                    )
                };
                let _ = tx
                    .send(DispatchEvent::Failed(ApiError::Unavailable(message)))
                    .await;
                return;
            }
            Err(err) => {
                let _ = tx
                    .send(DispatchEvent::Failed(ApiError::Internal(err.to_string())))
                    .await;
                return;
            }
        };
        let mut routed = routed;
        let worker_id = routed.worker_id.clone();
        let uncached = routed
            .decision
            .chosen()
            .map_or(context.len() as u64, |c| c.uncached_prompt_tokens);
        route_span.record("policy", routed.decision.explanation.policy);
        route_span.record("worker", worker_id.as_str());
        route_span.record("overlap_blocks", i64::from(routed.cached_blocks));
        route_span.record("uncached_prompt_tokens", uncached as i64);
        tracing::debug!(request = %job.request_id, worker = %worker_id, attempt, "dispatching");
        // Only a fresh start can use a prefill worker: a migration continues from tokens the
        // failed worker produced, and the new decode worker recomputes that context itself.
        let mut prefill_worker: Option<WorkerId> = None;
        let mut running_prefill = None;
        let kv_source = if generated.is_empty() {
            let (engine, needs_prefill) = {
                let info = routed.worker.info.read().unwrap_or_else(|p| p.into_inner());
                (info.engine, needs_prefill(&info))
            };
            match prefill_stage(
                pool,
                &job.routes,
                &job.disagg,
                engine,
                needs_prefill,
                &job.request_id,
                &context,
                uncached,
                job.max_retries + 1,
                &mut excluded_prefill,
                route_span,
            )
            .await
            {
                Prefilled::Aggregated(why) => {
                    tracing::debug!(request = %job.request_id, worker = %worker_id, %why, "aggregated");
                    None
                }
                Prefilled::Source {
                    source,
                    worker: prefill,
                    running,
                } => {
                    tracing::debug!(request = %job.request_id, %prefill, decode = %worker_id, pipelined = source.pipelined, "disaggregated");
                    prefill_worker = Some(prefill);
                    running_prefill = running;
                    Some(source)
                }
                Prefilled::Fail(err) => {
                    let _ = tx.send(DispatchEvent::Failed(err)).await;
                    return;
                }
                Prefilled::Reroute(why) => {
                    let why = format!("{}, and {why}", serves_only_with_prefill(&worker_id));
                    tracing::warn!(request = %job.request_id, worker = %worker_id, %why, "rerouting to a worker that serves without a prefill worker");
                    rerouted = Some(why);
                    // Dropping `routed` releases the load counted on the decode worker.
                    continue;
                }
            }
        } else {
            route_span.record("mode", "aggregated");
            route_span.record("mode_reason", "a migration continues on one worker");
            drop(route_span);
            None
        };
        let decode_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "decode",
            otel.kind = "client",
            attempt = i64::from(attempt),
            attempt.kind = attempt_kind,
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
        let generated_before = generated.len();
        let request = GenerateRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: context,
            sampling: Some(SamplingParams {
                max_tokens: remaining,
                temperature: job.temperature,
                seed: job.seed,
                ignore_eos: job.ignore_eos,
                stop_token_ids: job.stop_token_ids.clone(),
            }),
            kv_source,
        };
        let mut request = tonic::Request::new(request);
        switchyard_telemetry::inject_context(&decode_span, request.metadata_mut());
        let mut client = routed.worker.client.clone();
        let end = match client.generate(request).await {
            Err(status) => classify(status),
            Ok(response) => {
                let mut stream = response.into_inner();
                let mut end = AttemptEnd::worker_failed("worker closed the stream early");
                while let Some(message) = stream.next().await {
                    let message = match message {
                        Ok(message) => message,
                        Err(status) => {
                            end = classify(status);
                            break;
                        }
                    };
                    if let Some(mut prefill) = running_prefill.take() {
                        // The decode worker's first token ends the pipelined prefill.
                        prefill.prefill_done();
                    }
                    if !started {
                        started = true;
                        decode_span.record(
                            "cached_prompt_tokens",
                            i64::from(message.cached_prompt_tokens),
                        );
                        routed.prefill_done();
                        let event = DispatchEvent::Started {
                            worker: worker_id.clone(),
                            prompt_tokens: job.prompt.len() as u32,
                            cached_prompt_tokens: message.cached_prompt_tokens,
                        };
                        if tx.send(event).await.is_err() {
                            end = AttemptEnd::ConsumerGone;
                            break;
                        }
                    } else {
                        routed.prefill_done();
                    }
                    if !message.token_ids.is_empty() {
                        generated.extend_from_slice(&message.token_ids);
                        if tx
                            .send(DispatchEvent::Tokens(message.token_ids))
                            .await
                            .is_err()
                        {
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
        drop(routed);
        decode_span.record(
            "completion_tokens",
            (generated.len() - generated_before) as i64,
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
        drop(decode_span);
        drop(running_prefill);
        match end {
            AttemptEnd::Done | AttemptEnd::ConsumerGone => return,
            AttemptEnd::Refused(err) => {
                let _ = tx.send(DispatchEvent::Failed(err)).await;
                return;
            }
            AttemptEnd::WorkerFailed { reason, blame } => {
                match (blame, prefill_worker.take()) {
                    (Blame::KvSource, Some(prefill)) => excluded_prefill.push(prefill),
                    _ => excluded.push(worker_id.clone()),
                }
                if generated.is_empty() {
                    retries += 1;
                    if retries > job.max_retries {
                        let err = ApiError::Upstream(format!(
                            "{} workers failed before the first token; last: {reason}",
                            retries
                        ));
                        let _ = tx.send(DispatchEvent::Failed(err)).await;
                        return;
                    }
                    pool.metrics.retries.inc();
                    tracing::warn!(request = %job.request_id, worker = %worker_id, %reason, "worker failed before the first token; retrying elsewhere");
                } else {
                    migrations += 1;
                    if migrations > job.max_migrations {
                        let err = ApiError::Upstream(format!(
                            "the stream failed {migrations} times; last: {reason}"
                        ));
                        let _ = tx.send(DispatchEvent::Failed(err)).await;
                        return;
                    }
                    pool.metrics.migrations.inc();
                    tracing::warn!(request = %job.request_id, worker = %worker_id, generated = generated.len(), %reason, "worker failed mid-stream; migrating");
                }
                if generated.len() as u32 >= job.max_tokens {
                    let _ = tx.send(DispatchEvent::Finished(Finish::Length)).await;
                    return;
                }
            }
        }
    }
}

/// Whether a worker of `model` that serves only with a prefill worker is registered (what a 503
/// for want of an aggregated worker should then explain).
fn any_needs_prefill(pool: &WorkerPool, model: &str) -> bool {
    pool.workers_of(model)
        .iter()
        .any(|w| needs_prefill(&w.info()))
}

/// What a worker's failed `Generate` means for the request. The one place the gateway reads
/// the worker's fault mark (`switchyard_proto::fault`): the message is for people and is only
/// passed on.
fn classify(status: tonic::Status) -> AttemptEnd {
    match status.code() {
        // The decode worker cannot use the prefill worker's KV (another model shape): the
        // deployment pairs workers that must not pair. Not the client's fault (so not a 400),
        // and not a transient one of either worker (so no retry that would hide it).
        Code::InvalidArgument if fault_of(&status) == Some(Fault::KvLayout) => {
            AttemptEnd::Refused(ApiError::Upstream(status.message().to_owned()))
        }
        Code::InvalidArgument | Code::OutOfRange => {
            AttemptEnd::Refused(ApiError::bad_request(status.message().to_owned()))
        }
        code => AttemptEnd::WorkerFailed {
            reason: format!("{code:?}: {}", status.message()),
            blame: match fault_of(&status) {
                Some(Fault::KvSource) => Blame::KvSource,
                Some(Fault::KvLayout) | None => Blame::Answering,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use switchyard_proto::fault::kv_source_unavailable;

    use super::*;

    fn blame(status: tonic::Status) -> Option<Blame> {
        match classify(status) {
            AttemptEnd::WorkerFailed { blame, .. } => Some(blame),
            _ => None,
        }
    }

    #[test]
    fn the_fault_mark_not_the_wording_decides_who_is_blamed() {
        assert_eq!(
            blame(kv_source_unavailable("the engine went quiet")),
            Some(Blame::KvSource)
        );
        assert_eq!(
            blame(tonic::Status::unavailable(
                "pulling kv from 10.0.0.1:7000: no answer within 30s"
            )),
            Some(Blame::Answering)
        );
        assert_eq!(
            blame(tonic::Status::internal("worker crashed")),
            Some(Blame::Answering)
        );
    }

    #[test]
    fn the_human_message_is_kept() {
        match classify(kv_source_unavailable("pulling kv from p:1: stream ended")) {
            AttemptEnd::WorkerFailed { reason, .. } => {
                assert_eq!(reason, "Unavailable: pulling kv from p:1: stream ended");
            }
            _ => panic!("a marked unavailable status is a failed attempt"),
        }
        assert!(matches!(
            classify(tonic::Status::invalid_argument("prompt is empty")),
            AttemptEnd::Refused(ApiError::BadRequest { .. })
        ));
        // A layout mismatch is refused too, but as the deployment's error, not the client's.
        match classify(switchyard_proto::fault::kv_layout_mismatch(
            "prefill p:1 announces 40 layers; this decode worker has 32",
        )) {
            AttemptEnd::Refused(ApiError::Upstream(message)) => {
                assert!(message.contains("40 layers"), "{message}");
            }
            _ => panic!("a layout mismatch is refused as an upstream error"),
        }
    }
}
