//! Which addresses are workers of this cluster: a decode worker pulls KV only from them.
//!
//! A `Generate` names the prefill worker to pull from (`KvSource.address`). Without a check,
//! anyone who may call `Generate` could make this worker dial any host and port and read the
//! answer in the error (a port scanner inside the cluster).
//!
//! The directory asks the registry on demand: the one entry of the worker the source names
//! (`KvSource.worker_id`), and remembers a confirmed address for [`CONFIRMED_FOR`]. It does not
//! watch the registry: with every worker watching every registration, a fleet start cost W²
//! watch events and stalled 1,000 workers around 350 (`docs/scaling.md`). A source without an
//! id (an older gateway) is looked up among all workers, at most once per [`LIST_EVERY`].
//! A worker that left stays accepted for at most [`CONFIRMED_FOR`]: its address would have to
//! be taken by something else within that time to matter.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use switchyard_core::WorkerId;
use switchyard_registry::Registry;
use tokio::time::Instant;

/// How long an address the registry confirmed is accepted without asking again.
const CONFIRMED_FOR: Duration = Duration::from_secs(5);
/// Fewest time between two reads of every worker caused by sources without an id.
const LIST_EVERY: Duration = Duration::from_millis(500);
/// Confirmed addresses kept at most (expired ones are dropped past it).
const MAX_CONFIRMED: usize = 4096;

/// The cluster's workers this worker was told to pull KV from, checked in the registry.
#[derive(Debug)]
pub struct PeerDirectory {
    registry: Arc<dyn Registry>,
    /// Address → the worker the registry said serves there, and when it said so.
    confirmed: Mutex<HashMap<String, (WorkerId, Instant)>>,
    last_listed: Mutex<Option<Instant>>,
}

impl PeerDirectory {
    pub fn new(registry: Arc<dyn Registry>) -> Arc<Self> {
        Arc::new(Self {
            registry,
            confirmed: Mutex::new(HashMap::new()),
            last_listed: Mutex::new(None),
        })
    }

    /// Whether `address` is a live worker of this cluster; `worker`, when the source names
    /// it, is the worker that must be registered there.
    pub async fn is_worker(&self, worker: Option<&WorkerId>, address: &str) -> bool {
        if self.recently_confirmed(worker, address) {
            return true;
        }
        match worker {
            Some(id) => match self.registry.worker(id).await {
                Ok(Some(info)) if info.address == address => {
                    self.confirm(info.id, address);
                    true
                }
                Ok(_) => false,
                Err(err) => {
                    tracing::warn!(worker = %id, error = %err, "cannot read the registry to check a kv source");
                    false
                }
            },
            None => self.listed(address).await,
        }
    }

    fn recently_confirmed(&self, worker: Option<&WorkerId>, address: &str) -> bool {
        self.confirmed.lock().get(address).is_some_and(|(id, at)| {
            at.elapsed() < CONFIRMED_FOR && worker.is_none_or(|named| named == id)
        })
    }

    fn confirm(&self, id: WorkerId, address: &str) {
        let mut confirmed = self.confirmed.lock();
        if confirmed.len() >= MAX_CONFIRMED {
            confirmed.retain(|_, (_, at)| at.elapsed() < CONFIRMED_FOR);
        }
        if confirmed.len() < MAX_CONFIRMED {
            confirmed.insert(address.to_owned(), (id, Instant::now()));
        }
    }

    /// Reads every worker (throttled) and checks `address` among them.
    async fn listed(&self, address: &str) -> bool {
        {
            let mut last = self.last_listed.lock();
            if last.is_some_and(|t| t.elapsed() < LIST_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        match self.registry.list_workers().await {
            Ok(workers) => {
                let found = workers.into_iter().find(|w| w.address == address);
                found.map(|w| self.confirm(w.id, address)).is_some()
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the registry to check a kv source");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use switchyard_core::{BlockSize, EngineKind, Role, WorkerInfo};
    use switchyard_registry::MemoryRegistry;

    use super::*;

    fn info(id: &str, address: &str) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: address.into(),
            model: "m".into(),
            role: Role::Prefill,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 64,
            max_context_tokens: 4096,
            engine: EngineKind::Sim,
            incarnation: 1,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    fn id(id: &str) -> WorkerId {
        WorkerId::new(id).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_named_source_is_checked_against_its_own_entry() {
        let registry = Arc::new(MemoryRegistry::new());
        let registration = registry
            .register(info("p1", "10.0.0.1:7000"), Duration::from_secs(10))
            .await
            .unwrap();
        let peers = PeerDirectory::new(registry.clone());
        assert!(peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
        // Another worker's address, an unknown worker, an unknown address: refused.
        assert!(!peers.is_worker(Some(&id("p2")), "10.0.0.1:7000").await);
        assert!(!peers.is_worker(Some(&id("p1")), "10.0.0.9:22").await);
        // Confirmed for a while without asking; once that passes, a gone worker is refused.
        registration.deregister().await.unwrap();
        assert!(peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
        tokio::time::advance(CONFIRMED_FOR).await;
        assert!(!peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_joined_after_a_refusal_is_found_at_once() {
        let registry = Arc::new(MemoryRegistry::new());
        let peers = PeerDirectory::new(registry.clone());
        assert!(!peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
        let _registration = registry
            .register(info("p1", "10.0.0.1:7000"), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_without_an_id_is_looked_up_among_all_workers_throttled() {
        let registry = Arc::new(MemoryRegistry::new());
        let peers = PeerDirectory::new(registry.clone());
        assert!(!peers.is_worker(None, "10.0.0.1:7000").await);
        let _registration = registry
            .register(info("p1", "10.0.0.1:7000"), Duration::from_secs(10))
            .await
            .unwrap();
        // Within the throttle the registry is not read again.
        assert!(!peers.is_worker(None, "10.0.0.1:7000").await);
        tokio::time::advance(LIST_EVERY).await;
        assert!(peers.is_worker(None, "10.0.0.1:7000").await);
        // Now confirmed: no read needed, and a named check of the same worker agrees.
        assert!(peers.is_worker(Some(&id("p1")), "10.0.0.1:7000").await);
    }
}
