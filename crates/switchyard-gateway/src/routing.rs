//! Routing glue: candidates for a model, the policy's decision, in-flight bookkeeping, the
//! decision log and the routing metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use switchyard_core::{BlockHash, EngineKind, Role, TokenId, WorkerId, WorkerInfo, block_hashes};
use switchyard_router::{Candidate, Decision, PolicyConfig, PolicyKind, RouteError, RouteRequest};

use crate::metrics::PolicyLabels;
use crate::pool::{DecisionRecord, ModelRoutes, WorkerHandle, WorkerPool};
use crate::recorder::{Record, Recorder, RouteRecord};

static NEXT_ROUTE: AtomicU64 = AtomicU64::new(1);

/// A routed request. While it lives, the model's load view counts it on the chosen worker;
/// dropping it releases that count.
#[derive(Debug)]
pub struct RoutedRequest {
    pub worker: Arc<WorkerHandle>,
    pub worker_id: WorkerId,
    /// Shared with the decision log, which keeps the same explanation: copying its per-worker
    /// breakdown was most of a route's allocations with many workers.
    pub decision: Arc<Decision>,
    /// Leading prompt blocks the chosen worker holds in its device tier.
    pub cached_blocks: u32,
    routes: Arc<ModelRoutes>,
    key: u64,
    prefill_done: bool,
    recorder: Arc<Recorder>,
    /// Whether the KV recording sees this request. Prefill-pool routes are left out: a
    /// recording replays generations against policies, and a prefill is not one.
    recorded: bool,
}

impl RoutedRequest {
    /// The first token arrived: the request moves from the prefill queue to decoding.
    pub fn prefill_done(&mut self) {
        if !self.prefill_done {
            self.prefill_done = true;
            let mut core = self.routes.lock();
            core.load.on_prefill_done(&self.worker_id, self.key);
            if self.recorded {
                self.recorder.record(|| self.bookkeeping_record(true));
            }
        }
    }

    /// The recorder's `prefill_done` or `finished` record of this request.
    fn bookkeeping_record(&self, prefill_done: bool) -> Record {
        let (tick, model, key, worker) = (
            self.recorder.now_tick(),
            self.routes.model.clone(),
            self.key,
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
        let mut core = self.routes.lock();
        core.load.on_finished(&self.worker_id, self.key);
        if self.recorded {
            self.recorder.record(|| self.bookkeeping_record(false));
        }
    }
}

/// The workers a request may go to: what the policy sees, and their handles in the same
/// order. Two lists rather than pairs, so the policy gets its slice without a copy of every
/// worker id.
#[derive(Debug, Default)]
pub struct Candidates {
    ids: Vec<Candidate>,
    handles: Vec<Arc<WorkerHandle>>,
}

impl Candidates {
    /// The workers of `pool` for which `eligible` holds and that are not draining.
    fn select(pool: &WorkerPool, eligible: impl Fn(&WorkerInfo) -> bool) -> Self {
        let workers = pool.workers();
        let mut out = Candidates {
            ids: Vec::with_capacity(workers.len()),
            handles: Vec::with_capacity(workers.len()),
        };
        for w in workers {
            // Read each worker's info in place: cloning it (three strings) per worker per
            // request was the larger part of routing with many workers.
            let id = {
                let info = w.info.read().unwrap_or_else(|p| p.into_inner());
                eligible(&info).then(|| info.id.clone())
            };
            if let Some(id) = id
                && !w.is_draining()
            {
                out.ids.push(Candidate::from(id));
                out.handles.push(w);
            }
        }
        out
    }

    pub fn ids(&self) -> &[Candidate] {
        &self.ids
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The handle of the chosen worker.
    fn take(mut self, worker: &WorkerId) -> Option<Arc<WorkerHandle>> {
        let at = self.ids.iter().position(|c| c.worker == *worker)?;
        Some(self.handles.swap_remove(at))
    }
}

/// Whether `info`'s worker can generate only from a prefill worker's KV, never from a bare
/// prompt. An SGLang worker of role `decode` fronts a server started with
/// `--disaggregation-mode decode`, which rejects requests without bootstrap fields, so it must
/// never be sent an aggregated request. vLLM decode engines and the simulator compute a prompt
/// themselves when no KV comes, and role `both` serves anything. The gateway learns this from
/// the registry entry alone (engine kind and role), so it holds for workers of any version.
pub fn needs_prefill(info: &WorkerInfo) -> bool {
    info.engine == EngineKind::Sglang && info.role == Role::Decode
}

/// Workers of the model that can take a generation now; with `aggregated_only`, only those
/// that can run it without a prefill worker (see [`needs_prefill`]).
pub fn candidates(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    exclude: &[WorkerId],
    aggregated_only: bool,
) -> Candidates {
    Candidates::select(pool, |info| {
        info.model == routes.model
            && info.role.serves_decode()
            && !(aggregated_only && needs_prefill(info))
            && !exclude.contains(&info.id)
    })
}

/// The route request for `tokens` (hashing happens here, outside any lock).
pub fn route_request(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    tokens: &[TokenId],
    session: Option<String>,
) -> RouteRequest {
    let hashes: Vec<BlockHash> = block_hashes(tokens, routes.block_size);
    RouteRequest {
        block_hashes: hashes,
        prompt_tokens: tokens.len() as u64,
        block_size: routes.block_size,
        session,
        now: pool.now_tick(),
    }
}

/// Chooses a worker for `tokens` and records the decision; `aggregated_only` leaves out the
/// workers that need a prefill worker (the request will not get one), and `note` says why in
/// the decision log when an earlier attempt decided it.
#[allow(clippy::too_many_arguments)]
pub fn route(
    pool: &WorkerPool,
    routes: &Arc<ModelRoutes>,
    tokens: &[TokenId],
    max_tokens: u32,
    session: Option<String>,
    exclude: &[WorkerId],
    request_id: &str,
    attempt: u32,
    aggregated_only: bool,
    note: Option<&str>,
) -> Result<RoutedRequest, RouteError> {
    let started = Instant::now();
    let request = route_request(pool, routes, tokens, session);
    let candidates = candidates(pool, routes, exclude, aggregated_only);
    if candidates.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    let only = &candidates.ids;
    let block_size = u64::from(routes.block_size.get());
    let (decision, cached_blocks, key) = {
        let mut core = routes.lock();
        let core = &mut *core;
        let decision = Arc::new(
            core.policy
                .choose(&request, only, &core.index, &core.load)?,
        );
        let chosen = decision.chosen();
        let uncached = chosen.map_or(request.prompt_tokens, |c| c.uncached_prompt_tokens);
        let cached_blocks = chosen.map_or(0, |c| c.overlap.device);
        let key = NEXT_ROUTE.fetch_add(1, Ordering::Relaxed);
        let blocks = (request.prompt_tokens + u64::from(max_tokens)).div_ceil(block_size);
        core.load
            .on_routed(&decision.worker, key, uncached, blocks, request.now);
        pool.recorder.record(|| {
            route_record(
                routes,
                &request,
                only,
                max_tokens,
                key,
                attempt,
                &decision,
                cached_blocks,
            )
        });
        core.record(DecisionRecord {
            request_id: request_id.to_owned(),
            model: routes.model.clone(),
            at_unix_ms: unix_ms(),
            attempt,
            stage: Stage::Decode,
            decision: Arc::clone(&decision),
            note: note.map(str::to_owned),
        });
        (decision, cached_blocks, key)
    };
    let m = &pool.metrics;
    m.routing_overhead.observe(started.elapsed().as_secs_f64());
    m.decisions
        .get_or_create(&PolicyLabels {
            policy: decision.explanation.policy,
        })
        .inc();
    m.prompt_blocks_requested
        .inc_by(request.block_hashes.len() as u64);
    m.prompt_blocks_cached.inc_by(u64::from(cached_blocks));
    routed_request(pool, routes, candidates, decision, cached_blocks, key, true)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Which pool a decision chose from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// A worker that generates (role decode or both).
    Decode,
    /// A prefill-pool worker (role prefill) computing the prompt's KV for a decode worker.
    Prefill,
}

/// Prefill-pool workers (role prefill) of the model that can take a prefill now for a decode
/// worker in front of `engine`. Only workers of the same engine kind pair up: the KV moves
/// between the engines (the simulator's blocks over `PullKv`, vLLM's and SGLang's through the
/// engines' own transfer), and neither side can read the other kind's.
pub fn prefill_candidates(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    engine: EngineKind,
    exclude: &[WorkerId],
) -> Candidates {
    Candidates::select(pool, |info| {
        info.model == routes.model
            && info.role == Role::Prefill
            && info.engine == engine
            && !exclude.contains(&info.id)
    })
}

/// The KV-aware choice among prefill workers: the kv policy's cost (uncached tokens after
/// overlap plus queued prefill) over the prefill pool. A fresh kv policy rather than the live
/// one, whatever it is: the live policy's per-request state (session pins, predicted caches,
/// turns) describes the decode pool and must not be moved by prefill choices.
fn prefill_decision(
    routes: &ModelRoutes,
    request: &RouteRequest,
    candidates: &[Candidate],
) -> Result<Decision, RouteError> {
    let mut policy = PolicyKind::Kv.build(&PolicyConfig::default())?;
    let core = routes.lock();
    policy.choose(request, candidates, &core.index, &core.load)
}

/// What a prefill-pool route would decide for `tokens`, without routing (admin explain).
pub fn explain_prefill(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    engine: EngineKind,
    tokens: &[TokenId],
) -> Result<Decision, RouteError> {
    let request = route_request(pool, routes, tokens, None);
    let only = prefill_candidates(pool, routes, engine, &[]).ids;
    if only.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    prefill_decision(routes, &request, &only)
}

/// Chooses a prefill worker for `tokens`, counts the prefill on it in the load view (until
/// the returned request is dropped) and logs the decision.
#[allow(clippy::too_many_arguments)]
pub fn route_prefill(
    pool: &WorkerPool,
    routes: &Arc<ModelRoutes>,
    engine: EngineKind,
    tokens: &[TokenId],
    exclude: &[WorkerId],
    request_id: &str,
    attempt: u32,
) -> Result<RoutedRequest, RouteError> {
    let request = route_request(pool, routes, tokens, None);
    let candidates = prefill_candidates(pool, routes, engine, exclude);
    if candidates.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    let decision = Arc::new(prefill_decision(routes, &request, &candidates.ids)?);
    let chosen = decision.chosen();
    let uncached = chosen.map_or(request.prompt_tokens, |c| c.uncached_prompt_tokens);
    let cached_blocks = chosen.map_or(0, |c| c.overlap.device);
    let key = NEXT_ROUTE.fetch_add(1, Ordering::Relaxed);
    {
        let mut core = routes.lock();
        let blocks = request
            .prompt_tokens
            .div_ceil(u64::from(routes.block_size.get()));
        core.load
            .on_routed(&decision.worker, key, uncached, blocks, request.now);
        core.record(DecisionRecord {
            request_id: request_id.to_owned(),
            model: routes.model.clone(),
            at_unix_ms: unix_ms(),
            attempt,
            stage: Stage::Prefill,
            decision: Arc::clone(&decision),
            note: None,
        });
    }
    routed_request(
        pool,
        routes,
        candidates,
        decision,
        cached_blocks,
        key,
        false,
    )
}

/// The [`RoutedRequest`] for `decision`, whose load the caller already counted under `key`.
/// `recorded` says whether the recorder was told of the route (its bookkeeping then follows).
fn routed_request(
    pool: &WorkerPool,
    routes: &Arc<ModelRoutes>,
    candidates: Candidates,
    decision: Arc<Decision>,
    cached_blocks: u32,
    key: u64,
    recorded: bool,
) -> Result<RoutedRequest, RouteError> {
    let worker = candidates
        .take(&decision.worker)
        .ok_or(RouteError::NoCandidates)?;
    Ok(RoutedRequest {
        worker_id: decision.worker.clone(),
        worker,
        decision,
        cached_blocks,
        routes: Arc::clone(routes),
        key,
        prefill_done: false,
        recorder: Arc::clone(&pool.recorder),
        recorded,
    })
}

/// The recorder's `route` record of a decision.
#[allow(clippy::too_many_arguments)]
fn route_record(
    routes: &ModelRoutes,
    request: &RouteRequest,
    candidates: &[Candidate],
    max_tokens: u32,
    key: u64,
    attempt: u32,
    decision: &Decision,
    cached_blocks: u32,
) -> Record {
    Record::Route(Box::new(RouteRecord {
        tick: request.now,
        model: routes.model.clone(),
        key,
        attempt,
        block_size: request.block_size.get(),
        prompt_tokens: request.prompt_tokens,
        max_tokens,
        session: request.session.clone(),
        block_hashes: request.block_hashes.clone(),
        candidates: candidates.iter().map(|c| c.worker.clone()).collect(),
        policy: decision.explanation.policy.to_owned(),
        chosen: decision.worker.clone(),
        cached_blocks,
    }))
}

/// What the current policy would decide for `tokens`, without sending or recording anything.
///
/// Evaluated on a copy of the live policy, so the preview sees its state (turn, session pins,
/// predicted caches) without changing it.
pub fn explain(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    tokens: &[TokenId],
    session: Option<String>,
    aggregated_only: bool,
) -> Result<Decision, RouteError> {
    let request = route_request(pool, routes, tokens, session);
    let only = candidates(pool, routes, &[], aggregated_only).ids;
    if only.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    let core = routes.lock();
    let mut preview = core.policy.clone_box();
    preview.choose(&request, &only, &core.index, &core.load)
}
