//! Routing policies behind one small trait, and the explanation every decision carries.
//!
//! | name | chooses |
//! |---|---|
//! | `kv` (default) | the lowest predicted cost in seconds: prefill the request waits for (its uncached tokens plus the queue already there, plus loading its cached prefix from host, disk or remote tiers) plus decode pressure; see [`kv`] and `cost` |
//! | `round-robin` | the next candidate in turn |
//! | `random` | a uniformly random candidate (seeded) |
//! | `least-loaded` | the lowest queued prefill plus decode pressure, ignoring caches |
//! | `session` | the worker a session id is pinned to, falling back to `kv`; see [`session`] |
//! | `approx-kv` | `kv` scoring with overlap predicted from its own past decisions, for engines that publish no KV events; see [`approx`] |
//! | `dynamo-kv` | NVIDIA Dynamo's KV router cost (overlap weight × prefill blocks + decode blocks), for comparison; see [`dynamo`] |
//! | `sglang-ca` | the SGLang router's cache-aware policy (balance thresholds, a tree of routed requests), for comparison; see [`sglang`] |
//!
//! Every policy fills the same per-worker breakdown ([`WorkerScore`]) so explanations can be
//! compared across policies; `score` is the policy's own figure (lower is better).

pub mod approx;
mod cost;
mod dense;
pub mod dynamo;
mod explain;
pub mod kv;
mod placement;
mod ranked;
pub mod session;
pub mod sglang;
mod shortlist;
mod simple;

use serde::{Deserialize, Serialize};
use switchyard_core::{BlockHash, BlockSize, KvTierCosts, WorkerId, WorkerInfo};

use crate::error::RouteError;
use crate::index::PrefixIndex;
use crate::load::{LoadView, Tick};

pub use approx::{ApproxConfig, ApproxKvPolicy};
pub use cost::{ASSUMED_KV_BYTES_PER_TOKEN, KvConfig, Onboarding};
pub use dynamo::{DynamoConfig, DynamoKvPolicy};
pub use explain::{Explanation, WorkerScore};
pub use kv::KvPolicy;
pub use placement::PeerLink;
pub use session::{SessionConfig, SessionPolicy};
pub use sglang::{SglangCaPolicy, SglangConfig};
pub use simple::{LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy};

/// What the router knows about a request when it routes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRequest {
    /// Chained hashes of the prompt's full blocks, in order.
    pub block_hashes: Vec<BlockHash>,
    /// Prompt length in tokens (including the partial last block).
    pub prompt_tokens: u64,
    /// Block size the hashes were computed with.
    pub block_size: BlockSize,
    /// Session (conversation, agent run) the request belongs to, if the client said.
    pub session: Option<String>,
    /// When the request is routed, on the caller's clock.
    pub now: Tick,
    /// The LoRA adapter the request runs under (its blocks hash under it): only workers that
    /// serve it are candidates ([`crate::serve::DecodeFilter::adapter`]).
    pub adapter: Option<String>,
}

/// A worker the request may go to (healthy, right role, not draining).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub worker: WorkerId,
    /// The tier costs the worker announced; none: typical figures are assumed.
    pub kv_tiers: Option<KvTierCosts>,
    /// The link it pulls a peer's KV over while serving aggregated, and its engine kind (only
    /// a peer of the same kind can hand it KV), when it announced one
    /// ([`WorkerInfo::kv_peer`]): sub-agent placement may price a copy to it.
    pub kv_peer: Option<PeerLink>,
}

impl Candidate {
    /// A worker as its registration describes it.
    pub fn of(info: &WorkerInfo) -> Self {
        Self {
            worker: info.id.clone(),
            kv_tiers: info.kv_tiers,
            kv_peer: info.kv_peer.map(|link| PeerLink {
                engine: info.engine,
                link,
            }),
        }
    }
}

impl From<WorkerId> for Candidate {
    fn from(worker: WorkerId) -> Self {
        Self {
            worker,
            kv_tiers: None,
            kv_peer: None,
        }
    }
}

/// The chosen worker and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub worker: WorkerId,
    pub explanation: Explanation,
}

impl Decision {
    /// The chosen worker's breakdown (its uncached tokens feed [`LoadView::on_routed`]).
    pub fn chosen(&self) -> Option<&WorkerScore> {
        self.explanation
            .workers
            .iter()
            .find(|w| w.worker == self.worker)
    }

    /// Every candidate, the chosen worker first and then the others best first by the deciding
    /// policy's own figures (the order its choice rule ranks them in): where a proxy should go
    /// next when the chosen worker cannot be reached (the endpoint picker's fallbacks).
    pub fn ranked(&self, request: &RouteRequest) -> Vec<&WorkerId> {
        let mut others: Vec<&WorkerScore> = self
            .explanation
            .workers
            .iter()
            .filter(|w| w.worker != self.worker)
            .collect();
        others.sort_by(|a, b| explain::compare(request, a, b));
        std::iter::once(&self.worker)
            .chain(others.into_iter().map(|w| &w.worker))
            .collect()
    }
}

/// A routing policy. `choose` takes `&mut self` because some policies keep state (a turn
/// counter, an RNG, session pins, predicted caches); the caller records the decision in the
/// [`LoadView`] itself.
pub trait Policy: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError>;

    /// Whether the next decisions explain every candidate (the admin API's explain, a sampled
    /// decision), or only the few a policy deciding among many candidates needs (see
    /// `shortlist`). The choice is the same either way.
    fn explain_all(&mut self, _all: bool) {}

    /// The decision [`Policy::choose`] would make, for a policy that can make it without
    /// changing itself (no turn taken, no pin or prediction moved, no generator drawn): then
    /// decisions for one model need not take turns. `None`: call `choose`.
    fn choose_shared(
        &self,
        _request: &RouteRequest,
        _candidates: &[Candidate],
        _index: &PrefixIndex,
        _load: &LoadView,
        _ask: SharedAsk,
    ) -> Option<Result<Decision, RouteError>> {
        None
    }

    /// A worker left; policies that remember workers forget it.
    fn worker_removed(&mut self, _worker: &WorkerId) {}

    /// A copy with the same state, so a decision can be previewed (the admin API's explain)
    /// without moving the live policy's turn, pins or predictions.
    fn clone_box(&self) -> Box<dyn Policy>;
}

/// How a shared decision ([`Policy::choose_shared`]) is asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedAsk {
    /// Explain every candidate (the admin API's explain, a sampled decision).
    pub explain_all: bool,
    /// The candidates are the load view's roster itself ([`LoadView::set_roster`]), in its
    /// order: a policy may read the view's ranking of them ([`crate::load::ranking`]) instead
    /// of scoring every one.
    pub rostered: bool,
}

/// The roster entry of a candidate for the load view's ranking ([`LoadView::set_roster`]):
/// its prefill rate (announced, or the typical one for `block_size`) and whether a peer copy
/// may be priced to it.
pub fn roster_worker(candidate: &Candidate, block_size: u32) -> crate::load::ranking::RosterWorker {
    crate::load::ranking::RosterWorker {
        id: candidate.worker.clone(),
        prefill_tokens_per_s: cost::costs_of(candidate, block_size, None)
            .0
            .prefill_tokens_per_s,
        prices_peer_copies: candidate.kv_peer.is_some(),
    }
}

/// Settings of every policy, so one configuration section can switch between them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Seed of the policies that sample (random, kv with a temperature).
    pub seed: u64,
    pub kv: KvConfig,
    pub session: SessionConfig,
    pub approx: ApproxConfig,
    pub dynamo: DynamoConfig,
    pub sglang: SglangConfig,
}

/// The policies by name, for the CLI and the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    Kv,
    RoundRobin,
    Random,
    LeastLoaded,
    Session,
    ApproxKv,
    DynamoKv,
    SglangCa,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 8] = [
        PolicyKind::Kv,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::Session,
        PolicyKind::ApproxKv,
        PolicyKind::DynamoKv,
        PolicyKind::SglangCa,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Kv => "kv",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::Session => "session",
            PolicyKind::ApproxKv => "approx-kv",
            PolicyKind::DynamoKv => "dynamo-kv",
            PolicyKind::SglangCa => "sglang-ca",
        }
    }

    /// Whether the policy's explanation shows the prefix index's overlap (every policy but
    /// `approx-kv` and `sglang-ca`, which show their own predictions).
    pub fn scores_index_overlap(self) -> bool {
        !matches!(self, PolicyKind::ApproxKv | PolicyKind::SglangCa)
    }

    /// Builds the policy, checking the settings it uses.
    pub fn build(self, config: &PolicyConfig) -> Result<Box<dyn Policy>, RouteError> {
        Ok(match self {
            PolicyKind::Kv => Box::new(KvPolicy::new(config.kv.clone(), config.seed)?),
            PolicyKind::RoundRobin => Box::new(RoundRobinPolicy::new(config.kv.clone())?),
            PolicyKind::Random => Box::new(RandomPolicy::new(config.kv.clone(), config.seed)?),
            PolicyKind::LeastLoaded => Box::new(LeastLoadedPolicy::new(config.kv.clone())?),
            PolicyKind::Session => Box::new(SessionPolicy::new(
                config.session.clone(),
                KvPolicy::new(config.kv.clone(), config.seed)?,
            )?),
            PolicyKind::ApproxKv => Box::new(ApproxKvPolicy::new(
                config.approx.clone(),
                KvPolicy::new(config.kv.clone(), config.seed)?,
            )?),
            PolicyKind::DynamoKv => {
                Box::new(DynamoKvPolicy::new(config.dynamo.clone(), config.seed)?)
            }
            PolicyKind::SglangCa => Box::new(SglangCaPolicy::new(config.sglang.clone())?),
        })
    }
}

impl PolicyKind {
    /// The policy named exactly `name` ([`PolicyKind::as_str`]), as an explanation names it:
    /// the parse without normalising (and allocating).
    pub fn named(name: &str) -> Option<Self> {
        PolicyKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = RouteError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(kind) = PolicyKind::named(s) {
            return Ok(kind);
        }
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == norm)
            .ok_or_else(|| RouteError::UnknownPolicy(s.to_owned()))
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod placement_tests;
#[cfg(test)]
mod ranked_tests;
#[cfg(test)]
mod shortlist_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
