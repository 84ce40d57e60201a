//! The gateway's connection to the event plane and its one consumer per model: every worker
//! of a model publishes on a subject of its own, and the model's consumer reads them all
//! (`switchyard.<cluster>.kv.<model>.>`), handing each message to its worker's follower
//! ([`super::plane_dispatch`], read by [`super::plane`]). One consumer per worker meant 10,000
//! consumers per gateway at 10,000 workers, more than JetStream's API answered in time
//! (`docs/scaling.md`).
//!
//! A model's consumer is made when its first worker joins, reads from the oldest message the
//! stream holds (a gateway that starts late catches up from the history), and lives as long as
//! the gateway. When it ends (the server restarted, the connection is gone for longer than the
//! client's own resumption covers), it is made again right after the last message it read: when
//! the stream still holds what follows, nothing is lost and each follower meets what it missed
//! in order (its ingest rules find any gap); when it does not (trimmed past that point, or a
//! server that lost its store), every follower of the model starts from a snapshot.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use switchyard_core::WorkerId;
use switchyard_event_plane::{EventPlane, EventPlaneConfig, ModelFollow, PlaneError, Start};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::follow::FollowContext;
use super::plane_dispatch::{Dispatch, FeedSubscription};

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How often a feed drops stale unclaimed messages and tells followers of their losses.
const TIDY_EVERY: Duration = Duration::from_secs(1);
/// Messages a feed reads before it lets other tasks (its followers) run.
const YIELD_EVERY: u32 = 64;

/// The gateway's one connection to the event plane (made by the first feed that needs it, and
/// made again by the next one when it failed) and its consumers, one per model.
#[derive(Debug)]
pub struct PlaneHandle {
    config: EventPlaneConfig,
    cluster: String,
    client_name: String,
    plane: OnceCell<EventPlane>,
    feeds: parking_lot::Mutex<HashMap<String, Arc<parking_lot::Mutex<Dispatch>>>>,
}

impl PlaneHandle {
    pub fn new(config: EventPlaneConfig, cluster: &str, client_name: &str) -> Self {
        Self {
            config,
            cluster: cluster.to_owned(),
            client_name: client_name.to_owned(),
            plane: OnceCell::new(),
            feeds: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    /// The connected plane.
    pub async fn get(&self) -> Result<&EventPlane, PlaneError> {
        self.plane
            .get_or_try_init(|| EventPlane::connect(&self.config, &self.cluster, &self.client_name))
            .await
    }

    /// Joins `worker` (of `incarnation`) to `model`'s consumer, starting the consumer (a task
    /// of `cx`'s) when it is the model's first.
    pub fn subscribe(
        self: &Arc<Self>,
        cx: &FollowContext,
        model: &str,
        worker: &WorkerId,
        incarnation: u64,
    ) -> FeedSubscription {
        let dispatch = {
            let mut feeds = self.feeds.lock();
            match feeds.get(model) {
                Some(dispatch) => Arc::clone(dispatch),
                None => {
                    let dispatch = Arc::new(parking_lot::Mutex::new(Dispatch::default()));
                    feeds.insert(model.to_owned(), Arc::clone(&dispatch));
                    let run = run_feed(Arc::clone(self), model.to_owned(), Arc::clone(&dispatch));
                    let cancel = cx.cancel.clone();
                    cx.tasks.spawn(async move {
                        tokio::select! {
                            _ = cancel.cancelled() => {}
                            () = run => {}
                        }
                    });
                    dispatch
                }
            }
        };
        let token = switchyard_event_plane::subject_token(worker.as_str());
        FeedSubscription::join(&dispatch, &token, incarnation)
    }
}

/// Reads `model`'s messages from the plane into `dispatch`, making the consumer again when it
/// ends, for as long as the gateway runs.
async fn run_feed(
    handle: Arc<PlaneHandle>,
    model: String,
    dispatch: Arc<parking_lot::Mutex<Dispatch>>,
) {
    let mut backoff = BACKOFF_MIN;
    // The last stream sequence number read: a new consumer starts after it.
    let mut last_read: Option<u64> = None;
    loop {
        let start = last_read.map_or(Start::Oldest, Start::After);
        let follow = match handle.get().await {
            Ok(plane) => plane.follow_model(&model, start).await,
            Err(error) => Err(error),
        };
        let follow = match follow {
            Ok(follow) => follow,
            Err(error) => {
                tracing::warn!(%model, %error, "cannot follow the model on the event plane; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        if last_read.is_some() {
            if !follow.resumed {
                tracing::warn!(%model, "the event plane no longer holds what the gateway missed; every worker of the model resyncs");
            }
            dispatch.lock().restarted(follow.resumed, Instant::now());
        }
        match read(&dispatch, follow, &mut last_read).await {
            Some(error) => {
                tracing::info!(%model, %error, "event plane consumer ended; following again");
            }
            None => tracing::info!(%model, "event plane consumer ended; following again"),
        }
        backoff = BACKOFF_MIN;
        tokio::time::sleep(backoff).await;
    }
}

/// Reads `follow` into `dispatch` until it ends (with the error that ended it, if one did).
async fn read(
    dispatch: &parking_lot::Mutex<Dispatch>,
    follow: ModelFollow,
    last_read: &mut Option<u64>,
) -> Option<PlaneError> {
    let ModelFollow {
        mut messages,
        pending,
        last_at_start,
        ..
    } = follow;
    if pending == 0 {
        dispatch.lock().caught_up();
    }
    let mut read_since_yield = 0;
    let mut tidy = tokio::time::interval(TIDY_EVERY);
    tidy.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let delivered = tokio::select! {
            delivered = messages.next() => delivered,
            _ = tidy.tick() => {
                dispatch.lock().tidy(Instant::now());
                continue;
            }
        };
        let delivered = match delivered {
            Some(Ok(delivered)) => delivered,
            Some(Err(error)) => return Some(error),
            None => return None,
        };
        read_since_yield += 1;
        if read_since_yield == YIELD_EVERY {
            // A history read back-to-back comes in batches the client already holds: let the
            // followers drain their queues before they fill up (a full one costs a snapshot).
            read_since_yield = 0;
            tokio::task::yield_now().await;
        }
        *last_read = Some(delivered.stream_sequence);
        let mut dispatch = dispatch.lock();
        dispatch.deliver(
            &delivered.worker_token,
            delivered.bytes,
            delivered.message.map_err(|e| e.to_string()),
            Instant::now(),
        );
        // Caught up: nothing of the model was left when it was read, or it was published
        // after the consumer was made (a steady flow may never leave it at zero pending).
        if delivered.pending == 0 || delivered.stream_sequence > last_at_start {
            dispatch.caught_up();
        }
    }
}
