//! Disaggregated serving in the offline cluster, as the gateway and the workers do it.
//!
//! The decode worker is chosen first (the cluster's policy over the workers that decode); what
//! it would have to compute, its uncached prompt tokens, decides whether the prompt is
//! prefilled in the prefill pool (`auto`: at least `min_uncached_tokens` and the best prefill
//! worker not saturated; `enforce`: always). The prefill worker is chosen by the `kv` policy,
//! as the gateway's, and runs the prompt pipelined: the blocks each prefill step computes are
//! exported at once, cut into chunks of `blocks_per_chunk`, planned through the decode worker's
//! staging area ([`StagingArea::plan`], the worker's planner) and charged on a link that moves
//! one chunk after another ([`switchyard_engine_sim::TimingModel::transfer_time`]: bytes over
//! the bandwidth plus a fixed cost per descriptor). The transfer is DMA: it delays this request
//! only, not the decode worker's batch. Each chunk lands as a held import on the decode worker
//! (announced to the index like computed blocks). When the prefill's token is sampled and the
//! last chunk has landed, the decode worker emits it as the first token and runs
//! `prompt + [first]` for the remaining tokens, its prompt part a prefix hit; the import hold is
//! let go once that continuation produces its first token (it is admitted), as live.

use rustc_hash::FxHashMap as HashMap;

use indicatif::ProgressBar;
use serde::Serialize;
use switchyard_core::{BlockHash, Role, TokenId};
use switchyard_engine_sim::{BlockExport, KvLayout, SimRequest, TokenOutput};
use switchyard_router::serve::{
    Booking, DEFAULT_MAX_PREFILL_QUEUE_TOKENS, DEFAULT_MIN_UNCACHED_TOKENS, Disaggregation,
    ServeSettings,
};

use super::{Cluster, ClusterConfig, Event};
use crate::error::ReplayError;
use crate::metrics::RequestRecord;
use crate::workload::{Micros, Outbox, RequestSpec, Workload};

/// Simulator ids of prefills and of import holds: far above any workload's request ids.
const PREFILL_ID_BASE: u64 = 1 << 62;
const HOLD_ID_BASE: u64 = 3 << 61;
/// Staging area of a worker's KV pulls (the worker's default).
pub(super) const DEFAULT_STAGING_BYTES: u64 = 8 << 20;

/// When a request uses the prefill pool (the gateway's `--disaggregation`, minus `off`, which
/// is a cluster without a [`DisaggConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DisaggMode {
    /// When the decode worker's uncached prompt is at least `min_uncached_tokens` and the
    /// best prefill worker has at most `max_prefill_queue_tokens` queued.
    Auto,
    /// Every request; without a prefill worker it fails, as the gateway answers 503.
    Enforce,
}

impl DisaggMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DisaggMode::Auto => "auto",
            DisaggMode::Enforce => "enforce",
        }
    }
}

impl From<DisaggMode> for Disaggregation {
    fn from(mode: DisaggMode) -> Self {
        match mode {
            DisaggMode::Auto => Disaggregation::Auto,
            DisaggMode::Enforce => Disaggregation::Enforce,
        }
    }
}

/// Worker roles and the disaggregation settings (the gateway's defaults, the worker's chunk
/// size, staging area and KV layout).
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggConfig {
    /// One per worker.
    pub roles: Vec<Role>,
    pub mode: DisaggMode,
    pub min_uncached_tokens: u64,
    pub max_prefill_queue_tokens: u64,
    /// Blocks per pulled KV chunk (the worker's `default_blocks_per_chunk`).
    pub blocks_per_chunk: usize,
    /// Both sides' KV layout (128 KiB/token by default: an 8B model at TP 1).
    pub layout: KvLayout,
    pub staging_bytes: u64,
}

impl DisaggConfig {
    /// `prefill` prefill workers then decode workers, with the gateway's and workers' defaults.
    pub fn split(prefill: usize, decode: usize, mode: DisaggMode) -> Self {
        let mut roles = vec![Role::Prefill; prefill];
        roles.extend(std::iter::repeat_n(Role::Decode, decode));
        Self {
            roles,
            mode,
            min_uncached_tokens: DEFAULT_MIN_UNCACHED_TOKENS,
            max_prefill_queue_tokens: DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
            blocks_per_chunk: 32,
            layout: KvLayout::default(),
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

/// What one worker did over a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerStats {
    pub role: &'static str,
    pub steps: u64,
    /// Simulated seconds spent in steps.
    pub busy_s: f64,
    /// Prompt tokens computed.
    pub prefill_tokens: u64,
    /// The most prompt tokens one sequence had to compute here (prompt minus cache hit).
    pub longest_prefill: u64,
    /// Sequences preempted (their KV dropped for lack of room, recomputed later).
    pub preempted: u64,
    /// Host-tier blocks copied back to the device for prefix hits.
    pub host_hit_blocks: u64,
}

/// The prefill pool's and the links' totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DisaggStats {
    /// Requests prefilled in the prefill pool.
    pub disaggregated: u64,
    /// Requests that wanted the prefill pool and stayed aggregated (pool saturated or empty).
    pub kept_aggregated: u64,
    pub chunks: u64,
    pub bytes: u64,
    pub descriptors: u64,
    /// Link time of every chunk, summed (most of it overlaps the prefills).
    pub transfer_s: f64,
    /// Blocks that landed on a decode worker without room to place them (all in use): the
    /// continuation recomputes them there. Prefix copies' blocks count here too.
    pub blocks_not_placed: u64,
    /// Prefixes copied from a peer's device instead of recomputed (placement), their bytes
    /// (their link time is in `transfer_s`) and the blocks placed on arrival; left out of the
    /// JSON when nothing was copied, so runs without placement read as before.
    #[serde(skip_serializing_if = "is_zero")]
    pub peer_copies: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub peer_bytes: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub peer_blocks: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A disaggregated request between its arrival and its first token.
#[derive(Debug)]
struct Flow {
    decode: usize,
    prefill: usize,
    prefill_id: u64,
    /// The prefill's booking on its worker, released when the decode worker's first token
    /// shows the pull is done (what the gateway sees too).
    prefill_booking: Booking,
    hold: u64,
    prompt: Vec<TokenId>,
    max_tokens: u32,
    parent: Option<BlockHash>,
    /// When the request's link is free again (its last chunk so far has landed).
    link_free_at: Micros,
    cached: u32,
    first: Option<TokenId>,
    /// A chunk found no room: later ones would not continue a chain, so (as live) the import
    /// stops and the continuation computes the rest.
    stopped: bool,
}

/// The cluster's disaggregation state; see the module docs.
#[derive(Debug, Default)]
pub(super) struct Flows {
    flows: HashMap<u64, Flow>,
    /// Prefill simulator id → request id.
    by_prefill: HashMap<u64, u64>,
    /// Request id → (decode worker, import hold still to release), for continuations.
    pub continuations: HashMap<u64, (usize, Option<u64>)>,
    next: u64,
    pub stats: DisaggStats,
}

/// The workers' roles: all `both` without a [`DisaggConfig`].
pub(super) fn roles(config: &ClusterConfig) -> Result<Vec<Role>, ReplayError> {
    let Some(d) = &config.disagg else {
        return Ok(vec![Role::Both; config.workers]);
    };
    if d.roles.len() != config.workers {
        return Err(ReplayError::InvalidConfig(format!(
            "{} roles for {} workers",
            d.roles.len(),
            config.workers
        )));
    }
    if d.blocks_per_chunk == 0 {
        return Err(ReplayError::InvalidConfig(
            "blocks_per_chunk must be at least 1".into(),
        ));
    }
    d.layout
        .validate()
        .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
    Ok(d.roles.clone())
}

impl Cluster {
    /// The serving core's settings for this cluster (disaggregation off without a
    /// [`DisaggConfig`]).
    pub(super) fn serve_settings(&self) -> ServeSettings {
        match &self.config.disagg {
            None => ServeSettings::default(),
            Some(d) => ServeSettings {
                disaggregation: d.mode.into(),
                min_uncached_tokens: d.min_uncached_tokens,
                max_prefill_queue_tokens: d.max_prefill_queue_tokens,
            },
        }
    }

    /// Queues the prefill of `spec` on worker `p` for decode worker `d`, with the bookings the
    /// serving core made for them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_disaggregated(
        &mut self,
        spec: RequestSpec,
        tokens: Vec<TokenId>,
        d: usize,
        p: usize,
        decode_booking: Booking,
        prefill_booking: Booking,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) -> Result<(), ReplayError> {
        let n = self.flows.next;
        self.flows.next += 1;
        let prefill_id = PREFILL_ID_BASE + n;
        self.records.push(RequestRecord {
            id: spec.id,
            worker: d as u32,
            arrival: self.now,
            first_token: None,
            finished: None,
            prompt_tokens: tokens.len() as u64,
            cached_tokens: 0,
            output_tokens: 0,
            ok: false,
        });
        let slot = self.records.len() - 1;
        self.last_token_at.push(self.now);
        let prefill = SimRequest {
            hold_blocks: true,
            pipeline: true,
            ignore_eos: true,
            ..SimRequest::new(prefill_id, tokens.clone(), 1)
        };
        // The decode side must be able to hold the whole sequence too.
        let fits = self.workers[d]
            .sim
            .config()
            .max_context_tokens
            .checked_sub(tokens.len() as u64)
            .is_some_and(|room| room >= u64::from(spec.max_tokens));
        if !fits || self.workers[p].sim.add_request(prefill).is_err() {
            self.release(&prefill_booking);
            self.release(&decode_booking);
            self.session_ended(spec.id);
            progress.inc(1);
            workload.on_finished(spec.id, false, self.now, out);
            return Ok(());
        }
        self.bookings.insert(spec.id, decode_booking);
        self.live.insert(spec.id, slot);
        self.flows.by_prefill.insert(prefill_id, spec.id);
        self.flows.flows.insert(
            spec.id,
            Flow {
                decode: d,
                prefill: p,
                prefill_id,
                prefill_booking,
                hold: HOLD_ID_BASE + n,
                prompt: tokens,
                max_tokens: spec.max_tokens,
                parent: None,
                link_free_at: self.now,
                cached: 0,
                first: None,
                stopped: false,
            },
        );
        self.flows.stats.disaggregated += 1;
        if self.workers[p].pending.is_none() {
            self.start_step(p);
        }
        Ok(())
    }

    /// Puts the blocks a prefill step exported on their requests' links.
    pub(super) fn export(&mut self, exports: &[BlockExport]) {
        let Some(settings) = self.config.disagg.as_ref() else {
            return;
        };
        let (per_chunk, layout) = (settings.blocks_per_chunk.max(1), settings.layout);
        let block_size = self.block_size.get();
        for export in exports {
            let Some(&request) = self.flows.by_prefill.get(&export.id) else {
                continue;
            };
            let Some(flow) = self.flows.flows.get_mut(&request) else {
                continue;
            };
            let decode = &mut self.workers[flow.decode];
            let timing = decode.sim.config().timing;
            let mut landings = Vec::new();
            for chunk in export.blocks.chunks(per_chunk) {
                let plan = decode
                    .staging
                    .plan(&layout, &layout, block_size, chunk.len() as u32);
                let link = timing.transfer_time(plan.bytes, plan.descriptors);
                let start = flow.link_free_at.max(self.now);
                flow.link_free_at = start + link.as_micros() as Micros;
                let stats = &mut self.flows.stats;
                stats.chunks += 1;
                stats.bytes += plan.bytes;
                stats.descriptors += plan.descriptors;
                stats.transfer_s += link.as_secs_f64();
                landings.push((flow.link_free_at, chunk.to_vec()));
            }
            for (at, blocks) in landings {
                self.schedule(at, Event::Import(request, blocks));
            }
        }
    }

    /// A chunk landed: the decode worker imports it, held for the request.
    pub(super) fn import(&mut self, request: u64, blocks: &[(BlockHash, Vec<TokenId>)]) {
        let Some(flow) = self.flows.flows.get_mut(&request) else {
            return;
        };
        if flow.stopped {
            self.flows.stats.blocks_not_placed += blocks.len() as u64;
            return;
        }
        let (d, hold, parent) = (flow.decode, flow.hold, flow.parent);
        flow.parent = blocks.last().map(|b| b.0).or(parent);
        let outcome = self.workers[d]
            .sim
            .import_blocks(Some(hold), parent, blocks);
        let missing = (blocks.len() - outcome.imported) as u64;
        flow.stopped = missing > 0;
        self.flows.stats.blocks_not_placed += missing;
        self.publish(d, outcome.events);
    }

    /// Whether `token` is a prefill's; if so its request emits once its KV has landed.
    pub(super) fn prefill_done(&mut self, token: &TokenOutput) -> bool {
        let Some(request) = self.flows.by_prefill.remove(&token.id) else {
            return false;
        };
        // The prefill's booking stays until the decode worker's first token: the gateway
        // learns that the prefill ended no sooner.
        if let Some(flow) = self.flows.flows.get_mut(&request) {
            flow.first = Some(token.token);
            flow.cached = token.cached_prompt_tokens;
            let at = flow.link_free_at.max(self.now);
            self.schedule(at, Event::Emit(request));
        }
        true
    }

    /// The decode worker emits the first token and continues the request.
    pub(super) fn emit(
        &mut self,
        request: u64,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) {
        let Some(flow) = self.flows.flows.remove(&request) else {
            return;
        };
        let Some(first) = flow.first else {
            return;
        };
        // The pull is done: the prefill worker's hold goes, and with the decode worker's first
        // token its booking ends and the decode worker's request is decoding.
        self.workers[flow.prefill].sim.release_hold(flow.prefill_id);
        self.release(&flow.prefill_booking);
        if let Some(booking) = self.bookings.get(&request) {
            self.core.prefill_done(booking);
        }
        let Some(&slot) = self.live.get(&request) else {
            return;
        };
        let record = &mut self.records[slot];
        record.first_token = Some(self.now);
        record.cached_tokens = u64::from(flow.cached);
        record.output_tokens = 1;
        if let Some(at) = self.last_token_at.get_mut(slot) {
            *at = self.now;
        }
        let d = flow.decode;
        let mut prompt = flow.prompt;
        prompt.push(first);
        let continued = flow.max_tokens > 1
            && self.workers[d]
                .sim
                .add_request(SimRequest {
                    ignore_eos: true,
                    ..SimRequest::new(request, prompt, flow.max_tokens - 1)
                })
                .is_ok();
        if continued {
            self.flows
                .continuations
                .insert(request, (d, Some(flow.hold)));
            if self.workers[d].pending.is_none() {
                self.start_step(d);
            }
            return;
        }
        // One token asked for (done), or the continuation was refused (failed).
        self.workers[d].sim.release_hold(flow.hold);
        let ok = flow.max_tokens <= 1;
        record.ok = ok;
        record.finished = ok.then_some(self.now);
        self.live.remove(&request);
        if let Some(booking) = self.bookings.remove(&request) {
            self.release(&booking);
        }
        if ok {
            self.finished.push(slot);
        }
        self.session_ended(request);
        progress.inc(1);
        workload.on_finished(request, ok, self.now, out);
    }

    /// Tokens emitted before `id`'s outputs on worker `w` (1 for a disaggregated request's
    /// continuation, whose first token came from the prefill); releases the import hold at
    /// the continuation's first output.
    pub(super) fn continued(&mut self, w: usize, id: u64) -> u64 {
        let Some((d, hold)) = self.flows.continuations.get_mut(&id) else {
            return 0;
        };
        if *d != w {
            return 0;
        }
        if let Some(hold) = hold.take() {
            self.workers[w].sim.release_hold(hold);
        }
        1
    }
}
