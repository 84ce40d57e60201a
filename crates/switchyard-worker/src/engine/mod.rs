//! The `Engine` trait: what the worker agent needs from an inference engine.
//!
//! The agent's gRPC service is written once against this trait; the built-in simulator
//! ([`sim::SimEngine`]) is the first implementation, real engines (vLLM, SGLang) are fronted by
//! [`vllm::VllmEngine`] (HTTP generation in [`openai_http`] with log probabilities read by
//! [`engine_logprobs`], ZMQ KV events in [`zmq_events`],
//! decoded by [`kv_decode`] and rehashed by [`kv_relay`], load from [`engine_metrics`], and
//! disaggregated prefill/decode through the engines' own KV transfer in [`pd`], retention hints
//! as SGLang radix-eviction priorities in [`sglang_retention`]); TensorRT-LLM's
//! `trtllm-serve` by the same adapter started by [`trtllm`], its pulled KV events read by
//! [`trtllm_events`] and its disaggregation through `disaggregated_params` in [`trtllm_pd`]. An engine publishes its KV cache changes into its [`EventLog`].

mod adapter_base;
mod capability;
pub mod config;
pub mod engine_logprobs;
pub mod engine_metrics;
pub mod kv_decode;
pub mod kv_relay;
pub mod openai_http;
pub mod pd;
#[cfg(test)]
mod proptests;
pub mod sglang_retention;
pub mod sim;
pub mod stats;
pub mod trtllm;
pub mod trtllm_events;
pub mod trtllm_pd;
pub mod trtllm_wire;
pub mod vllm;
pub mod zmq_events;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::Stream;
use switchyard_core::{BlockHash, BlockSize, EngineKind, LoadStats, TokenId};
use switchyard_proto::ErrorCode;
use tokio::sync::mpsc;

use crate::event_log::EventLog;

pub use capability::{EngineTransfer, KvExport, KvImporter};

/// Fixed facts about an engine, announced at registration.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpec {
    pub kind: EngineKind,
    pub block_size: BlockSize,
    pub kv_capacity_blocks: u64,
    pub max_context_tokens: u64,
    /// Bytes of KV cache per token (all layers, keys and values), for transfer sizing.
    pub kv_bytes_per_token: u64,
}

/// A generation request as the engine sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    /// How to sample (validated); unset fields stay unset so the engine's defaults apply.
    pub sampling: switchyard_core::Sampling,
    /// The adapter and cache salt the prompt's KV is named by; the engine receives both.
    pub identity: switchyard_core::KvIdentity,
    /// Keep the request's blocks cached after it ends (honoured where
    /// [`Engine::honours_retention`]).
    pub retention: switchyard_core::Retention,
    /// Scheduling priority (lower is earlier), set only for an engine that
    /// [`Engine::schedules_by_priority`].
    pub priority: Option<i32>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// End-of-sequence or a stop token.
    Stop,
    /// The engine gave up on the request (cancelled or shut down).
    Aborted,
}

/// Tokens produced since the previous chunk.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationChunk {
    pub tokens: Vec<TokenId>,
    /// With `Sampling::logprobs`: one per token, in order; empty otherwise.
    pub logprobs: Vec<switchyard_core::TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: u32,
    pub cached_prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// Runs `on_drop` when dropped unless disarmed: the RAII way to cancel engine work when the
/// consumer goes away.
pub struct DropGuard {
    on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl DropGuard {
    pub fn new(on_drop: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self {
            on_drop: Some(Box::new(on_drop)),
        }
    }

    pub fn disarm(&mut self) {
        self.on_drop = None;
    }
}

impl Drop for DropGuard {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

impl std::fmt::Debug for DropGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DropGuard")
            .field("armed", &self.on_drop.is_some())
            .finish()
    }
}

/// The token stream of one request. Dropping it before the end aborts the request.
#[derive(Debug)]
pub struct GenerationStream {
    rx: mpsc::UnboundedReceiver<Result<GenerationChunk, EngineError>>,
    abort: DropGuard,
}

impl GenerationStream {
    pub fn new(
        rx: mpsc::UnboundedReceiver<Result<GenerationChunk, EngineError>>,
        abort: DropGuard,
    ) -> Self {
        Self { rx, abort }
    }
}

impl Stream for GenerationStream {
    type Item = Result<GenerationChunk, EngineError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &item
            && chunk.finish.is_some()
        {
            // Finished by itself: nothing left to abort.
            self.abort.disarm();
        }
        if let Poll::Ready(None) = &item {
            self.abort.disarm();
        }
        item
    }
}

/// A prefill request whose KV blocks are kept for a decode worker to pull.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillParams {
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    /// How long the blocks stay held if nobody pulls them.
    pub hold: Duration,
    /// Answer once the prefill is admitted and stream its blocks to the puller chunk by chunk.
    pub pipelined: bool,
    /// The adapter and cache salt the prompt's KV is named by, as in [`GenerateParams`].
    pub identity: switchyard_core::KvIdentity,
    /// Keep the prompt's blocks cached once the hold is released, as in [`GenerateParams`].
    pub retention: switchyard_core::Retention,
    /// The request's sampling, for an engine whose prefill samples the first token the decode
    /// side continues from (TensorRT-LLM); `None` from older gateways (sampled greedily).
    pub sampling: Option<switchyard_core::Sampling>,
    /// Scheduling priority, as in [`GenerateParams`].
    pub priority: Option<i32>,
}

/// What a finished prefill holds.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutcome {
    pub handle: String,
    pub block_hashes: Vec<BlockHash>,
    pub prompt_tokens: u32,
    pub cached_prompt_tokens: u32,
    /// Meaningless when `pipelined`: the first token then arrives with the pull's last piece.
    pub first_token: TokenId,
    pub expires_at: SystemTime,
    /// For engines that move KV themselves: what the decode side's engine needs to fetch it (a
    /// JSON object: vLLM's `kv_transfer_params`, SGLang's bootstrap address and room). `None`
    /// when the decode worker pulls the blocks over `PullKv`.
    pub engine_transfer_params: Option<String>,
    /// The prefill is still running; the counts are not final.
    pub pipelined: bool,
}

/// One block of a KV pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBlock {
    pub hash: BlockHash,
    pub tokens: Vec<TokenId>,
}

/// Part of a KV pull: the next blocks in prompt order, and on the last piece what the prefill
/// found out (for a pipelined prefill, which answered before it knew).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvPiece {
    pub blocks: Vec<HeldBlock>,
    pub last: bool,
    /// On the last piece of a pipelined prefill: the first generated token.
    pub first_token: Option<TokenId>,
    pub cached_prompt_tokens: u32,
}

/// The blocks under a handle, claimed by one puller, as pieces that arrive while the prefill
/// runs (pipelined) or all at once. The hold is released, and an unfinished prefill aborted,
/// when this is dropped.
#[derive(Debug)]
pub struct KvPull {
    pieces: mpsc::UnboundedReceiver<Result<KvPiece, EngineError>>,
    pipelined: bool,
    _release: DropGuard,
}

impl KvPull {
    /// A pull of blocks that are all there already (the prefill finished).
    pub fn complete(blocks: Vec<HeldBlock>, release: DropGuard) -> Self {
        let (tx, pieces) = mpsc::unbounded_channel();
        let _ = tx.send(Ok(KvPiece {
            blocks,
            last: true,
            ..KvPiece::default()
        }));
        Self {
            pieces,
            pipelined: false,
            _release: release,
        }
    }

    /// A pull fed by a running prefill: one piece per finished chunk, then a last one.
    pub fn streaming(
        pieces: mpsc::UnboundedReceiver<Result<KvPiece, EngineError>>,
        release: DropGuard,
    ) -> Self {
        Self {
            pieces,
            pipelined: true,
            _release: release,
        }
    }

    /// Whether the pieces come from a prefill still running (the trace tells the two apart).
    pub fn pipelined(&self) -> bool {
        self.pipelined
    }

    /// The next piece; `None` when the engine went away before the last one.
    pub async fn next_piece(&mut self) -> Option<Result<KvPiece, EngineError>> {
        self.pieces.recv().await
    }
}

/// A decode-side import in progress: the blocks imported so far stay held (referenced) until
/// this is dropped, so a chunked import keeps its earlier chunks and queued requests cannot
/// evict them before the decode request is admitted. Dropping it releases them (they stay
/// cached), so a pull that fails half way leaks nothing.
#[derive(Debug)]
pub struct KvImport {
    pub(crate) hold: u64,
    /// Hash of the last block imported: the parent of the next chunk's first block.
    pub(crate) parent: Option<BlockHash>,
    /// Blocks placed so far (a prefix of the prompt's blocks).
    pub imported: usize,
    /// The cache could not take a block: later blocks are not imported (the request
    /// recomputes them), since a chain with a hole is no prefix.
    pub(crate) stopped: bool,
    /// When the simulated link finishes what it was given: chunks transfer one after another,
    /// each starting when it arrives or when the previous one is done, whichever is later.
    pub(crate) link_free_at: Option<tokio::time::Instant>,
    /// Bytes and descriptors moved, before and after coalescing.
    pub stats: switchyard_engine_sim::PlanStats,
    /// The source's layout as it announced it; `None` plans from the configured one.
    pub(crate) source_layout: Option<switchyard_engine_sim::KvLayout>,
    pub(crate) _release: DropGuard,
}

impl KvImport {
    /// Plans this import's remaining chunks from `layout`, the one its source announced.
    pub fn plan_from(&mut self, layout: switchyard_engine_sim::KvLayout) {
        self.source_layout = Some(layout);
    }

    /// The source tensor-parallel degree the chunks were planned from, when announced.
    pub fn announced_tensor_parallel(&self) -> Option<u32> {
        self.source_layout.map(|l| l.tensor_parallel)
    }

    /// Waits until the link has moved everything handed to it (imports may carry a short
    /// transfer debt rather than sleep sub-millisecond amounts chunk by chunk).
    pub async fn settle(&self) {
        if let Some(free_at) = self.link_free_at {
            tokio::time::sleep_until(free_at).await;
        }
    }
}

/// Why an engine refused or failed a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The request itself is invalid; retrying it cannot help.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No KV handle of that name (never issued, already pulled, or expired).
    #[error("kv handle {0:?} not found (never issued, already pulled, or expired)")]
    HandleNotFound(String),
    /// The engine is shutting down; another worker can take the request.
    #[error("engine is stopped")]
    Stopped,
    /// The engine could not be reached or failed (connection refused, 5xx, broken stream); the
    /// engine's fault, and another worker or a later retry can help.
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// The engine took the request and then reported that it failed it (an error event in its
    /// stream): the engine's fault, as [`EngineError::Unavailable`].
    #[error("engine failed the request: {0}")]
    Failed(String),
    /// This engine cannot do what was asked; retrying on it cannot help.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A disaggregated request's KV could not be had from its source (the prefill worker or,
    /// for engines that move KV themselves, the prefill engine): the source's fault, not this
    /// worker's, and a retry with another prefill worker can help. The message says what
    /// failed (`pulling kv from …`).
    #[error("{0}")]
    KvSource(String),
}

impl EngineError {
    /// What the failure means on the wire ([`ErrorCode`]).
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            EngineError::HandleNotFound(_) => ErrorCode::NotFound,
            EngineError::Stopped | EngineError::Unavailable(_) | EngineError::Failed(_) => {
                ErrorCode::Unavailable
            }
            EngineError::Unsupported(_) => ErrorCode::Unsupported,
            // The one place a worker marks a failure as the KV source's: the gateway reads
            // the mark, not the message, to blame the prefill worker.
            EngineError::KvSource(_) => ErrorCode::KvSource,
        }
    }
}

impl From<EngineError> for tonic::Status {
    fn from(err: EngineError) -> Self {
        err.code().status(err.to_string())
    }
}

/// An inference engine behind the worker agent.
#[async_trait::async_trait]
pub trait Engine: Send + Sync + std::fmt::Debug + 'static {
    fn spec(&self) -> &EngineSpec;

    /// Starts a generation; tokens arrive on the returned stream.
    async fn generate(&self, params: GenerateParams) -> Result<GenerationStream, EngineError>;

    /// Runs a prefill and holds its blocks under a handle until pulled or expired.
    async fn prefill(&self, params: PrefillParams) -> Result<PrefillOutcome, EngineError>;

    /// How this engine lays out its KV cache, when it knows (the simulator does): announced to
    /// the decode workers that pull from it, and checked against what their sources announce.
    fn kv_layout(&self) -> Option<switchyard_engine_sim::KvLayout> {
        None
    }

    /// Its KV export, when it holds a prefill's blocks for a decode worker to pull (the
    /// simulator); `None` when its prefills hand the KV over otherwise.
    fn kv_export(&self) -> Option<&dyn KvExport> {
        None
    }

    /// Its KV import, when it takes blocks pulled from a prefill worker into its cache (the
    /// simulator).
    fn kv_import(&self) -> Option<&dyn KvImporter> {
        None
    }

    /// Its engine-managed transfer, when it fetches a prompt's KV from the prefill engine
    /// itself (vLLM's KV connectors, SGLang's bootstrap).
    fn engine_transfer(&self) -> Option<&dyn EngineTransfer> {
        None
    }

    /// Whether it keeps a request's blocks as its retention hint asks (the simulator; SGLang
    /// with `--engine-retention-priority`, through its radix-eviction priority); an engine
    /// without such a control ignores hints and the worker counts them unhonoured.
    fn honours_retention(&self) -> bool {
        false
    }

    /// Whether it schedules waiting requests by their `priority` (vLLM and SGLang started
    /// with priority scheduling, which the worker's configuration says); an engine that does
    /// not is never sent one, and the worker counts non-zero priorities as unhonoured.
    fn schedules_by_priority(&self) -> bool {
        false
    }

    /// Current load.
    fn load(&self) -> LoadStats;

    /// Whether [`Engine::load`]'s `queued_prefill_tokens` is the engine's own figure (the
    /// simulator's scheduler knows it). Else the worker reports its own count of the prompt
    /// tokens its requests still have to prefill (see `state`): vLLM, SGLang and
    /// TensorRT-LLM publish waiting and running requests, not tokens.
    fn reports_queued_prefill(&self) -> bool {
        false
    }

    /// The LoRA adapters the engine serves, when it can say and they may change while it runs
    /// (vLLM lists them in `/v1/models`); None: the worker's configured list stands.
    fn adapters(&self) -> Option<tokio::sync::watch::Receiver<Vec<String>>> {
        None
    }

    /// What the engine counts beyond its load (held handles, its event relay), read at each
    /// scrape of the worker's `/metrics`.
    fn telemetry(&self) -> stats::EngineTelemetry {
        stats::EngineTelemetry::default()
    }

    /// The engine's KV event log.
    fn events(&self) -> &Arc<EventLog>;

    /// Stops background work; pending requests end with `Aborted`.
    fn shutdown(&self);
}
