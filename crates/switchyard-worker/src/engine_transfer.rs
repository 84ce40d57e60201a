//! The decode side of disaggregated serving when the engines move the KV themselves (vLLM's
//! KV connectors, SGLang's bootstrap): the `KvSource` carries the prefill engine's transfer
//! parameters, which go to this worker's engine with the request (see
//! [`crate::engine::pd`]); nothing is pulled over `PullKv`.
//!
//! The engine generates the whole completion, its first token included, so its stream is passed
//! through as it is (no token is added, none is counted twice). Only the cached prompt tokens are
//! taken from the prefill: the decode engine counts the KV it received as cached, which is not
//! what the client asked about (prompt tokens the prefill found in its prefix cache).
//!
//! An engine that aborts the request, or reports that it failed it (TensorRT-LLM's error event
//! when its cache transceiver could not fetch the KV), before its first token most likely never
//! got the KV (the prefill engine died after its worker answered, an SGLang room nobody filled,
//! a context request the context server no longer holds): that is reported as a failed pull ([`EngineError::KvSource`], as the simulator's pull failures are),
//! so the gateway blames the prefill worker and keeps this decode worker eligible for the retry.

use std::sync::Arc;

use futures::StreamExt;
use serde_json::Value;
use switchyard_proto::{ErrorCode, v1};
use tonic::Status;

use crate::engine::{Engine, EngineError, FinishReason, GenerateParams, GenerationChunk};
use crate::kv_source::ChunkStream;
use crate::metrics::{PullFailure, WorkerMetrics};

/// Generates from `source`'s engine transfer parameters. A source without them (a simulator
/// prefill worker's handle) cannot feed an engine that moves KV itself: refused before anything
/// is pulled, as `FAILED_PRECONDITION`, so the gateway tries another pairing.
pub(crate) async fn generate(
    engine: &dyn Engine,
    params: GenerateParams,
    source: v1::KvSource,
    metrics: &Arc<WorkerMetrics>,
) -> Result<ChunkStream, Status> {
    let kind = engine.spec().kind;
    if source.engine_transfer_params.is_empty() {
        return Err(ErrorCode::WrongWorker.status(format!(
            "this worker's {kind} engine fetches KV itself and needs the prefill engine's transfer \
             parameters; the kv_source has none (a prefill worker of another engine kind?)"
        )));
    }
    let transfer = match serde_json::from_str::<Value>(&source.engine_transfer_params) {
        Ok(Value::Object(fields)) => fields,
        Ok(_) | Err(_) => {
            return Err(ErrorCode::InvalidRequest
                .status("kv_source.engine_transfer_params is not a JSON object"));
        }
    };
    let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
    let cached = source.cached_prompt_tokens.min(prompt_tokens);
    metrics.pull_received();
    let transferring = engine.engine_transfer().ok_or(EngineError::Unsupported(
        "this engine cannot take engine transfer parameters (they come from a vllm or sglang prefill worker)",
    ))?;
    let stream = transferring
        .generate_with_transfer(params, transfer)
        .await?;
    let metrics = Arc::clone(metrics);
    let mut started = false;
    Ok(Box::pin(stream.map(move |item| {
        let item = match item {
            Ok(chunk)
                if !started
                    && chunk.tokens.is_empty()
                    && chunk.finish == Some(FinishReason::Aborted) =>
            {
                metrics.pull_failed(PullFailure::EngineTransfer);
                Err(EngineError::KvSource(format!(
                    "pulling kv through the {kind} engine's own transfer failed: the engine \
                     aborted the request before its first token"
                )))
            }
            Err(EngineError::Failed(why)) if !started => {
                metrics.pull_failed(PullFailure::EngineTransfer);
                Err(EngineError::KvSource(format!(
                    "pulling kv through the {kind} engine's own transfer failed: the engine \
                     failed the request before its first token ({why})"
                )))
            }
            other => other,
        };
        started |= item.as_ref().is_ok_and(|c| !c.tokens.is_empty());
        item.map(|chunk| GenerationChunk {
            cached_prompt_tokens: cached,
            ..chunk
        })
    })))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::Map;
    use switchyard_core::{BlockSize, EngineKind, LoadStats, WorkerId};
    use tokio::sync::mpsc;

    use super::*;
    use crate::engine::{
        DropGuard, EngineError, EngineSpec, EngineTransfer, FinishReason, GenerationStream,
        PrefillOutcome, PrefillParams,
    };
    use crate::event_log::EventLog;

    /// An engine that answers every transfer generation with two chunks, counting the whole
    /// prompt as cached the way a decode engine that received the KV does.
    #[derive(Debug)]
    struct Receiving {
        spec: EngineSpec,
        events: Arc<EventLog>,
        given: Mutex<Vec<Map<String, Value>>>,
        /// Abort every request before its first token, as after a failed transfer.
        abort: bool,
        /// Report a failure after this many tokens, as TensorRT-LLM reports one in its stream.
        fail_after: Option<usize>,
    }

    impl Receiving {
        fn new() -> Self {
            Self {
                spec: EngineSpec {
                    kind: EngineKind::Vllm,
                    block_size: BlockSize::new(4).unwrap(),
                    kv_capacity_blocks: 8,
                    max_context_tokens: 64,
                    kv_bytes_per_token: 1,
                },
                events: Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 8)),
                given: Mutex::new(Vec::new()),
                abort: false,
                fail_after: None,
            }
        }
    }

    #[async_trait::async_trait]
    impl EngineTransfer for Receiving {
        async fn generate_with_transfer(
            &self,
            params: GenerateParams,
            transfer: Map<String, Value>,
        ) -> Result<GenerationStream, EngineError> {
            self.given.lock().unwrap().push(transfer);
            let prompt_tokens = params.prompt.len() as u32;
            let chunk = |tokens: Vec<u32>, finish, completion_tokens| GenerationChunk {
                tokens,
                logprobs: Vec::new(),
                finish,
                prompt_tokens,
                cached_prompt_tokens: prompt_tokens,
                completion_tokens,
            };
            let (tx, rx) = mpsc::unbounded_channel();
            if self.abort {
                tx.send(Ok(chunk(Vec::new(), Some(FinishReason::Aborted), 0)))
                    .unwrap();
                return Ok(GenerationStream::new(rx, DropGuard::new(|| {})));
            }
            if let Some(after) = self.fail_after {
                for n in 0..after {
                    tx.send(Ok(chunk(vec![7], None, n as u32 + 1))).unwrap();
                }
                tx.send(Err(EngineError::Failed("kv cache transfer failed".into())))
                    .unwrap();
                return Ok(GenerationStream::new(rx, DropGuard::new(|| {})));
            }
            tx.send(Ok(chunk(vec![7], None, 1))).unwrap();
            tx.send(Ok(chunk(vec![8], Some(FinishReason::Length), 2)))
                .unwrap();
            Ok(GenerationStream::new(rx, DropGuard::new(|| {})))
        }
    }

    #[async_trait::async_trait]
    impl Engine for Receiving {
        fn spec(&self) -> &EngineSpec {
            &self.spec
        }
        async fn generate(&self, _: GenerateParams) -> Result<GenerationStream, EngineError> {
            Err(EngineError::Unsupported("not in this test"))
        }
        async fn prefill(&self, _: PrefillParams) -> Result<PrefillOutcome, EngineError> {
            Err(EngineError::Unsupported("not in this test"))
        }
        fn engine_transfer(&self) -> Option<&dyn EngineTransfer> {
            Some(self)
        }
        fn load(&self) -> LoadStats {
            LoadStats::default()
        }
        fn events(&self) -> &Arc<EventLog> {
            &self.events
        }
        fn shutdown(&self) {}
    }

    fn metrics() -> Arc<WorkerMetrics> {
        let engine: Arc<dyn Engine> = Arc::new(Receiving::new());
        Arc::new(WorkerMetrics::new(
            "w",
            engine,
            crate::state::WorkerState::new(switchyard_core::Role::Both),
        ))
    }

    fn failures(metrics: &WorkerMetrics) -> f64 {
        crate::metrics::sample(
            &metrics.encode(),
            "switchyard_worker_kv_pull_failures_total",
            &[("reason", "engine_transfer")],
        )
        .unwrap()
    }

    fn params() -> GenerateParams {
        GenerateParams {
            request_id: "r".into(),
            prompt: (1..=10).collect(),
            sampling: switchyard_core::Sampling {
                max_tokens: 2,
                temperature: Some(0.0),
                ignore_eos: true,
                ..switchyard_core::Sampling::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        }
    }

    fn source(params: &str, cached: u32) -> v1::KvSource {
        v1::KvSource {
            address: "prefill:1".into(),
            cached_prompt_tokens: cached,
            first_token_id: 7,
            engine_transfer_params: params.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_engine_stream_passes_through_with_the_prefills_cached_count() {
        let engine = Receiving::new();
        let metrics = metrics();
        let stream = generate(
            &engine,
            params(),
            source(r#"{"remote_block_ids":[3]}"#, 4),
            &metrics,
        )
        .await
        .unwrap();
        let chunks: Vec<GenerationChunk> = stream.map(Result::unwrap).collect().await;
        // Nothing added: the first token is the engine's, counted once.
        let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.clone()).collect();
        assert_eq!(tokens, vec![7, 8]);
        assert_eq!(chunks.last().unwrap().completion_tokens, 2);
        assert!(chunks.iter().all(|c| c.cached_prompt_tokens == 4));
        assert_eq!(
            engine.given.lock().unwrap()[0]["remote_block_ids"],
            serde_json::json!([3])
        );
        assert_eq!(failures(&metrics), 0.0);
    }

    #[tokio::test]
    async fn sources_without_usable_parameters_are_refused_before_the_engine() {
        let engine = Receiving::new();
        let metrics = metrics();
        let code = |r: Result<ChunkStream, Status>| r.err().map(|s| s.code());
        assert_eq!(
            code(generate(&engine, params(), source("", 0), &metrics).await),
            Some(tonic::Code::FailedPrecondition)
        );
        assert_eq!(
            code(generate(&engine, params(), source("[1,2]", 0), &metrics).await),
            Some(tonic::Code::InvalidArgument)
        );
        assert_eq!(
            code(generate(&engine, params(), source("{not json", 0), &metrics).await),
            Some(tonic::Code::InvalidArgument)
        );
        assert!(engine.given.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_abort_before_the_first_token_is_a_failed_pull() {
        let engine = Receiving {
            abort: true,
            ..Receiving::new()
        };
        let metrics = metrics();
        let stream = generate(&engine, params(), source("{}", 0), &metrics)
            .await
            .unwrap();
        let items: Vec<_> = stream.collect().await;
        assert_eq!(failures(&metrics), 1.0);
        let status = Status::from(items[0].clone().unwrap_err());
        assert_eq!(status.code(), tonic::Code::Unavailable);
        // The gateway's dispatch tells a failed pull by this mark and blames the prefill.
        assert_eq!(
            switchyard_proto::fault::fault_of(&status),
            Some(switchyard_proto::fault::Fault::KvSource),
            "{status:?}"
        );
        assert!(status.message().contains("pulling kv"), "{status:?}");
    }

    #[tokio::test]
    async fn an_engine_reported_failure_before_the_first_token_is_a_failed_pull() {
        let engine = Receiving {
            fail_after: Some(0),
            ..Receiving::new()
        };
        let first = metrics();
        let stream = generate(&engine, params(), source("{}", 0), &first)
            .await
            .unwrap();
        let items: Vec<_> = stream.collect().await;
        assert_eq!(failures(&first), 1.0);
        let status = Status::from(items[0].clone().unwrap_err());
        assert_eq!(
            switchyard_proto::fault::fault_of(&status),
            Some(switchyard_proto::fault::Fault::KvSource),
            "{status:?}"
        );
        assert!(
            status.message().contains("kv cache transfer failed"),
            "{status:?}"
        );

        // After a token the KV had arrived: a later failure is the decode engine's own.
        let engine = Receiving {
            fail_after: Some(1),
            ..Receiving::new()
        };
        let later = metrics();
        let stream = generate(&engine, params(), source("{}", 0), &later)
            .await
            .unwrap();
        let items: Vec<_> = stream.collect().await;
        assert_eq!(items[0].as_ref().unwrap().tokens, vec![7]);
        let status = Status::from(items[1].clone().unwrap_err());
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(switchyard_proto::fault::fault_of(&status), None);
        assert_eq!(failures(&later), 0.0);
    }

    #[tokio::test]
    async fn an_engine_failure_that_is_not_a_missing_transfer_stays_unmarked() {
        // An engine that cannot be reached at all is this worker's problem, whatever its
        // message says: the gateway must not keep retrying this decode worker for it.
        let status = Status::from(EngineError::Unavailable(
            "pulling kv is what we were doing when the engine went away".into(),
        ));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(switchyard_proto::fault::fault_of(&status), None);
    }
}
