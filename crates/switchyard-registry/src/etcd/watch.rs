//! The task behind an etcd [`WorkerWatch`](crate::WorkerWatch).
//!
//! It turns watch events into [`WorkerChange`]s against its own view of the live workers. When
//! the stream breaks (etcd restarted, the revision was compacted), it lists the workers again,
//! emits the difference between its view and the fresh list, and watches on from the list's
//! revision, so consumers converge on the truth without ever seeing a duplicate add or a
//! remove of something they never saw.
//!
//! A worker the fresh list lacks is not removed at once: it is removed if it is still missing
//! [`RESYNC_REMOVAL_GRACE`] later. When etcd comes back without the workers' keys (it lost its
//! data, or their leases ran out while it was away) the workers put them back within about a
//! second of etcd answering, and a consumer that removed them meanwhile would have refused
//! requests for nothing. A worker that is really gone is still removed, a few seconds later;
//! a gateway stops routing to it long before, when its load stream breaks. A delete seen on the
//! live stream (a worker deregistering, a lease expiring) removes at once.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{EventType, WatchStream};
use switchyard_core::{WorkerId, WorkerInfo};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Conn, parse_worker};
use crate::WorkerChange;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How long a worker missing from the list after a broken watch keeps its place before it is
/// removed: several times the workers' re-registration backoff (at most 1 s between attempts).
pub const RESYNC_REMOVAL_GRACE: Duration = Duration::from_secs(5);

/// Known workers a resync did not list, and when they are removed unless they come back.
type Missing = BTreeMap<WorkerId, Instant>;

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
    let mut missing = Missing::new();
    loop {
        let end = tokio::select! {
            () = cancel.cancelled() => return,
            end = pump(&conn, &mut stream, &mut known, &mut missing, &changes_tx) => end,
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
            let give_up_at = Instant::now() + RESYNC_REMOVAL_GRACE;
            for change in resync(&mut known, &mut missing, fresh, give_up_at) {
                if changes_tx.send(change).is_err() {
                    return;
                }
            }
            match conn.watch_workers_from(revision + 1).await {
                Ok(stream) => break stream,
                Err(error) => tracing::debug!(%error, "worker watch reopen failed; retrying"),
            }
        };
        tracing::info!(
            workers = known.len(),
            missing = missing.len(),
            "worker watch resynced"
        );
    }
}

/// Brings `known` to a fresh list after a broken watch and returns the changes to emit:
/// additions and updates at once; a known worker the list lacks stays known (and is recorded
/// in `missing` with the time it is given up) until [`expire`] or a watch event decides.
fn resync(
    known: &mut BTreeMap<WorkerId, WorkerInfo>,
    missing: &mut Missing,
    fresh: BTreeMap<WorkerId, WorkerInfo>,
    give_up_at: Instant,
) -> Vec<WorkerChange> {
    let mut changes = Vec::new();
    for (id, info) in &fresh {
        missing.remove(id);
        match known.get(id) {
            None => changes.push(WorkerChange::Added(info.clone())),
            Some(old) if old != info => changes.push(WorkerChange::Updated(info.clone())),
            Some(_) => {}
        }
    }
    let mut next = fresh;
    for (id, info) in std::mem::take(known) {
        if let std::collections::btree_map::Entry::Vacant(slot) = next.entry(id) {
            missing.entry(slot.key().clone()).or_insert(give_up_at);
            slot.insert(info);
        }
    }
    *known = next;
    changes
}

/// Removes the missing workers whose grace ended by `now`.
fn expire(
    known: &mut BTreeMap<WorkerId, WorkerInfo>,
    missing: &mut Missing,
    now: Instant,
) -> Vec<WorkerChange> {
    let gone: Vec<WorkerId> = missing
        .iter()
        .filter(|&(_, &at)| at <= now)
        .map(|(id, _)| id.clone())
        .collect();
    gone.into_iter()
        .filter_map(|id| {
            missing.remove(&id);
            tracing::info!(worker = %id, "worker still missing after a resync; removed");
            known.remove(&id).map(|_| WorkerChange::Removed(id))
        })
        .collect()
}

/// Sleeps until the earliest give-up time, or forever when nothing is missing.
async fn next_expiry(missing: &Missing) {
    match missing.values().min() {
        Some(&at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Applies watch events to `known` and forwards the changes, until the stream ends.
async fn pump(
    conn: &Conn,
    stream: &mut WatchStream,
    known: &mut BTreeMap<WorkerId, WorkerInfo>,
    missing: &mut Missing,
    changes_tx: &mpsc::UnboundedSender<WorkerChange>,
) -> PumpEnd {
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            () = next_expiry(missing) => {
                for change in expire(known, missing, Instant::now()) {
                    if changes_tx.send(change).is_err() {
                        return PumpEnd::ReceiverGone;
                    }
                }
                continue;
            }
        };
        let response = match message {
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
            // Whatever the live stream says about a worker settles whether it is missing.
            if let Ok(id) = conn.keys.worker_id_of(kv.key()) {
                missing.remove(&id);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{BlockSize, EngineKind, Role};

    fn worker(id: &str, role: Role) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: "127.0.0.1:1".into(),
            model: "m".into(),
            role,
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

    fn map(workers: &[WorkerInfo]) -> BTreeMap<WorkerId, WorkerInfo> {
        workers.iter().map(|w| (w.id.clone(), w.clone())).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_resync_adds_and_updates_at_once_and_removes_only_after_the_grace() {
        let (a, b, c) = (
            worker("a", Role::Both),
            worker("b", Role::Both),
            worker("c", Role::Both),
        );
        let b2 = worker("b", Role::Decode);
        let mut known = map(&[a.clone(), b.clone()]);
        let mut missing = Missing::new();
        let now = Instant::now();
        let changes = resync(
            &mut known,
            &mut missing,
            map(&[b2.clone(), c.clone()]),
            now + RESYNC_REMOVAL_GRACE,
        );
        assert_eq!(
            changes,
            vec![
                WorkerChange::Updated(b2.clone()),
                WorkerChange::Added(c.clone())
            ]
        );
        // a is still known, only missing.
        assert_eq!(known, map(&[a.clone(), b2.clone(), c.clone()]));
        assert_eq!(missing.len(), 1);
        assert!(expire(&mut known, &mut missing, now).is_empty());

        // A second resync before the grace ends keeps the first deadline.
        let later = now + RESYNC_REMOVAL_GRACE / 2;
        resync(
            &mut known,
            &mut missing,
            map(&[b2.clone(), c.clone()]),
            later + RESYNC_REMOVAL_GRACE,
        );
        assert_eq!(
            expire(&mut known, &mut missing, now + RESYNC_REMOVAL_GRACE),
            vec![WorkerChange::Removed(a.id.clone())]
        );
        assert_eq!(known, map(&[b2, c]));
        assert!(missing.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_worker_listed_again_is_neither_removed_nor_re_added() {
        let a = worker("a", Role::Both);
        let mut known = map(std::slice::from_ref(&a));
        let mut missing = Missing::new();
        let now = Instant::now();
        assert!(resync(&mut known, &mut missing, BTreeMap::new(), now).is_empty());
        assert!(resync(&mut known, &mut missing, map(std::slice::from_ref(&a)), now).is_empty());
        assert!(missing.is_empty());
        assert!(expire(&mut known, &mut missing, now + RESYNC_REMOVAL_GRACE).is_empty());
        assert_eq!(known, map(&[a]));
    }
}
