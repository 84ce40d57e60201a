//! The simulator as an engine: a task that owns a [`Simulator`] and runs it in real time.
//!
//! The simulator itself is synchronous and knows nothing of time; this runner executes one step
//! after another, sleeps each step's simulated duration divided by the speed-up factor, hands
//! tokens to the request streams and publishes the step's KV events. Commands (add, abort,
//! release) queue on a channel and take effect at the next step boundary, as in a real engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use switchyard_core::{BlockHash, EngineKind, LoadStats, TokenId, WorkerId, chain_hash};
use switchyard_engine_sim::{
    BlockExport, FinishReason as SimFinish, SimConfig, SimError, SimRequest, Simulator,
    StagingArea, TimingModel, TokenOutput,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{
    DropGuard, Engine, EngineError, EngineSpec, FinishReason, GenerateParams, GenerationChunk,
    GenerationStream, HeldBlock, KvExport, KvImport, KvImporter, KvPiece, KvPull, PrefillOutcome,
    PrefillParams,
};
use crate::event_log::EventLog;

mod guided;
mod transfer;

pub use transfer::TransferSetup;

/// How far the runner may fall behind real time before it stops trying to catch up.
const MAX_LAG: Duration = Duration::from_millis(200);

/// The blocks a held prefill keeps, as the simulator reports them.
type HeldBlocks = Vec<(BlockHash, Vec<TokenId>)>;

type ChunkTx = mpsc::UnboundedSender<Result<GenerationChunk, EngineError>>;
type PieceTx = mpsc::UnboundedSender<Result<KvPiece, EngineError>>;
type PieceRx = mpsc::UnboundedReceiver<Result<KvPiece, EngineError>>;

/// Where a request's results go: a generation's tokens, or a pipelined prefill's blocks
/// (chunk by chunk) and then its first token.
enum Sink {
    Tokens(ChunkTx),
    Pieces(PieceTx),
}

impl Sink {
    fn fail(&self, err: EngineError) {
        let _ = match self {
            Sink::Tokens(tx) => tx.send(Err(err)).is_ok(),
            Sink::Pieces(tx) => tx.send(Err(err)).is_ok(),
        };
    }
}

enum Command {
    Add {
        // Boxed: a request is several times the size of every other command.
        request: Box<SimRequest>,
        out: Sink,
        ack: oneshot::Sender<Result<(), SimError>>,
    },
    Abort(u64),
    Release(u64),
    Held {
        id: u64,
        reply: oneshot::Sender<Option<HeldBlocks>>,
    },
    Import {
        hold: u64,
        parent: Option<BlockHash>,
        blocks: HeldBlocks,
        reply: oneshot::Sender<usize>,
    },
}

#[derive(Debug)]
struct HeldHandle {
    request: u64,
    /// A pipelined prefill's pieces, until a puller claims them.
    pieces: Option<PieceRx>,
}

/// The simulated engine.
#[derive(Debug)]
pub struct SimEngine {
    spec: EngineSpec,
    cmd_tx: mpsc::UnboundedSender<Command>,
    load_rx: watch::Receiver<LoadStats>,
    events: Arc<EventLog>,
    next_request: AtomicU64,
    handles: Arc<Mutex<HashMap<String, HeldHandle>>>,
    /// Handles that expired unpulled since start.
    expired_handles: Arc<AtomicU64>,
    /// Idle blocks retention hints pin, as the runner last saw.
    retained_blocks: Arc<AtomicU64>,
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// Charges KV imports their transfer time.
    timing: TimingModel,
    speedup: f64,
    transfer: TransferSetup,
    /// One staging area for the worker's imports, reused across chunks and requests.
    staging: Mutex<StagingArea>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Add { request, .. } => write!(f, "Add({})", request.id),
            Command::Abort(id) => write!(f, "Abort({id})"),
            Command::Release(id) => write!(f, "Release({id})"),
            Command::Held { id, .. } => write!(f, "Held({id})"),
            Command::Import { hold, blocks, .. } => {
                write!(f, "Import({hold}: {} blocks)", blocks.len())
            }
        }
    }
}

impl SimEngine {
    /// Starts the simulator task. `speedup` > 1 runs simulated time faster than real time.
    pub fn start(
        worker: WorkerId,
        incarnation: u64,
        config: SimConfig,
        speedup: f64,
        kv_bytes_per_token: u64,
        event_buffer: usize,
        transfer: TransferSetup,
    ) -> Result<Self, SimError> {
        let spec = EngineSpec {
            kind: EngineKind::Sim,
            block_size: config.block_size,
            kv_capacity_blocks: config.num_device_blocks,
            max_context_tokens: config.max_context_tokens,
            kv_bytes_per_token,
        };
        let timing = config.timing;
        let speedup = if speedup.is_finite() && speedup > 0.0 {
            speedup
        } else {
            1.0
        };
        let sim = Simulator::new(config)?;
        let events = Arc::new(EventLog::new(worker, incarnation, event_buffer));
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (load_tx, load_rx) = watch::channel(sim.load());
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let retained_blocks = Arc::new(AtomicU64::new(0));
        let runner = Runner {
            sim,
            cmd_rx,
            load_tx,
            events: Arc::clone(&events),
            sinks: HashMap::new(),
            speedup,
            started: Instant::now(),
            retained_blocks: Arc::clone(&retained_blocks),
        };
        tasks.spawn(runner.run(cancel.clone()));
        Ok(Self {
            spec,
            cmd_tx,
            load_rx,
            events,
            next_request: AtomicU64::new(1),
            handles: Arc::new(Mutex::new(HashMap::new())),
            expired_handles: Arc::new(AtomicU64::new(0)),
            retained_blocks,
            tasks,
            cancel,
            timing,
            speedup,
            transfer,
            staging: Mutex::new(StagingArea::new(transfer.staging_bytes)),
        })
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.cmd_tx.send(cmd).map_err(|_| EngineError::Stopped)
    }

    async fn add(&self, request: SimRequest) -> Result<ChunkRx, EngineError> {
        let (out, rx) = mpsc::unbounded_channel();
        self.add_with(request, Sink::Tokens(out)).await?;
        Ok(rx)
    }

    async fn add_with(&self, request: SimRequest, out: Sink) -> Result<(), EngineError> {
        let (ack, ack_rx) = oneshot::channel();
        self.send(Command::Add {
            request: Box::new(request),
            out,
            ack,
        })?;
        match ack_rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(EngineError::InvalidRequest(err.to_string())),
            Err(_) => Err(EngineError::Stopped),
        }
    }

    /// Issues a handle for request `id` and arms its expiry: unpulled after `hold`, the
    /// request is aborted (if still prefilling) and its blocks released.
    fn issue_handle(
        &self,
        id: u64,
        pieces: Option<PieceRx>,
        hold: Duration,
    ) -> (String, SystemTime) {
        let handle = format!("kv-{}-{id}", self.events.incarnation());
        let expires_at = SystemTime::now() + hold;
        self.lock_handles().insert(
            handle.clone(),
            HeldHandle {
                request: id,
                pieces,
            },
        );
        let handles = Arc::clone(&self.handles);
        let expired_count = Arc::clone(&self.expired_handles);
        let cmd_tx = self.cmd_tx.clone();
        let expiring = handle.clone();
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(hold) => {}
                _ = cancel.cancelled() => return,
            }
            let expired = handles
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&expiring);
            if let Some(held) = expired {
                expired_count.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(handle = %expiring, "kv handle expired unpulled; releasing blocks");
                let _ = cmd_tx.send(Command::Abort(held.request));
                let _ = cmd_tx.send(Command::Release(held.request));
            }
        });
        (handle, expires_at)
    }

    fn abort_guard(&self, id: u64) -> DropGuard {
        let tx = self.cmd_tx.clone();
        DropGuard::new(move || {
            // Releasing too covers a prefill that finished but whose handle was never issued.
            let _ = tx.send(Command::Abort(id));
            let _ = tx.send(Command::Release(id));
        })
    }

    fn lock_handles(&self) -> std::sync::MutexGuard<'_, HashMap<String, HeldHandle>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of KV handles currently held (for tests and metrics).
    pub fn held_handles(&self) -> usize {
        self.lock_handles().len()
    }
}

type ChunkRx = mpsc::UnboundedReceiver<Result<GenerationChunk, EngineError>>;

#[async_trait::async_trait]
impl KvExport for SimEngine {
    async fn pull_kv(&self, handle: &str) -> Result<KvPull, EngineError> {
        let held = self
            .lock_handles()
            .remove(handle)
            .ok_or_else(|| EngineError::HandleNotFound(handle.to_owned()))?;
        let id = held.request;
        // Ends the hold when the puller is done, and a pipelined prefill the puller abandons.
        let release = self.abort_guard(id);
        if let Some(pieces) = held.pieces {
            return Ok(KvPull::streaming(pieces, release));
        }
        let (reply, reply_rx) = oneshot::channel();
        self.send(Command::Held { id, reply })?;
        let blocks = reply_rx
            .await
            .map_err(|_| EngineError::Stopped)?
            .ok_or_else(|| EngineError::HandleNotFound(handle.to_owned()))?;
        Ok(KvPull::complete(to_held(blocks), release))
    }
}

#[async_trait::async_trait]
impl KvImporter for SimEngine {
    fn start_import(&self) -> Result<KvImport, EngineError> {
        let hold = self.next_request.fetch_add(1, Ordering::Relaxed);
        let tx = self.cmd_tx.clone();
        Ok(KvImport {
            hold,
            parent: None,
            imported: 0,
            stopped: false,
            link_free_at: None,
            stats: Default::default(),
            source_layout: None,
            _release: DropGuard::new(move || {
                let _ = tx.send(Command::Release(hold));
            }),
        })
    }

    async fn import_kv(
        &self,
        import: &mut KvImport,
        blocks: Vec<HeldBlock>,
    ) -> Result<usize, EngineError> {
        self.import_chunk(import, blocks).await
    }
}

#[async_trait::async_trait]
impl Engine for SimEngine {
    fn spec(&self) -> &EngineSpec {
        &self.spec
    }

    async fn generate(&self, params: GenerateParams) -> Result<GenerationStream, EngineError> {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let s = params.sampling;
        // A guided request gets a valid answer written for it (from its seed, else its
        // prompt), which the simulator then generates token by token.
        let script = match &s.guided {
            Some(constraint) => {
                let seed = s
                    .seed
                    .unwrap_or_else(|| chain_hash(None, &params.prompt).get());
                guided::script(constraint, seed).map_err(EngineError::InvalidRequest)?
            }
            None => Vec::new(),
        };
        // What the simulator can honour of the sampling: the seed, greedy decoding, stop
        // tokens, EOS, min_tokens and the extreme logit biases (ban, force). It has no model,
        // so nucleus, top-k, min-p and penalties have nothing to act on (docs/openai-api.md).
        let request = SimRequest {
            id,
            prompt: params.prompt,
            max_tokens: s.max_tokens,
            ignore_eos: s.ignore_eos,
            stop_token_ids: s.stop_token_ids,
            seed: s.seed,
            greedy: s.temperature == Some(0.0),
            min_tokens: s.min_tokens.unwrap_or(0),
            banned: s
                .logit_bias
                .iter()
                .filter(|(_, b)| **b <= -100.0)
                .map(|(t, _)| *t)
                .collect(),
            forced: s
                .logit_bias
                .iter()
                .filter(|(_, b)| **b >= 100.0)
                .map(|(t, _)| *t)
                .collect(),
            hold_blocks: false,
            pipeline: false,
            logprobs: s.logprobs,
            script,
            retention: params.retention,
            identity: params.identity,
            // The prompt arrives as tokens over gRPC: the simulator hashes it.
            prompt_hashes: None,
        };
        let rx = self.add(request).await?;
        Ok(GenerationStream::new(rx, self.abort_guard(id)))
    }

    async fn prefill(&self, params: PrefillParams) -> Result<PrefillOutcome, EngineError> {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let request = SimRequest {
            id,
            prompt: params.prompt.clone(),
            max_tokens: 1,
            ignore_eos: true,
            hold_blocks: true,
            pipeline: params.pipelined,
            identity: params.identity.clone(),
            retention: params.retention,
            ..SimRequest::default()
        };
        let block_hashes = params
            .identity
            .block_hashes(&params.prompt, self.spec.block_size);
        if params.pipelined {
            // The handle is valid once the request is queued: its blocks reach the puller
            // chunk by chunk, and the first token with the last piece.
            let (out, pieces) = mpsc::unbounded_channel();
            self.add_with(request, Sink::Pieces(out)).await?;
            let (handle, expires_at) = self.issue_handle(id, Some(pieces), params.hold);
            return Ok(PrefillOutcome {
                handle,
                block_hashes,
                prompt_tokens: params.prompt.len() as u32,
                cached_prompt_tokens: 0,
                first_token: 0,
                expires_at,
                engine_transfer_params: None,
                pipelined: true,
            });
        }
        let mut rx = self.add(request).await?;
        let mut guard = self.abort_guard(id);
        let chunk = loop {
            match rx.recv().await {
                Some(Ok(chunk)) if chunk.finish.is_some() => break chunk,
                Some(Ok(_)) => continue,
                Some(Err(err)) => return Err(err),
                None => return Err(EngineError::Stopped),
            }
        };
        let first_token = match (chunk.finish, chunk.tokens.first()) {
            (Some(FinishReason::Aborted), _) | (_, None) => return Err(EngineError::Stopped),
            (_, Some(&token)) => token,
        };
        let (handle, expires_at) = self.issue_handle(id, None, params.hold);
        guard.disarm();
        Ok(PrefillOutcome {
            handle,
            block_hashes,
            prompt_tokens: chunk.prompt_tokens,
            cached_prompt_tokens: chunk.cached_prompt_tokens,
            first_token,
            expires_at,
            engine_transfer_params: None,
            pipelined: false,
        })
    }

    fn kv_layout(&self) -> Option<switchyard_engine_sim::KvLayout> {
        // The destination side of its transfer setup is this worker's own layout.
        Some(self.transfer.dest)
    }

    fn kv_export(&self) -> Option<&dyn KvExport> {
        Some(self)
    }

    fn kv_import(&self) -> Option<&dyn KvImporter> {
        Some(self)
    }

    fn honours_retention(&self) -> bool {
        true
    }

    fn load(&self) -> LoadStats {
        *self.load_rx.borrow()
    }

    fn reports_queued_prefill(&self) -> bool {
        true
    }

    fn telemetry(&self) -> super::stats::EngineTelemetry {
        super::stats::EngineTelemetry {
            held_kv_handles: Some(self.held_handles() as u64),
            retained_kv_blocks: Some(self.retained_blocks.load(Ordering::Relaxed)),
            expired_kv_handles: Some(self.expired_handles.load(Ordering::Relaxed)),
            ..Default::default()
        }
    }

    fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
    }
}

struct Runner {
    sim: Simulator,
    cmd_rx: mpsc::UnboundedReceiver<Command>,
    load_tx: watch::Sender<LoadStats>,
    events: Arc<EventLog>,
    sinks: HashMap<u64, Sink>,
    speedup: f64,
    /// Retention hints expire on the wall clock (the gateway measures think times on it), from
    /// the runner's start.
    started: Instant,
    /// Idle blocks retention hints pin, after each step (for `/metrics`).
    retained_blocks: Arc<AtomicU64>,
}

impl Runner {
    async fn run(mut self, cancel: CancellationToken) {
        let mut clock_start = Instant::now();
        let mut simulated = Duration::ZERO;
        loop {
            self.sim.set_clock(self.started.elapsed());
            while let Ok(cmd) = self.cmd_rx.try_recv() {
                self.handle(cmd);
            }
            if !self.sim.has_work() {
                self.load_tx.send_replace(self.sim.load());
                tokio::select! {
                    cmd = self.cmd_rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd),
                        None => break,
                    },
                    _ = cancel.cancelled() => break,
                }
                // Idle time is not simulated time: restart the clock.
                clock_start = Instant::now();
                simulated = Duration::ZERO;
                continue;
            }
            let outcome = self.sim.step();
            if outcome.is_idle() {
                // Work exists but none can run (held blocks pin the cache): wait for a command
                // (an abort, a release or a new request) instead of spinning.
                tokio::select! {
                    cmd = self.cmd_rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd),
                        None => break,
                    },
                    _ = cancel.cancelled() => break,
                }
                clock_start = Instant::now();
                simulated = Duration::ZERO;
                continue;
            }
            // The step's results exist when the step ends: wait out its duration first, so a
            // token (and the blocks a KV pull can see) appear a step's time after it started,
            // and a one-step prefill's TTFT is its compute time rather than zero.
            simulated += outcome.duration.div_f64(self.speedup);
            let due = clock_start + simulated;
            let now = Instant::now();
            if now > due + MAX_LAG {
                clock_start = now;
                simulated = Duration::ZERO;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
                    _ = cancel.cancelled() => break,
                }
            }
            if !outcome.events.is_empty() {
                self.events.publish(outcome.events);
            }
            // Blocks before the token: a pipelined prefill's last piece follows its blocks.
            for export in outcome.exports {
                self.export(export);
            }
            for output in outcome.outputs {
                self.deliver(output);
            }
            self.load_tx.send_replace(self.sim.load());
            self.retained_blocks
                .store(self.sim.retained_blocks() as u64, Ordering::Relaxed);
        }
        for (_, sink) in self.sinks.drain() {
            sink.fail(EngineError::Stopped);
        }
    }

    fn handle(&mut self, cmd: Command) {
        // A command can end a wait of any length: the pins it makes start from now.
        self.sim.set_clock(self.started.elapsed());
        match cmd {
            Command::Add { request, out, ack } => {
                let id = request.id;
                match self.sim.add_request(*request) {
                    Ok(()) => {
                        self.sinks.insert(id, out);
                        let _ = ack.send(Ok(()));
                    }
                    Err(err) => {
                        let _ = ack.send(Err(err));
                    }
                }
            }
            Command::Abort(id) => {
                if self.sinks.remove(&id).is_some() {
                    self.sim.abort(id);
                }
            }
            Command::Release(id) => {
                self.sim.release_hold(id);
            }
            Command::Held { id, reply } => {
                let _ = reply.send(self.sim.held_blocks(id));
            }
            Command::Import {
                hold,
                parent,
                blocks,
                reply,
            } => {
                let outcome = self.sim.import_blocks(Some(hold), parent, &blocks);
                if !outcome.events.is_empty() {
                    self.events.publish(outcome.events);
                }
                self.load_tx.send_replace(self.sim.load());
                let _ = reply.send(outcome.imported);
            }
        }
    }

    fn export(&mut self, export: BlockExport) {
        let Some(Sink::Pieces(tx)) = self.sinks.get(&export.id) else {
            return;
        };
        let piece = KvPiece {
            blocks: to_held(export.blocks),
            ..KvPiece::default()
        };
        if tx.send(Ok(piece)).is_err() {
            // Nobody will pull these (the handle expired or the puller left): stop computing.
            self.sinks.remove(&export.id);
            self.sim.abort(export.id);
        }
    }

    fn deliver(&mut self, output: TokenOutput) {
        let finish = output.finish.map(|f| match f {
            SimFinish::Length => FinishReason::Length,
            SimFinish::Stop => FinishReason::Stop,
        });
        let id = output.id;
        let delivered = match self.sinks.get(&id) {
            Some(Sink::Tokens(tx)) => tx
                .send(Ok(GenerationChunk {
                    tokens: vec![output.token],
                    logprobs: output.logprobs.into_iter().collect(),
                    finish,
                    prompt_tokens: output.prompt_tokens,
                    cached_prompt_tokens: output.cached_prompt_tokens,
                    completion_tokens: output.completion_tokens,
                }))
                .is_ok(),
            Some(Sink::Pieces(tx)) => tx
                .send(Ok(KvPiece {
                    blocks: Vec::new(),
                    last: true,
                    first_token: Some(output.token),
                    cached_prompt_tokens: output.cached_prompt_tokens,
                }))
                .is_ok(),
            None => false,
        };
        if finish.is_some() {
            self.sinks.remove(&id);
        } else if !delivered && self.sinks.remove(&id).is_some() {
            // The consumer went away without its guard firing yet: stop computing for nobody.
            self.sim.abort(id);
        }
    }
}

fn to_held(blocks: HeldBlocks) -> Vec<HeldBlock> {
    blocks
        .into_iter()
        .map(|(hash, tokens)| HeldBlock { hash, tokens })
        .collect()
}
