//! The load view: what each worker reported plus what the router sent it since.
//!
//! Workers report [`LoadStats`] every so often. Between two reports the router has already sent
//! more requests, and a burst routed on the last report alone would all land on the worker that
//! looked idle. So the view adds the router's own in-flight bookkeeping on top of the report:
//!
//! - [`LoadView::on_routed`] records a request's predicted prefill tokens (its uncached part)
//!   and the KV blocks it will occupy;
//! - [`LoadView::on_prefill_done`] moves it from the prefill queue to the decode batch;
//! - [`LoadView::on_finished`] releases it.
//!
//! A new report replaces the reported figures and *absorbs* the in-flight requests it already
//! reflects: those routed at least [`LoadConfig::report_lag`] before the report arrived (the
//! lag covers the request's trip to the worker and the report's trip back). Absorbed requests
//! stop counting and are forgotten; requests routed after that point stay counted on top of the
//! report. Times are [`Tick`]s on the caller's monotonic clock (microseconds), so offline
//! replay drives the view with simulated time. Requests never finished (a lost response) are
//! forgotten after [`LoadConfig::in_flight_ttl`], and at most
//! [`LoadConfig::max_in_flight_per_worker`] are kept per worker (oldest dropped first).
//!
//! The view also keeps a roster of the model's candidates ordered by their load
//! ([`ranking`]), updated with every change above, so a decision can read the least loaded
//! workers instead of scoring every one.

pub mod pending;
pub mod ranking;

use serde::Serialize;
use switchyard_core::{BlockHash, LoadStats, WorkerId};

use crate::hasher::FxHashMap;
use pending::{Incoming, PendingPrefixes};
use ranking::{RankWeights, Ranking, RosterWorker};

/// Microseconds on the caller's monotonic clock.
pub type Tick = u64;

/// The caller's id for a routed request, unique among requests in flight.
pub type RequestId = u64;

/// Settings of a [`LoadView`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadConfig {
    /// How long before a report's arrival a request must have been routed to be reflected in
    /// it.
    pub report_lag: Tick,
    /// In-flight requests older than this are forgotten.
    pub in_flight_ttl: Tick,
    pub max_in_flight_per_worker: usize,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            report_lag: 50_000,
            in_flight_ttl: 600_000_000,
            max_in_flight_per_worker: 4096,
        }
    }
}

/// A worker's load as the router predicts it now: reported figures plus in-flight requests.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct WorkerLoad {
    pub queued_prefill_tokens: u64,
    pub running_requests: u64,
    pub active_decode_sequences: u64,
    pub active_blocks: u64,
    /// Device capacity in blocks as last reported (0 when unknown).
    pub capacity_blocks: u64,
    /// Requests routed to the worker and not yet reflected in a report.
    pub in_flight_requests: u64,
    /// KV bytes queued on the worker's transfer path (tier loads of requests routed there and
    /// not yet prefilled, plus any the worker reported).
    pub queued_onboard_bytes: u64,
    /// Whether the worker has reported at least once.
    pub reported: bool,
}

impl WorkerLoad {
    /// Fraction of device blocks referenced by running sequences (0 when capacity is unknown).
    pub fn kv_utilisation(&self) -> f64 {
        if self.capacity_blocks == 0 {
            return 0.0;
        }
        self.active_blocks as f64 / self.capacity_blocks as f64
    }
}

/// One request the router counts on a worker ([`LoadView::bookings`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BookedRequest {
    pub worker: WorkerId,
    pub request: RequestId,
    pub routed_at: Tick,
    pub prefill_tokens: u64,
    pub blocks: u64,
    pub prefill_done: bool,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    routed_at: Tick,
    prefill_tokens: u64,
    blocks: u64,
    onboard_bytes: u64,
    prefill_done: bool,
}

/// What a worker's in-flight requests add to its report, kept up to date with every change so
/// [`LoadView::get`] reads it without walking them (routing reads it per candidate).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Booked {
    requests: u64,
    blocks: u64,
    decoding: u64,
    prefill_tokens: u64,
    onboard_bytes: u64,
}

impl Booked {
    /// What one request adds.
    fn of(r: &InFlight) -> Self {
        let queued = !r.prefill_done;
        Self {
            requests: 1,
            blocks: r.blocks,
            decoding: u64::from(r.prefill_done),
            prefill_tokens: if queued { r.prefill_tokens } else { 0 },
            onboard_bytes: if queued { r.onboard_bytes } else { 0 },
        }
    }

    fn add(&mut self, o: Self) {
        self.requests += o.requests;
        self.blocks += o.blocks;
        self.decoding += o.decoding;
        self.prefill_tokens += o.prefill_tokens;
        self.onboard_bytes += o.onboard_bytes;
    }

    fn sub(&mut self, o: Self) {
        self.requests -= o.requests;
        self.blocks -= o.blocks;
        self.decoding -= o.decoding;
        self.prefill_tokens -= o.prefill_tokens;
        self.onboard_bytes -= o.onboard_bytes;
    }
}

#[derive(Debug, Default)]
struct WorkerEntry {
    reported: Option<LoadStats>,
    /// Transfer-path queue as last reported (see [`LoadView::report_transfer_queue`]).
    reported_onboard_bytes: u64,
    in_flight: FxHashMap<RequestId, InFlight>,
    /// The sum of `in_flight`'s contributions.
    booked: Booked,
}

impl WorkerEntry {
    /// Changes `request` (when in flight) with `change`, keeping the sums.
    fn update(&mut self, request: RequestId, change: impl FnOnce(&mut InFlight)) {
        if let Some(r) = self.in_flight.get_mut(&request) {
            self.booked.sub(Booked::of(r));
            change(r);
            self.booked.add(Booked::of(r));
        }
    }

    fn insert(&mut self, request: RequestId, r: InFlight) {
        self.booked.add(Booked::of(&r));
        if let Some(old) = self.in_flight.insert(request, r) {
            self.booked.sub(Booked::of(&old));
        }
    }

    fn remove(&mut self, request: RequestId) {
        if let Some(old) = self.in_flight.remove(&request) {
            self.booked.sub(Booked::of(&old));
        }
    }

    /// Keeps the requests for which `keep` holds.
    fn retain(&mut self, keep: impl Fn(&InFlight) -> bool) {
        let booked = &mut self.booked;
        self.in_flight.retain(|_, r| {
            let kept = keep(r);
            if !kept {
                booked.sub(Booked::of(r));
            }
            kept
        });
    }
}

/// Per-worker load; see the module docs.
#[derive(Debug, Default)]
pub struct LoadView {
    config: LoadConfig,
    workers: FxHashMap<WorkerId, WorkerEntry>,
    /// The prompt blocks of requests in flight, by worker ([`pending`]).
    pending: PendingPrefixes,
    /// The roster's workers by load ([`ranking`]).
    ranking: Ranking,
}

impl LoadView {
    pub fn new(config: LoadConfig) -> Self {
        Self {
            config,
            workers: FxHashMap::default(),
            pending: PendingPrefixes::default(),
            ranking: Ranking::default(),
        }
    }

    /// Ranks `roster` (the model's candidates, in the caller's order) by load under `weights`
    /// from now on ([`ranking`]), replacing the previous roster.
    pub fn set_roster(
        &mut self,
        weights: RankWeights,
        roster: impl IntoIterator<Item = RosterWorker>,
    ) {
        let mut ranking = std::mem::take(&mut self.ranking);
        ranking.set_roster(weights, roster, |w| self.get(w));
        self.ranking = ranking;
    }

    /// The roster by load ([`ranking`]).
    pub fn ranking(&self) -> &Ranking {
        &self.ranking
    }

    /// Moves `worker` in the ranking after a change of its load.
    fn rerank(&mut self, worker: &WorkerId) {
        if !self.ranking.is_empty() {
            let load = self.get(worker);
            self.ranking.refresh(worker, load);
        }
    }

    /// A request routed at `now` brings its prompt's blocks into its worker's cache until it
    /// finishes ([`pending`]).
    pub fn add_pending(&mut self, incoming: Incoming<'_>, now: Tick) {
        self.pending.add(incoming, now, self.config.in_flight_ttl);
    }

    /// For each worker where a request routed now would find some, how many leading blocks of
    /// `chain` requests in flight there will have computed by then (`block` tokens per block,
    /// `step_tokens` prompt tokens per engine step; [`pending`]).
    pub fn pending_leading(
        &self,
        chain: &[BlockHash],
        block: u32,
        step_tokens: u64,
    ) -> Vec<(WorkerId, u32)> {
        self.pending.leading(chain, block, step_tokens)
    }

    /// A load report received from `worker` at `now`.
    pub fn report(&mut self, worker: &WorkerId, stats: LoadStats, now: Tick) {
        let entry = self.workers.entry(worker.clone()).or_default();
        entry.reported = Some(stats);
        let absorbed_before = now.saturating_sub(self.config.report_lag);
        entry.retain(|r| r.routed_at > absorbed_before);
        self.rerank(worker);
    }

    /// The router sent `request` to `worker` at `now`: `prefill_tokens` still to compute there
    /// and `blocks` KV blocks it will occupy.
    pub fn on_routed(
        &mut self,
        worker: &WorkerId,
        request: RequestId,
        prefill_tokens: u64,
        blocks: u64,
        now: Tick,
    ) {
        let ttl = self.config.in_flight_ttl;
        let cap = self.config.max_in_flight_per_worker.max(1);
        let entry = self.workers.entry(worker.clone()).or_default();
        if entry.in_flight.len() >= cap {
            let cutoff = now.saturating_sub(ttl);
            entry.retain(|r| r.routed_at > cutoff);
            while entry.in_flight.len() >= cap {
                let oldest = entry
                    .in_flight
                    .iter()
                    .min_by_key(|(id, r)| (r.routed_at, **id))
                    .map(|(id, _)| *id);
                match oldest {
                    Some(id) => entry.remove(id),
                    None => break,
                };
            }
        }
        entry.insert(
            request,
            InFlight {
                routed_at: now,
                prefill_tokens,
                blocks,
                onboard_bytes: 0,
                prefill_done: false,
            },
        );
        self.rerank(worker);
    }

    /// `request`, in flight on `worker`, loads `bytes` of its cached prefix from non-device
    /// tiers before its prefill: they queue on the worker's transfer path until it is done.
    pub fn set_onboard_bytes(&mut self, worker: &WorkerId, request: RequestId, bytes: u64) {
        if let Some(e) = self.workers.get_mut(worker) {
            e.update(request, |r| r.onboard_bytes = bytes);
        }
        self.rerank(worker);
    }

    /// `worker`'s transfer path has `bytes` queued besides what the router routed since
    /// (replaces the previous figure); the counterfactual explain restores a recorded queue
    /// with it.
    pub fn report_transfer_queue(&mut self, worker: &WorkerId, bytes: u64) {
        self.workers
            .entry(worker.clone())
            .or_default()
            .reported_onboard_bytes = bytes;
        self.rerank(worker);
    }

    /// `request`, still in flight on `worker`, now has `prefill_tokens` to compute there (its
    /// serving mode changed: the prefill moved to another worker, or came back). Its routing
    /// time, blocks and state stay.
    pub fn set_prefill_tokens(
        &mut self,
        worker: &WorkerId,
        request: RequestId,
        prefill_tokens: u64,
    ) {
        self.pending.set_prefill_tokens(request, prefill_tokens);
        if let Some(e) = self.workers.get_mut(worker) {
            e.update(request, |r| r.prefill_tokens = prefill_tokens);
        }
        self.rerank(worker);
    }

    /// `request`'s prefill finished: it now decodes.
    pub fn on_prefill_done(&mut self, worker: &WorkerId, request: RequestId) {
        self.pending.prefill_done(request);
        if let Some(e) = self.workers.get_mut(worker) {
            e.update(request, |r| r.prefill_done = true);
        }
        self.rerank(worker);
    }

    /// `request` finished (or failed, or was cancelled): release it.
    pub fn on_finished(&mut self, worker: &WorkerId, request: RequestId) {
        self.pending.remove(request);
        if let Some(e) = self.workers.get_mut(worker) {
            e.remove(request);
        }
        self.rerank(worker);
    }

    /// Every request the router still counts on a worker, sorted by worker and request: what
    /// was booked, for the admin API and for tests that compare two routers' bookkeeping.
    pub fn bookings(&self) -> Vec<BookedRequest> {
        let mut out: Vec<BookedRequest> = self
            .workers
            .iter()
            .flat_map(|(worker, e)| {
                e.in_flight.iter().map(|(request, r)| BookedRequest {
                    worker: worker.clone(),
                    request: *request,
                    routed_at: r.routed_at,
                    prefill_tokens: r.prefill_tokens,
                    blocks: r.blocks,
                    prefill_done: r.prefill_done,
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.worker, a.request).cmp(&(&b.worker, b.request)));
        out
    }

    /// Forgets a worker that left.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        self.workers.remove(worker);
        self.pending.remove_worker(worker);
        self.ranking.retire(worker);
    }

    /// The worker's predicted load (zero for a worker never seen).
    pub fn get(&self, worker: &WorkerId) -> WorkerLoad {
        let Some(e) = self.workers.get(worker) else {
            return WorkerLoad::default();
        };
        let base = e.reported.unwrap_or_default();
        let b = e.booked;
        WorkerLoad {
            queued_prefill_tokens: base.queued_prefill_tokens + b.prefill_tokens,
            running_requests: base.running_requests + b.requests,
            active_decode_sequences: base.active_decode_sequences + b.decoding,
            active_blocks: base.active_blocks + b.blocks,
            capacity_blocks: base.capacity_blocks,
            in_flight_requests: e.in_flight.len() as u64,
            queued_onboard_bytes: e.reported_onboard_bytes + b.onboard_bytes,
            reported: e.reported.is_some(),
        }
    }

    /// The worker's device capacity in blocks as last reported (0 when unknown).
    pub fn capacity_blocks(&self, worker: &WorkerId) -> u64 {
        self.workers
            .get(worker)
            .and_then(|e| e.reported)
            .map_or(0, |r| r.capacity_blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: &str) -> WorkerId {
        WorkerId::new(n).unwrap()
    }

    #[test]
    fn in_flight_adds_to_the_report_and_is_released() {
        let mut view = LoadView::new(LoadConfig::default());
        let a = w("a");
        let stats = LoadStats {
            queued_prefill_tokens: 100,
            active_blocks: 10,
            capacity_blocks: 100,
            ..Default::default()
        };
        view.report(&a, stats, 1_000_000);
        view.on_routed(&a, 1, 500, 40, 1_000_100);
        let l = view.get(&a);
        assert_eq!(l.queued_prefill_tokens, 600);
        assert_eq!(l.active_blocks, 50);
        assert!((l.kv_utilisation() - 0.5).abs() < 1e-9);
        view.on_prefill_done(&a, 1);
        let l = view.get(&a);
        assert_eq!(l.queued_prefill_tokens, 100);
        assert_eq!(l.active_decode_sequences, 1);
        view.on_finished(&a, 1);
        assert_eq!(view.get(&a).active_blocks, 10);
        assert_eq!(view.get(&w("nobody")), WorkerLoad::default());
    }

    #[test]
    fn tier_loads_queue_on_the_transfer_path_until_prefill_is_done() {
        let mut view = LoadView::new(LoadConfig::default());
        let a = w("a");
        view.report_transfer_queue(&a, 1_000);
        view.on_routed(&a, 1, 10, 1, 0);
        view.set_onboard_bytes(&a, 1, 4_000);
        view.on_routed(&a, 2, 10, 1, 0);
        view.set_onboard_bytes(&a, 2, 500);
        assert_eq!(view.get(&a).queued_onboard_bytes, 5_500);
        view.on_prefill_done(&a, 1);
        assert_eq!(view.get(&a).queued_onboard_bytes, 1_500);
        view.on_finished(&a, 2);
        view.report_transfer_queue(&a, 0);
        assert_eq!(view.get(&a).queued_onboard_bytes, 0);
        // Unknown requests are ignored.
        view.set_onboard_bytes(&a, 99, 1);
        assert_eq!(view.get(&a).queued_onboard_bytes, 0);
    }

    #[test]
    fn a_report_absorbs_only_requests_it_can_have_seen() {
        let cfg = LoadConfig::default();
        let mut view = LoadView::new(cfg);
        let a = w("a");
        view.on_routed(&a, 1, 1000, 1, 0);
        view.on_routed(&a, 2, 2000, 1, 100_000);
        // Report at 120ms: request 1 (120ms old) is reflected, request 2 (20ms old) may not be.
        view.report(
            &a,
            LoadStats {
                queued_prefill_tokens: 1000,
                ..Default::default()
            },
            120_000,
        );
        let l = view.get(&a);
        assert_eq!(l.queued_prefill_tokens, 3000);
        assert_eq!(l.in_flight_requests, 1);
        // Finishing an absorbed request is harmless.
        view.on_finished(&a, 1);
        assert_eq!(view.get(&a).queued_prefill_tokens, 3000);
        // A later report absorbs request 2 as well.
        view.report(&a, LoadStats::default(), 200_000);
        assert_eq!(view.get(&a).queued_prefill_tokens, 0);
    }

    /// What [`LoadView::get`] adds to the report, recomputed from the requests themselves.
    fn recomputed(view: &LoadView, worker: &WorkerId) -> Booked {
        let mut sum = Booked::default();
        for r in view
            .workers
            .get(worker)
            .into_iter()
            .flat_map(|e| e.in_flight.values())
        {
            sum.add(Booked::of(r));
        }
        sum
    }

    #[test]
    fn the_kept_sums_match_the_requests_through_every_change() {
        let cfg = LoadConfig {
            max_in_flight_per_worker: 8,
            in_flight_ttl: 5_000,
            report_lag: 300,
        };
        let mut view = LoadView::new(cfg);
        let workers = [w("a"), w("b")];
        let weights = RankWeights {
            prefill_weight: 1.0,
            decode_weight: 0.1,
            block_size: 16,
        };
        view.set_roster(
            weights,
            workers.iter().map(|id| RosterWorker {
                id: id.clone(),
                prefill_tokens_per_s: 1,
                prices_peer_copies: false,
            }),
        );
        // SplitMix64: a fixed, varied sequence of changes.
        let mut state = 7u64;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        for step in 0..4_000u64 {
            let now = step * 10;
            let worker = &workers[(next() % 2) as usize];
            let request = next() % 24;
            match next() % 7 {
                0 | 1 => view.on_routed(worker, request, next() % 500, next() % 9, now),
                2 => view.on_prefill_done(worker, request),
                3 => view.on_finished(worker, request),
                4 => view.set_prefill_tokens(worker, request, next() % 300),
                5 => view.set_onboard_bytes(worker, request, next() % 4_000),
                _ => view.report(worker, LoadStats::default(), now),
            }
            for worker in &workers {
                assert_eq!(
                    view.workers
                        .get(worker)
                        .map(|e| e.booked)
                        .unwrap_or_default(),
                    recomputed(&view, worker),
                    "step {step}"
                );
                let ranked = view.ranking().position(worker).unwrap();
                assert_eq!(
                    *view.ranking().load(ranked),
                    view.get(worker),
                    "step {step}"
                );
            }
        }
    }

    #[test]
    fn in_flight_is_bounded_per_worker() {
        let cfg = LoadConfig {
            max_in_flight_per_worker: 3,
            ..LoadConfig::default()
        };
        let mut view = LoadView::new(cfg);
        let a = w("a");
        for i in 0..10 {
            view.on_routed(&a, i, 10, 1, i * 10);
        }
        let l = view.get(&a);
        assert_eq!(l.in_flight_requests, 3);
        assert_eq!(l.queued_prefill_tokens, 30);
        view.remove_worker(&a);
        assert_eq!(view.get(&a).in_flight_requests, 0);
    }
}
