//! [`Step::Generate`](switchyard_router::serve::Step::Generate) carried out: `Generate` on the
//! attempt's decode worker through the pool's transport, its tokens relayed to the consumer and
//! handed to the machine, until the worker finishes, fails, stops answering, or the consumer
//! leaves. The attempt's end goes back to the machine.

use std::ops::ControlFlow;
use std::sync::Arc;

use futures::StreamExt;
use switchyard_core::{BlockHash, Sampling, TokenLogprob, WorkerId};
use switchyard_proto::v1::{self, GenerateRequest, SamplingParams};
use switchyard_router::serve::{AttemptEnd, Mode, Step};
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tracing::Span;
use tracing::field::Empty;

use super::classify::classify;
use super::{Attempt, DispatchEvent, Driver, Finish, KvSource, OutcomeStatus, UnfinishedAttempt};
use crate::cluster::health::{Liveness, is_transport_failure};
use crate::cluster::pool::WorkerHandle;
use crate::observe::Observers;
use crate::observe::metrics::Metrics;
use crate::observe::recorder::ServedAs;
use crate::serving::routing::RoutedRequest;

/// One attempt's generation while it streams: the bookings it holds and what the engine has
/// reported of the prompt's cached tokens.
struct Relay<'a> {
    decode: RoutedRequest,
    /// A pipelined prefill still running, until the decode worker's first token.
    running: Option<Box<RoutedRequest>>,
    prompt_blocks: &'a [BlockHash],
    disaggregated: bool,
    span: &'a Span,
    /// The prompt's cached tokens (the engine's realized hit): the simulator and SGLang report
    /// them with the first message, vLLM only with its final usage. The audit takes the first
    /// nonzero count, or the last when none is.
    first_message: bool,
    cached_seen: u32,
    realize_pending: bool,
}

impl Relay<'_> {
    fn realize(&self, observers: &Observers, cached_prompt_tokens: u32) {
        self.decode.realize(
            observers,
            self.prompt_blocks,
            cached_prompt_tokens,
            !self.disaggregated,
        );
    }
}

impl Driver<'_> {
    /// [`Step::Generate`]: the attempt generates in `mode`; its end decides what follows.
    pub(super) async fn generate(&mut self, mode: Mode) -> Step {
        let Some(mut attempt) = self.attempt.take() else {
            return self
                .serving
                .ended(AttemptEnd::worker_failed("no attempt was routed"));
        };
        let request = &self.job.request_id;
        let worker = attempt.decode.worker_id.clone();
        if attempt.placement {
            let outcome = match mode {
                Mode::Disaggregated { .. } => "pulled",
                Mode::Aggregated { .. } => "recomputed",
            };
            self.observers
                .metrics
                .placements
                .get_or_create(&crate::observe::metrics::PlacementLabels { outcome })
                .inc();
        }
        match &mode {
            Mode::Aggregated { why, .. } => {
                attempt.decode.record_served(ServedAs::Aggregated, None);
                super::decided(&mut attempt.route_span, "aggregated", why, None);
                tracing::debug!(%request, %worker, %why, "aggregated");
            }
            Mode::Disaggregated { prefill } => {
                let pipelined = attempt.source.source.as_ref().is_some_and(|s| s.pipelined);
                tracing::debug!(%request, %prefill, decode = %worker, pipelined, "disaggregated");
            }
        }
        attempt.route_span = None;
        let end = self.stream(attempt).await;
        match &end {
            AttemptEnd::Done => self.end_outcome(OutcomeStatus::Completed, None),
            AttemptEnd::ConsumerGone => self.end_outcome(
                OutcomeStatus::Cancelled,
                Some(
                    "the answer stopped being read (client gone, or a stop string matched)".into(),
                ),
            ),
            _ => {}
        }
        self.serving.ended(end)
    }

    /// Streams the attempt's generation; its bookings end with it.
    async fn stream(&mut self, attempt: Attempt) -> AttemptEnd {
        let job = self.job;
        let Attempt {
            number,
            kind,
            request,
            context,
            decode,
            source:
                KvSource {
                    source: kv_source,
                    prefill_worker,
                    running,
                },
            placement,
            ..
        } = attempt;
        let disaggregated = kv_source.is_some();
        let mode = match (disaggregated, placement) {
            (true, true) => "placement",
            (true, false) => "disaggregated",
            (false, _) => "aggregated",
        };
        decode.audit.update(|o| {
            o.mode = Some(mode);
            o.prefill_worker = prefill_worker.as_ref().map(ToString::to_string);
            o.retention = Some(job.retention.hint()).filter(switchyard_core::Retention::is_some);
        });
        let span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "decode",
            otel.kind = "client",
            attempt = i64::from(number),
            attempt.kind = kind.as_str(),
            worker = decode.worker_id.as_str(),
            mode,
            prefill_worker = prefill_worker.as_ref().map(WorkerId::as_str),
            cached_prompt_tokens = Empty,
            completion_tokens = Empty,
            finish_reason = Empty,
        );
        let mut unfinished = UnfinishedAttempt {
            span: span.clone(),
            deadline: job.deadline,
            armed: true,
        };
        let generated_before = self.serving.generated().len();
        let mut call = tonic::Request::new(GenerateRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: context,
            sampling: Some(SamplingParams::from(&self.serving.sampling(&job.sampling))),
            kv_source,
            identity: switchyard_proto::identity_to_proto(&job.identity),
            retention: switchyard_proto::retention_to_proto(&job.retention.hint()),
            priority: job.priority,
        });
        switchyard_telemetry::inject_context(&span, call.metadata_mut());
        let mut relay = Relay {
            decode,
            running,
            prompt_blocks: &request.block_hashes,
            disaggregated,
            span: &span,
            first_message: true,
            cached_seen: 0,
            realize_pending: false,
        };
        let end = self.relay(&mut relay, call).await;
        // Releases the decode worker's booking (and a pipelined prefill's, if it never
        // finished).
        drop(relay);
        span.record(
            "completion_tokens",
            (self.serving.generated().len() - generated_before) as i64,
        );
        match &end {
            AttemptEnd::Done => {}
            AttemptEnd::ConsumerGone => {
                span.record("finish_reason", "cancelled");
            }
            AttemptEnd::WorkerFailed { reason, .. } => record_error(&span, reason.as_str()),
            AttemptEnd::Refused(err) => record_error(&span, err.message()),
        }
        unfinished.armed = false;
        end
    }

    /// Opens the worker's stream and relays its messages until the attempt ends. The attempt
    /// gives up on its worker the moment the worker is found unresponsive (its load reports
    /// stopped): a frozen worker holds its stream open without a word. A worker routed to while
    /// already unresponsive (none of the model answered) gets its chance.
    async fn relay(
        &mut self,
        relay: &mut Relay<'_>,
        call: tonic::Request<GenerateRequest>,
    ) -> AttemptEnd {
        let metrics = &self.observers.metrics;
        let worker = Arc::clone(&relay.decode.worker);
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
                Liveness::Unresponsive { reason, .. } => {
                    format!("worker stopped answering: {reason}")
                }
                Liveness::Answering => "worker stopped answering".to_owned(),
            }
        };
        tokio::pin!(stopped_answering);
        let opened = tokio::select! {
            opened = self.transport.generate(&worker.id(), call) => opened,
            reason = &mut stopped_answering => {
                metrics.unresponsive_cuts.inc();
                Err(tonic::Status::unavailable(reason))
            }
        };
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(status) => return failed(metrics, &worker, status),
        };
        loop {
            let message = tokio::select! {
                message = stream.next() => message,
                reason = &mut stopped_answering => {
                    metrics.unresponsive_cuts.inc();
                    return AttemptEnd::worker_failed(reason);
                }
            };
            let message = match message {
                None => return AttemptEnd::worker_failed("worker closed the stream early"),
                Some(Err(status)) => return failed(metrics, &worker, status),
                Some(Ok(message)) => message,
            };
            if let ControlFlow::Break(end) = self.on_message(relay, message).await {
                return end;
            }
        }
    }

    /// One message of the worker's stream: progress to the load view and the audit, events to
    /// the consumer, tokens to the machine.
    async fn on_message(
        &mut self,
        relay: &mut Relay<'_>,
        message: v1::GenerateResponse,
    ) -> ControlFlow<AttemptEnd> {
        let (observers, job, tx) = (self.observers, self.job, self.tx);
        if let Some(mut prefill) = relay.running.take() {
            // The decode worker's first token ends the pipelined prefill.
            prefill.prefill_done();
        }
        relay.decode.prefill_done();
        let cached_grew = message.cached_prompt_tokens > relay.cached_seen;
        relay.cached_seen = relay.cached_seen.max(message.cached_prompt_tokens);
        if relay.first_message || (relay.realize_pending && relay.cached_seen > 0) {
            relay.realize_pending = relay.first_message && relay.cached_seen == 0;
            relay.first_message = false;
            if !relay.realize_pending {
                relay.realize(observers, relay.cached_seen);
            }
        }
        let gone = ControlFlow::Break(AttemptEnd::ConsumerGone);
        if self.serving.started()
            && cached_grew
            && tx
                .send(DispatchEvent::Cached(relay.cached_seen))
                .await
                .is_err()
        {
            return gone;
        }
        if self.serving.mark_started() {
            relay.span.record(
                "cached_prompt_tokens",
                i64::from(message.cached_prompt_tokens),
            );
            let event = DispatchEvent::Started {
                worker: relay.decode.worker_id.clone(),
                prompt_tokens: job.prompt.len() as u32,
                cached_prompt_tokens: message.cached_prompt_tokens,
            };
            if tx.send(event).await.is_err() {
                return gone;
            }
        }
        if !message.token_ids.is_empty() {
            let logprobs = match logprobs_of(&job.sampling, &message) {
                Ok(logprobs) => logprobs,
                Err(reason) => return ControlFlow::Break(AttemptEnd::worker_failed(reason)),
            };
            self.serving.tokens(&message.token_ids);
            let event = DispatchEvent::Tokens {
                ids: message.token_ids,
                logprobs,
            };
            if tx.send(event).await.is_err() {
                return gone;
            }
        }
        let finish = match v1::FinishReason::try_from(message.finish_reason) {
            Ok(v1::FinishReason::Length) => Finish::Length,
            Ok(v1::FinishReason::Stop) => Finish::Stop,
            Ok(v1::FinishReason::Aborted) => {
                return ControlFlow::Break(AttemptEnd::worker_failed("worker aborted the request"));
            }
            _ => return ControlFlow::Continue(()),
        };
        if relay.realize_pending {
            // The engine never reported a cached token: its hit was 0.
            relay.realize(observers, 0);
        }
        relay.span.record(
            "finish_reason",
            match finish {
                Finish::Length => "length",
                Finish::Stop => "stop",
            },
        );
        let _ = tx.send(DispatchEvent::Finished(finish)).await;
        ControlFlow::Break(AttemptEnd::Done)
    }
}

/// A failed call to `worker`: a transport failure marks the worker failed; the status decides
/// the attempt's end.
fn failed(metrics: &Metrics, worker: &Arc<WorkerHandle>, status: tonic::Status) -> AttemptEnd {
    if is_transport_failure(&status) {
        worker.mark_failed(
            metrics,
            format!("a request to it failed: {}", status.message()),
        );
    }
    classify(status)
}

/// A message's log probabilities: one per token when the request asked for them (a worker that
/// sends another count failed the request), none otherwise.
pub(super) fn logprobs_of(
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
