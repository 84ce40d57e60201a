//! [`Step::Prefill`](switchyard_router::serve::Step::Prefill) carried out: the Prefill call on
//! the booked prefill worker through the pool's transport, with a timeout, its span, metric and
//! realized hit; a failure undoes the prefill booking (the decode worker computes its prompt
//! again until another prefill worker is booked) and goes back to the machine.

use switchyard_core::{BlockHash, WorkerId};
use switchyard_proto::ErrorCode;
use switchyard_proto::v1::{self, PrefillRequest};
use switchyard_router::serve::{PrefillFailure, Step};
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tracing::Instrument;
use tracing::field::Empty;

use super::{Driver, KvSource, decided};
use crate::serving::disagg::KvTransfer;
use crate::serving::routing::RoutedRequest;

/// A prefill that gave a KV source.
struct Prefilled {
    source: v1::KvSource,
    /// A pipelined prefill still running on its worker: its place in that worker's prefill
    /// queue stays booked until the decode worker's first token says it finished.
    running: Option<Box<RoutedRequest>>,
}

impl Driver<'_> {
    /// [`Step::Prefill`]: runs the attempt's booked prefill on `worker`.
    pub(super) async fn prefill(&mut self, worker: &WorkerId, try_number: u32, why: &str) -> Step {
        let Some(mut attempt) = self.attempt.take() else {
            return self
                .serving
                .prefilled(Err(PrefillFailure::Failed("no attempt was routed".into())));
        };
        let mode = if attempt.placement {
            "placement"
        } else {
            "disaggregated"
        };
        decided(&mut attempt.route_span, mode, why, Some(worker.as_str()));
        let Some(prefill) = attempt.prefill.take() else {
            self.attempt = Some(attempt);
            return self.serving.prefilled(Err(PrefillFailure::Failed(format!(
                "no prefill was booked on {worker}"
            ))));
        };
        let ran = self
            .run_prefill(
                prefill,
                &attempt.context,
                &attempt.request.block_hashes,
                try_number,
                attempt.placement,
            )
            .await;
        let result = match ran {
            Ok(Prefilled { source, running }) => {
                attempt.source = KvSource {
                    source: Some(source),
                    prefill_worker: Some(worker.clone()),
                    running,
                };
                Ok(())
            }
            Err((prefill, failure)) => {
                prefill.prefill_failed(&mut attempt.decode);
                if let PrefillFailure::Failed(failure) = &failure {
                    tracing::warn!(request = %self.job.request_id, %failure, "prefill failed; trying another prefill worker");
                    self.observers.metrics.retries.inc();
                }
                Err(failure)
            }
        };
        self.attempt = Some(attempt);
        self.serving.prefilled(result)
    }

    /// Runs Prefill on the routed prefill worker through the pool's transport. On success, the
    /// KV source to generate with; on failure the route back (so the caller can undo its
    /// booking) and what went wrong.
    async fn run_prefill(
        &self,
        prefill: RoutedRequest,
        prompt: &[switchyard_core::TokenId],
        prompt_blocks: &[BlockHash],
        try_number: u32,
        placement: bool,
    ) -> Result<Prefilled, (RoutedRequest, PrefillFailure)> {
        let job = self.job;
        let settings = &job.disagg;
        let worker = prefill.worker_id.clone();
        let prefill_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &job.span,
            "prefill",
            otel.kind = "client",
            prefill_attempt = i64::from(try_number),
            worker = worker.as_str(),
            prompt_tokens = prompt.len() as i64,
            overlap_blocks = i64::from(prefill.cached_blocks),
            cached_prompt_tokens = Empty,
        );
        let mut call = tonic::Request::new(PrefillRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: prompt.to_vec(),
            hold_ms: 0,
            // A worker that cannot pipeline answers when done (response.pipelined = false).
            pipelined: settings.kv_transfer == KvTransfer::Pipelined,
            identity: switchyard_proto::identity_to_proto(&job.identity),
            retention: switchyard_proto::retention_to_proto(&job.retention.hint()),
            // A context phase (TensorRT-LLM) samples the first token the decode continues from.
            sampling: Some(v1::SamplingParams::from(&job.sampling)),
            priority: job.priority,
        });
        switchyard_telemetry::inject_context(&prefill_span, call.metadata_mut());
        let answer = tokio::time::timeout(
            settings.prefill_timeout,
            self.transport.prefill(&prefill.worker.id(), call),
        )
        .instrument(prefill_span.clone())
        .await;
        let failure = match answer {
            Ok(Ok(response)) => {
                let prefilled = self.accepted(prefill, response, prompt_blocks, &prefill_span);
                if !placement {
                    self.observers
                        .metrics
                        .disagg_prefills
                        .get_or_create(&crate::observe::metrics::KvTransferLabels {
                            kv_transfer: if prefilled.source.pipelined {
                                "pipelined"
                            } else {
                                "after-prefill"
                            },
                        })
                        .inc();
                }
                return Ok(prefilled);
            }
            Ok(Err(status)) if ErrorCode::of(&status) == ErrorCode::InvalidRequest => {
                record_error(&prefill_span, status.message());
                PrefillFailure::Refused(status.message().to_owned())
            }
            Ok(Err(status)) => {
                let failure = format!("{worker}: {:?}: {}", status.code(), status.message());
                record_error(&prefill_span, failure.as_str());
                PrefillFailure::Failed(failure)
            }
            Err(_) => {
                let failure = format!("{worker}: no answer within {:?}", settings.prefill_timeout);
                record_error(&prefill_span, failure.as_str());
                PrefillFailure::Failed(failure)
            }
        };
        let detail = match &failure {
            PrefillFailure::Refused(message) => format!("refused the prompt: {message}"),
            PrefillFailure::Failed(message) => message.clone(),
        };
        self.observers.decisions.end(
            &prefill.audit,
            crate::observe::audit::OutcomeStatus::Failed,
            Some(detail),
        );
        Err((prefill, failure))
    }

    /// The prefill worker answered: its KV source, counted, and its realized hit when final.
    fn accepted(
        &self,
        mut prefill: RoutedRequest,
        response: v1::PrefillResponse,
        prompt_blocks: &[BlockHash],
        span: &tracing::Span,
    ) -> Prefilled {
        let observers = self.observers;
        span.record(
            "cached_prompt_tokens",
            i64::from(response.cached_prompt_tokens),
        );
        // A pipelined answer's counts are not final: only a finished prefill's hit is compared.
        if !response.pipelined {
            prefill.realize(
                observers,
                prompt_blocks,
                response.cached_prompt_tokens,
                true,
            );
        }
        let source = v1::KvSource {
            address: prefill.worker.info().address,
            handle: response.handle,
            first_token_id: response.first_token_id,
            cached_prompt_tokens: response.cached_prompt_tokens,
            engine_transfer_params: response.engine_transfer_params,
            pipelined: response.pipelined,
            worker_id: prefill.worker_id.to_string(),
        };
        let running = if response.pipelined {
            Some(Box::new(prefill))
        } else {
            prefill.prefill_done();
            None
        };
        Prefilled { source, running }
    }
}
