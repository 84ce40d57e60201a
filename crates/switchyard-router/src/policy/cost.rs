//! The cost model every load-aware policy scores with: the `kv` policy's settings and the
//! per-worker breakdown the explanation shows, in seconds of the worker's time:
//!
//! ```text
//! prefill_term = prefill_weight × ((uncached + queued prefill + overflow tokens) / prefill rate + onboarding)
//! decode_term  = decode_weight  × active blocks × block size / prefill rate
//! ```
//!
//! `overflow` is the memory term: the blocks the request's uncached prompt, and the cached
//! blocks it loads from other tiers or copies from a peer, need on top of the worker's active
//! blocks (reported plus booked) past the device capacity it reports, in tokens. An engine out
//! of KV memory preempts running sequences and computes them again later
//! (vLLM's and SGLang's recompute preemption, the simulator's), or holds the request until
//! enough of them finish; either way that many tokens of work are added to what the worker
//! owes, so they are priced as recomputation, in the same units as the queue. A worker that
//! reports no capacity is priced none. (Issue 45: on `dev_120`, 4 workers at twice the base
//! concurrency, kv without it sent long first turns to workers whose memory was full: TTFT p99
//! 290.7 s, behind Dynamo's cost; with it 104.8 s, and the hit rate 88.1 → 90.2 %.)
//!
//! `uncached` is what the worker recomputes: the prompt past its longest cached prefix in any
//! tier. `onboarding` is the time to bring that prefix's non-device blocks to the device:
//! per tier, the tier's latency plus the blocks' bytes over its bandwidth, plus the bytes
//! already queued on the worker's transfer path drained at its host link (every tier's blocks
//! cross the host-to-device link last). Bytes per block, bandwidths, latencies and the prefill
//! rate are what the worker announced at registration ([`KvTierCosts`]); a worker that
//! announced none is assumed [`KvTierCosts::typical`], and the explanation says so. A hit is
//! priced at its load time, as the engine will take it (vLLM, SGLang and LMCache load every
//! hit they find); the explanation shows the time recomputing the same tokens would take, so
//! a tier slower than recompute is visible, and a worker holding blocks only there loses to a
//! cold one with the same queue.
//!
//! Its own file so that the `kv` policy and the explanation both build on it without using each
//! other.

use serde::{Deserialize, Serialize};
use switchyard_core::{KvTierCosts, StorageTier, TierLink, WorkerId};

use super::explain::WorkerScore;
use super::placement;
use super::{Candidate, RouteRequest};
use crate::error::RouteError;
use crate::hasher::FxHashMap;
use crate::index::TierOverlap;
use crate::load::{LoadView, WorkerLoad};

/// KV bytes per token assumed for a worker that announces no tier costs: an 8B-class model in
/// fp16 (32 layers × 8 KV heads × 128 dims × K and V × 2 bytes), the simulator's default.
pub const ASSUMED_KV_BYTES_PER_TOKEN: u64 = 131_072;

/// Default [`KvConfig::prefill_step_tokens`]: vLLM's and SGLang's default step budget.
pub const DEFAULT_PREFILL_STEP_TOKENS: u64 = 8192;

/// Settings of the `kv` policy (also the load terms of the other policies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    pub prefill_weight: f64,
    pub decode_weight: f64,
    /// Replaced by the tier costs workers announce; refused when set (see [`KvConfig::validate`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_hit_factor: Option<f64>,
    /// Replaced like `host_hit_factor`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_hit_factor: Option<f64>,
    /// 0 picks the lowest cost; above 0 samples (softmax over normalised costs).
    pub temperature: f64,
    /// Prompt tokens an engine prefills per step (vLLM's `max_num_batched_tokens`, SGLang's
    /// chunked prefill size; both 8,192 by default): a request queued behind another finds the
    /// blocks they share cached only if at least a step of work lies between them (see
    /// `load::pending`).
    pub prefill_step_tokens: u64,
    /// The link between workers a prefix can be copied over (sub-agent placement, see
    /// `placement`) for workers that announce none: with one, such a worker may be priced with
    /// copying the device prefix another such worker holds instead of recomputing it. Not read
    /// from configuration: the replay lab's cluster sets it for its simulated workers; live
    /// workers announce their own link (`WorkerInfo::kv_peer`), which the gateway prices.
    #[serde(skip)]
    pub peer_link: Option<TierLink>,
    /// The host-to-device link of workers that announce no tier costs, in place of
    /// [`KvTierCosts::typical`]'s. Not read from configuration: the replay lab's cluster sets it
    /// to its simulators' own link, so that a host hit is priced at the time the simulated
    /// engine takes to load it (live workers announce their own, `WorkerInfo::kv_tiers`).
    #[serde(skip)]
    pub host_link: Option<TierLink>,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            prefill_weight: 1.0,
            decode_weight: 0.1,
            host_hit_factor: None,
            disk_hit_factor: None,
            temperature: 0.0,
            prefill_step_tokens: DEFAULT_PREFILL_STEP_TOKENS,
            peer_link: None,
            host_link: None,
        }
    }
}

impl KvConfig {
    pub fn validate(&self) -> Result<(), RouteError> {
        for (key, set) in [
            ("host_hit_factor", self.host_hit_factor.is_some()),
            ("disk_hit_factor", self.disk_hit_factor.is_some()),
        ] {
            if set {
                return Err(RouteError::InvalidConfig(format!(
                    "kv.{key} is no longer used: a tier hit is priced in time from the tier costs each worker announces (the worker's [kv_tiers] section or --kv-host-gbytes-per-s and the like); remove it"
                )));
            }
        }
        let finite_non_neg = |v: f64| v.is_finite() && v >= 0.0;
        if !finite_non_neg(self.prefill_weight) || !finite_non_neg(self.decode_weight) {
            return Err(RouteError::InvalidConfig(
                "kv weights must be finite and non-negative".into(),
            ));
        }
        if self.peer_link.is_some_and(|l| l.bytes_per_s == 0) {
            return Err(RouteError::InvalidConfig(
                "the peer link's bandwidth must be positive".into(),
            ));
        }
        if self.host_link.is_some_and(|l| l.bytes_per_s == 0) {
            return Err(RouteError::InvalidConfig(
                "the host link's bandwidth must be positive".into(),
            ));
        }
        if self.prefill_step_tokens == 0 {
            return Err(RouteError::InvalidConfig(
                "kv.prefill_step_tokens must be at least 1".into(),
            ));
        }
        if !finite_non_neg(self.temperature) {
            return Err(RouteError::InvalidConfig(
                "temperature must be finite and non-negative".into(),
            ));
        }
        Ok(())
    }
}

/// What serving the request's cached prefix costs a worker: blocks to load per tier, the time
/// that takes, and what recomputing them instead would take.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Onboarding {
    /// Leading blocks to load from host, disk and the remote tier.
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub remote_blocks: u32,
    /// Bytes those blocks are.
    pub bytes: u64,
    /// Bytes already queued on the worker's transfer path ahead of them.
    pub queued_bytes: u64,
    /// Seconds until they are on the device (queue, latencies, transfers).
    pub seconds: f64,
    /// Seconds recomputing the same tokens would take there.
    pub recompute_seconds: f64,
    /// Blocks past the worker's own cached prefix copied from a peer's device (placement),
    /// and the seconds the copy takes; its recompute time is `peer_recompute_seconds`. Left out
    /// of the JSON when no copy is priced, so explanations without placement read as before.
    #[serde(skip_serializing_if = "no_peer_blocks")]
    pub peer_blocks: u32,
    #[serde(skip_serializing_if = "no_seconds")]
    pub peer_seconds: f64,
    #[serde(skip_serializing_if = "no_seconds")]
    pub peer_recompute_seconds: f64,
    /// The figures used.
    pub costs: KvTierCosts,
    /// Whether the worker announced them (else [`KvTierCosts::typical`] was assumed).
    pub announced: bool,
}

fn no_peer_blocks(blocks: &u32) -> bool {
    *blocks == 0
}

fn no_seconds(seconds: &f64) -> bool {
    *seconds == 0.0
}

impl Onboarding {
    /// The onboarding of `overlap`'s non-device blocks on a worker with `costs` and
    /// `queued_bytes` ahead on its transfer path.
    pub fn price(
        overlap: TierOverlap,
        costs: KvTierCosts,
        announced: bool,
        queued_bytes: u64,
        block_size: u32,
    ) -> Self {
        let host_blocks = overlap.device_or_host.saturating_sub(overlap.device);
        let disk_blocks = overlap
            .device_host_or_disk
            .saturating_sub(overlap.device_or_host);
        let remote_blocks = overlap.any_tier.saturating_sub(overlap.device_host_or_disk);
        let bytes_of = |blocks: u32| u64::from(blocks) * costs.bytes_per_block;
        let mut seconds = 0.0;
        for (tier, blocks) in [
            (StorageTier::Host, host_blocks),
            (StorageTier::Disk, disk_blocks),
            (StorageTier::Remote, remote_blocks),
        ] {
            if let Some(link) = costs.link(tier) {
                seconds += link.seconds(bytes_of(blocks), 0);
            }
        }
        let loaded = host_blocks + disk_blocks + remote_blocks;
        if loaded > 0 {
            seconds += queued_bytes as f64 / costs.host.bytes_per_s as f64;
        }
        Self {
            host_blocks,
            disk_blocks,
            remote_blocks,
            bytes: bytes_of(loaded),
            queued_bytes,
            seconds,
            recompute_seconds: costs.recompute_seconds(u64::from(loaded) * u64::from(block_size)),
            peer_blocks: 0,
            peer_seconds: 0.0,
            peer_recompute_seconds: 0.0,
            costs,
            announced,
        }
    }

    /// Blocks to load from outside device memory.
    pub fn blocks(&self) -> u32 {
        self.host_blocks + self.disk_blocks + self.remote_blocks
    }
}

/// The tier costs a candidate is scored with, and whether it announced them; a worker that
/// announced none is assumed [`KvTierCosts::typical`], with `host_link` (the configured
/// [`KvConfig::host_link`]) when there is one.
pub(crate) fn costs_of(
    candidate: &Candidate,
    block_size: u32,
    host_link: Option<TierLink>,
) -> (KvTierCosts, bool) {
    match candidate.kv_tiers {
        Some(c) => (c, true),
        None => {
            let typical = KvTierCosts::typical(ASSUMED_KV_BYTES_PER_TOKEN * u64::from(block_size));
            let host = host_link.unwrap_or(typical.host);
            (KvTierCosts { host, ..typical }, false)
        }
    }
}

/// Which blocks a policy counts as a worker's besides what `overlap_of` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    /// Only what the overlap source says (the peers' policies, as they score).
    Ignored,
    /// The leading blocks requests in flight bring to each worker ([`LoadView::pending_leading`]):
    /// a request queued behind them finds them cached.
    Counted,
}

/// Fills the breakdown of every candidate; `score` is set to the kv cost
/// (`prefill_term + decode_term`, seconds), which policies may overwrite.
pub(crate) fn breakdown(
    request: &RouteRequest,
    candidates: &[Candidate],
    load: &LoadView,
    cfg: &KvConfig,
    overlap_of: impl Fn(&WorkerId) -> TierOverlap,
    pending: Pending,
) -> Vec<WorkerScore> {
    let scorer = Scorer::new(request, candidates, load, cfg, overlap_of, pending);
    scorer.all()
}

/// The cost model over one request's candidates: what [`breakdown`] fills, one candidate at a
/// time, so that a policy can rank many candidates by their cost alone and build the full
/// breakdown only for those it explains (`shortlist`).
pub(crate) struct Scorer<'a> {
    request: &'a RouteRequest,
    candidates: &'a [Candidate],
    load: &'a LoadView,
    cfg: &'a KvConfig,
    /// Per candidate, with the pending blocks counted.
    overlaps: Vec<TierOverlap>,
    pending: Vec<u32>,
}

impl<'a> Scorer<'a> {
    pub(crate) fn new(
        request: &'a RouteRequest,
        candidates: &'a [Candidate],
        load: &'a LoadView,
        cfg: &'a KvConfig,
        overlap_of: impl Fn(&WorkerId) -> TierOverlap,
        pending: Pending,
    ) -> Self {
        let bs = request.block_size.get();
        let pending = match pending {
            Pending::Ignored => Vec::new(),
            Pending::Counted => {
                load.pending_leading(&request.block_hashes, bs, cfg.prefill_step_tokens)
            }
        };
        let pending_map: FxHashMap<&WorkerId, u32> = pending.iter().map(|(w, n)| (w, *n)).collect();
        let pending_of = |w: &WorkerId| {
            if pending_map.is_empty() {
                0
            } else {
                pending_map.get(w).copied().unwrap_or(0)
            }
        };
        let pending: Vec<u32> = candidates.iter().map(|c| pending_of(&c.worker)).collect();
        let overlaps = candidates
            .iter()
            .zip(&pending)
            .map(|(c, &p)| with_pending(overlap_of(&c.worker), p))
            .collect();
        Self {
            request,
            candidates,
            load,
            cfg,
            overlaps,
            pending,
        }
    }

    /// Whether some candidate may be priced a copy from a peer ([`placement`]): then a
    /// candidate's cost depends on the others' overlap.
    pub(crate) fn prices_peer_copies(&self) -> bool {
        self.cfg.peer_link.is_some() || self.candidates.iter().any(|c| c.kv_peer.is_some())
    }

    pub(crate) fn len(&self) -> usize {
        self.candidates.len()
    }

    pub(crate) fn candidate(&self, i: usize) -> &Candidate {
        &self.candidates[i]
    }

    /// Candidate `i`'s cost and running requests: what the choice rule compares first.
    pub(crate) fn cost(&self, i: usize) -> (f64, u64) {
        let (figures, load) = self.figures(i);
        (
            figures.prefill_term + figures.decode_term,
            load.running_requests,
        )
    }

    /// Every candidate's breakdown, in their order.
    pub(crate) fn all(&self) -> Vec<WorkerScore> {
        (0..self.candidates.len()).map(|i| self.score(i)).collect()
    }

    /// Candidate `i`'s full breakdown.
    pub(crate) fn score(&self, i: usize) -> WorkerScore {
        let (f, l) = self.figures(i);
        breakdown_of(&self.candidates[i], self.overlaps[i], self.pending[i], l, f)
    }

    fn figures(&self, i: usize) -> (Figures, WorkerLoad) {
        let c = &self.candidates[i];
        let l = self.load.get(&c.worker);
        let (costs, _) = costs_of(c, self.request.block_size.get(), self.cfg.host_link);
        let peers = placement::PeerView::new(self.candidates, &self.overlaps, self.cfg.peer_link);
        let peer = peers.copy_for(i, &costs, self.request.block_size.get());
        let figures = figures_of(self.request, self.cfg, c, self.overlaps[i], &l, peer);
        (figures, l)
    }
}

/// What the cost model adds to a candidate's load.
pub(crate) struct Figures {
    uncached: u64,
    overflow_blocks: u64,
    onboarding: Onboarding,
    prefill_term: f64,
    decode_term: f64,
}

impl Figures {
    /// The kv cost: what the choice rule compares first.
    pub(crate) fn cost(&self) -> f64 {
        self.prefill_term + self.decode_term
    }
}

/// The cost model for one candidate with `overlap` (pending blocks counted), load `l` and
/// `peer` copy: every path that prices a candidate ([`Scorer`], the ranked decision) prices it
/// here, so their figures agree to the bit.
pub(crate) fn figures_of(
    request: &RouteRequest,
    cfg: &KvConfig,
    c: &Candidate,
    overlap: TierOverlap,
    l: &WorkerLoad,
    peer: placement::PeerCopy,
) -> Figures {
    let bs = request.block_size.get();
    let (costs, announced) = costs_of(c, bs, cfg.host_link);
    let mut onboarding = Onboarding::price(overlap, costs, announced, l.queued_onboard_bytes, bs);
    onboarding.peer_blocks = peer.blocks;
    onboarding.peer_seconds = peer.seconds;
    onboarding.peer_recompute_seconds = peer.recompute_seconds;
    let cached = u64::from(overlap.any_tier + peer.blocks) * u64::from(bs);
    let uncached = request.prompt_tokens.saturating_sub(cached);
    // A block loaded from another tier or copied from a peer takes a device block as surely
    // as a computed one: the engine allocates it before the copy lands.
    let new_blocks =
        uncached.div_ceil(u64::from(bs)) + u64::from(onboarding.blocks()) + u64::from(peer.blocks);
    let overflow_blocks = if l.capacity_blocks > 0 {
        (l.active_blocks + new_blocks).saturating_sub(l.capacity_blocks)
    } else {
        0
    };
    let prefill_seconds = costs
        .recompute_seconds(uncached + l.queued_prefill_tokens + overflow_blocks * u64::from(bs))
        + onboarding.seconds
        + peer.seconds;
    Figures {
        uncached,
        overflow_blocks,
        onboarding,
        prefill_term: cfg.prefill_weight * prefill_seconds,
        decode_term: cfg.decode_weight * costs.recompute_seconds(l.active_blocks * u64::from(bs)),
    }
}

/// The breakdown of candidate `c` from its figures.
pub(crate) fn breakdown_of(
    c: &Candidate,
    overlap: TierOverlap,
    pending_blocks: u32,
    l: WorkerLoad,
    f: Figures,
) -> WorkerScore {
    WorkerScore {
        pending_blocks,
        worker: c.worker.clone(),
        overlap,
        uncached_prompt_tokens: f.uncached,
        queued_prefill_tokens: l.queued_prefill_tokens,
        running_requests: l.running_requests,
        active_decode_sequences: l.active_decode_sequences,
        active_blocks: l.active_blocks,
        kv_utilisation: l.kv_utilisation(),
        onboarding: f.onboarding,
        overflow_blocks: f.overflow_blocks,
        prefill_term: f.prefill_term,
        decode_term: f.decode_term,
        score: f.prefill_term + f.decode_term,
        probability: None,
    }
}

/// `overlap` with `pending` leading blocks counted as device blocks.
pub(crate) fn with_pending(overlap: TierOverlap, pending: u32) -> TierOverlap {
    TierOverlap {
        device: overlap.device.max(pending),
        device_or_host: overlap.device_or_host.max(pending),
        device_host_or_disk: overlap.device_host_or_disk.max(pending),
        any_tier: overlap.any_tier.max(pending),
    }
}
