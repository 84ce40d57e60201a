//! The gateway's gRPC connections to its workers, keyed by worker id: one lazily connected
//! channel per worker, dialed when the worker joins (plain or mTLS, with the gateway's
//! credential) and dropped when it leaves. Everything that calls a worker takes its client from
//! here by id — the request path's transport ([`crate::serving::transport::GrpcTransport`]),
//! the KV-event and load followers, the admin API's control calls — so a worker's handle in the
//! pool is its state only, and a call to a worker that has left fails as such instead of
//! reaching a stale channel.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Duration;

use switchyard_core::{WorkerId, WorkerInfo};
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_security::{AuthChannel, Dialer, SecurityError};

/// A worker's gRPC client (cheap to clone: clones share the channel).
pub type Client = WorkerClient<AuthChannel>;

/// The clients of the workers in the pool, by worker id.
#[derive(Debug)]
pub struct WorkerConnections {
    dialer: Dialer,
    clients: RwLock<HashMap<WorkerId, Client>>,
}

impl WorkerConnections {
    /// No connection yet; workers are dialed with `dialer`.
    pub fn new(dialer: Dialer) -> Self {
        Self {
            dialer,
            clients: RwLock::new(HashMap::new()),
        }
    }

    /// Dials `worker` (lazily: the connection is made by its first call) and keeps its client,
    /// replacing any earlier one of the same id. An address the dialer cannot use is an error
    /// and nothing is kept.
    pub fn connect(&self, worker: &WorkerInfo) -> Result<Client, SecurityError> {
        let endpoint = self.dialer.endpoint(&worker.address)?;
        let channel = self.dialer.lazy(
            endpoint
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5)),
        );
        let client = WorkerClient::new(channel);
        self.write().insert(worker.id.clone(), client.clone());
        Ok(client)
    }

    /// Drops `worker`'s client: calls through it that are under way finish, new ones find no
    /// worker.
    pub fn disconnect(&self, worker: &WorkerId) {
        self.write().remove(worker);
    }

    /// `worker`'s client, if it is connected.
    pub fn client(&self, worker: &WorkerId) -> Option<Client> {
        self.clients
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(worker)
            .cloned()
    }

    /// `worker`'s client, or the status a call to a worker that is not connected gets
    /// (`unavailable`: the worker left, another may serve the request).
    pub fn client_or_status(&self, worker: &WorkerId) -> Result<Client, tonic::Status> {
        self.client(worker).ok_or_else(|| {
            tonic::Status::unavailable(format!("worker {worker} is not connected: it left"))
        })
    }

    /// How many workers are connected.
    pub fn len(&self) -> usize {
        self.clients.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<WorkerId, Client>> {
        self.clients.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_security::{Identity, PeerRole};

    fn worker(id: &str, address: &str) -> WorkerInfo {
        let mut info = crate::cluster::pool::test_pool::worker_info(id, "m");
        info.address = address.to_owned();
        info
    }

    fn connections() -> WorkerConnections {
        WorkerConnections::new(Dialer::open(Identity::new("test", PeerRole::Gateway)))
    }

    #[tokio::test]
    async fn a_worker_is_reachable_from_its_join_to_its_leave() {
        let connections = connections();
        let id = WorkerId::new("w1").unwrap();
        assert!(connections.client(&id).is_none());
        connections
            .connect(&worker("w1", "127.0.0.1:1"))
            .expect("a usable address");
        assert!(connections.client(&id).is_some());
        assert_eq!(connections.len(), 1);
        connections.disconnect(&id);
        assert!(connections.client(&id).is_none());
        let status = connections.client_or_status(&id).expect_err("it left");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("w1"), "{status:?}");
        assert!(connections.is_empty());
    }

    #[tokio::test]
    async fn an_unusable_address_keeps_nothing() {
        let connections = connections();
        assert!(
            connections
                .connect(&worker("w1", "not a uri\u{0}"))
                .is_err()
        );
        assert!(connections.is_empty());
    }
}
