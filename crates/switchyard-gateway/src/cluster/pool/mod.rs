//! The workers the gateway knows, and the routing state of each model.
//!
//! The registry watch adds, updates and removes workers here. Each worker gets a lazily
//! connected gRPC client and two subscriber tasks ([`subscriber`]): its KV events feed
//! the model's prefix index, its load reports feed the model's load view (both in the
//! [`ServingCore`]). Their stream opens are bounded ([`subscriptions`]), so a gateway that
//! starts in front of a large fleet does not open every stream at once. A worker that
//! leaves is dropped from both at once. Routing ([`crate::serving::routing`]) locks a model's
//! [`RouterCore`] for the few microseconds a decision takes; nothing awaits under that lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use switchyard_core::{BlockSize, WorkerId, WorkerInfo};
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_router::serve::ServingCore;
use switchyard_router::{IndexConfig, LoadConfig, PolicyConfig, PolicyKind, RouteError, Tick};
use switchyard_security::{AuthChannel, Dialer, Identity, PeerRole};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::observe::audit::{AuditConfig, DecisionLog, KvAudit};
use crate::observe::metrics::{Metrics, WorkerLabels};
use crate::observe::recorder::{Record, Recorder};

pub mod ingest;
pub mod kv_checks;
pub mod members;
pub mod plane;
pub mod subscriber;
pub mod subscriptions;

/// A worker reports its load at least every `load_interval_ms`; four heartbeats missed (and
/// at least 2 s, well above a busy runtime's hiccup) make it unresponsive. A worker that
/// crashes or drops its connection is out at once (its stream breaks); this bound is for one
/// that hangs with its connection open.
pub fn default_unresponsive_after(load_interval_ms: u32) -> Duration {
    Duration::from_millis(u64::from(load_interval_ms) * 4).max(Duration::from_secs(2))
}

/// The routing state of one model: the serving core (index, load view, policies). Its
/// decisions go to the pool's [`DecisionLog`].
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
    pub core: parking_lot::Mutex<RouterCore>,
    /// The model's workers as routing reads them, rebuilt when one joins, changes or leaves.
    pub members: members::ModelMembers,
}

impl ModelRoutes {
    /// The model's routing state; held for the microseconds a decision takes, never across an
    /// await. (`parking_lot`: a panic elsewhere does not poison routing.)
    pub fn lock(&self) -> parking_lot::MutexGuard<'_, RouterCore> {
        self.core.lock()
    }
}

/// A worker as the gateway sees it.
#[derive(Debug)]
pub struct WorkerHandle {
    pub info: RwLock<WorkerInfo>,
    pub client: WorkerClient<AuthChannel>,
    /// Set from the worker's load reports; a draining worker gets no new requests.
    pub draining: AtomicBool,
    /// Whether it answers, whatever its lease says ([`crate::cluster::health`]).
    pub health: crate::cluster::health::Health,
    /// Cancels this worker's subscriber tasks.
    pub cancel: CancellationToken,
    /// Whether its KV events arrive and agree with its own view ([`crate::observe::audit::kv`]).
    pub kv: KvAudit,
    /// Whether its snapshot and first load report are in ([`subscriptions`]).
    pub subscription: subscriptions::WorkerSubscription,
}

impl WorkerHandle {
    pub fn info(&self) -> WorkerInfo {
        self.info.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn id(&self) -> WorkerId {
        self.info
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .id
            .clone()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
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

/// Every known worker and every model's routing state.
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
    /// Every routing decision with what then happened ([`crate::observe::audit::decisions`]).
    pub decisions: Arc<DecisionLog>,
    pub(crate) audit: AuditConfig,
    /// Registered workers refused for routing, with the reason (their block size differs from
    /// their model's).
    refused: RwLock<BTreeMap<WorkerId, String>>,
    pub(crate) load_interval_ms: u32,
    /// Asks workers to push a report this long after their load changes (0: interval only).
    pub(crate) load_push_min_ms: u32,
    pub metrics: Arc<Metrics>,
    epoch: Instant,
    pub(crate) cancel: CancellationToken,
    pub(crate) tasks: TaskTracker,
    /// Records the router's inputs while a recording runs (admin API).
    pub recorder: Arc<Recorder>,
    /// A worker whose load reports stop for this long is unresponsive ([`crate::cluster::health`]).
    pub(crate) unresponsive_after: Duration,
    /// How channels to workers are opened (plain or mTLS, with the gateway's credential).
    dialer: Dialer,
    /// Where routed requests go (which workers are candidates).
    pub delivery: Delivery,
    /// Bounds the worker streams opening at once; counts the workers followed in full.
    pub subscriptions: subscriptions::Subscriptions,
    /// KV events are read from this event plane instead of a gRPC stream per worker.
    pub(crate) event_plane: Option<Arc<plane::PlaneHandle>>,
}

impl WorkerPool {
    pub fn new(
        policy_kind: PolicyKind,
        policy_settings: PolicyConfig,
        decision_log_size: usize,
        load_interval_ms: u32,
        metrics: Arc<Metrics>,
    ) -> Result<Self, RouteError> {
        // Fail now, not at the first worker, when the settings are bad.
        policy_kind.build(&policy_settings)?;
        let epoch = Instant::now();
        Ok(Self {
            workers: RwLock::new(BTreeMap::new()),
            models: RwLock::new(BTreeMap::new()),
            adapters: RwLock::new(BTreeMap::new()),
            policy_settings,
            policy_kind: RwLock::new(policy_kind),
            decisions: Arc::new(
                DecisionLog::new(decision_log_size, None)
                    .counting_outcomes(metrics.audit.decision_outcomes.clone()),
            ),
            audit: AuditConfig::default(),
            refused: RwLock::new(BTreeMap::new()),
            load_interval_ms,
            load_push_min_ms: 0,
            epoch,
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            recorder: Arc::new(Recorder::new(epoch)),
            unresponsive_after: default_unresponsive_after(load_interval_ms),
            dialer: Dialer::open(Identity::new("default", PeerRole::Gateway)),
            delivery: Delivery::WorkerGrpc,
            subscriptions: subscriptions::Subscriptions::new(
                subscriptions::DEFAULT_CONCURRENCY,
                metrics.subscriptions_opening.clone(),
                metrics.workers_subscribed.clone(),
            ),
            event_plane: None,
            metrics,
        })
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

    /// The same pool with the audit's settings and decision log (an on-disk copy, when
    /// configured).
    pub fn with_audit(mut self, audit: AuditConfig, decisions: DecisionLog) -> Self {
        self.audit = audit;
        self.decisions = Arc::new(decisions);
        self
    }

    /// Registered workers the pool refuses to route to, with the reason.
    pub fn refused(&self) -> BTreeMap<WorkerId, String> {
        self.refused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_refused(&self, id: &WorkerId, reason: Option<String>) {
        let mut refused = self.refused.write().unwrap_or_else(|p| p.into_inner());
        match reason {
            Some(reason) => refused.insert(id.clone(), reason),
            None => refused.remove(id),
        };
        self.metrics.audit.workers_refused.set(refused.len() as i64);
    }

    /// The same pool, reading KV events from the event plane (`plane`) instead of a gRPC
    /// stream per worker.
    pub fn with_event_plane(mut self, plane: Option<Arc<plane::PlaneHandle>>) -> Self {
        self.event_plane = plane;
        self
    }

    /// The same pool, dialing workers with `dialer`.
    pub fn with_dialer(mut self, dialer: Dialer) -> Self {
        self.dialer = dialer;
        self
    }

    /// The same pool, calling a worker unresponsive after `after` without a load report.
    pub fn with_unresponsive_after(mut self, after: Duration) -> Self {
        self.unresponsive_after = after;
        self
    }

    /// The same pool, asking workers to push a load report `ms` after their load changes, at
    /// most one per `ms` (0: reports on the interval only).
    pub fn with_load_push(mut self, ms: u32) -> Self {
        self.load_push_min_ms = ms;
        self
    }

    /// The same pool, opening at most `concurrency` worker streams at once (at least 1).
    pub fn with_subscribe_concurrency(mut self, concurrency: usize) -> Self {
        self.subscriptions = subscriptions::Subscriptions::new(
            concurrency,
            self.metrics.subscriptions_opening.clone(),
            self.metrics.workers_subscribed.clone(),
        );
        self
    }

    /// How far the gateway has come in following every worker it knows.
    pub fn subscription_progress(&self) -> subscriptions::SubscriptionProgress {
        let workers = self.workers.read().map(|w| w.len()).unwrap_or(0);
        self.subscriptions.progress(workers)
    }

    /// `worker` stopped answering (a transport failure, its load stream broke or went
    /// silent): out of routing until it answers again.
    pub fn worker_failed(&self, worker: &WorkerHandle, reason: impl Into<String>) {
        let id = worker.id();
        if worker.health.failed(&id, reason) {
            self.metrics.unresponsive_transitions.inc();
            self.metrics
                .worker_unresponsive
                .get_or_create(&WorkerLabels {
                    worker: id.to_string(),
                })
                .set(1);
        }
    }

    /// `worker` answered (a load report arrived): back in routing if it was out.
    pub fn worker_answered(&self, worker: &WorkerHandle) {
        // Every load report lands here: the usual case (it was answering) costs one read.
        if worker.health.is_answering() {
            return;
        }
        let id = worker.id();
        if worker.health.answered(&id) {
            self.metrics
                .worker_unresponsive
                .get_or_create(&WorkerLabels {
                    worker: id.to_string(),
                })
                .set(0);
        }
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

    /// Workers of `model`.
    pub fn workers_of(&self, model: &str) -> Vec<Arc<WorkerHandle>> {
        self.workers()
            .into_iter()
            .filter(|w| w.info().model == model)
            .collect()
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
        let routes = Arc::new(ModelRoutes {
            model: info.model.clone(),
            block_size: info.block_size,
            max_context_tokens: info.max_context_tokens,
            core: parking_lot::Mutex::new(RouterCore { serving }),
            members: members::ModelMembers::default(),
        });
        models.insert(info.model.clone(), Arc::clone(&routes));
        Ok(routes)
    }

    /// A worker joined (or changed): start following it.
    pub fn upsert_worker(self: &Arc<Self>, info: WorkerInfo) {
        if let Some(existing) = self.worker(&info.id) {
            let old = existing.info();
            if old.incarnation == info.incarnation && old.address == info.address {
                self.count_adapters(Some(&old), Some(&info));
                let model = info.model.clone();
                *existing.info.write().unwrap_or_else(|p| p.into_inner()) = info;
                // A role, adapter or endpoint change reaches routing on the next request.
                self.refresh_members(&model);
                if old.model != model {
                    self.refresh_members(&old.model);
                }
                return;
            }
            // Restarted or moved: follow the new incarnation from scratch.
            self.remove_worker(&info.id);
        }
        let routes = match self.routes_for(&info) {
            Ok(routes) => routes,
            Err(message) => {
                tracing::warn!(worker = %info.id, "{message}; refusing to route to the worker");
                self.set_refused(&info.id, Some(message));
                return;
            }
        };
        self.set_refused(&info.id, None);
        let channel = match self.dialer.endpoint(&info.address) {
            Ok(endpoint) => self.dialer.lazy(
                endpoint
                    .connect_timeout(Duration::from_secs(2))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(5))
                    .keep_alive_timeout(Duration::from_secs(5)),
            ),
            Err(err) => {
                tracing::warn!(worker = %info.id, address = %info.address, error = %err, "invalid worker address; ignoring the worker");
                return;
            }
        };
        let handle = Arc::new(WorkerHandle {
            client: WorkerClient::new(channel),
            draining: AtomicBool::new(false),
            health: crate::cluster::health::Health::new(),
            cancel: self.cancel.child_token(),
            info: RwLock::new(info.clone()),
            kv: KvAudit::default(),
            subscription: subscriptions::WorkerSubscription::default(),
        });
        self.workers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(info.id.clone(), Arc::clone(&handle));
        self.count_adapters(None, Some(&info));
        self.refresh_members(&info.model);
        self.recorder.record(|| Record::WorkerJoined {
            tick: self.now_tick(),
            worker: info.clone(),
        });
        self.metrics
            .workers
            .set(self.workers.read().map(|w| w.len()).unwrap_or(0) as i64);
        self.metrics
            .audit
            .worker_joined(info.id.as_str(), &info.model);
        tracing::info!(worker = %info.id, address = %info.address, model = %info.model, role = %info.role, "worker joined");
        subscriber::spawn(self, handle, routes);
    }

    /// A worker left: stop following it and forget its blocks and load at once.
    pub fn remove_worker(&self, id: &WorkerId) {
        self.set_refused(id, None);
        let removed = self
            .workers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let Some(handle) = removed else { return };
        handle.cancel.cancel();
        self.subscriptions.left(&handle.subscription);
        let info = handle.info();
        self.count_adapters(Some(&info), None);
        let model = info.model;
        self.refresh_members(&model);
        if let Some(routes) = self.model(&model) {
            let mut core = routes.lock();
            core.serving.remove_worker(id);
            self.recorder.record(|| Record::WorkerLeft {
                tick: self.now_tick(),
                model,
                worker: id.clone(),
            });
        }
        self.metrics.remove_worker(id.as_str());
        self.metrics.audit.remove_worker(id.as_str());
        self.metrics
            .workers
            .set(self.workers.read().map(|w| w.len()).unwrap_or(0) as i64);
        tracing::info!(worker = %id, "worker left; its blocks are dropped from the index");
    }

    /// Rebuilds `model`'s member list ([`members`]) from the workers known now.
    fn refresh_members(&self, model: &str) {
        if let Some(routes) = self.model(model) {
            routes.members.rebuild(model, || self.workers());
        }
    }

    /// Stops every subscriber task.
    pub async fn shutdown(&self) {
        self.recorder.close();
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{BlockSize, EngineKind, Role};

    fn info(id: &str, model: &str, adapters: &[&str]) -> WorkerInfo {
        WorkerInfo {
            adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
            id: WorkerId::new(id).unwrap(),
            // Nothing listens on port 1: the pool's subscriber fails and retries, harmlessly.
            address: "127.0.0.1:1".into(),
            model: model.into(),
            role: Role::Both,
            block_size: BlockSize::new(4).unwrap(),
            kv_capacity_blocks: 100,
            max_context_tokens: 10_000,
            engine: EngineKind::Vllm,
            incarnation: 1,
            engine_endpoint: None,
            kv_tiers: None,
        }
    }

    #[tokio::test]
    async fn an_adapter_is_found_on_the_base_models_of_the_workers_serving_it_now() {
        let pool = Arc::new(
            WorkerPool::new(
                PolicyKind::Kv,
                PolicyConfig::default(),
                16,
                100,
                Arc::new(Metrics::new()),
            )
            .unwrap(),
        );
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
}
