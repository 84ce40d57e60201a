//! The gRPC `switchyard.v1.Worker` service over an [`Engine`].
//!
//! Validates requests (bad input is `INVALID_ARGUMENT` with a sentence, never a panic), enforces
//! role and drain state, counts requests in flight, and turns engine streams into gRPC streams.
//! Dropping a response stream (the caller went away) drops the engine stream, which aborts the
//! request in the engine. Each call is counted in the worker's metrics when it ends; the
//! response streams themselves live in [`streams`].

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt, stream};
use switchyard_core::WorkerInfo;
use switchyard_proto::convert::{load_to_wire, role_from_wire, worker_info_to_wire};
use switchyard_proto::{ErrorCode, v1};
use switchyard_telemetry::{WORKER_SPANS, extract_parent, record_error};
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::{Engine, EngineError, FinishReason, GenerateParams, PrefillParams};
use crate::event_log::SubscriptionStart;
use crate::kv_source::{ChunkStream, generate_from_source};
use crate::metrics::{EventSink, RequestKind, RequestRecord, WorkerMetrics};

pub mod access;
mod load_pacer;
pub mod plane;
mod streams;

pub use access::Access;
use access::Call;

use crate::state::{InFlightGuard, WorkerState, worker_load};
use load_pacer::{Due, LoadPacer};
use streams::{
    DigestIdentity, EventStreamState, PullSent, PullState, digest_timer, start_messages,
    stream_generate,
};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Tunables of the service.
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    /// How long prefilled blocks are held when the caller does not say.
    pub default_hold: Duration,
    /// Longest hold a caller may ask for.
    pub max_hold: Duration,
    pub default_blocks_per_chunk: u32,
    pub default_load_interval: Duration,
    /// Longest a decode worker waits for a prefill worker's `PullKv` (disaggregated serving)
    /// before failing the request as unavailable, so a dead prefill worker cannot hang it.
    pub kv_pull_timeout: Duration,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        Self {
            default_hold: Duration::from_secs(30),
            max_hold: Duration::from_secs(600),
            default_blocks_per_chunk: 32,
            default_load_interval: Duration::from_millis(200),
            kv_pull_timeout: Duration::from_secs(30),
        }
    }
}

/// Most KV events a consumer may ask for in one message (`KvEventsRequest.max_batch_events`).
pub const MAX_BATCH_EVENTS: u32 = 1024;

/// The Worker service implementation.
#[derive(Debug, Clone)]
pub struct WorkerService {
    info: WorkerInfo,
    /// The LoRA adapters the engine serves now (`info.adapters` when the worker started).
    adapters: tokio::sync::watch::Receiver<Vec<String>>,
    engine: Arc<dyn Engine>,
    state: WorkerState,
    metrics: Arc<WorkerMetrics>,
    limits: ServiceLimits,
    access: Access,
}

impl WorkerService {
    pub fn new(
        info: WorkerInfo,
        adapters: tokio::sync::watch::Receiver<Vec<String>>,
        engine: Arc<dyn Engine>,
        state: WorkerState,
        metrics: Arc<WorkerMetrics>,
        limits: ServiceLimits,
        access: Access,
    ) -> Self {
        Self {
            info,
            adapters,
            engine,
            state,
            metrics,
            limits,
            access,
        }
    }

    pub fn into_server(self) -> v1::worker_server::WorkerServer<Self> {
        v1::worker_server::WorkerServer::new(self)
    }

    fn check_accepting(&self) -> Result<(), Status> {
        if self.state.is_draining() {
            return Err(ErrorCode::Unavailable.status(format!(
                "worker {} is draining and takes no new requests",
                self.info.id
            )));
        }
        Ok(())
    }

    fn check_prompt(&self, prompt: &[u32], max_tokens: u32) -> Result<(), Status> {
        if prompt.is_empty() {
            return Err(ErrorCode::InvalidRequest.status("prompt is empty"));
        }
        let context = self.engine.spec().max_context_tokens;
        let needed = prompt.len() as u64 + u64::from(max_tokens);
        if needed > context {
            return Err(ErrorCode::InvalidRequest.status(format!(
                "prompt of {} tokens plus max_tokens {max_tokens} exceeds the worker's context of {context} tokens",
                prompt.len()
            )));
        }
        Ok(())
    }

    /// A request's retention hint, checked and counted: passed to an engine that honours it,
    /// unhonoured (and dropped) otherwise.
    fn retention(
        &self,
        hint: Option<v1::RetentionHint>,
    ) -> Result<switchyard_core::Retention, Status> {
        let retention = switchyard_proto::retention_from_proto(hint)
            .map_err(|e| ErrorCode::InvalidRequest.status(e.to_string()))?;
        if !retention.is_some() {
            return Ok(retention);
        }
        let honoured = self.engine.honours_retention();
        self.metrics.retention_hint(honoured);
        Ok(if honoured {
            retention
        } else {
            switchyard_core::Retention::default()
        })
    }

    /// A request's scheduling priority, counted: passed to an engine that schedules by it,
    /// unhonoured (and dropped) otherwise. The default (0, or none) is not counted, and an
    /// engine that does not schedule by priority is never sent one (vLLM refuses a non-zero
    /// priority unless started with `--scheduling-policy priority`).
    fn priority(&self, priority: Option<i32>) -> Option<i32> {
        let schedules = self.engine.schedules_by_priority();
        if priority.is_some_and(|p| p != 0) {
            self.metrics.request_priority(schedules);
        }
        priority.filter(|_| schedules)
    }

    /// `Generate` inside its `generate` span, which the returned stream holds until it ends.
    async fn start_generate(
        &self,
        req: v1::GenerateRequest,
        span: tracing::Span,
        record: RequestRecord,
    ) -> Result<Response<BoxStream<v1::GenerateResponse>>, Status> {
        match self.open_generate(req, &span).await {
            Ok((engine_stream, in_flight)) => Ok(Response::new(stream_generate(
                engine_stream,
                in_flight,
                span,
                record,
            ))),
            Err(status) => {
                record.finish(status.code());
                Err(status)
            }
        }
    }

    /// Checks a `Generate` and starts it in the engine (after pulling its KV, if it has a
    /// source).
    async fn open_generate(
        &self,
        req: v1::GenerateRequest,
        span: &tracing::Span,
    ) -> Result<(ChunkStream, InFlightGuard), Status> {
        span.record("request_id", req.request_id.as_str());
        span.record("prompt_tokens", req.prompt_token_ids.len() as i64);
        span.record("disaggregated", req.kv_source.is_some());
        let sampling = switchyard_core::Sampling::try_from(req.sampling.unwrap_or_default())
            .map_err(|e| ErrorCode::InvalidRequest.status(e.to_string()))?;
        self.check_prompt(&req.prompt_token_ids, sampling.max_tokens)?;
        let identity = switchyard_proto::identity_from_proto(req.identity)
            .map_err(|e| ErrorCode::InvalidRequest.status(e.to_string()))?;
        self.check_adapter(&identity)?;
        if !self.state.role().serves_decode() {
            return Err(ErrorCode::WrongWorker.status(format!(
                "worker {} has role prefill and does not generate; send Prefill",
                self.info.id
            )));
        }
        self.check_accepting()?;
        // Counted only for a request the worker takes.
        let retention = self.retention(req.retention)?;
        let priority = self.priority(req.priority);
        let in_flight = self.state.begin_request();
        if req.kv_source.is_none() {
            self.queue_prefill(&in_flight, &req.prompt_token_ids, &identity);
        }
        let params = GenerateParams {
            request_id: req.request_id,
            prompt: req.prompt_token_ids,
            sampling,
            identity,
            retention,
            priority,
        };
        let engine_stream: ChunkStream = match req.kv_source {
            // The first token comes from the prefill worker, which computes no log
            // probabilities: the gateway serves such requests aggregated.
            Some(_) if params.sampling.logprobs.is_some() => {
                return Err(ErrorCode::InvalidRequest.status(
                    "log probabilities are served aggregated, not from a prefill worker's KV",
                ));
            }
            Some(source) => {
                if !source.address.is_empty() {
                    self.access
                        .check_kv_source(&source.address, &source.worker_id)
                        .await?;
                }
                generate_from_source(
                    &*self.engine,
                    params,
                    source,
                    self.limits.kv_pull_timeout,
                    &self.metrics,
                    &self.access.dialer,
                )
                .await?
            }
            None => Box::pin(self.engine.generate(params).await?),
        };
        // The engine holds the request now: a report pushed from here shows it.
        self.state.load_changed();
        Ok((engine_stream, in_flight))
    }

    /// Counts the prompt tokens `guard`'s request has to prefill here, where the engine does
    /// not count them itself ([`Engine::reports_queued_prefill`]): the prompt past the leading
    /// blocks the engine's KV events say it holds, in any tier.
    fn queue_prefill(
        &self,
        guard: &InFlightGuard,
        prompt: &[u32],
        identity: &switchyard_core::KvIdentity,
    ) {
        if self.engine.reports_queued_prefill() {
            return;
        }
        let block = self.engine.spec().block_size;
        let held = self
            .engine
            .events()
            .leading_held(&identity.block_hashes(prompt, block));
        let cached = held.saturating_mul(block.as_usize()).min(prompt.len());
        guard.queue_prefill((prompt.len() - cached) as u64);
    }

    /// Refuses a request under a LoRA adapter this worker's engine does not serve (the gateway
    /// sends such requests only to workers that registered the adapter).
    fn check_adapter(&self, identity: &switchyard_core::KvIdentity) -> Result<(), Status> {
        let Some(adapter) = &identity.adapter else {
            return Ok(());
        };
        let served = self.adapters.borrow();
        if served.contains(adapter) {
            return Ok(());
        }
        Err(ErrorCode::WrongWorker.status(format!(
            "worker {} does not serve LoRA adapter {adapter:?} (it serves {})",
            self.info.id,
            if served.is_empty() {
                "none".to_owned()
            } else {
                served.join(", ")
            }
        )))
    }

    /// `Prefill` inside its `prefill` span.
    async fn run_prefill(
        &self,
        req: v1::PrefillRequest,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let span = tracing::Span::current();
        span.record("request_id", req.request_id.as_str());
        span.record("prompt_tokens", req.prompt_token_ids.len() as i64);
        self.check_prompt(&req.prompt_token_ids, 1)?;
        let identity = switchyard_proto::identity_from_proto(req.identity)
            .map_err(|e| ErrorCode::InvalidRequest.status(e.to_string()))?;
        self.check_adapter(&identity)?;
        let sampling = req
            .sampling
            .map(switchyard_core::Sampling::try_from)
            .transpose()
            .map_err(|e| ErrorCode::InvalidRequest.status(e.to_string()))?;
        if !self.state.role().serves_prefill() {
            return Err(ErrorCode::WrongWorker.status(format!(
                "worker {} has role decode and does not prefill",
                self.info.id
            )));
        }
        self.check_accepting()?;
        // Counted only for a request the worker takes.
        let retention = self.retention(req.retention)?;
        let priority = self.priority(req.priority);
        let hold = match req.hold_ms {
            0 => self.limits.default_hold,
            ms => Duration::from_millis(u64::from(ms)).min(self.limits.max_hold),
        };
        let in_flight = self.state.begin_request();
        self.queue_prefill(&in_flight, &req.prompt_token_ids, &identity);
        let outcome = self
            .engine
            .prefill(PrefillParams {
                request_id: req.request_id,
                prompt: req.prompt_token_ids,
                hold,
                pipelined: req.pipelined,
                identity,
                retention,
                sampling,
                priority,
            })
            .await?;
        Ok(Response::new(v1::PrefillResponse {
            handle: Some(v1::KvHandle { id: outcome.handle }),
            block_hashes: outcome.block_hashes.iter().map(|h| h.get()).collect(),
            cached_prompt_tokens: outcome.cached_prompt_tokens,
            prompt_tokens: outcome.prompt_tokens,
            first_token_id: outcome.first_token,
            expires_at_unix_ms: unix_ms(outcome.expires_at),
            engine_transfer_params: outcome.engine_transfer_params.unwrap_or_default(),
            pipelined: outcome.pipelined,
        }))
    }
}

impl WorkerService {
    /// `PullKv` inside its `serve_pull` span, which the returned stream holds until it ends.
    async fn start_pull(
        &self,
        req: v1::PullKvRequest,
        span: tracing::Span,
    ) -> Result<Response<BoxStream<v1::KvChunk>>, Status> {
        let record = self.metrics.request(RequestKind::Pull);
        let Some(handle) = req.handle.map(|h| h.id).filter(|id| !id.is_empty()) else {
            record.finish(tonic::Code::InvalidArgument);
            return Err(ErrorCode::InvalidRequest.status("handle is missing"));
        };
        span.record("handle", handle.as_str());
        let per_chunk = match req.blocks_per_chunk {
            0 => self.limits.default_blocks_per_chunk,
            n => n,
        } as usize;
        let Some(export) = self.engine.kv_export() else {
            let status = Status::from(EngineError::Unsupported(
                "this worker's engine holds no blocks to pull: a vllm/sglang prefill worker's \
                 engine hands the KV to the decode engine itself (engine transfer parameters)",
            ));
            record.finish(status.code());
            return Err(status);
        };
        let in_flight = self.state.begin_request();
        let pull = match export.pull_kv(&handle).await {
            Ok(pull) => pull,
            Err(err) => {
                let status = Status::from(err);
                record.finish(status.code());
                return Err(status);
            }
        };
        self.metrics.pull_served();
        span.record("pipelined", pull.pipelined());
        let state = PullState {
            record: Some(record),
            pull,
            per_chunk: per_chunk.max(1),
            bytes_per_token: self.engine.spec().kv_bytes_per_token,
            next_block: 0,
            pending: std::collections::VecDeque::new(),
            done: false,
            layout: self
                .engine
                .kv_layout()
                .map(|l| crate::kv_layout::announce(&l, self.engine.spec().block_size.get())),
            sent: PullSent::default(),
            span,
        };
        // The pull (and with it the hold on the blocks) ends when the stream is dropped.
        let stream = stream::unfold(state, |mut st| async move {
            let item = st.next_chunk().await?;
            st.note(&item);
            Some((item, st))
        })
        .map(move |item| {
            let _ = &in_flight;
            item
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The outcome a finished generation is counted with: an engine that gave up on it aborted it.
fn finish_code(finish: FinishReason) -> tonic::Code {
    match finish {
        FinishReason::Length | FinishReason::Stop => tonic::Code::Ok,
        FinishReason::Aborted => tonic::Code::Aborted,
    }
}

fn finish_to_wire(finish: Option<FinishReason>) -> i32 {
    let reason = match finish {
        None => v1::FinishReason::Unspecified,
        Some(FinishReason::Length) => v1::FinishReason::Length,
        Some(FinishReason::Stop) => v1::FinishReason::Stop,
        Some(FinishReason::Aborted) => v1::FinishReason::Aborted,
    };
    reason.into()
}

/// A finish reason as the trace shows it.
fn finish_name(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Aborted => "aborted",
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[tonic::async_trait]
impl v1::worker_server::Worker for WorkerService {
    async fn info(
        &self,
        request: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::WorkerInfo>, Status> {
        self.access.check(&request, Call::Info)?;
        let mut info = self.info.clone();
        info.role = self.state.role();
        info.adapters = self.adapters.borrow().clone();
        Ok(Response::new(worker_info_to_wire(
            &info,
            self.state.is_draining(),
        )))
    }

    type GenerateStream = BoxStream<v1::GenerateResponse>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = tracing::info_span!(
            target: WORKER_SPANS,
            "generate",
            otel.kind = "server",
            worker = self.info.id.as_str(),
            request_id = Empty,
            prompt_tokens = Empty,
            disaggregated = Empty,
            cached_prompt_tokens = Empty,
            completion_tokens = Empty,
            finish_reason = Empty,
        );
        extract_parent(&span, request.metadata());
        // Arrival: the time to first token counts from here.
        let record = self.metrics.request(RequestKind::Generate);
        if let Err(status) = self.access.check(&request, Call::Generate) {
            record.finish(status.code());
            return Err(status);
        }
        let started = self
            .start_generate(request.into_inner(), span.clone(), record)
            .instrument(span.clone())
            .await;
        if let Err(status) = &started {
            record_error(&span, status.message());
        }
        started
    }

    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let span = tracing::info_span!(
            target: WORKER_SPANS,
            "prefill",
            otel.kind = "server",
            worker = self.info.id.as_str(),
            request_id = Empty,
            prompt_tokens = Empty,
            cached_prompt_tokens = Empty,
        );
        extract_parent(&span, request.metadata());
        let record = self.metrics.request(RequestKind::Prefill);
        if let Err(status) = self.access.check(&request, Call::Prefill) {
            record.finish(status.code());
            return Err(status);
        }
        let answer = self
            .run_prefill(request.into_inner())
            .instrument(span.clone())
            .await;
        match &answer {
            Ok(response) => {
                let response = response.get_ref();
                span.record(
                    "cached_prompt_tokens",
                    i64::from(response.cached_prompt_tokens),
                );
                // A pipelined prefill's cached count comes with the last piece of its pull.
                self.metrics.tokens(
                    RequestKind::Prefill,
                    response.prompt_tokens,
                    response.cached_prompt_tokens,
                    0,
                );
                record.finish(tonic::Code::Ok);
            }
            Err(status) => {
                record_error(&span, status.message());
                record.finish(status.code());
            }
        }
        answer
    }

    type PullKvStream = BoxStream<v1::KvChunk>;

    async fn pull_kv(
        &self,
        request: Request<v1::PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        // The decode worker's `transfer` span is the caller; the span lasts as long as the
        // stream, so its duration is the time the decode side spent pulling.
        let span = tracing::info_span!(
            target: WORKER_SPANS,
            "serve_pull",
            otel.kind = "server",
            worker = self.info.id.as_str(),
            handle = Empty,
            pipelined = Empty,
            chunks = Empty,
            blocks = Empty,
            bytes = Empty,
        );
        extract_parent(&span, request.metadata());
        if let Err(status) = self.access.check(&request, Call::PullKv) {
            self.metrics
                .request(RequestKind::Pull)
                .finish(status.code());
            return Err(status);
        }
        let started = self
            .start_pull(request.into_inner(), span.clone())
            .instrument(span.clone())
            .await;
        if let Err(status) = &started {
            record_error(&span, status.message());
        }
        started
    }

    type KvEventsStream = BoxStream<v1::KvEventsResponse>;

    async fn kv_events(
        &self,
        request: Request<v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        self.access.check(&request, Call::KvEvents)?;
        let req = request.into_inner();
        let log = Arc::clone(self.engine.events());
        let subscription = log.subscribe(req.from_seq, req.incarnation);
        let worker_id = self.info.id.to_string();
        let incarnation = log.incarnation();
        let next_seq = match &subscription.start {
            SubscriptionStart::Replay(_) => req.from_seq,
            SubscriptionStart::Snapshot { next_seq, .. } => Some(*next_seq),
        };
        let max_batch = req.max_batch_events.min(MAX_BATCH_EVENTS) as usize;
        let state = EventStreamState {
            log,
            pending: start_messages(subscription.start, max_batch).into(),
            live: subscription.live,
            next_seq,
            at: subscription.at,
            digest_every: digest_timer(req.digest_interval_ms),
            identity: DigestIdentity {
                model: self.info.model.clone(),
                block_size: self.info.block_size,
            },
            max_batch,
            lagged: false,
            logged_at_us: 0,
        };
        let metrics = Arc::clone(&self.metrics);
        let stream = stream::unfold(state, |mut st| async move {
            let payload = st.next_payload().await?;
            Some(((payload, st.logged_at_us), st))
        })
        .map(move |(payload, logged_at_unix_us)| {
            metrics.kv_events_sent(EventSink::Grpc, plane::events_in(&payload));
            Ok(v1::KvEventsResponse {
                worker_id: worker_id.clone(),
                incarnation,
                payload: Some(payload),
                logged_at_unix_us,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type LoadStatsStream = BoxStream<v1::LoadReport>;

    async fn load_stats(
        &self,
        request: Request<v1::LoadStatsRequest>,
    ) -> Result<Response<Self::LoadStatsStream>, Status> {
        self.access.check(&request, Call::LoadStats)?;
        let request = request.into_inner();
        let interval = match request.interval_ms {
            0 => self.limits.default_load_interval,
            ms => Duration::from_millis(u64::from(ms).max(10)),
        };
        let push_gap = match request.push_min_interval_ms {
            0 => None,
            ms => Some(Duration::from_millis(u64::from(ms))),
        };
        let service = self.clone();
        let pacer = LoadPacer::new(interval, push_gap, self.state.watch_load());
        let stream = stream::unfold((pacer, None), move |(mut pacer, mut last)| {
            let service = service.clone();
            async move {
                loop {
                    let due = pacer.wait().await;
                    let report = load_to_wire(
                        &service.info.id,
                        &worker_load(&*service.engine, &service.state),
                        service.state.role(),
                        service.state.is_draining(),
                        0,
                    );
                    if due == Due::Settle && last.as_ref() == Some(&report) {
                        continue;
                    }
                    last = Some(report.clone());
                    let report = v1::LoadReport {
                        timestamp_unix_ms: unix_ms(SystemTime::now()),
                        ..report
                    };
                    return Some((Ok(report), (pacer, last)));
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn control(
        &self,
        request: Request<v1::ControlRequest>,
    ) -> Result<Response<v1::ControlResponse>, Status> {
        self.access.check(&request, Call::Control)?;
        let command = request
            .into_inner()
            .command
            .ok_or_else(|| ErrorCode::InvalidRequest.status("control command is missing"))?;
        match command {
            v1::control_request::Command::SetRole(set) => {
                let role = role_from_wire(set.role)
                    .map_err(|_| ErrorCode::InvalidRequest.status("set_role needs a role"))?;
                tracing::info!(worker = %self.info.id, %role, "role changed by control request");
                self.state.set_role(role);
            }
            v1::control_request::Command::Drain(drain) => {
                tracing::info!(worker = %self.info.id, "draining by control request");
                self.state.set_draining(true);
                if drain.wait_ms > 0 {
                    self.state
                        .wait_idle(Duration::from_millis(u64::from(drain.wait_ms)))
                        .await;
                }
            }
            v1::control_request::Command::Resume(_) => {
                tracing::info!(worker = %self.info.id, "resumed by control request");
                self.state.set_draining(false);
            }
        }
        Ok(Response::new(v1::ControlResponse {
            role: v1::Role::from(self.state.role()).into(),
            draining: self.state.is_draining(),
            in_flight: self.state.in_flight(),
        }))
    }
}
