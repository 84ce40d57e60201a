//! The task behind an etcd [`WorkerWatch`](crate::WorkerWatch).
//!
//! It turns watch events into [`WorkerChange`]s against its own view of the live workers. When
//! the stream breaks (etcd restarted, the revision was compacted), it lists the workers again,
//! emits the difference between its view and the fresh list, and watches on from the list's
//! revision, so consumers converge on the truth without ever seeing a duplicate add or a
//! remove of something they never saw.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{EventType, WatchStream};
use switchyard_core::{WorkerId, WorkerInfo};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Conn, parse_worker};
use crate::{WorkerChange, diff_workers};

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Why pumping a watch stream stopped.
enum PumpEnd {
    /// Nobody listens any more.
    ReceiverGone,
    Broken(String),
}

pub(super) async fn feed(
    conn: Conn,
    mut known: BTreeMap<WorkerId, WorkerInfo>,
    mut stream: WatchStream,
    changes_tx: mpsc::UnboundedSender<WorkerChange>,
    cancel: CancellationToken,
) {
    loop {
        let end = tokio::select! {
            () = cancel.cancelled() => return,
            end = pump(&conn, &mut stream, &mut known, &changes_tx) => end,
        };
        match end {
            PumpEnd::ReceiverGone => return,
            PumpEnd::Broken(reason) => {
                tracing::warn!(%reason, "worker watch broke; resyncing");
            }
        }
        let mut backoff = MIN_BACKOFF;
        stream = loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let (fresh, revision) = match conn.list_workers().await {
                Ok(listed) => listed,
                Err(error) => {
                    tracing::debug!(%error, "worker resync failed; retrying");
                    continue;
                }
            };
            for change in diff_workers(&known, &fresh) {
                if changes_tx.send(change).is_err() {
                    return;
                }
            }
            known = fresh;
            match conn.watch_workers_from(revision + 1).await {
                Ok(stream) => break stream,
                Err(error) => tracing::debug!(%error, "worker watch reopen failed; retrying"),
            }
        };
        tracing::info!(workers = known.len(), "worker watch resynced");
    }
}

/// Applies watch events to `known` and forwards the changes, until the stream ends.
async fn pump(
    conn: &Conn,
    stream: &mut WatchStream,
    known: &mut BTreeMap<WorkerId, WorkerInfo>,
    changes_tx: &mpsc::UnboundedSender<WorkerChange>,
) -> PumpEnd {
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return PumpEnd::Broken("etcd closed the watch stream".into()),
            Err(error) => return PumpEnd::Broken(error.to_string()),
        };
        if response.canceled() {
            return PumpEnd::Broken(format!(
                "etcd cancelled the watch (compacted at revision {}): {}",
                response.compact_revision(),
                response.cancel_reason()
            ));
        }
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let change = match event.event_type() {
                EventType::Put => match parse_worker(conn, kv) {
                    Ok(info) => match known.insert(info.id.clone(), info.clone()) {
                        None => Some(WorkerChange::Added(info)),
                        Some(old) if old != info => Some(WorkerChange::Updated(info)),
                        Some(_) => None,
                    },
                    Err(error) => {
                        tracing::warn!(%error, "skipping malformed worker entry");
                        // A valid worker overwritten with garbage is no longer a valid worker.
                        conn.keys
                            .worker_id_of(kv.key())
                            .ok()
                            .and_then(|id| known.remove(&id).map(|_| WorkerChange::Removed(id)))
                    }
                },
                EventType::Delete => conn
                    .keys
                    .worker_id_of(kv.key())
                    .ok()
                    .and_then(|id| known.remove(&id).map(|_| WorkerChange::Removed(id))),
            };
            if let Some(change) = change
                && changes_tx.send(change).is_err()
            {
                return PumpEnd::ReceiverGone;
            }
        }
    }
}
