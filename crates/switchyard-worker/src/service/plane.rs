//! The worker's side of the KV event plane: one task that follows the worker's event log the
//! way a gRPC `KvEvents` stream does (the same [`EventStreamState`]: a snapshot first, then the
//! live events in batches, resuming from the log when it falls behind) and publishes each
//! message once to the plane, whatever the number of gateways reading it.
//!
//! A publish that fails is retried with backoff until it is stored: while it waits, the live
//! channel may overflow, and the state then resumes from the log (a replay, or a snapshot when
//! the log no longer holds the missed events), so what reaches the plane is always a sequence
//! the gateways' ingest rules accept, at worst with a snapshot in it.

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::BlockSize;
use switchyard_event_plane::EventPlane;
use switchyard_proto::v1::{self, kv_events_response::Payload};
use tokio_util::sync::CancellationToken;

use super::streams::{DigestIdentity, EventStreamState, digest_timer, start_messages};
use crate::event_log::{EventLog, SubscriptionStart};
use crate::metrics::{EventSink, WorkerMetrics};

/// Most events per plane message, as a gateway asks of a gRPC stream.
const MAX_BATCH_EVENTS: usize = 64;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// How many KV events a message carries (a snapshot or a digest carries none).
pub fn events_in(payload: &Payload) -> u64 {
    match payload {
        Payload::Event(_) => 1,
        Payload::Batch(batch) => batch.events.len() as u64,
        Payload::Snapshot(_) | Payload::Digest(_) => 0,
    }
}

/// What the publisher says it is: the worker and model its subject names.
#[derive(Debug, Clone)]
pub struct Publisher {
    pub plane: EventPlane,
    pub model: String,
    pub block_size: BlockSize,
    pub log: Arc<EventLog>,
    pub metrics: Arc<WorkerMetrics>,
    /// Milliseconds between digests on the plane (0: none).
    pub digest_interval_ms: u32,
}

impl Publisher {
    /// Publishes the log's messages until `stop` is cancelled or the log closes.
    pub async fn run(self, stop: CancellationToken) {
        let worker = self.log.worker().to_string();
        let subject = self.plane.subject(&self.model, &worker);
        let incarnation = self.log.incarnation();
        let mut state = self.start();
        let mut failing = false;
        loop {
            let payload = tokio::select! {
                () = stop.cancelled() => return,
                payload = state.next_payload() => payload,
            };
            let Some(payload) = payload else { return };
            let events = events_in(&payload);
            let message = v1::KvEventsResponse {
                worker_id: worker.clone(),
                incarnation,
                payload: Some(payload),
            };
            let mut backoff = BACKOFF_MIN;
            loop {
                match self.plane.publish(&subject, &message).await {
                    Ok(()) => {
                        if failing {
                            tracing::info!(worker = %worker, %subject, "publishing kv events to the event plane again");
                            failing = false;
                        }
                        self.metrics.kv_events_sent(EventSink::Plane, events);
                        break;
                    }
                    Err(error) => {
                        self.metrics.plane_publish_failed();
                        if failing {
                            tracing::debug!(worker = %worker, %error, "event plane publish failed; retrying");
                        } else {
                            tracing::warn!(worker = %worker, %error, "event plane publish failed; retrying");
                            failing = true;
                        }
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
        }
    }

    /// A stream state that starts from a snapshot of the log, then follows it.
    fn start(&self) -> EventStreamState {
        let subscription = self.log.subscribe(None, self.log.incarnation());
        let next_seq = match &subscription.start {
            SubscriptionStart::Replay(_) => None,
            SubscriptionStart::Snapshot { next_seq, .. } => Some(*next_seq),
        };
        EventStreamState {
            log: Arc::clone(&self.log),
            pending: start_messages(subscription.start, MAX_BATCH_EVENTS).into(),
            live: subscription.live,
            next_seq,
            at: subscription.at,
            digest_every: digest_timer(self.digest_interval_ms),
            identity: DigestIdentity {
                model: self.model.clone(),
                block_size: self.block_size,
            },
            max_batch: MAX_BATCH_EVENTS,
            lagged: false,
        }
    }
}

/// Connects to the plane (retrying with backoff while it is unreachable, so a worker does not
/// wait for NATS to serve) and publishes the log's messages until `stop`.
pub async fn connect_and_publish(
    config: switchyard_event_plane::EventPlaneConfig,
    cluster: String,
    model: String,
    block_size: BlockSize,
    log: Arc<EventLog>,
    metrics: Arc<WorkerMetrics>,
    stop: CancellationToken,
) {
    let worker = log.worker().to_string();
    let mut backoff = BACKOFF_MIN;
    let mut said = false;
    let client_name = format!("switchyard-worker {worker}");
    let plane = loop {
        let connect = EventPlane::connect(&config, &cluster, &client_name);
        let connected = tokio::select! {
            () = stop.cancelled() => return,
            connected = connect => connected,
        };
        match connected {
            Ok(plane) => break plane,
            Err(error) if !said => {
                tracing::warn!(worker = %worker, %error, "cannot reach the event plane yet; retrying");
                said = true;
            }
            Err(error) => {
                tracing::debug!(worker = %worker, %error, "event plane still unreachable")
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    };
    tracing::info!(worker = %worker, subject = %plane.subject(&model, &worker), "publishing kv events to the event plane");
    Publisher {
        plane,
        model,
        block_size,
        log,
        metrics,
        digest_interval_ms: config.digest_interval_ms,
    }
    .run(stop)
    .await;
}
