//! The workers the gateway knows, and the routing state of each model.
//!
//! [`WorkerPool`] is that state: the workers ([`worker`]), each model's [`ServingCore`] and
//! member list ([`members`]), the adapters they serve, the routing policy and the workers
//! refused for routing. It holds no observer and runs no task. [`followers`] keeps it up to
//! date: the registry watch adds, updates and removes workers through it, and each worker gets
//! two follower tasks ([`subscriber`], or [`plane`] for its KV events, fed by the one consumer
//! per model of [`plane_feed`]) that take the pool and
//! their own context ([`follow`]: metrics, recorder, intervals, the workers' connections
//! ([`connections`]), the task tracker): its
//! KV events feed the model's prefix index, its load reports the model's load view. Their
//! stream opens are bounded ([`subscriptions`]), so a gateway that starts in front of a large
//! fleet does not open every stream at once. A worker that leaves is dropped from both at once.
//! Routing ([`crate::serving::routing`]) holds a model's [`RouterCore`] for the microseconds
//! a decision takes — shared while a policy that does not change itself decides, exclusively to
//! book — and nothing awaits under that lock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use switchyard_core::{BlockSize, WorkerId, WorkerInfo};
use switchyard_router::serve::ServingCore;
use switchyard_router::{IndexConfig, LoadConfig, PolicyConfig, PolicyKind, RouteError, Tick};
use tokio::time::Instant;

pub mod connections;
pub mod follow;
pub mod followers;
pub mod ingest;
pub mod journal;
pub mod kv_checks;
pub mod members;
pub mod plane;
pub mod plane_dispatch;
pub mod plane_feed;
pub mod subscriber;
pub mod subscriptions;
pub mod worker;

#[cfg(test)]
pub(crate) mod test_pool;

pub use worker::WorkerHandle;

/// The routing state of one model: the serving core (index, load view, policies). Its
/// decisions go to the gateway's [`DecisionLog`](crate::observe::audit::DecisionLog).
#[derive(Debug)]
pub struct RouterCore {
    pub serving: ServingCore,
}

/// A model's routing state, shared by its workers' subscribers and the request path.
#[derive(Debug)]
pub struct ModelRoutes {
    pub model: String,
    pub block_size: BlockSize,
    pub max_context_tokens: u64,
    /// Read-mostly: decisions of a policy that decides without changing itself take it
    /// shared ([`ModelRoutes::read`]), so one model's decisions run on every core at once;
    /// events and load reports take it exclusively, and bookings when it is free
    /// ([`ModelRoutes::change`]). Reach it only through those methods, which apply the
    /// [`journal`] first.
    core: parking_lot::RwLock<RouterCore>,
    /// Bookings that found the state busy, applied before anyone next reads or changes it.
    journal: journal::Journal,
    /// The model's workers as routing reads them, rebuilt when one joins, changes or leaves.
    pub members: members::ModelMembers,
}

impl ModelRoutes {
    /// The routing state of `model` over `serving`.
    pub fn new(
        model: String,
        block_size: BlockSize,
        max_context_tokens: u64,
        serving: ServingCore,
    ) -> Self {
        Self {
            model,
            block_size,
            max_context_tokens,
            core: parking_lot::RwLock::new(RouterCore { serving }),
            journal: journal::Journal::default(),
            members: members::ModelMembers::default(),
        }
    }

    /// The model's routing state, exclusively, with every queued booking applied; held for the
    /// microseconds a booking or an event takes, never across an await. (`parking_lot`: a
    /// panic elsewhere does not poison routing.)
    pub fn lock(&self) -> parking_lot::RwLockWriteGuard<'_, RouterCore> {
        let mut core = self.core.write();
        self.journal.apply(&mut core.serving);
        core
    }

    /// The model's routing state, shared with other readers: for decisions and queries that
    /// change nothing. Queued bookings are applied first when nobody holds the state (never
    /// waiting for it to be free); a reader that finds it held may miss only the bookings of
    /// decisions made meanwhile ([`journal`]).
    pub fn read(&self) -> parking_lot::RwLockReadGuard<'_, RouterCore> {
        if self.journal.is_queued()
            && let Some(mut core) = self.core.try_write()
        {
            self.journal.apply(&mut core.serving);
            return parking_lot::RwLockWriteGuard::downgrade(core);
        }
        self.core.read()
    }

    /// Changes the routing state: with `now` at once when nobody holds it (after the queued
    /// changes), otherwise queues `later` for whoever takes it next ([`journal`]) — or, past
    /// [`journal::JOURNAL_LIMIT`] queued changes, waits for it.
    pub fn change(
        &self,
        now: impl FnOnce(&mut ServingCore),
        later: impl FnOnce() -> journal::Deferred,
    ) {
        if let Some(mut core) = self.core.try_write() {
            self.journal.apply(&mut core.serving);
            now(&mut core.serving);
            return;
        }
        if self.journal.push(later()) >= journal::JOURNAL_LIMIT {
            drop(self.lock());
        }
    }
}

/// Where a routed request goes, which decides the workers that can be candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Delivery {
    /// The gateway sends it to the worker over gRPC: every worker can take it.
    #[default]
    WorkerGrpc,
    /// A proxy sends it to the engine's own HTTP API (the endpoint picker, `switchyard epp`):
    /// only workers that registered an engine endpoint can take it.
    EngineHttp,
}

/// Every known worker and every model's routing state. It holds no observer and runs no task:
/// [`followers::Followers`] keeps it up to date and counts and records what changes.
#[derive(Debug)]
pub struct WorkerPool {
    workers: RwLock<BTreeMap<WorkerId, Arc<WorkerHandle>>>,
    models: RwLock<BTreeMap<String, Arc<ModelRoutes>>>,
    /// Per LoRA adapter, the base models of the workers in `workers` serving it, with how many
    /// workers each: a request naming an adapter finds its base model without a sweep of the
    /// workers (kept with `workers`, see [`Self::count_adapters`]).
    adapters: RwLock<BTreeMap<String, BTreeMap<String, usize>>>,
    policy_settings: PolicyConfig,
    policy_kind: RwLock<PolicyKind>,
    /// Registered workers refused for routing, with the reason (their block size differs from
    /// their model's).
    refused: RwLock<BTreeMap<WorkerId, String>>,
    epoch: Instant,
    /// Changes to whether a worker takes requests (draining, answering) so far: a member list
    /// that found every member open at one count need not look again until it moves
    /// ([`members::MemberList::open_at`]).
    routing_epoch: Arc<AtomicU64>,
    /// Inside [`Self::batch_membership`]: the models whose member lists wait for its end.
    deferred: Mutex<Option<BTreeSet<String>>>,
    /// Where routed requests go (which workers are candidates).
    pub delivery: Delivery,
}

impl WorkerPool {
    pub fn new(policy_kind: PolicyKind, policy_settings: PolicyConfig) -> Result<Self, RouteError> {
        // Fail now, not at the first worker, when the settings are bad.
        policy_kind.build(&policy_settings)?;
        Ok(Self {
            workers: RwLock::new(BTreeMap::new()),
            models: RwLock::new(BTreeMap::new()),
            adapters: RwLock::new(BTreeMap::new()),
            policy_settings,
            policy_kind: RwLock::new(policy_kind),
            refused: RwLock::new(BTreeMap::new()),
            epoch: Instant::now(),
            routing_epoch: Arc::new(AtomicU64::new(0)),
            deferred: Mutex::new(None),
            delivery: Delivery::WorkerGrpc,
        })
    }

    /// Changes to whether a worker takes requests (draining, answering) so far.
    pub fn routing_epoch(&self) -> u64 {
        self.routing_epoch.load(Ordering::Acquire)
    }

    /// The counter [`Self::routing_epoch`] reads, for a new worker's handle.
    pub(crate) fn routing_epoch_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.routing_epoch)
    }

    /// The router clock's zero ([`Self::now_tick`]); the recorder's ticks count from it too.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// The settings every policy is built with.
    pub fn policy_settings(&self) -> &PolicyConfig {
        &self.policy_settings
    }

    /// The same pool, routing for `delivery`.
    pub fn with_delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = delivery;
        self
    }

    /// Whether `info`'s worker can take requests delivered the way this pool's are.
    pub fn deliverable(&self, info: &WorkerInfo) -> bool {
        match self.delivery {
            Delivery::WorkerGrpc => true,
            Delivery::EngineHttp => info.engine_endpoint.is_some(),
        }
    }

    /// The worker whose engine endpoint is `endpoint` (`host:port`).
    pub fn worker_at_endpoint(&self, endpoint: &str) -> Option<Arc<WorkerHandle>> {
        self.workers().into_iter().find(|w| {
            w.info
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .engine_endpoint
                .as_deref()
                == Some(endpoint)
        })
    }

    /// Registered workers the pool refuses to route to, with the reason.
    pub fn refused(&self) -> BTreeMap<WorkerId, String> {
        self.refused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Refuses `id` for `reason`, or takes it back (`None`); how many are refused now.
    pub(crate) fn set_refused(&self, id: &WorkerId, reason: Option<String>) -> usize {
        let mut refused = self.refused.write().unwrap_or_else(|p| p.into_inner());
        match reason {
            Some(reason) => refused.insert(id.clone(), reason),
            None => refused.remove(id),
        };
        refused.len()
    }

    /// Microseconds since the pool started: the router's clock (tokio's, so tests can pause
    /// and advance it).
    pub fn now_tick(&self) -> Tick {
        self.epoch.elapsed().as_micros() as Tick
    }

    pub fn policy_kind(&self) -> PolicyKind {
        *self.policy_kind.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Switches every model to `kind`. Policies start fresh (session pins and predicted caches
    /// belong to the policy that made them).
    pub fn set_policy(&self, kind: PolicyKind) -> Result<(), RouteError> {
        let models: Vec<Arc<ModelRoutes>> = self.models().into_values().collect();
        let mut built = Vec::with_capacity(models.len());
        for _ in &models {
            built.push(kind.build(&self.policy_settings)?);
        }
        for (routes, policy) in models.iter().zip(built) {
            routes.lock().serving.set_policy(kind, policy);
        }
        *self.policy_kind.write().unwrap_or_else(|p| p.into_inner()) = kind;
        tracing::info!(policy = %kind, "routing policy switched");
        Ok(())
    }

    pub fn models(&self) -> BTreeMap<String, Arc<ModelRoutes>> {
        self.models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn model(&self, name: &str) -> Option<Arc<ModelRoutes>> {
        self.models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    pub fn workers(&self) -> Vec<Arc<WorkerHandle>> {
        self.workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn worker(&self, id: &WorkerId) -> Option<Arc<WorkerHandle>> {
        self.workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// The workers of `model` as routing reads them (its member list: each with its
    /// description, shared, not copied); `None` when no worker ever served it.
    pub fn members_of(&self, model: &str) -> Option<Arc<members::MemberList>> {
        self.model(model).map(|routes| routes.members.snapshot())
    }

    /// Whether a worker serves `model` now.
    pub fn serves(&self, model: &str) -> bool {
        self.members_of(model)
            .is_some_and(|list| !list.members.is_empty())
    }

    /// The base models of the workers that serve the LoRA adapter `adapter`, without repeats
    /// (more than one is a misconfigured fleet: the caller refuses the name as ambiguous).
    pub fn adapter_models(&self, adapter: &str) -> Vec<String> {
        self.adapters
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(adapter)
            .map(|models| models.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Keeps [`Self::adapter_models`]'s counts as a worker's description leaves `workers`
    /// (`left`) and another enters (`joined`): a worker joining, leaving, or changing (both),
    /// in one step, so an adapter the change keeps never looks unserved meanwhile.
    fn count_adapters(&self, left: Option<&WorkerInfo>, joined: Option<&WorkerInfo>) {
        let moves = |info: Option<&WorkerInfo>| info.is_some_and(|i| !i.adapters.is_empty());
        if !moves(left) && !moves(joined) {
            return;
        }
        let mut adapters = self.adapters.write().unwrap_or_else(|p| p.into_inner());
        if let Some(info) = left {
            for adapter in &info.adapters {
                let Some(models) = adapters.get_mut(adapter) else {
                    continue;
                };
                if let Some(count) = models.get_mut(&info.model) {
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        models.remove(&info.model);
                    }
                }
                if models.is_empty() {
                    adapters.remove(adapter);
                }
            }
        }
        if let Some(info) = joined {
            for adapter in &info.adapters {
                *adapters
                    .entry(adapter.clone())
                    .or_default()
                    .entry(info.model.clone())
                    .or_default() += 1;
            }
        }
    }

    pub(crate) fn routes_for(&self, info: &WorkerInfo) -> Result<Arc<ModelRoutes>, String> {
        let mut models = self.models.write().unwrap_or_else(|p| p.into_inner());
        if let Some(routes) = models.get(&info.model) {
            if routes.block_size != info.block_size {
                return Err(format!(
                    "worker {} announces block size {} for model {} but the gateway routes it with {}",
                    info.id, info.block_size, info.model, routes.block_size
                ));
            }
            return Ok(Arc::clone(routes));
        }
        let serving = ServingCore::new(
            info.block_size,
            IndexConfig::new(info.block_size),
            LoadConfig::default(),
            self.policy_kind(),
            &self.policy_settings,
        )
        .map_err(|e| e.to_string())?;
        let routes = Arc::new(ModelRoutes::new(
            info.model.clone(),
            info.block_size,
            info.max_context_tokens,
            serving,
        ));
        models.insert(info.model.clone(), Arc::clone(&routes));
        Ok(routes)
    }

    /// How many workers the pool holds.
    pub fn worker_count(&self) -> usize {
        self.workers.read().map(|w| w.len()).unwrap_or(0)
    }

    /// `existing` (the same incarnation at the same address) is now described by `info`: a
    /// role, adapter or endpoint change reaches routing on the next request.
    pub(crate) fn update_worker(&self, existing: &WorkerHandle, info: WorkerInfo) {
        let old = existing.info();
        self.count_adapters(Some(&old), Some(&info));
        let model = info.model.clone();
        *existing.info.write().unwrap_or_else(|p| p.into_inner()) = info;
        self.refresh_members(&model);
        if old.model != model {
            self.refresh_members(&old.model);
        }
    }

    /// Adds a worker just joined (its model's routes made by [`Self::routes_for`]).
    pub(crate) fn insert_worker(&self, handle: Arc<WorkerHandle>) {
        let info = handle.info();
        self.workers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(info.id.clone(), handle);
        self.count_adapters(None, Some(&info));
        self.refresh_members(&info.model);
    }

    /// Takes out the worker `id` (gone from its model's members and the adapter counts; its
    /// blocks and load are the caller's to drop, with the model's lock held).
    pub(crate) fn take_worker(&self, id: &WorkerId) -> Option<Arc<WorkerHandle>> {
        let handle = self
            .workers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)?;
        let info = handle.info();
        self.count_adapters(Some(&info), None);
        self.refresh_members(&info.model);
        Some(handle)
    }

    /// Runs `f` with the member lists' rebuilds held back: each model whose workers changed
    /// meanwhile (here or on another thread) is rebuilt once, when `f` is done. A rebuild reads
    /// every worker, so a watch's initial list or a burst of joins rebuilt per worker cost
    /// O(W²): 20–46 s before a gateway in front of 10,000 workers was ready. Inside, a member
    /// list lags the pool: a worker just joined is not a candidate yet (it has no snapshot or
    /// load either), and one that left still is, though the load ranking no longer reads it
    /// (`Ranking::retire`), so only a full scan (a retry, an explained decision) can choose it
    /// and then finds it gone (`unavailable`, retried elsewhere). Calls inside `f` nest in it.
    pub fn batch_membership<T>(&self, f: impl FnOnce() -> T) -> T {
        let outer = {
            let mut deferred = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
            let outer = deferred.is_none();
            if outer {
                *deferred = Some(BTreeSet::new());
            }
            outer
        };
        let out = f();
        if outer {
            let models = self
                .deferred
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or_default();
            for model in models {
                self.rebuild_members(&model);
            }
        }
        out
    }

    /// Rebuilds `model`'s member list ([`members`]), now or at the end of the batch it is in.
    fn refresh_members(&self, model: &str) {
        if let Some(models) = self
            .deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            models.insert(model.to_owned());
            return;
        }
        self.rebuild_members(model);
    }

    /// Rebuilds `model`'s member list ([`members`]) from the workers known now.
    fn rebuild_members(&self, model: &str) {
        if let Some(routes) = self.model(model) {
            // The roster: the members a plain generation may go to when all are open.
            let in_roster = |info: &WorkerInfo| self.deliverable(info) && info.role.serves_decode();
            routes.members.rebuild(
                model,
                || self.workers(),
                in_roster,
                |roster| {
                    routes.lock().serving.set_roster(roster);
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, model: &str, adapters: &[&str]) -> WorkerInfo {
        WorkerInfo {
            adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
            ..test_pool::worker_info(id, model)
        }
    }

    #[tokio::test]
    async fn an_adapter_is_found_on_the_base_models_of_the_workers_serving_it_now() {
        let pool = test_pool::TestPool::new(16, &[]);
        let none: Vec<String> = Vec::new();
        pool.upsert_worker(info("a", "llama", &["sql"]));
        pool.upsert_worker(info("b", "llama", &["sql", "chat"]));
        assert_eq!(pool.adapter_models("sql"), ["llama"]);
        assert_eq!(pool.adapter_models("chat"), ["llama"]);
        assert_eq!(
            pool.adapter_models("llama"),
            none,
            "a base model is no adapter"
        );
        // Another base model claiming the adapter: both are named (the caller refuses it).
        pool.upsert_worker(info("c", "qwen", &["sql"]));
        assert_eq!(pool.adapter_models("sql"), ["llama", "qwen"]);
        // A worker's list changing (an adapter unloaded, another loaded).
        pool.upsert_worker(info("b", "llama", &["code"]));
        assert_eq!(pool.adapter_models("chat"), none);
        assert_eq!(pool.adapter_models("code"), ["llama"]);
        assert_eq!(
            pool.adapter_models("sql"),
            ["llama", "qwen"],
            "a still serves it"
        );
        pool.remove_worker(&WorkerId::new("a").unwrap());
        assert_eq!(pool.adapter_models("sql"), ["qwen"]);
        // A restarted worker (new incarnation) is followed from scratch, its adapters too.
        let mut restarted = info("c", "qwen", &["chat"]);
        restarted.incarnation = 2;
        pool.upsert_worker(restarted);
        assert_eq!(pool.adapter_models("sql"), none);
        assert_eq!(pool.adapter_models("chat"), ["qwen"]);
        // Everything gone: nothing left over.
        for id in ["b", "c"] {
            pool.remove_worker(&WorkerId::new(id).unwrap());
        }
        assert!(pool.adapters.read().unwrap().is_empty());
        pool.shutdown().await;
    }

    #[tokio::test]
    async fn a_batch_of_membership_changes_rebuilds_each_model_s_members_once_at_its_end() {
        let pool = test_pool::TestPool::new(16, &[test_pool::worker_info("a", "llama")]);
        let ids = |model: &str| -> Vec<String> {
            let routes = pool.model(model).unwrap();
            let list = routes.members.snapshot();
            list.candidates
                .iter()
                .map(|c| c.worker.to_string())
                .collect()
        };
        assert_eq!(ids("llama"), ["a"]);
        pool.batch_membership(|| {
            pool.upsert_worker(test_pool::worker_info("b", "llama"));
            pool.upsert_worker(test_pool::worker_info("q", "qwen"));
            pool.batch_membership(|| pool.remove_worker(&WorkerId::new("a").unwrap()));
            // Held back until the outer batch ends, the inner one included.
            assert_eq!(ids("llama"), ["a"]);
            assert!(ids("qwen").is_empty());
        });
        assert_eq!(ids("llama"), ["b"]);
        assert_eq!(ids("qwen"), ["q"]);
        // Outside a batch, each change is in the list at once.
        pool.upsert_worker(test_pool::worker_info("c", "llama"));
        assert_eq!(ids("llama"), ["b", "c"]);
        pool.shutdown().await;
    }
}
