//! The in-process registry for single-process deployments (`switchyard up`) and tests.
//!
//! It follows the etcd backend's rules: leases, admission checks, watch snapshots without gaps.
//! A lease lives as long as its [`Registration`]; once the registration is abandoned or
//! dropped the lease expires `ttl` later on tokio's clock, which a reaper task (owned by the
//! registry handles) enforces, so paused-time tests can `advance` through expiries.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use switchyard_core::{Role, WorkerId, WorkerInfo};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::replicas::{Announcement, DropHook, ReplicaInfo, Replicas};
use crate::{
    LeaseHandle, LeaseState, OwnedTask, Registration, Registry, RegistryError, WorkerChange,
    WorkerWatch, check_admission, check_ttl,
};

type LeaseId = u64;

/// An in-memory [`Registry`]. Clones share the same state.
#[derive(Debug, Clone, Default)]
pub struct MemoryRegistry {
    shared: Arc<Shared>,
    /// Expires abandoned leases; started on first registration, stopped with the last handle.
    reaper: Arc<OnceLock<OwnedTask>>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Woken whenever a lease gets a deadline.
    deadlines_changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    workers: BTreeMap<WorkerId, (WorkerInfo, LeaseId)>,
    /// `None` while a registration keeps the lease alive, else when it expires.
    leases: HashMap<LeaseId, Option<Instant>>,
    next_lease: LeaseId,
    roles: HashMap<WorkerId, Role>,
    plan: Option<serde_json::Value>,
    /// Gateway replicas by id, with the announcement that holds each (a newer one replaces).
    replicas: BTreeMap<String, (ReplicaInfo, u64)>,
    next_announcement: u64,
    watchers: Vec<mpsc::UnboundedSender<WorkerChange>>,
}

impl State {
    fn emit(&mut self, change: WorkerChange) {
        self.watchers.retain(|tx| tx.send(change.clone()).is_ok());
    }

    fn remove_lease(&mut self, lease: LeaseId) {
        self.leases.remove(&lease);
        let gone: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, (_, l))| *l == lease)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.workers.remove(&id);
            self.emit(WorkerChange::Removed(id));
        }
    }

    /// Expires due leases; returns the next deadline.
    fn expire_due(&mut self, now: Instant) -> Option<Instant> {
        let due: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, deadline)| deadline.is_some_and(|d| d <= now))
            .map(|(lease, _)| *lease)
            .collect();
        for lease in due {
            self.remove_lease(lease);
        }
        self.leases.values().flatten().min().copied()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every update is a single step.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl MemoryRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    fn ensure_reaper(&self) {
        self.reaper.get_or_init(|| {
            let shared = Arc::clone(&self.shared);
            OwnedTask::spawn(move |cancel| async move {
                cancel.run_until_cancelled(reap(shared)).await;
            })
        });
    }
}

async fn reap(shared: Arc<Shared>) {
    loop {
        let next = shared.lock().expire_due(Instant::now());
        match next {
            Some(deadline) => tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = shared.deadlines_changed.notified() => {}
            },
            None => shared.deadlines_changed.notified().await,
        }
    }
}

impl MemoryRegistry {
    /// Registers `info`; with `stale`, in place of that exact registration of its id.
    fn register_replacing(
        &self,
        info: WorkerInfo,
        ttl: Duration,
        stale: Option<&WorkerInfo>,
    ) -> Result<Registration, RegistryError> {
        info.validate().map_err(RegistryError::InvalidWorkerInfo)?;
        check_ttl(ttl)?;
        self.ensure_reaper();
        let mut state = self.shared.lock();
        let replaces = match (state.workers.get(&info.id), stale) {
            (Some((current, _)), Some(stale)) if current == stale => true,
            (Some(_), _) => return Err(RegistryError::AlreadyRegistered(info.id.clone())),
            (None, _) => false,
        };
        check_admission(&info, state.workers.values().map(|(w, _)| w), replaces)?;
        let lease = state.next_lease;
        state.next_lease += 1;
        state.leases.insert(lease, None);
        state.workers.insert(info.id.clone(), (info.clone(), lease));
        state.emit(if replaces {
            WorkerChange::Updated(info.clone())
        } else {
            WorkerChange::Added(info.clone())
        });
        drop(state);
        let (status_tx, _) = watch::channel(LeaseState::Live);
        Ok(Registration::new(Box::new(MemoryLease {
            registry: self.clone(),
            lease,
            ttl,
            info: Mutex::new(info),
            status_tx,
            released: AtomicBool::new(false),
        })))
    }
}

#[async_trait]
impl crate::Discovery for MemoryRegistry {
    async fn discover(&self) -> Result<WorkerWatch, RegistryError> {
        self.watch_workers().await
    }
}

/// A replica lives exactly as long as its announcement: one process, nothing to outlive.
#[async_trait]
impl Replicas for MemoryRegistry {
    async fn announce(
        &self,
        replica: ReplicaInfo,
        ttl: Duration,
    ) -> Result<Announcement, RegistryError> {
        replica.validate().map_err(RegistryError::InvalidReplica)?;
        check_ttl(ttl)?;
        let mut state = self.shared.lock();
        let token = state.next_announcement;
        state.next_announcement += 1;
        let id = replica.id.clone();
        state.replicas.insert(id.clone(), (replica, token));
        drop(state);
        let shared = Arc::clone(&self.shared);
        Ok(Announcement::withdrawn_by(DropHook(Box::new(move || {
            let mut state = shared.lock();
            if state.replicas.get(&id).is_some_and(|(_, t)| *t == token) {
                state.replicas.remove(&id);
            }
        }))))
    }

    async fn list_replicas(&self) -> Result<Vec<ReplicaInfo>, RegistryError> {
        let state = self.shared.lock();
        Ok(state.replicas.values().map(|(r, _)| r.clone()).collect())
    }
}

#[async_trait]
impl Registry for MemoryRegistry {
    async fn register(
        &self,
        info: WorkerInfo,
        ttl: Duration,
    ) -> Result<Registration, RegistryError> {
        self.register_replacing(info, ttl, None)
    }

    async fn take_over(
        &self,
        info: WorkerInfo,
        ttl: Duration,
        stale: &WorkerInfo,
    ) -> Result<Registration, RegistryError> {
        self.register_replacing(info, ttl, Some(stale))
    }

    async fn list_workers(&self) -> Result<Vec<WorkerInfo>, RegistryError> {
        let state = self.shared.lock();
        Ok(state.workers.values().map(|(w, _)| w.clone()).collect())
    }

    async fn worker(&self, id: &WorkerId) -> Result<Option<WorkerInfo>, RegistryError> {
        Ok(self.shared.lock().workers.get(id).map(|(w, _)| w.clone()))
    }

    async fn watch_workers(&self) -> Result<WorkerWatch, RegistryError> {
        let (changes_tx, changes_rx) = mpsc::unbounded_channel();
        let mut state = self.shared.lock();
        let initial = state.workers.values().map(|(w, _)| w.clone()).collect();
        state.watchers.push(changes_tx);
        Ok(WorkerWatch::new(initial, changes_rx, None))
    }

    async fn set_desired_role(&self, id: &WorkerId, role: Role) -> Result<(), RegistryError> {
        self.shared.lock().roles.insert(id.clone(), role);
        Ok(())
    }

    async fn desired_role(&self, id: &WorkerId) -> Result<Option<Role>, RegistryError> {
        Ok(self.shared.lock().roles.get(id).copied())
    }

    async fn put_plan(&self, plan: &serde_json::Value) -> Result<(), RegistryError> {
        self.shared.lock().plan = Some(plan.clone());
        Ok(())
    }

    async fn plan(&self) -> Result<Option<serde_json::Value>, RegistryError> {
        Ok(self.shared.lock().plan.clone())
    }
}

#[derive(Debug)]
struct MemoryLease {
    registry: MemoryRegistry,
    lease: LeaseId,
    ttl: Duration,
    info: Mutex<WorkerInfo>,
    status_tx: watch::Sender<LeaseState>,
    /// Set once the lease was deleted or handed to the reaper.
    released: AtomicBool,
}

impl MemoryLease {
    fn current_info(&self) -> MutexGuard<'_, WorkerInfo> {
        self.info
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Lets the lease run out `ttl` from now, as it would if the process had died.
    fn start_expiry(&self) {
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + self.ttl;
        if let Some(slot) = self.registry.shared.lock().leases.get_mut(&self.lease) {
            *slot = Some(deadline);
        }
        self.registry.shared.deadlines_changed.notify_one();
    }
}

#[async_trait]
impl LeaseHandle for MemoryLease {
    fn info(&self) -> WorkerInfo {
        self.current_info().clone()
    }

    async fn update(&self, info: WorkerInfo) -> Result<(), RegistryError> {
        let mut state = self.registry.shared.lock();
        match state.workers.get(&info.id) {
            Some((_, lease)) if *lease == self.lease => {}
            _ => return Err(RegistryError::LeaseLost(info.id)),
        }
        check_admission(&info, state.workers.values().map(|(w, _)| w), true)?;
        let previous = state
            .workers
            .insert(info.id.clone(), (info.clone(), self.lease));
        if previous.is_none_or(|(old, _)| old != info) {
            state.emit(WorkerChange::Updated(info.clone()));
        }
        drop(state);
        *self.current_info() = info;
        Ok(())
    }

    async fn deregister(self: Box<Self>) -> Result<(), RegistryError> {
        self.released.store(true, Ordering::SeqCst);
        self.registry.shared.lock().remove_lease(self.lease);
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        self.start_expiry();
    }

    fn status(&self) -> watch::Receiver<LeaseState> {
        self.status_tx.subscribe()
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        self.start_expiry();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{BlockSize, EngineKind};

    fn worker(id: &str) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: "127.0.0.1:1".into(),
            model: "m".into(),
            role: Role::Both,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: EngineKind::Sim,
            incarnation: 0,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn abandoned_lease_expires_exactly_after_its_ttl() {
        let registry = MemoryRegistry::new();
        let ttl = Duration::from_secs(10);
        let registration = registry.register(worker("a"), ttl).await.unwrap();
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            registry.list_workers().await.unwrap().len(),
            1,
            "kept alive"
        );
        registration.abandon();
        tokio::time::advance(ttl - Duration::from_millis(1)).await;
        assert_eq!(registry.list_workers().await.unwrap().len(), 1);
        tokio::time::advance(Duration::from_millis(2)).await;
        tokio::task::yield_now().await;
        assert!(registry.list_workers().await.unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_registration_expires_like_an_abandoned_one() {
        let registry = MemoryRegistry::new();
        drop(
            registry
                .register(worker("a"), Duration::from_secs(2))
                .await
                .unwrap(),
        );
        assert_eq!(registry.list_workers().await.unwrap().len(), 1);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(registry.list_workers().await.unwrap().is_empty());
        // The id is free again.
        assert!(
            registry
                .register(worker("a"), Duration::from_secs(2))
                .await
                .is_ok()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_every_handle_stops_the_reaper() {
        let registry = MemoryRegistry::new();
        let registration = registry
            .register(worker("a"), Duration::from_secs(2))
            .await
            .unwrap();
        let shared = Arc::downgrade(&registry.shared);
        registration.abandon();
        drop(registry);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            shared.upgrade().is_none(),
            "reaper task still holds the state"
        );
    }
}
