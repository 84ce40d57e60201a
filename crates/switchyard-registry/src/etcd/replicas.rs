//! Gateway replicas in etcd: `gateways/<id>` under a lease the replica keeps alive.
//!
//! The keep-alive task is simpler than a worker's (`lease`): a replica's id is its own (the pod
//! name), so after an outage it grants a new lease and puts its entry again without checking
//! who else holds the key, and when stopped it revokes the lease so the others see it leave at
//! once.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::PutOptions;
use tokio_util::sync::CancellationToken;

use super::{Conn, EtcdRegistry, ttl_seconds};
use crate::replicas::{Announcement, ReplicaInfo, Replicas};
use crate::{OwnedTask, RegistryError, check_ttl};

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

#[async_trait]
impl Replicas for EtcdRegistry {
    async fn announce(
        &self,
        replica: ReplicaInfo,
        ttl: Duration,
    ) -> Result<Announcement, RegistryError> {
        replica.validate().map_err(RegistryError::InvalidReplica)?;
        check_ttl(ttl)?;
        let conn = self.conn.clone();
        let ttl_secs = ttl_seconds(ttl);
        let lease = put_under_new_lease(&conn, &replica, ttl_secs).await?;
        tracing::info!(replica = %replica.id, address = %replica.address, lease, "gateway replica announced");
        let task =
            OwnedTask::spawn(move |cancel| keep_alive(conn, replica, ttl_secs, lease, cancel));
        Ok(Announcement::kept_by(task))
    }

    async fn list_replicas(&self) -> Result<Vec<ReplicaInfo>, RegistryError> {
        let conn = &self.conn;
        let (entries, _) = conn
            .list_prefix("list gateway replicas", conn.keys.gateways_prefix())
            .await?;
        let mut replicas = Vec::with_capacity(entries.len());
        for kv in &entries {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let parsed = crate::proof::decode::<ReplicaInfo>(
                kv.value(),
                conn.proof.as_deref(),
                &conn.unverified,
            );
            match parsed {
                Ok(Some(replica))
                    if replica.validate().is_ok() && key == conn.keys.gateway(&replica.id) =>
                {
                    replicas.push(replica);
                }
                Ok(Some(_)) => {
                    tracing::warn!(%key, "skipping a gateway entry that does not match its key")
                }
                Ok(None) => tracing::warn!(%key, "skipping a gateway entry without a valid proof"),
                Err(error) => tracing::warn!(%key, %error, "skipping a malformed gateway entry"),
            }
        }
        replicas.sort();
        Ok(replicas)
    }
}

/// Grants a lease of `ttl_secs` and puts `replica` under it; returns the lease.
async fn put_under_new_lease(
    conn: &Conn,
    replica: &ReplicaInfo,
    ttl_secs: i64,
) -> Result<i64, RegistryError> {
    let key = conn.keys.gateway(&replica.id);
    let value = crate::proof::encode(replica, conn.proof.as_deref()).map_err(|source| {
        RegistryError::Encode {
            key: key.clone(),
            source,
        }
    })?;
    let mut client = conn.client.clone();
    let lease = conn
        .call("grant a lease", client.lease_grant(ttl_secs, None))
        .await?
        .id();
    conn.call(
        "announce a gateway replica",
        client.put(key, value, Some(PutOptions::new().with_lease(lease))),
    )
    .await?;
    Ok(lease)
}

/// Keeps `lease` alive every ttl/3; when that fails, announces again under a new lease (with
/// backoff) until cancelled, then revokes the lease.
async fn keep_alive(
    conn: Conn,
    replica: ReplicaInfo,
    ttl_secs: i64,
    mut lease: i64,
    cancel: CancellationToken,
) {
    let interval = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(1)) / 3;
    let mut backoff = MIN_BACKOFF;
    loop {
        let ended = tokio::select! {
            () = cancel.cancelled() => break,
            ended = keep_lease(&conn, lease, interval) => ended,
        };
        tracing::warn!(replica = %replica.id, error = %ended, "gateway replica lease lost; announcing again");
        loop {
            tokio::select! {
                () = cancel.cancelled() => return revoke(&conn, lease).await,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            match put_under_new_lease(&conn, &replica, ttl_secs).await {
                Ok(new_lease) => {
                    lease = new_lease;
                    backoff = MIN_BACKOFF;
                    break;
                }
                Err(error) => {
                    tracing::warn!(replica = %replica.id, %error, "cannot announce the gateway replica; retrying")
                }
            }
        }
    }
    revoke(&conn, lease).await;
}

/// Keeps `lease` alive until a keep-alive fails; returns why.
async fn keep_lease(conn: &Conn, lease: i64, interval: Duration) -> RegistryError {
    let action = "keep a gateway lease alive";
    let mut client = conn.client.clone();
    let (mut keeper, mut responses) = match conn
        .call_on_lease(action, lease, client.lease_keep_alive(lease))
        .await
    {
        Ok(streams) => streams,
        Err(error) => return error,
    };
    loop {
        if let Err(error) = conn.call_on_lease(action, lease, keeper.keep_alive()).await {
            return error;
        }
        match conn.call_on_lease(action, lease, responses.message()).await {
            Ok(Some(response)) if response.ttl() > 0 => {}
            Ok(_) => {
                return RegistryError::LeaseNotFound { lease };
            }
            Err(error) => return error,
        }
        tokio::time::sleep(interval).await;
    }
}

/// Revokes `lease` (deleting the entry with it), best effort.
async fn revoke(conn: &Conn, lease: i64) {
    let mut client = conn.client.clone();
    if let Err(error) = conn
        .call("revoke a lease", client.lease_revoke(lease))
        .await
    {
        tracing::debug!(%error, "gateway lease left to expire");
    }
}
