//! Following a worker's KV events through the event plane instead of a gRPC stream
//! (`switchyard_event_plane`, `docs/scaling.md`).
//!
//! The gateway reads each model with one consumer ([`super::plane_feed`]), which hands every
//! message to its worker's follower here by the subject it came on ([`super::plane_dispatch`]).
//! A follower applies each message through the same [`subscriber::apply`] (so the same pure
//! `ingest` and its cursor) as a gRPC stream's. The consumer reads from the oldest message the
//! stream still holds, so a gateway that starts late catches up from the stream: the history
//! begins with the snapshot the worker published when it started, or with its first event,
//! which the index accepts for a worker it has not seen. When the history no longer reaches
//! back that far, or the ingest rules find a gap, the worker is asked for a snapshot over gRPC,
//! and the stream goes on from there (what the snapshot already holds comes back as stale
//! events and is skipped). Load reports stay on gRPC (`subscriber::follow_load`).
//!
//! A follower also takes a snapshot when the feed says messages of its worker were lost (its
//! queue was full while it took a snapshot, a consumer could not resume, messages that came
//! before the worker registered overflowed what the feed keeps for it), when a message does
//! not decode, and when the consumer has read the whole history and none of it placed the
//! cursor: after [`FIRST_MESSAGE_GRACE`] without a first message (a worker that registered
//! before its first publish reached the stream needs none), the stream holds nothing of the
//! worker and only a snapshot says what it has.
//!
//! Two rules keep an old history from undoing what a gateway knows: messages of another
//! incarnation than the one registered are skipped (a worker restart re-registers it, and the
//! pool follows the new incarnation from scratch), and a snapshot in the stream that is not
//! ahead of the cursor is skipped (the events after it up to the cursor are stale anyway).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use switchyard_proto::v1::{self, KvEventsRequest, kv_events_response::Payload};

use super::follow::FollowContext;
use super::ingest::Cursor;
use super::plane_dispatch::{FeedItem, FeedSubscription};
use super::subscriber::apply;
use super::subscriptions::Stream;
use super::{ModelRoutes, WorkerHandle, WorkerPool};

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How long a follower whose worker the history holds nothing of waits for the worker's first
/// message before it takes a snapshot over gRPC.
pub const FIRST_MESSAGE_GRACE: Duration = Duration::from_secs(2);

/// Follows `worker`'s KV events, which its model's consumer hands over through `feed`, until
/// the worker's token is cancelled (dropping `feed` then takes it out of the consumer's
/// dispatch).
pub(super) async fn follow_plane(
    pool: Arc<WorkerPool>,
    cx: Arc<FollowContext>,
    worker: Arc<WorkerHandle>,
    routes: Arc<ModelRoutes>,
    mut feed: FeedSubscription,
) {
    let id = worker.id();
    let incarnation = worker.info().incarnation;
    let mut cursor = Cursor::default();
    let mut resync_rx = cx.recorder.resync_requests();
    // Armed when the consumer has read the history without placing the cursor.
    let grace = tokio::time::sleep(FIRST_MESSAGE_GRACE);
    tokio::pin!(grace);
    let mut waiting = false;
    loop {
        let item = tokio::select! {
            item = feed.recv() => item,
            Ok(()) = resync_rx.changed() => {
                // A recording starts from a fresh snapshot of every worker.
                snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
                continue;
            }
            () = &mut grace, if waiting => {
                waiting = false;
                if cursor.next_seq.is_none() {
                    snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
                }
                continue;
            }
        };
        let message = match item {
            // The feed is gone: the gateway stops.
            None => return,
            Some(FeedItem::Message(message)) => message,
            Some(FeedItem::CaughtUp) => {
                if cursor.next_seq.is_none() {
                    grace
                        .as_mut()
                        .reset(tokio::time::Instant::now() + FIRST_MESSAGE_GRACE);
                    waiting = true;
                }
                continue;
            }
            Some(FeedItem::Lost) => {
                tracing::info!(worker = %id, "kv events lost on the event plane; resyncing");
                snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
                continue;
            }
            Some(FeedItem::Undecodable(error)) => {
                // Not one of ours: what it held is unknown, so start again from a snapshot.
                cx.metrics.kv_events_invalid.inc();
                tracing::warn!(worker = %id, %error, "undecodable message on the event plane; resyncing");
                snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
                continue;
            }
        };
        if !wanted(incarnation, &cursor, &message) {
            continue;
        }
        if behind_a_digest(&cursor, &message) {
            // The worker is past where the index is, and the plane holds no way there.
            snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
            continue;
        }
        if !apply(&pool, &cx, &routes, &id, &mut cursor, message) {
            snapshot(&pool, &cx, &worker, &routes, &mut cursor).await;
        }
        if cursor.next_seq.is_some() {
            cx.subscriptions
                .delivered(&worker.subscription, Stream::Events);
        }
    }
}

/// Whether a message read from the plane can tell the index anything: it is of the registered
/// incarnation, and not a snapshot behind where the cursor already stands.
fn wanted(incarnation: u64, cursor: &Cursor, message: &v1::KvEventsResponse) -> bool {
    if message.incarnation != incarnation {
        return false;
    }
    match (&message.payload, cursor.next_seq) {
        (Some(Payload::Snapshot(snapshot)), Some(next)) if cursor.incarnation == incarnation => {
            snapshot.next_seq > next
        }
        _ => true,
    }
}

/// Whether `message` is a digest showing the worker past where the cursor stands: past
/// sequence 0 of an incarnation the cursor has not followed yet (the history no longer holds
/// how the worker got there), or, in the incarnation it follows, past its next sequence number
/// (a digest goes out in order after every event before it, so events are missing: one left
/// out of the plane for its size, with no event after it yet to show the gap).
fn behind_a_digest(cursor: &Cursor, message: &v1::KvEventsResponse) -> bool {
    match &message.payload {
        Some(Payload::Digest(digest)) if cursor.incarnation != message.incarnation => {
            digest.next_seq > 0
        }
        Some(Payload::Digest(digest)) => cursor.next_seq.is_some_and(|next| digest.next_seq > next),
        _ => false,
    }
}

/// Takes a snapshot of `worker` over gRPC (the first message of a `KvEvents` stream opened
/// without a position) and applies it, retrying with backoff until it applies or the worker's
/// token is cancelled (the follower then stops with it).
async fn snapshot(
    pool: &WorkerPool,
    cx: &FollowContext,
    worker: &WorkerHandle,
    routes: &ModelRoutes,
    cursor: &mut Cursor,
) {
    let id = worker.id();
    let mut backoff = BACKOFF_MIN;
    loop {
        match fetch_snapshot(cx, worker).await {
            Ok(message) => {
                if apply(pool, cx, routes, &id, cursor, message) && cursor.next_seq.is_some() {
                    cx.subscriptions
                        .delivered(&worker.subscription, Stream::Events);
                    return;
                }
            }
            Err(why) => {
                tracing::debug!(worker = %id, %why, "cannot take a snapshot over gRPC; retrying");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn fetch_snapshot(
    cx: &FollowContext,
    worker: &WorkerHandle,
) -> Result<v1::KvEventsResponse, String> {
    // Bounded like the gRPC streams' opens: a gateway starting in front of a large fleet whose
    // history is gone does not ask every worker at once.
    let _permit = cx.subscriptions.open().await;
    let mut client = cx
        .connections
        .client_or_status(&worker.id())
        .map_err(|s| s.message().to_owned())?;
    let request = KvEventsRequest {
        from_seq: None,
        incarnation: 0,
        digest_interval_ms: 0,
        max_batch_events: 1,
    };
    let first = tokio::time::timeout(cx.unresponsive_after, async move {
        let mut stream = client
            .kv_events(request)
            .await
            .map_err(|s| s.message().to_owned())?
            .into_inner();
        match stream.next().await {
            Some(Ok(message)) => Ok(message),
            Some(Err(status)) => Err(status.message().to_owned()),
            None => Err("the stream ended before its snapshot".to_owned()),
        }
    })
    .await
    .map_err(|_| format!("no snapshot within {:?}", cx.unresponsive_after))??;
    match first.payload {
        Some(Payload::Snapshot(_)) => Ok(first),
        _ => Err("the stream did not start with a snapshot".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(incarnation: u64, payload: Payload) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation,
            payload: Some(payload),
        }
    }

    fn snapshot_at(next_seq: u64) -> Payload {
        Payload::Snapshot(v1::Snapshot {
            next_seq,
            blocks: Vec::new(),
        })
    }

    #[test]
    fn other_incarnations_and_snapshots_behind_the_cursor_are_skipped() {
        let fresh = Cursor::default();
        let at_10 = Cursor {
            incarnation: 7,
            next_seq: Some(10),
        };
        let event = Payload::Event(v1::KvEvent { seq: 3, kind: None });
        assert!(!wanted(7, &fresh, &message(8, event.clone())));
        assert!(wanted(7, &fresh, &message(7, event.clone())));
        // Events always go to ingest: it decides stale, next or gap.
        assert!(wanted(7, &at_10, &message(7, event)));
        assert!(wanted(7, &fresh, &message(7, snapshot_at(4))));
        assert!(!wanted(7, &at_10, &message(7, snapshot_at(4))));
        assert!(!wanted(7, &at_10, &message(7, snapshot_at(10))));
        assert!(wanted(7, &at_10, &message(7, snapshot_at(11))));
        // A cursor waiting for a snapshot takes any.
        let waiting = Cursor {
            incarnation: 7,
            next_seq: None,
        };
        assert!(wanted(7, &waiting, &message(7, snapshot_at(1))));
    }

    #[test]
    fn a_digest_of_an_incarnation_not_followed_yet_asks_for_a_snapshot() {
        let digest = |next_seq| {
            Payload::Digest(v1::KvDigest {
                next_seq,
                ..Default::default()
            })
        };
        let fresh = Cursor::default();
        assert!(behind_a_digest(&fresh, &message(7, digest(5))));
        // A worker that has published nothing yet: nothing is missing.
        assert!(!behind_a_digest(&fresh, &message(7, digest(0))));
        let following = Cursor {
            incarnation: 7,
            next_seq: Some(5),
        };
        // Followed and at the digest's point: the digest check (`kv_checks`) compares it with
        // the index instead.
        assert!(!behind_a_digest(&following, &message(7, digest(5))));
        // Followed, but the worker is past the cursor: events went missing.
        assert!(behind_a_digest(&following, &message(7, digest(9))));
        // Behind the cursor (not possible in order; a stale digest): nothing to do.
        assert!(!behind_a_digest(&following, &message(7, digest(3))));
        assert!(!behind_a_digest(
            &fresh,
            &message(7, Payload::Event(v1::KvEvent { seq: 3, kind: None }))
        ));
    }
}
