//! Worker registry: who is serving, with which role, and what the planner decided.
//!
//! Workers register a [`WorkerInfo`] under a lease and keep it alive; when a worker dies its
//! lease expires and every gateway sees it go. The planner writes desired roles and its plan.
//!
//! - [`Registry`] (this file) is the capability every backend offers, with [`Registration`]
//!   (a live lease, kept alive in the background) and [`WorkerWatch`] (a snapshot plus the
//!   changes after it).
//! - [`keys`] is the etcd key layout of DESIGN.md §3.
//! - [`etcd`] is the production backend ([`EtcdRegistry`]): leases, transactions, watches,
//!   and the reconnect/re-register logic that survives etcd restarts; [`etcd::users`] sets up
//!   etcd's own users for a cluster (a member user limited to its prefix, root, auth enable).
//! - [`memory`] is the single-process backend ([`MemoryRegistry`]) for `switchyard up` and tests;
//!   its leases run on tokio time, so tests can pause and advance the clock.
//! - [`proof`] signs and checks entries ([`EntryProof`]), so a worker written into etcd by
//!   someone else is ignored.
//! - [`error`] is the one error type, with whose fault it is and whether to retry.
//! - [`discovery`] is the [`Discovery`] capability every registry offers (membership only),
//!   which sources outside etcd (Kubernetes) offer too, and [`Merged`] follows several at once.
//! - [`replicas`] is the [`Replicas`] capability: gateway replicas announce themselves under a
//!   lease and list each other, to share sessions.
//! - [`retry`] waits for an unavailable backend with backoff ([`retry::until_available`]), so
//!   a role started while etcd is down waits for it instead of exiting.
//!
//! Both backends pass the same conformance suite (`tests/conformance.rs`).

// Tests may unwrap: a failure there is the test failing.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::time::Duration;

use async_trait::async_trait;
use switchyard_core::{Role, WorkerId, WorkerInfo};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

pub mod discovery;
pub mod error;
pub mod etcd;
pub mod keys;
pub mod memory;
pub mod proof;
pub mod replicas;
pub mod retry;

pub use discovery::{Discovery, Merged};
pub use error::{Fault, RegistryError};
pub use etcd::{EtcdAuth, EtcdRegistry};
pub use memory::MemoryRegistry;
pub use proof::{EntryProof, Unverified};
pub use replicas::{Announcement, ReplicaInfo, Replicas};

/// The registry capability: worker membership under leases, desired roles, and the plan.
/// Every registry is also a [`Discovery`] source (its `discover` is [`Registry::watch_workers`])
/// and holds the gateway [`Replicas`].
#[async_trait]
pub trait Registry: Discovery + Replicas + Send + Sync + std::fmt::Debug {
    /// Publishes `info` under a lease of `ttl` (at least one second; etcd rounds it up to whole
    /// seconds) and keeps the lease alive in the background until the returned
    /// [`Registration`] is deregistered, abandoned or dropped.
    ///
    /// Refuses a worker whose id is already live ([`RegistryError::AlreadyRegistered`]) and a
    /// worker whose block size differs from a live worker of the same model
    /// ([`RegistryError::BlockSizeMismatch`]).
    async fn register(
        &self,
        info: WorkerInfo,
        ttl: Duration,
    ) -> Result<Registration, RegistryError>;

    /// Registers `info` in place of `stale`, a registration of the same id whose process is
    /// gone (the caller found that nothing answers as that incarnation at its address): a
    /// worker restarted under its id before its old lease expired. Succeeds while the id is
    /// still registered exactly as `stale`, or is free; otherwise refuses as
    /// [`register`](Self::register) does. The old lease is left to expire with nothing on it.
    async fn take_over(
        &self,
        info: WorkerInfo,
        ttl: Duration,
        stale: &WorkerInfo,
    ) -> Result<Registration, RegistryError>;

    /// The live workers, sorted by id.
    async fn list_workers(&self) -> Result<Vec<WorkerInfo>, RegistryError>;

    /// The live worker `id`, if it is registered: one key read, for callers that need one
    /// worker now and then (a decode worker checking a KV source) rather than the whole set.
    async fn worker(&self, id: &WorkerId) -> Result<Option<WorkerInfo>, RegistryError>;

    /// The live workers plus every change after that snapshot, with no gap between the two.
    async fn watch_workers(&self) -> Result<WorkerWatch, RegistryError>;

    /// Records the role the planner wants `id` to serve.
    async fn set_desired_role(&self, id: &WorkerId, role: Role) -> Result<(), RegistryError>;

    /// The role the planner wants `id` to serve, if it said.
    async fn desired_role(&self, id: &WorkerId) -> Result<Option<Role>, RegistryError>;

    /// Replaces the planner's latest decision.
    async fn put_plan(&self, plan: &serde_json::Value) -> Result<(), RegistryError>;

    /// The planner's latest decision, if any.
    async fn plan(&self) -> Result<Option<serde_json::Value>, RegistryError>;
}

/// One change to the set of live workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerChange {
    Added(WorkerInfo),
    Updated(WorkerInfo),
    Removed(WorkerId),
}

/// A snapshot of the live workers and the stream of changes after it.
///
/// Dropping it stops the background task that feeds it (etcd backend).
#[derive(Debug)]
pub struct WorkerWatch {
    /// The live workers when the watch started, sorted by id.
    pub initial: Vec<WorkerInfo>,
    changes_rx: mpsc::UnboundedReceiver<WorkerChange>,
    _feeder: Option<OwnedTask>,
    _guard: Option<tokio_util::sync::DropGuard>,
}

impl WorkerWatch {
    pub(crate) fn new(
        initial: Vec<WorkerInfo>,
        changes_rx: mpsc::UnboundedReceiver<WorkerChange>,
        feeder: Option<OwnedTask>,
    ) -> Self {
        Self {
            initial,
            changes_rx,
            _feeder: feeder,
            _guard: None,
        }
    }

    /// A watch fed by a source outside this crate: `initial`, then what arrives on
    /// `changes_rx` (closing it ends the watch). Dropping the watch cancels `feeder`'s token,
    /// which stops the task feeding it.
    pub fn from_channel(
        initial: Vec<WorkerInfo>,
        changes_rx: mpsc::UnboundedReceiver<WorkerChange>,
        feeder: tokio_util::sync::DropGuard,
    ) -> Self {
        Self {
            initial,
            changes_rx,
            _feeder: None,
            _guard: Some(feeder),
        }
    }

    /// The next change, or `None` when the registry behind the watch is gone.
    pub async fn next(&mut self) -> Option<WorkerChange> {
        self.changes_rx.recv().await
    }

    /// A change that is already waiting, without blocking.
    pub fn try_next(&mut self) -> Option<WorkerChange> {
        self.changes_rx.try_recv().ok()
    }
}

/// Whether a registration's lease is known to be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// The last keep-alive succeeded; the worker is listed.
    Live,
    /// The backend is unreachable or the lease was lost; the registration keeps retrying and
    /// re-registers under a new lease when it can.
    Reconnecting,
}

/// A worker's live entry in the registry.
///
/// Dropping it stops the keep-alive without deleting the entry (like [`Registration::abandon`]);
/// call [`Registration::deregister`] on a clean shutdown so gateways see the worker leave at once.
#[derive(Debug)]
pub struct Registration {
    lease: Box<dyn LeaseHandle>,
}

impl Registration {
    pub(crate) fn new(lease: Box<dyn LeaseHandle>) -> Self {
        Self { lease }
    }

    /// The worker info as last published.
    pub fn info(&self) -> WorkerInfo {
        self.lease.info()
    }

    /// Publishes a new description of the same worker (for example after a role change).
    ///
    /// The id cannot change, and the block-size rule is checked again.
    pub async fn update(&self, info: WorkerInfo) -> Result<(), RegistryError> {
        let current = self.lease.info();
        if info.id != current.id {
            return Err(RegistryError::IdChanged {
                from: current.id,
                to: info.id,
            });
        }
        info.validate().map_err(RegistryError::InvalidWorkerInfo)?;
        self.lease.update(info).await
    }

    /// Deletes the entry, releases the lease and stops the keep-alive.
    ///
    /// If the backend cannot be reached the error is returned, and the entry still disappears
    /// after its ttl because nothing keeps it alive any more.
    pub async fn deregister(self) -> Result<(), RegistryError> {
        self.lease.deregister().await
    }

    /// Stops keeping the lease alive without deleting anything, as a killed process would:
    /// the entry disappears once the ttl runs out.
    pub fn abandon(self) {
        self.lease.abandon();
    }

    /// The lease state, updated by the keep-alive task.
    pub fn status(&self) -> watch::Receiver<LeaseState> {
        self.lease.status()
    }
}

/// What a backend does for a [`Registration`].
#[async_trait]
pub(crate) trait LeaseHandle: Send + Sync + std::fmt::Debug {
    fn info(&self) -> WorkerInfo;
    async fn update(&self, info: WorkerInfo) -> Result<(), RegistryError>;
    async fn deregister(self: Box<Self>) -> Result<(), RegistryError>;
    fn abandon(self: Box<Self>);
    fn status(&self) -> watch::Receiver<LeaseState>;
}

/// A background task that is cancelled when its owner drops this.
#[derive(Debug)]
pub(crate) struct OwnedTask {
    cancel: CancellationToken,
    handle: Option<tokio::task::JoinHandle<()>>,
}

impl OwnedTask {
    /// Spawns `task(cancel)`; the task must return promptly once `cancel` fires.
    pub(crate) fn spawn<F, Fut>(task: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let cancel = CancellationToken::new();
        let handle = tokio::spawn(task(cancel.clone()));
        Self {
            cancel,
            handle: Some(handle),
        }
    }

    /// Cancels the task and waits until it has finished.
    pub(crate) async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(handle) = self.handle.take() {
            // A panic in the task has already been reported by the runtime.
            let _ = handle.await;
        }
    }
}

impl Drop for OwnedTask {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Checks the registration rules for `info` against the live workers (other than itself).
pub(crate) fn check_admission<'a>(
    info: &WorkerInfo,
    live: impl IntoIterator<Item = &'a WorkerInfo>,
    allow_same_id: bool,
) -> Result<(), RegistryError> {
    for other in live {
        if other.id == info.id {
            if allow_same_id {
                continue;
            }
            return Err(RegistryError::AlreadyRegistered(info.id.clone()));
        }
        if other.model == info.model && other.block_size != info.block_size {
            return Err(RegistryError::BlockSizeMismatch {
                model: info.model.clone(),
                worker: info.id.clone(),
                requested: info.block_size,
                existing_worker: other.id.clone(),
                existing: other.block_size,
            });
        }
    }
    Ok(())
}

/// Refuses leases shorter than a second (etcd's minimum is about 1.5 s anyway).
pub(crate) fn check_ttl(ttl: Duration) -> Result<(), RegistryError> {
    if ttl < Duration::from_secs(1) {
        return Err(RegistryError::InvalidTtl(ttl));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{BlockSize, EngineKind};

    fn worker(id: &str, model: &str, block: u32) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: "127.0.0.1:1".into(),
            model: model.into(),
            role: Role::Both,
            block_size: BlockSize::new(block).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: EngineKind::Sim,
            incarnation: 0,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    #[test]
    fn admission_refuses_duplicates_and_block_size_mismatches() {
        let live = [worker("a", "m", 16), worker("b", "n", 32)];
        assert!(check_admission(&worker("c", "m", 16), &live, false).is_ok());
        assert!(check_admission(&worker("c", "n", 32), &live, false).is_ok());
        assert!(matches!(
            check_admission(&worker("a", "m", 16), &live, false),
            Err(RegistryError::AlreadyRegistered(_))
        ));
        assert!(check_admission(&worker("a", "m", 16), &live, true).is_ok());
        assert!(matches!(
            check_admission(&worker("c", "m", 32), &live, false),
            Err(RegistryError::BlockSizeMismatch { .. })
        ));
    }

    #[test]
    fn short_ttls_are_refused() {
        assert!(check_ttl(Duration::from_millis(999)).is_err());
        assert!(check_ttl(Duration::from_secs(1)).is_ok());
    }
}
