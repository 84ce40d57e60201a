//! Which addresses are workers of this cluster: a decode worker pulls KV only from them.
//!
//! A `Generate` names the prefill worker to pull from (`KvSource.address`). Without a check,
//! anyone who may call `Generate` could make this worker dial any host and port and read the
//! answer in the error (a port scanner inside the cluster). The directory follows the registry
//! (a watch, so a check is a lookup), and a miss asks the registry once more before refusing, so
//! a prefill worker that the gateway saw join a moment before this worker did is not refused.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use switchyard_core::WorkerId;
use switchyard_registry::{Registry, WorkerChange};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Fewest time between two registry reads caused by unknown addresses.
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// The live workers' addresses of this worker's cluster (the registry's namespace).
#[derive(Debug)]
pub struct PeerDirectory {
    registry: Arc<dyn Registry>,
    addresses: RwLock<HashMap<WorkerId, String>>,
    last_refresh: parking_lot::Mutex<Option<Instant>>,
}

impl PeerDirectory {
    /// Starts following the registry until `stop` (the returned task ends with it). While
    /// the registry cannot be watched (etcd down), checks ask it directly.
    pub fn follow(
        registry: Arc<dyn Registry>,
        stop: CancellationToken,
    ) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let directory = Arc::new(Self {
            registry,
            addresses: RwLock::new(HashMap::new()),
            last_refresh: parking_lot::Mutex::new(None),
        });
        let follower = tokio::spawn(Arc::clone(&directory).run(stop));
        (directory, follower)
    }

    async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let registry = Arc::clone(&self.registry);
            let watched = switchyard_registry::retry::until_available(
                "follow the cluster's workers",
                &stop,
                || registry.watch_workers(),
            )
            .await;
            let mut watch = match watched {
                Ok(Some(watch)) => watch,
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot follow the cluster's workers; retrying");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            *self.addresses.write() = watch
                .initial
                .iter()
                .map(|w| (w.id.clone(), w.address.clone()))
                .collect();
            loop {
                let change = tokio::select! {
                    _ = stop.cancelled() => return,
                    change = watch.next() => change,
                };
                match change {
                    Some(WorkerChange::Added(w) | WorkerChange::Updated(w)) => {
                        self.addresses.write().insert(w.id, w.address);
                    }
                    Some(WorkerChange::Removed(id)) => {
                        self.addresses.write().remove(&id);
                    }
                    // The watch ended (registry reconnecting): watch again.
                    None => break,
                }
            }
        }
    }

    /// Whether `address` is a live worker of this cluster.
    pub async fn is_worker(&self, address: &str) -> bool {
        if self.knows(address) {
            return true;
        }
        {
            let mut last = self.last_refresh.lock();
            if last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        match self.registry.list_workers().await {
            Ok(workers) => {
                let mut addresses = self.addresses.write();
                for w in workers {
                    addresses.insert(w.id, w.address);
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the registry to check a kv source")
            }
        }
        self.knows(address)
    }

    fn knows(&self, address: &str) -> bool {
        self.addresses.read().values().any(|a| a == address)
    }
}
