//! Routing glue: the serving core's steps ([`switchyard_router::serve`]) over the gateway's
//! workers — candidates read from the pool, bookings held by guards that release them when the
//! request ends, the decision log, the KV recording and the routing metrics. What is decided
//! and what is booked is the core's; this file only supplies the gateway's inputs.

use std::sync::Arc;
use std::time::Instant;

use switchyard_core::{BlockHash, EngineKind, WorkerId, WorkerInfo};
use switchyard_router::serve::{
    self, Booking, DecodeFilter, PrefillAsk, PrefillChoice, RescoreBasis, ServeSettings,
    ServingCore, may_decode,
};
use switchyard_router::{Candidate, Decision, RouteError, RouteRequest};

mod candidates;
pub mod placement;
mod prompt_hashes;

pub use candidates::{Candidates, candidates, needs_prefill, prefill_candidates};
pub use prompt_hashes::{BlockNaming, PromptHashes, route_request, route_request_from};

use crate::cluster::pool::journal::Deferred;
use crate::cluster::pool::{ModelRoutes, WorkerHandle, WorkerPool};
use crate::observe::Observers;
pub use crate::observe::audit::decisions::Stage;
use crate::observe::audit::realized::{Realized, realize};
use crate::observe::audit::{DecisionEntry, DecisionLog, OutcomeStatus, RequestTags};
use crate::observe::metrics::PolicyLabels;
use crate::observe::recorder::{PrefillRecord, Record, Recorder, RouteRecord, ServedAs};

/// A routed request. While it lives, the model's load view counts its [`Booking`] on the
/// chosen worker; dropping it releases that count.
#[derive(Debug)]
pub struct RoutedRequest {
    pub worker: Arc<WorkerHandle>,
    pub worker_id: WorkerId,
    /// Shared with the decision log, which keeps the same explanation: copying its per-worker
    /// breakdown was most of a route's allocations with many workers.
    pub decision: Arc<Decision>,
    /// Leading prompt blocks the chosen worker holds in its device tier.
    pub cached_blocks: u32,
    /// What the core booked for this request on the worker.
    pub booking: Booking,
    /// The decision as the decision log keeps it, to which the outcome is written.
    pub audit: Arc<DecisionEntry>,
    decisions: Arc<DecisionLog>,
    pub routes: Arc<ModelRoutes>,
    prefill_done: bool,
    recorder: Arc<Recorder>,
    /// Whether the KV recording sees this request's bookkeeping (`prefill_done`, `finished`,
    /// `prefill_failed`).
    recorded: bool,
    /// The route record of a decode decision whose serving mode is decided next (the prefill
    /// step): written with it by [`RoutedRequest::record_served`] or [`route_prefill`].
    pending: Option<Box<RouteRecord>>,
    /// Sub-agent placement: the candidate the decision priced copying the prompt's prefix
    /// from ([`Decision::peer_source`] over the candidates it was decided among).
    pub peer: Option<WorkerId>,
}

impl RoutedRequest {
    /// Compares the engine's realized prefix hit for this decision with its prediction
    /// ([`realized`](crate::observe::audit::realized)): `comparable` when the worker computed
    /// the prompt itself.
    pub fn realize(
        &self,
        observers: &Observers,
        prompt_blocks: &[BlockHash],
        cached_prompt_tokens: u32,
        comparable: bool,
    ) {
        let index_now = || {
            let core = self.routes.read();
            let index = &core.serving.index;
            let now = index
                .worker_key(&self.worker_id)
                .map_or(0, |key| index.overlap(prompt_blocks).get(key).any_tier);
            (now, index.awaiting_snapshot(&self.worker_id))
        };
        realize(
            &observers.metrics.audit,
            observers.audit.kv_silence_after(),
            Realized {
                entry: &self.audit,
                kv: &self.worker.kv,
                index_now: &index_now,
                prompt_blocks,
                cached_prompt_tokens: u64::from(cached_prompt_tokens),
                comparable,
            },
        );
    }

    /// Writes the route record this decision still holds, with how the attempt is served (see
    /// [`RoutedRequest::pending`]), at once and under the model's lock like every router input.
    /// Nothing happens when the record was written already or the recording is off.
    pub fn record_served(&mut self, served: ServedAs, prefill: Option<PrefillRecord>) {
        if let Some(record) = self.pending.take() {
            let _core = self.routes.lock();
            write_route(&self.recorder, record, served, prefill);
        }
    }

    /// The first token arrived: the request moves from the prefill queue to decoding.
    pub fn prefill_done(&mut self) {
        self.record_served(ServedAs::Aggregated, None);
        if !self.prefill_done {
            self.prefill_done = true;
            self.release(ServingCore::prefill_done, Deferred::PrefillDone);
            if self.recorded {
                self.recorder.record(|| self.bookkeeping_record(true));
            }
        }
    }

    /// The uncached prompt tokens the chosen worker would compute itself.
    pub fn uncached_prompt_tokens(&self) -> u64 {
        self.booking.uncached_prompt_tokens
    }

    /// This prefill failed or was given up: its booking goes, and `decode` computes its prompt
    /// itself again (until another prefill worker is booked for it).
    pub fn prefill_failed(mut self, decode: &mut RoutedRequest) {
        let mut core = self.routes.lock();
        core.serving
            .prefill_failed(&self.booking, &mut decode.booking);
        if self.recorded {
            self.recorder.record(|| Record::PrefillFailed {
                tick: self.recorder.now_tick(),
                model: self.routes.model.clone(),
                key: self.booking.key,
                decode_key: decode.booking.key,
            });
        }
        drop(core);
        // Dropping `self` releases and records nothing more: its booking is gone already.
        self.recorded = false;
    }

    /// The proxy served the request on `worker`, another candidate of the decision than the
    /// chosen one (it went down the endpoint picker's fallbacks): the booking moves there
    /// ([`serve::ServingCore::move_booking`]). The recording keeps the route as decided and
    /// ends it here.
    pub fn served_by(
        &mut self,
        worker: Arc<WorkerHandle>,
        request: &RouteRequest,
        max_tokens: u32,
    ) {
        let to = worker.id();
        if to == self.worker_id {
            return;
        }
        self.record_served(ServedAs::Aggregated, None);
        let moved = self.routes.lock().serving.move_booking(
            &self.booking,
            &self.decision,
            &to,
            request,
            max_tokens,
        );
        if self.recorded {
            self.recorder.record(|| self.bookkeeping_record(false));
            self.recorded = false;
        }
        self.booking = moved;
        self.worker = worker;
        self.worker_id = to;
        self.cached_blocks = self
            .decision
            .explanation
            .workers
            .iter()
            .find(|w| w.worker == self.worker_id)
            .map_or(0, |w| w.overlap.device);
        if self.prefill_done {
            self.routes.lock().serving.prefill_done(&self.booking);
        }
    }

    /// Ends the booking's prefill ([`Deferred::PrefillDone`]) or the booking
    /// ([`Deferred::Finished`]) in the load view: now or when the model's state is next free
    /// ([`ModelRoutes::change`]); at once under the exclusive lock when the KV recording sees
    /// this request, so its records follow the order the router applied them in.
    fn release(&self, now: fn(&mut ServingCore, &Booking), later: fn(Booking) -> Deferred) {
        if self.recorded && self.recorder.is_active() {
            now(&mut self.routes.lock().serving, &self.booking);
        } else {
            self.routes.change(
                |serving| now(serving, &self.booking),
                || later(self.booking.clone()),
            );
        }
    }

    /// The recorder's `prefill_done` or `finished` record of this request.
    fn bookkeeping_record(&self, prefill_done: bool) -> Record {
        let (tick, model, key, worker) = (
            self.recorder.now_tick(),
            self.routes.model.clone(),
            self.booking.key,
            Some(self.worker_id.clone()),
        );
        if prefill_done {
            Record::PrefillDone {
                tick,
                model,
                key,
                worker,
            }
        } else {
            Record::Finished {
                tick,
                model,
                key,
                worker,
            }
        }
    }
}

impl Drop for RoutedRequest {
    fn drop(&mut self) {
        // A prefill decision's work ends with its route (a failure was written before);
        // dispatch writes a decode decision's outcome, which it knows better.
        if self.audit.stage == Stage::Prefill {
            self.decisions
                .end(&self.audit, OutcomeStatus::Completed, None);
        }
        self.record_served(ServedAs::Aggregated, None);
        self.release(ServingCore::finished, Deferred::Finished);
        if self.recorded {
            self.recorder.record(|| self.bookkeeping_record(false));
        }
    }
}

/// What one decode route asks for.
#[derive(Debug, Clone, Copy)]
pub struct DecodeAsk<'a> {
    pub request: &'a RouteRequest,
    /// Tokens the attempt generates (what its booking counts).
    pub max_tokens: u32,
    /// Which generating workers the attempt may use.
    pub filter: DecodeFilter<'a>,
    pub tags: &'a Arc<RequestTags>,
    /// The attempt's number, from 1.
    pub attempt: u32,
    /// Why the candidates were narrowed when an earlier attempt decided it, for the decision
    /// log.
    pub note: Option<&'a str>,
    /// The serving mode is decided after this route (the prefill step may follow): the KV
    /// recording's route record then waits for the mode ([`RoutedRequest::record_served`],
    /// [`route_prefill`]), so a replay serves the request in one step as the serving core's
    /// [`serve::ServingCore::serve`] does.
    pub prefill_pool: bool,
}

impl<'a> DecodeAsk<'a> {
    /// A first attempt served aggregated, with no note: the common case.
    pub fn first(
        request: &'a RouteRequest,
        max_tokens: u32,
        filter: DecodeFilter<'a>,
        tags: &'a Arc<RequestTags>,
    ) -> Self {
        Self {
            request,
            max_tokens,
            filter,
            tags,
            attempt: 1,
            note: None,
            prefill_pool: false,
        }
    }
}

/// Step 1 of the serving core: chooses the generating worker for the ask's request among the
/// candidates its filter leaves, books it, and records the decision (to `observers`).
pub fn route(
    pool: &WorkerPool,
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    ask: DecodeAsk<'_>,
) -> Result<RoutedRequest, RouteError> {
    let candidates = candidates(pool, routes, ask.filter);
    route_candidates(observers, routes, candidates, ask)
}

/// [`route`] among the workers `within` admits as well: the endpoint picker's subset of
/// endpoints a proxy may send the request to.
pub fn route_within(
    pool: &WorkerPool,
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    ask: DecodeAsk<'_>,
    within: &dyn Fn(&WorkerInfo) -> bool,
) -> Result<RoutedRequest, RouteError> {
    let filter = ask.filter;
    let candidates = Candidates::select_within(pool, routes, |w| may_decode(w, filter), within);
    route_candidates(observers, routes, candidates, ask)
}

fn route_candidates(
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    candidates: Candidates,
    ask: DecodeAsk<'_>,
) -> Result<RoutedRequest, RouteError> {
    let DecodeAsk {
        request,
        max_tokens,
        tags,
        ..
    } = ask;
    let started = Instant::now();
    let only = candidates.ids();
    // Decided under the shared lock when the policy can (other decisions for the model run
    // meanwhile), then booked when the state is free (`ModelRoutes::change`). A policy that
    // changes itself to decide, and a recorded decision (whose record must follow every router
    // input in order), decide and book under the exclusive lock.
    let decided = {
        let core = routes.read();
        let serving = &core.serving;
        serving.decide_decode(request, only).map(|decided| {
            decided.map(|d| {
                let basis = RescoreBasis::capture(request, &d, &serving.index, &serving.load);
                let booking = serving.booking_for(&d, request, max_tokens);
                (d, basis, booking)
            })
        })
    };
    let Booked {
        decision,
        booking,
        basis,
        pending,
        peer,
    } = match decided {
        Some(decided) if !observers.recorder.is_active() => {
            let (decision, basis, booking) = decided?;
            count_booking(routes, &booking, request);
            Booked {
                peer: decision.peer_source(only).cloned(),
                decision: Arc::new(decision),
                booking,
                basis,
                pending: None,
            }
        }
        decided => book_locked(observers, routes, &ask, only, decided)?,
    };
    let audit = observers.decisions.push(
        DecisionEntry::new(
            Arc::clone(tags),
            routes.model.clone(),
            routes.block_size.get(),
            ask.attempt,
            Stage::Decode,
            Arc::clone(&decision),
            ask.note.map(str::to_owned),
        )
        .with_basis(basis),
    );
    let m = &observers.metrics;
    m.routing_overhead.observe(started.elapsed().as_secs_f64());
    m.decisions
        .get_or_create(&PolicyLabels {
            policy: decision.explanation.policy,
        })
        .inc();
    m.prompt_blocks_requested
        .inc_by(request.block_hashes.len() as u64);
    m.prompt_blocks_cached
        .inc_by(u64::from(cached_blocks(&decision)));
    let mut routed = routed_request(observers, routes, candidates, decision, booking, audit)?;
    routed.pending = pending;
    routed.peer = peer;
    Ok(routed)
}

/// What a decision settled under the shared lock carries to its booking: the decision, its
/// basis for the counterfactual, and the booking made for it.
type Settled = (Decision, RescoreBasis, Booking);

/// A decode decision and what was booked for it.
struct Booked {
    decision: Arc<Decision>,
    booking: Booking,
    basis: RescoreBasis,
    /// The route record kept for the serving mode ([`RoutedRequest::pending`]).
    pending: Option<Box<RouteRecord>>,
    /// [`RoutedRequest::peer`].
    peer: Option<WorkerId>,
}

/// The booking step under the model's exclusive lock: a decision settled under the shared lock
/// is counted, or (`None`) the policy, which changes itself to decide, decides and books here;
/// the route record is written (or kept for the serving mode) when the recording runs.
fn book_locked(
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    ask: &DecodeAsk<'_>,
    only: &[Candidate],
    decided: Option<Result<Settled, RouteError>>,
) -> Result<Booked, RouteError> {
    let (request, max_tokens, tags) = (ask.request, ask.max_tokens, ask.tags);
    let mut core = routes.lock();
    let (decision, booking, basis) = match decided {
        Some(decided) => {
            let (decision, basis, booking) = decided?;
            let serving = &mut core.serving;
            serving.count_booking(
                &booking,
                &request.block_hashes,
                request.prompt_tokens,
                request.now,
            );
            (decision, booking, basis)
        }
        None => {
            let (decision, booking) = core.serving.route_decode(request, only, max_tokens)?;
            let serving = &core.serving;
            let basis = RescoreBasis::capture(request, &decision, &serving.index, &serving.load);
            (decision, booking, basis)
        }
    };
    let peer = decision.peer_source(only).cloned();
    let decision = Arc::new(decision);
    let mut pending = None;
    if observers.recorder.is_active() {
        let mut record = route_record(routes, ask, only, booking.key, &decision);
        record.tenant.clone_from(&tags.tenant);
        if ask.prefill_pool {
            pending = Some(record);
        } else {
            write_route(&observers.recorder, record, ServedAs::Aggregated, None);
        }
    }
    Ok(Booked {
        decision,
        booking,
        basis,
        pending,
        peer,
    })
}

/// Counts a decode booking made under the shared lock on its worker, now or when the model's
/// state is next free ([`ModelRoutes::change`]).
fn count_booking(routes: &ModelRoutes, booking: &Booking, request: &RouteRequest) {
    routes.change(
        |serving| {
            serving.count_booking(
                booking,
                &request.block_hashes,
                request.prompt_tokens,
                request.now,
            );
        },
        || Deferred::Book {
            booking: booking.clone(),
            blocks: request.block_hashes.clone(),
            prompt_tokens: request.prompt_tokens,
            now: request.now,
        },
    );
}

fn cached_blocks(decision: &Decision) -> u32 {
    decision.chosen().map_or(0, |c| c.overlap.device)
}

/// The outcome of a prefill route.
#[derive(Debug)]
pub enum PrefillRoute {
    /// Booked: the prefill runs on this worker, and the decode worker's booking says it
    /// computes none of the prompt.
    Routed(RoutedRequest),
    /// `auto`, and even the best prefill worker is too busy: stay aggregated (the reason).
    Saturated(String),
    /// No prefill worker can be chosen.
    Unavailable(RouteError),
}

/// What a prefill route is asked: the attempt's request, the serving core's ask for a prefill
/// worker (among those of the decode worker's engine), under the model's serving settings, for
/// the request its decisions are logged under.
#[derive(Debug, Clone, Copy)]
pub struct PrefillRouteAsk<'a> {
    pub settings: &'a ServeSettings,
    pub request: &'a RouteRequest,
    pub ask: &'a PrefillAsk,
    pub tags: &'a Arc<RequestTags>,
}

/// Steps 3 and 4 of the serving core: chooses a prefill worker for the ask's request, books
/// it, makes `decode`'s booking disaggregated, and logs the decision (to `observers`). The
/// first prefill route of an attempt writes the decode route's record with its outcome (a
/// prefill retried after a failure is not recorded: see `docs/kv-recording.md`).
pub fn route_prefill(
    pool: &WorkerPool,
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    prefill: PrefillRouteAsk<'_>,
    decode: &mut RoutedRequest,
) -> PrefillRoute {
    let PrefillRouteAsk {
        settings,
        request,
        ask,
        tags,
    } = prefill;
    let needs_prefill = ask.needs_prefill;
    let candidates = prefill_candidates(
        pool,
        routes,
        ask.engine,
        &ask.exclude,
        request.adapter.as_deref(),
    );
    let (decision, booking, basis) = {
        let mut core = routes.lock();
        let pending = decode.pending.take();
        let record = |served, chosen: Option<&Decision>, key| {
            if let Some(record) = pending {
                let prefill = PrefillRecord {
                    key,
                    candidates: candidates.ids().iter().map(|c| c.worker.clone()).collect(),
                    chosen: chosen.map(|d| d.worker.clone()),
                    cached_blocks: chosen.map_or(0, cached_blocks),
                };
                write_route(&observers.recorder, record, served, Some(prefill));
            }
        };
        let decision =
            match core
                .serving
                .choose_prefill(settings, request, candidates.ids(), needs_prefill)
            {
                PrefillChoice::Chosen(decision) => decision,
                PrefillChoice::Saturated { why, decision } => {
                    record(ServedAs::Aggregated, Some(&decision), None);
                    return PrefillRoute::Saturated(why);
                }
                PrefillChoice::Unavailable(err) => {
                    let served = if settings.disaggregation == serve::Disaggregation::Enforce {
                        ServedAs::Refused
                    } else if needs_prefill {
                        ServedAs::Rerouted
                    } else {
                        ServedAs::Aggregated
                    };
                    record(served, None, None);
                    return PrefillRoute::Unavailable(err);
                }
            };
        let basis =
            RescoreBasis::capture(request, &decision, &core.serving.index, &core.serving.load);
        let booking = core
            .serving
            .book_prefill(&decision, request, &mut decode.booking);
        record(ServedAs::Disaggregated, Some(&decision), Some(booking.key));
        (Arc::new(decision), booking, basis)
    };
    let audit = observers.decisions.push(
        DecisionEntry::new(
            Arc::clone(tags),
            routes.model.clone(),
            routes.block_size.get(),
            ask.try_number,
            Stage::Prefill,
            Arc::clone(&decision),
            None,
        )
        .with_basis(basis),
    );
    match routed_request(observers, routes, candidates, decision, booking, audit) {
        Ok(routed) => PrefillRoute::Routed(routed),
        Err(err) => PrefillRoute::Unavailable(err),
    }
}

/// What a prefill route would decide for `request`, without routing (admin explain).
pub fn explain_prefill(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    settings: &ServeSettings,
    request: &RouteRequest,
    engine: EngineKind,
    needs_prefill: bool,
) -> PrefillChoice {
    let only = prefill_candidates(pool, routes, engine, &[], request.adapter.as_deref());
    routes
        .read()
        .serving
        .explain_prefill(settings, request, only.ids(), needs_prefill)
}

/// The [`RoutedRequest`] for `decision`, whose booking the core made.
fn routed_request(
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    candidates: Candidates,
    decision: Arc<Decision>,
    booking: Booking,
    audit: Arc<DecisionEntry>,
) -> Result<RoutedRequest, RouteError> {
    let Some(worker) = candidates.take(&decision.worker) else {
        // Cannot happen (the policy chooses among the candidates); release what was booked.
        routes.lock().serving.finished(&booking);
        observers.decisions.end(
            &audit,
            OutcomeStatus::Failed,
            Some("the chosen worker was not among the candidates".into()),
        );
        return Err(RouteError::NoCandidates);
    };
    Ok(routed_on(
        observers, routes, worker, decision, booking, audit,
    ))
}

/// The [`RoutedRequest`] on `worker` for `decision`, whose booking the core made.
fn routed_on(
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    worker: Arc<WorkerHandle>,
    decision: Arc<Decision>,
    booking: Booking,
    audit: Arc<DecisionEntry>,
) -> RoutedRequest {
    RoutedRequest {
        worker_id: decision.worker.clone(),
        cached_blocks: cached_blocks(&decision),
        worker,
        decision,
        booking,
        audit,
        decisions: Arc::clone(&observers.decisions),
        routes: Arc::clone(routes),
        prefill_done: false,
        recorder: Arc::clone(&observers.recorder),
        recorded: true,
        pending: None,
        peer: None,
    }
}

/// The recorder's `route` record of a decode decision; its serving mode is filled in when it
/// is written ([`write_route`]).
fn route_record(
    routes: &ModelRoutes,
    ask: &DecodeAsk<'_>,
    candidates: &[Candidate],
    key: u64,
    decision: &Decision,
) -> Box<RouteRecord> {
    let request = ask.request;
    Box::new(RouteRecord {
        tick: request.now,
        model: routes.model.clone(),
        key,
        attempt: ask.attempt,
        block_size: request.block_size.get(),
        prompt_tokens: request.prompt_tokens,
        max_tokens: ask.max_tokens,
        session: request.session.clone(),
        tenant: None,
        block_hashes: request.block_hashes.clone(),
        candidates: candidates.iter().map(|c| c.worker.clone()).collect(),
        policy: decision.explanation.policy.to_owned(),
        chosen: decision.worker.clone(),
        cached_blocks: cached_blocks(decision),
        prefill_pool: ask.prefill_pool,
        served: ServedAs::Aggregated,
        prefill: None,
    })
}

/// Writes a route record with how the attempt was served. Callers hold the model's lock.
fn write_route(
    recorder: &Recorder,
    mut record: Box<RouteRecord>,
    served: ServedAs,
    prefill: Option<PrefillRecord>,
) {
    record.served = served;
    record.prefill = prefill;
    recorder.record(|| Record::Route(record));
}

/// What the current policy would decide for `tokens`, without sending or recording anything.
///
/// Evaluated on a copy of the live policy, so the preview sees its state (turn, session pins,
/// predicted caches) without changing it.
pub fn explain(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    request: &RouteRequest,
    filter: DecodeFilter<'_>,
) -> Result<Decision, RouteError> {
    let only = candidates(pool, routes, filter);
    routes.read().serving.explain_decode(request, only.ids())
}

#[cfg(test)]
#[path = "concurrent_tests.rs"]
mod concurrent_tests;
