//! A registration's lease and the task that keeps it alive.
//!
//! The task sends a keep-alive every ttl/3. When etcd cannot be reached it marks the
//! registration [`LeaseState::Reconnecting`] and retries with backoff, forever. When etcd answers
//! again there are two cases: the lease survived (etcd restarts renew every lease), and the
//! task simply keeps it alive; or the lease is gone (it expired while we were cut off, or
//! someone revoked it), and the task grants a new lease and puts the worker key again.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use switchyard_core::WorkerInfo;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Conn, encode_worker, members};
use crate::{LeaseHandle, LeaseState, OwnedTask, RegistryError, check_admission};

/// First retry delay after a failure; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// State shared by a [`Registration`](crate::Registration) and its keep-alive task.
struct LeaseShared {
    conn: Conn,
    key: String,
    ttl_secs: i64,
    /// The info to publish, including on re-registration.
    info: Mutex<WorkerInfo>,
    /// The current lease; held across the put so updates and re-registration do not interleave.
    lease_id: tokio::sync::Mutex<i64>,
    status_tx: watch::Sender<LeaseState>,
}

impl LeaseShared {
    fn info(&self) -> MutexGuard<'_, WorkerInfo> {
        self.info
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn interval(&self) -> Duration {
        Duration::from_secs(u64::try_from(self.ttl_secs).unwrap_or(1)) / 3
    }

    fn set_status(&self, state: LeaseState) {
        self.status_tx.send_if_modified(|current| {
            let changed = *current != state;
            *current = state;
            changed
        });
    }
}

pub(super) struct EtcdLease {
    shared: Arc<LeaseShared>,
    keep_alive: OwnedTask,
}

impl std::fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLease")
            .field("key", &self.shared.key)
            .field("ttl_secs", &self.shared.ttl_secs)
            .finish_non_exhaustive()
    }
}

impl EtcdLease {
    /// Takes over a freshly granted lease that `info` was put under, and keeps it alive.
    pub(super) fn start(conn: Conn, info: WorkerInfo, lease_id: i64, ttl_secs: i64) -> Self {
        let (status_tx, _) = watch::channel(LeaseState::Live);
        let shared = Arc::new(LeaseShared {
            key: conn.keys.worker(&info.id),
            conn,
            ttl_secs,
            info: Mutex::new(info),
            lease_id: tokio::sync::Mutex::new(lease_id),
            status_tx,
        });
        let task_shared = Arc::clone(&shared);
        let keep_alive = OwnedTask::spawn(move |cancel| keep_alive(task_shared, cancel));
        Self { shared, keep_alive }
    }
}

#[async_trait]
impl LeaseHandle for EtcdLease {
    fn info(&self) -> WorkerInfo {
        self.shared.info().clone()
    }

    async fn update(&self, info: WorkerInfo) -> Result<(), RegistryError> {
        let shared = &self.shared;
        let lease_id = shared.lease_id.lock().await;
        let conn = &shared.conn;
        match members::witness(conn, &info.model, &info.id).await? {
            Some(witness) => witness.admits(&info)?,
            None => check_admission(&info, conn.list_workers().await?.0.values(), true)?,
        }
        let value = encode_worker(conn, &info)?;
        let member = members::Entry::of(conn, &info)?;
        let previous = std::mem::replace(&mut *shared.info(), info.clone());
        // Even if the put below fails, a re-registration will publish the new info.
        let mut ops = vec![
            TxnOp::put(
                shared.key.clone(),
                value,
                Some(PutOptions::new().with_lease(*lease_id)),
            ),
            member.put(*lease_id),
        ];
        if previous.model != info.model {
            ops.push(members::delete(conn, &previous));
        }
        let txn = Txn::new()
            .when([Compare::lease(
                shared.key.clone(),
                CompareOp::Equal,
                *lease_id,
            )])
            .and_then(ops);
        let mut client = shared.conn.client.clone();
        let response = shared.conn.call("update a worker", client.txn(txn)).await?;
        if response.succeeded() {
            Ok(())
        } else {
            Err(RegistryError::LeaseLost(info.id))
        }
    }

    async fn deregister(self: Box<Self>) -> Result<(), RegistryError> {
        let Self { shared, keep_alive } = *self;
        // Stop the task first so it cannot re-register behind our back.
        keep_alive.stop().await;
        let lease_id = *shared.lease_id.lock().await;
        let conn = &shared.conn;
        // Revoking the lease deletes the key with it. If the lease is already gone, so is our
        // key (a key of the same name under another lease belongs to someone else).
        let mut client = conn.client.clone();
        match conn
            .call_on_lease("revoke a lease", lease_id, client.lease_revoke(lease_id))
            .await
        {
            Ok(_) | Err(RegistryError::LeaseNotFound { .. }) => {}
            Err(error) => return Err(error),
        }
        tracing::info!(key = %shared.key, "worker deregistered");
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        // Dropping the task handle cancels the keep-alive; the lease runs out on its own.
        drop(self);
    }

    fn status(&self) -> watch::Receiver<LeaseState> {
        self.shared.status_tx.subscribe()
    }
}

/// Why a keep-alive session ended.
enum SessionEnd {
    /// etcd says the lease does not exist any more.
    LeaseGone,
    Failed(RegistryError),
}

async fn keep_alive(shared: Arc<LeaseShared>, cancel: CancellationToken) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let end = tokio::select! {
            () = cancel.cancelled() => return,
            end = session(&shared, &mut backoff) => end,
        };
        shared.set_status(LeaseState::Reconnecting);
        match end {
            SessionEnd::LeaseGone => {
                tracing::warn!(key = %shared.key, "lease expired; re-registering");
                let outcome = tokio::select! {
                    () = cancel.cancelled() => return,
                    outcome = reregister(&shared) => outcome,
                };
                match outcome {
                    Ok(()) => {
                        backoff = MIN_BACKOFF;
                        continue;
                    }
                    Err(error) => {
                        tracing::warn!(key = %shared.key, %error, "re-registration failed; retrying")
                    }
                }
            }
            SessionEnd::Failed(error) => {
                tracing::warn!(key = %shared.key, %error, ?backoff, "lease keep-alive failed; retrying");
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Keeps the current lease alive until something goes wrong.
async fn session(shared: &LeaseShared, backoff: &mut Duration) -> SessionEnd {
    let lease_id = *shared.lease_id.lock().await;
    let conn = &shared.conn;
    let mut client = conn.client.clone();
    let action = "keep a lease alive";
    let (mut keeper, mut responses) = match conn
        .call_on_lease(action, lease_id, client.lease_keep_alive(lease_id))
        .await
    {
        Ok(streams) => streams,
        Err(RegistryError::LeaseNotFound { .. }) => return SessionEnd::LeaseGone,
        Err(error) => return SessionEnd::Failed(error),
    };
    loop {
        match conn
            .call_on_lease(action, lease_id, keeper.keep_alive())
            .await
        {
            Ok(()) => {}
            Err(RegistryError::LeaseNotFound { .. }) => return SessionEnd::LeaseGone,
            Err(error) => return SessionEnd::Failed(error),
        }
        match conn
            .call_on_lease(action, lease_id, responses.message())
            .await
        {
            Ok(Some(response)) if response.ttl() > 0 => {
                shared.set_status(LeaseState::Live);
                *backoff = MIN_BACKOFF;
            }
            // A keep-alive answered with TTL 0, or etcd's "lease not found": the lease expired
            // while etcd was out of reach (a stall longer than the TTL) or was revoked.
            Ok(Some(_)) | Err(RegistryError::LeaseNotFound { .. }) => return SessionEnd::LeaseGone,
            Ok(None) => {
                return SessionEnd::Failed(RegistryError::Unavailable {
                    action: "keep a lease alive",
                    source: etcd_client::Error::LeaseKeepAliveError(
                        "etcd closed the keep-alive stream".into(),
                    ),
                });
            }
            Err(error) => return SessionEnd::Failed(error),
        }
        tokio::time::sleep(shared.interval()).await;
    }
}

/// Grants a new lease and puts the worker key under it, if the id is still free.
///
/// The block-size rule is not checked again: the worker passed it when it joined, and refusing
/// to come back after an outage would turn a blip into a lost worker.
async fn reregister(shared: &LeaseShared) -> Result<(), RegistryError> {
    let mut lease_id = shared.lease_id.lock().await;
    let conn = &shared.conn;
    let info = shared.info().clone();
    let value = encode_worker(conn, &info)?;
    let member = members::Entry::of(conn, &info)?;
    let mut client = conn.client.clone();
    let new_lease = conn
        .call("grant a lease", client.lease_grant(shared.ttl_secs, None))
        .await?
        .id();
    let txn = Txn::new()
        .when([Compare::version(shared.key.clone(), CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(
                shared.key.clone(),
                value,
                Some(PutOptions::new().with_lease(new_lease)),
            ),
            member.put(new_lease),
        ]);
    let registered = conn.call("re-register a worker", client.txn(txn)).await;
    if !matches!(registered, Ok(ref response) if response.succeeded()) {
        // Best effort: an unused lease also expires on its own.
        let _ = conn
            .call("revoke a lease", client.lease_revoke(new_lease))
            .await;
        registered?;
        return Err(RegistryError::AlreadyRegistered(info.id));
    }
    *lease_id = new_lease;
    shared.set_status(LeaseState::Live);
    tracing::info!(worker = %info.id, lease = new_lease, "worker re-registered under a new lease");
    Ok(())
}
