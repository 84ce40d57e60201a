//! Gateway replicas: who else serves the cluster's API, so the replicas can share sessions.
//!
//! Each gateway replica announces a [`ReplicaInfo`] under a lease (etcd: `gateways/<id>`,
//! see [`crate::keys`]) and keeps it alive while it serves; every replica lists the live ones
//! ([`Replicas::list_replicas`]) to decide which of them owns a session. A replica that dies
//! drops out once its lease runs out; one that stops cleanly leaves at once
//! ([`Announcement::leave`]).

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{OwnedTask, RegistryError};

/// Longest accepted replica id.
pub const MAX_REPLICA_ID_LEN: usize = 128;

/// One gateway replica as the others see it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaInfo {
    /// Unique among the live replicas: 1 to 128 of `[A-Za-z0-9._-]` (a pod name fits).
    pub id: String,
    /// `host:port` where the other replicas reach this one's HTTP API.
    pub address: String,
}

impl ReplicaInfo {
    /// Checks the id (it becomes part of a key) and that an address is given.
    pub fn validate(&self) -> Result<(), String> {
        let id_ok = !self.id.is_empty()
            && self.id.len() <= MAX_REPLICA_ID_LEN
            && self
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !id_ok {
            return Err(format!(
                "replica id {:?} must be 1 to {MAX_REPLICA_ID_LEN} of [A-Za-z0-9._-]",
                self.id
            ));
        }
        if self.address.trim().is_empty() {
            return Err(format!("replica {} has no address", self.id));
        }
        Ok(())
    }
}

/// The gateway-replica capability of a registry.
#[async_trait]
pub trait Replicas: Send + Sync + std::fmt::Debug {
    /// Publishes `replica` under a lease of `ttl` (at least one second) and keeps it alive in
    /// the background, re-announcing after an outage, until the [`Announcement`] is left or
    /// dropped. A replica announcing the id of a live one replaces it (the id is the pod's).
    async fn announce(
        &self,
        replica: ReplicaInfo,
        ttl: Duration,
    ) -> Result<Announcement, RegistryError>;

    /// The live replicas, sorted by id.
    async fn list_replicas(&self) -> Result<Vec<ReplicaInfo>, RegistryError>;
}

/// A replica's live entry. Dropping it stops the keep-alive (the entry runs out with its lease,
/// at once for the in-memory registry); [`leave`](Self::leave) removes it before returning.
#[derive(Debug)]
pub struct Announcement {
    keep_alive: Option<OwnedTask>,
    on_drop: Option<DropHook>,
}

/// What the in-memory registry does when an announcement ends.
pub(crate) struct DropHook(pub(crate) Box<dyn FnOnce() + Send + Sync>);

impl std::fmt::Debug for DropHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DropHook")
    }
}

impl Announcement {
    /// Kept alive by `task`, which withdraws the entry when cancelled.
    pub(crate) fn kept_by(task: OwnedTask) -> Self {
        Self {
            keep_alive: Some(task),
            on_drop: None,
        }
    }

    /// Withdrawn by `hook` when the announcement ends.
    pub(crate) fn withdrawn_by(hook: DropHook) -> Self {
        Self {
            keep_alive: None,
            on_drop: Some(hook),
        }
    }

    /// Withdraws the entry and waits until that is done (best effort: an unreachable etcd lets
    /// the lease run out instead).
    pub async fn leave(mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.stop().await;
        }
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        if let Some(DropHook(hook)) = self.on_drop.take() {
            hook();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_cannot_escape_their_key() {
        let replica = |id: &str| ReplicaInfo {
            id: id.into(),
            address: "127.0.0.1:8080".into(),
        };
        assert!(replica("gateway-7d9f-x.1").validate().is_ok());
        for bad in ["", "a/b", "a b", &"x".repeat(129)] {
            assert!(replica(bad).validate().is_err(), "{bad:?}");
        }
        let mut no_address = replica("g1");
        no_address.address = " ".into();
        assert!(no_address.validate().is_err());
    }
}
