//! The serving core: how one request is served, written once. The live gateway, the replay
//! lab's cluster and the planner's bench all call it, so a policy studied offline is the policy
//! that runs live.
//!
//! A request is served in steps, each a method of [`ServingCore`] (pure: no I/O, no async, the
//! caller's clock in [`RouteRequest::now`]):
//!
//! 1. **Decode worker** ([`ServingCore::route_decode`]): the live policy chooses among the
//!    candidates (`candidates`: role, draining, exclusions, engine pairing) and the request
//!    is booked on it as aggregated ([`BookingKind::Aggregated`]).
//! 2. **Mode** ([`serving_mode`]): from what that worker would compute (its uncached prompt
//!    tokens) and the [`ServeSettings`], stay aggregated or try the prefill pool.
//! 3. **Prefill worker** ([`ServingCore::choose_prefill`]): the `kv` policy over the prefill
//!    candidates of the decode worker's engine; under `auto` a saturated pool keeps the request
//!    aggregated.
//! 4. **Disaggregated booking** ([`ServingCore::book_prefill`]): the prefill worker is booked
//!    with its own uncached tokens, and the decode worker's booking becomes
//!    [`BookingKind::DisaggregatedDecode`] (it computes none of the prompt). A prefill that
//!    fails is undone with [`ServingCore::prefill_failed`] (the decode worker is aggregated
//!    again until another prefill worker is booked).
//! 5. **Progress** ([`ServingCore::prefill_done`], [`ServingCore::finished`]).
//!
//! The *sequence* of those steps — and of a request's attempts: retries, migrations, reroutes,
//! prefill retries — is written once, in the [`machine`] ([`Serving`]): the gateway's dispatch
//! drives it over its worker transport, and [`ServingCore::serve`] drives it with simulated
//! outcomes for callers with no I/O between steps (the replay lab, the planner's bench).
//!
//! [`retention`] turns a session's observed think times into the retention hint its requests
//! carry ([`ThinkTimes`]), for the live gateway and the replay lab alike.
//!
//! [`sessions`] schedules agent sessions as programs: a turn whose session's working set does
//! not fit beside the resident sessions' waits at its tool-call boundary, up to its aging
//! bound ([`SessionScheduler`]), for the live gateway and the replay lab alike.
//!
//! [`counterfactual`] re-scores a decision already made under another policy, over the load
//! and index overlap recorded with it (the admin API's counterfactual explain).
//!
//! A caller that keeps the model's candidates as one list (the gateway's member list) hands it
//! to [`ServingCore::set_roster`]: the load view then keeps those workers ordered by load, and a
//! decode decision among exactly that list reads the order instead of scoring every candidate
//! (`policy::ranked`), with the same result. Callers that build their candidates per request
//! (the replay lab, the planner's bench) decide as before.
//!
//! What a booking counts is decided in one place ([`Booking`]'s constructors): a generating
//! worker holds `prompt + max_tokens` tokens of KV, a prefill worker `prompt` tokens; a
//! worker's queued prefill is what it computes of the prompt.

mod candidates;
pub mod counterfactual;
pub mod machine;
mod offline;
pub mod retention;
pub mod sessions;
mod settings;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use switchyard_core::{BlockHash, BlockSize, KvIdentity, TokenId, WorkerId};

use crate::error::RouteError;
use crate::index::{IndexConfig, PrefixIndex};
use crate::load::ranking::RankWeights;
use crate::load::{LoadConfig, LoadView, RequestId, Tick};
use crate::policy::{
    Candidate, Decision, Policy, PolicyConfig, PolicyKind, RouteRequest, SharedAsk, roster_worker,
};

pub use candidates::{DecodeFilter, WorkerFacts, may_decode, may_prefill_for, needs_prefill};
pub use counterfactual::{RescoreBasis, rescore};
pub use machine::{
    After, AttemptEnd, AttemptKind, Blame, Finish, Mode, Plan, PrefillAsk, PrefillFailure,
    PrefillPick, RouteAsk, RouteFailure, Routed, ServeError, Serving, Step, no_prefill_worker,
    serves_only_with_prefill,
};
pub use offline::{ServeOutcome, Served};
pub use retention::{RetentionConfig, ThinkTimes};
pub use sessions::{Offer, SessionScheduler, SessionStats};
pub use settings::{
    DEFAULT_MAX_PREFILL_QUEUE_TOKENS, DEFAULT_MIN_UNCACHED_TOKENS, Disaggregation, ServeSettings,
};

/// The route request for `tokens`: their chained block hashes and length.
pub fn route_request(
    tokens: &[TokenId],
    block_size: BlockSize,
    session: Option<String>,
    now: Tick,
) -> RouteRequest {
    route_request_as(tokens, &KvIdentity::PLAIN, block_size, session, now)
}

/// [`route_request`] for a prompt whose KV is named by `identity` (an adapter, a cache salt):
/// its blocks hash as the engine's events for that identity do, so it only matches them.
pub fn route_request_as(
    tokens: &[TokenId],
    identity: &KvIdentity,
    block_size: BlockSize,
    session: Option<String>,
    now: Tick,
) -> RouteRequest {
    RouteRequest {
        block_hashes: identity.block_hashes(tokens, block_size),
        prompt_tokens: tokens.len() as u64,
        block_size,
        session,
        now,
        adapter: identity.adapter.clone(),
    }
}

/// What a booking stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BookingKind {
    /// The worker computes the uncached prompt and generates.
    Aggregated,
    /// The worker generates from KV a prefill worker computes: no prefill of its own.
    DisaggregatedDecode,
    /// A prefill-pool worker computing the prompt's KV for a decode worker.
    Prefill,
}

/// A request's place in the load view, from routing until it ends. Plain data: the caller
/// gives it back to [`ServingCore::prefill_done`] and [`ServingCore::finished`] (the gateway
/// wraps it in a guard that does so when the request ends).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Booking {
    pub worker: WorkerId,
    /// The load view's request id, unique per core.
    pub key: RequestId,
    pub kind: BookingKind,
    /// Prompt tokens this worker would compute itself (its uncached part).
    pub uncached_prompt_tokens: u64,
    /// Prefill tokens counted in the worker's queue.
    pub prefill_tokens: u64,
    /// KV blocks the request will occupy there.
    pub blocks: u64,
    /// Bytes of its cached prefix the worker loads from non-device tiers first (they queue on
    /// its transfer path).
    pub onboard_bytes: u64,
}

impl Booking {
    /// What a request routed to `decision`'s worker books there when that worker computes its
    /// prompt and generates `max_tokens`: its uncached prompt tokens queue as prefill, and it
    /// will hold `prompt + max_tokens` tokens of KV. (Also the rule `switchyard replay events`
    /// books by, replaying a recording against other policies.)
    pub fn aggregated(
        key: RequestId,
        decision: &Decision,
        request: &RouteRequest,
        max_tokens: u32,
    ) -> Self {
        let uncached = uncached_of(decision, request);
        Self {
            worker: decision.worker.clone(),
            key,
            kind: BookingKind::Aggregated,
            uncached_prompt_tokens: uncached,
            prefill_tokens: uncached,
            blocks: (request.prompt_tokens + u64::from(max_tokens))
                .div_ceil(u64::from(request.block_size.get())),
            onboard_bytes: onboard_bytes_of(decision),
        }
    }
}

/// Why the first step chose the mode it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModeChoice {
    /// Prefill on the decode worker; the reason is for logs and explanations.
    Aggregated(String),
    /// Try the prefill pool. `forced`: the decode worker serves only with a prefill worker
    /// ([`needs_prefill`]) and `auto` must not fall back to aggregated on it.
    TryPrefill { forced: bool },
}

/// Step 2: whether the prefill pool should be tried, from what the decode worker would
/// compute (`uncached`) and whether it [`needs_prefill`].
pub fn serving_mode(settings: &ServeSettings, uncached: u64, needs_prefill: bool) -> ModeChoice {
    match settings.disaggregation {
        Disaggregation::Off => ModeChoice::Aggregated("disaggregation is off".into()),
        Disaggregation::Enforce => ModeChoice::TryPrefill { forced: false },
        Disaggregation::Auto if needs_prefill => ModeChoice::TryPrefill { forced: true },
        Disaggregation::Auto if uncached < settings.min_uncached_tokens => {
            ModeChoice::Aggregated(format!(
                "{uncached} uncached prompt tokens on the decode worker, below the threshold of {}",
                settings.min_uncached_tokens
            ))
        }
        Disaggregation::Auto => ModeChoice::TryPrefill { forced: false },
    }
}

/// Whether an attempt can only use workers that serve without a prefill worker: with
/// disaggregation off, for a migration (it continues from generated tokens on one worker), and
/// after a reroute (a decode worker that needed a prefill worker could get none).
pub fn aggregated_only(settings: &ServeSettings, migrating: bool, rerouted: bool) -> bool {
    settings.disaggregation == Disaggregation::Off || migrating || rerouted
}

/// The outcome of step 3.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillChoice {
    /// Prefill on the decision's worker.
    Chosen(Decision),
    /// `auto` and even the best prefill worker has too much queued: stay aggregated.
    Saturated { decision: Decision, why: String },
    /// No prefill worker could be chosen.
    Unavailable(RouteError),
}

/// One model's routing state and the serving decision over it: the prefix index, the load
/// view, the live policy and the prefill pool's policy.
#[derive(Debug)]
pub struct ServingCore {
    pub index: PrefixIndex,
    pub load: LoadView,
    policy: Box<dyn Policy>,
    policy_kind: PolicyKind,
    /// The prefill pool's choice: `kv` cost (uncached tokens plus queued prefill), whatever the
    /// live policy is; its per-request state (session pins, predicted caches, turns) describes
    /// the decode pool and must not be moved by prefill choices.
    prefill_policy: Box<dyn Policy>,
    block_size: BlockSize,
    /// The next booking's key: taken under a shared borrow too ([`ServingCore::booking_for`]).
    next_key: AtomicU64,
    /// Decode decisions so far, counted to explain one in [`EXPLAIN_ALL_EVERY`] in full.
    decided: AtomicU64,
    /// The model's candidates as the caller keeps them ([`ServingCore::set_roster`]): a
    /// decision among exactly this list reads the load view's ranking of it.
    roster: Arc<[Candidate]>,
    /// What the load view ranks the roster by: the `kv` settings' weights.
    rank_weights: (f64, f64),
}

/// One decode decision in this many explains every candidate, however many there are: the
/// decision log's sample of full explanations. The others explain the best few when there are
/// many candidates (`policy::shortlist`); the choice is the same either way.
pub const EXPLAIN_ALL_EVERY: u64 = 256;

impl ServingCore {
    pub fn new(
        block_size: BlockSize,
        index: IndexConfig,
        load: LoadConfig,
        policy_kind: PolicyKind,
        policy_config: &PolicyConfig,
    ) -> Result<Self, RouteError> {
        Ok(Self {
            index: PrefixIndex::new(index),
            load: LoadView::new(load),
            policy: policy_kind.build(policy_config)?,
            policy_kind,
            prefill_policy: PolicyKind::Kv.build(&PolicyConfig::default())?,
            block_size,
            next_key: AtomicU64::new(1),
            decided: AtomicU64::new(0),
            roster: Arc::from(Vec::new()),
            rank_weights: (
                policy_config.kv.prefill_weight,
                policy_config.kv.decode_weight,
            ),
        })
    }

    /// The model's candidates when every one may take a request, as the caller keeps them (the
    /// gateway's member list): a decode decision among this very list — the same allocation,
    /// not a copy — reads the load view's ranking of it ([`crate::load::ranking`]) instead of
    /// scoring every candidate. Call it again whenever the list is replaced.
    pub fn set_roster(&mut self, roster: Arc<[Candidate]>) {
        let (prefill_weight, decode_weight) = self.rank_weights;
        let block_size = self.block_size.get();
        let weights = RankWeights {
            prefill_weight,
            decode_weight,
            block_size,
        };
        self.load
            .set_roster(weights, roster.iter().map(|c| roster_worker(c, block_size)));
        self.roster = roster;
    }

    /// Whether `candidates` is the roster itself ([`ServingCore::set_roster`]): a decode
    /// decision among them reads the load view's ranking.
    pub fn is_roster(&self, candidates: &[Candidate]) -> bool {
        !candidates.is_empty() && std::ptr::eq(candidates, &*self.roster)
    }

    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    pub fn policy_kind(&self) -> PolicyKind {
        self.policy_kind
    }

    /// Replaces the live policy (it starts fresh: pins and predictions belong to the old one).
    pub fn set_policy(&mut self, kind: PolicyKind, policy: Box<dyn Policy>) {
        self.policy = policy;
        self.policy_kind = kind;
    }

    /// A worker left: forget its blocks, its load and whatever the policies remember of it.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        self.index.remove_worker(worker);
        self.load.remove_worker(worker);
        self.policy.worker_removed(worker);
        self.prefill_policy.worker_removed(worker);
    }

    fn next_key(&self) -> RequestId {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// Step 1: the live policy chooses the generating worker among `candidates`, and the
    /// request is booked there as [`BookingKind::Aggregated`] with `max_tokens` to generate.
    pub fn route_decode(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        max_tokens: u32,
    ) -> Result<(Decision, Booking), RouteError> {
        let decision = match self.decide_decode(request, candidates) {
            Some(decided) => decided?,
            None => {
                let explain_all = self.explains_all();
                self.policy.explain_all(explain_all);
                let decided = self
                    .policy
                    .choose(request, candidates, &self.index, &self.load);
                self.policy.explain_all(false);
                decided?
            }
        };
        let booking = self.book_decode(&decision, request, max_tokens);
        Ok((decision, booking))
    }

    /// Step 1's choice when the live policy can make it without changing itself (the `kv`
    /// policy without a temperature): under a shared borrow, so callers deciding for one model
    /// from several threads need not take turns (they book with [`ServingCore::book_decode`]).
    /// `None`: the policy must change to decide; call [`ServingCore::route_decode`].
    pub fn decide_decode(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
    ) -> Option<Result<Decision, RouteError>> {
        if candidates.is_empty() {
            return Some(Err(RouteError::NoCandidates));
        }
        let explain_all = self
            .decided
            .load(Ordering::Relaxed)
            .is_multiple_of(EXPLAIN_ALL_EVERY);
        let ask = SharedAsk {
            explain_all,
            rostered: self.is_roster(candidates),
        };
        let decided =
            self.policy
                .choose_shared(request, candidates, &self.index, &self.load, ask)?;
        self.decided.fetch_add(1, Ordering::Relaxed);
        Some(decided)
    }

    /// Books the request on `decision`'s worker as [`BookingKind::Aggregated`] with
    /// `max_tokens` to generate: step 1's second half.
    pub fn book_decode(
        &mut self,
        decision: &Decision,
        request: &RouteRequest,
        max_tokens: u32,
    ) -> Booking {
        let booking = self.booking_for(decision, request, max_tokens);
        self.book(&booking, request);
        booking
    }

    /// What [`ServingCore::book_decode`] would book for `decision`, with its key taken, under a
    /// shared borrow: a caller deciding from several threads counts it later with
    /// [`ServingCore::count_booking`] (until then the load view does not see it).
    pub fn booking_for(
        &self,
        decision: &Decision,
        request: &RouteRequest,
        max_tokens: u32,
    ) -> Booking {
        Booking::aggregated(self.next_key(), decision, request, max_tokens)
    }

    /// Counts a booking made by [`ServingCore::booking_for`] on its worker: `blocks` (the
    /// request's prompt blocks), `prompt_tokens` long, routed at `now`, as
    /// [`ServingCore::book_decode`] counts its own.
    pub fn count_booking(
        &mut self,
        booking: &Booking,
        blocks: &[BlockHash],
        prompt_tokens: u64,
        now: Tick,
    ) {
        self.load.add_pending(
            crate::load::pending::Incoming {
                request: booking.key,
                worker: &booking.worker,
                blocks,
                prompt_tokens,
                prefill_tokens: booking.prefill_tokens,
            },
            now,
        );
        self.load.on_routed(
            &booking.worker,
            booking.key,
            booking.prefill_tokens,
            booking.blocks,
            now,
        );
        self.load
            .set_onboard_bytes(&booking.worker, booking.key, booking.onboard_bytes);
    }

    /// Whether the next decode decision explains every candidate ([`EXPLAIN_ALL_EVERY`]).
    fn explains_all(&self) -> bool {
        self.decided
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(EXPLAIN_ALL_EVERY)
    }

    /// What step 1 would decide, on a copy of the live policy: nothing changes (admin explain).
    /// Every candidate is explained.
    pub fn explain_decode(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
    ) -> Result<Decision, RouteError> {
        if candidates.is_empty() {
            return Err(RouteError::NoCandidates);
        }
        let mut preview = self.policy.clone_box();
        preview.explain_all(true);
        preview.choose(request, candidates, &self.index, &self.load)
    }

    /// Step 3: the prefill worker among `candidates` (the prefill pool of the decode worker's
    /// engine), or why there is none. Books nothing.
    pub fn choose_prefill(
        &mut self,
        settings: &ServeSettings,
        request: &RouteRequest,
        candidates: &[Candidate],
        needs_prefill: bool,
    ) -> PrefillChoice {
        if candidates.is_empty() {
            return PrefillChoice::Unavailable(RouteError::NoCandidates);
        }
        let decision =
            match self
                .prefill_policy
                .choose(request, candidates, &self.index, &self.load)
            {
                Ok(decision) => decision,
                Err(err) => return PrefillChoice::Unavailable(err),
            };
        saturation(settings, decision, needs_prefill)
    }

    /// What step 3 would decide; nothing changes (admin explain).
    pub fn explain_prefill(
        &self,
        settings: &ServeSettings,
        request: &RouteRequest,
        candidates: &[Candidate],
        needs_prefill: bool,
    ) -> PrefillChoice {
        if candidates.is_empty() {
            return PrefillChoice::Unavailable(RouteError::NoCandidates);
        }
        let mut preview = self.prefill_policy.clone_box();
        preview.explain_all(true);
        match preview.choose(request, candidates, &self.index, &self.load) {
            Ok(decision) => saturation(settings, decision, needs_prefill),
            Err(err) => PrefillChoice::Unavailable(err),
        }
    }

    /// Step 4: books the prompt's prefill on the prefill decision's worker and makes `decode`
    /// (the request's generating worker) a [`BookingKind::DisaggregatedDecode`]: its KV comes
    /// from the prefill worker.
    pub fn book_prefill(
        &mut self,
        prefill: &Decision,
        request: &RouteRequest,
        decode: &mut Booking,
    ) -> Booking {
        let uncached = uncached_of(prefill, request);
        let booking = Booking {
            worker: prefill.worker.clone(),
            key: self.next_key(),
            kind: BookingKind::Prefill,
            uncached_prompt_tokens: uncached,
            prefill_tokens: uncached,
            blocks: request
                .prompt_tokens
                .div_ceil(u64::from(self.block_size.get())),
            onboard_bytes: onboard_bytes_of(prefill),
        };
        self.book(&booking, request);
        decode.kind = BookingKind::DisaggregatedDecode;
        decode.prefill_tokens = 0;
        self.load
            .set_prefill_tokens(&decode.worker, decode.key, decode.prefill_tokens);
        booking
    }

    /// Sub-agent placement's step 4: books the prompt's prefill on `source`, the peer holding
    /// its prefix ([`Decision::peer_source`]), with what `source` computes of it by the decode
    /// decision's breakdown (it hits its cache), and makes `decode` a
    /// [`BookingKind::DisaggregatedDecode`] as [`ServingCore::book_prefill`] does. Returns the
    /// source's booking and the decision it was made from (`decision` with `source` chosen).
    pub fn book_peer_prefill(
        &mut self,
        decision: &Decision,
        source: &WorkerId,
        request: &RouteRequest,
        decode: &mut Booking,
    ) -> (Decision, Booking) {
        let mut prefill = Decision {
            worker: source.clone(),
            explanation: decision.explanation.clone(),
        };
        prefill.explanation.chosen = source.clone();
        let booking = self.book_prefill(&prefill, request, decode);
        (prefill, booking)
    }

    /// A booked prefill failed (or was given up): its booking goes, and `decode` computes its
    /// prompt itself again until another prefill worker is booked.
    pub fn prefill_failed(&mut self, prefill: &Booking, decode: &mut Booking) {
        self.finished(prefill);
        decode.kind = BookingKind::Aggregated;
        decode.prefill_tokens = decode.uncached_prompt_tokens;
        self.load
            .set_prefill_tokens(&decode.worker, decode.key, decode.prefill_tokens);
    }

    /// The booked request's prefill finished on its worker (a first token, or the end of a
    /// prefill): it no longer queues prefill there.
    pub fn prefill_done(&mut self, booking: &Booking) {
        self.load.on_prefill_done(&booking.worker, booking.key);
    }

    /// The request was served by `to`, another candidate of `decision` than the one it was
    /// booked on (a proxy went down the endpoint picker's fallbacks): the booking on the chosen
    /// worker ends and the request is booked on `to` as aggregated, with what `to` computes of
    /// the prompt by the decision's breakdown. Returns the new booking.
    pub fn move_booking(
        &mut self,
        booking: &Booking,
        decision: &Decision,
        to: &WorkerId,
        request: &RouteRequest,
        max_tokens: u32,
    ) -> Booking {
        self.finished(booking);
        let mut served = Decision {
            worker: to.clone(),
            explanation: decision.explanation.clone(),
        };
        served.explanation.chosen = to.clone();
        let moved = Booking::aggregated(self.next_key(), &served, request, max_tokens);
        self.book(&moved, request);
        moved
    }

    /// The booked request ended on its worker (finished, failed or cancelled).
    pub fn finished(&mut self, booking: &Booking) {
        self.load.on_finished(&booking.worker, booking.key);
    }

    /// Counts `booking` on its worker, whose cache the request's prompt blocks are on their way
    /// to ([`LoadView::add_pending`]).
    fn book(&mut self, booking: &Booking, request: &RouteRequest) {
        self.count_booking(
            booking,
            &request.block_hashes,
            request.prompt_tokens,
            request.now,
        );
    }
}

/// What the decision's worker loads from non-device tiers (nothing when the policy gave no
/// breakdown).
fn onboard_bytes_of(decision: &Decision) -> u64 {
    decision.chosen().map_or(0, |c| c.onboarding.bytes)
}

/// What the decision's worker would compute of the prompt (all of it when the policy gave no
/// breakdown).
fn uncached_of(decision: &Decision, request: &RouteRequest) -> u64 {
    decision
        .chosen()
        .map_or(request.prompt_tokens, |c| c.uncached_prompt_tokens)
}

/// Saturation applies to `auto` only: `enforce` queues behind a busy prefill worker, and so
/// does a decode worker that cannot serve without one (`needs_prefill`).
fn saturation(settings: &ServeSettings, decision: Decision, needs_prefill: bool) -> PrefillChoice {
    let queued = decision.chosen().map_or(0, |c| c.queued_prefill_tokens);
    if settings.disaggregation == Disaggregation::Auto
        && !needs_prefill
        && queued > settings.max_prefill_queue_tokens
    {
        let why = format!(
            "prefill pool saturated: the best prefill worker {} has {queued} prefill tokens queued (limit {})",
            decision.worker, settings.max_prefill_queue_tokens
        );
        PrefillChoice::Saturated { decision, why }
    } else {
        PrefillChoice::Chosen(decision)
    }
}

#[cfg(test)]
mod tests;
