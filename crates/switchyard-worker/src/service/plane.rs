//! The worker's side of the KV event plane: one task that follows the worker's event log the
//! way a gRPC `KvEvents` stream does (the same [`EventStreamState`]: a snapshot first, then the
//! live events in batches, resuming from the log when it falls behind) and publishes each
//! message once to the plane, whatever the number of gateways reading it.
//!
//! A publish that fails is retried with backoff until it is stored: while it waits, the live
//! channel may overflow, and the state then resumes from the log (a replay, or a snapshot when
//! the log no longer holds the missed events), so what reaches the plane is always a sequence
//! the gateways' ingest rules accept, at worst with a snapshot in it.
//!
//! A message larger than the server takes (`max_payload`, 1 MiB unless its configuration says
//! otherwise: a snapshot of a large cache, a batch of long prompts' events) is split ([`fit`]):
//! a batch into smaller batches, in order; what cannot fit alone (one huge event, a snapshot)
//! is left out and counted. Its readers then find a gap in the sequence and take the worker's
//! snapshot over gRPC, which has no such bound.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
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

/// Bytes left for what a message's encoding adds around its payload and envelope fields.
const ENVELOPE_SLACK: usize = 16;

/// Puts `payload` into `out` as messages whose payload encodes in at most `room` bytes: as it
/// is when it fits, a batch split in halves (its events stay in order) until each part fits.
/// An event, a snapshot or a digest that does not fit alone is left out. Returns how many
/// messages were left out (each event counts as one).
pub fn fit(payload: Payload, room: usize, out: &mut Vec<Payload>) -> u64 {
    if payload.encoded_len() <= room {
        out.push(payload);
        return 0;
    }
    match payload {
        Payload::Batch(mut batch) if batch.events.len() > 1 => {
            let second = batch.events.split_off(batch.events.len() / 2);
            fit(Payload::Batch(batch), room, out)
                + fit(
                    Payload::Batch(v1::KvEventBatch { events: second }),
                    room,
                    out,
                )
        }
        Payload::Batch(batch) => batch.events.len() as u64,
        Payload::Event(_) | Payload::Snapshot(_) | Payload::Digest(_) => 1,
    }
}

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
            let envelope = v1::KvEventsResponse {
                worker_id: worker.clone(),
                incarnation,
                payload: None,
                logged_at_unix_us: state.logged_at_us,
            };
            let room = self
                .plane
                .max_payload()
                .saturating_sub(envelope.encoded_len() + ENVELOPE_SLACK);
            let mut parts = Vec::new();
            let left = fit(payload, room, &mut parts);
            if left > 0 {
                self.metrics.plane_oversized(left);
                tracing::warn!(worker = %worker, left, max_payload = self.plane.max_payload(), "kv events larger than the event plane takes were left out of it; its readers take a snapshot over gRPC");
            }
            for payload in parts {
                let message = v1::KvEventsResponse {
                    payload: Some(payload),
                    ..envelope.clone()
                };
                if !self.publish(&subject, &message, &stop, &mut failing).await {
                    return;
                }
            }
        }
    }

    /// Publishes `message`, retrying with backoff until it is stored; false when `stop` came
    /// first.
    async fn publish(
        &self,
        subject: &str,
        message: &v1::KvEventsResponse,
        stop: &CancellationToken,
        failing: &mut bool,
    ) -> bool {
        let worker = &message.worker_id;
        let events = message.payload.as_ref().map_or(0, events_in);
        let mut backoff = BACKOFF_MIN;
        loop {
            match self.plane.publish(subject, message).await {
                Ok(()) => {
                    if *failing {
                        tracing::info!(worker = %worker, %subject, "publishing kv events to the event plane again");
                        *failing = false;
                    }
                    self.metrics.kv_events_sent(EventSink::Plane, events);
                    return true;
                }
                Err(error) => {
                    self.metrics.plane_publish_failed();
                    if *failing {
                        tracing::debug!(worker = %worker, %error, "event plane publish failed; retrying");
                    } else {
                        tracing::warn!(worker = %worker, %error, "event plane publish failed; retrying");
                        *failing = true;
                    }
                    tokio::select! {
                        () = stop.cancelled() => return false,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
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
            logged_at_us: 0,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An event removing `blocks` blocks (its encoding grows with them).
    fn event(seq: u64, blocks: u64) -> v1::KvEvent {
        v1::KvEvent {
            seq,
            kind: Some(v1::kv_event::Kind::Removed(v1::Removed {
                blocks: (1..=blocks).map(|h| h << 40).collect(),
                ..Default::default()
            })),
        }
    }

    fn batch(events: Vec<v1::KvEvent>) -> Payload {
        Payload::Batch(v1::KvEventBatch { events })
    }

    fn seqs(parts: &[Payload]) -> Vec<Vec<u64>> {
        parts
            .iter()
            .map(|p| match p {
                Payload::Batch(b) => b.events.iter().map(|e| e.seq).collect(),
                Payload::Event(e) => vec![e.seq],
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn what_fits_goes_whole() {
        let whole = batch((0..8).map(|s| event(s, 4)).collect());
        let mut out = Vec::new();
        assert_eq!(fit(whole.clone(), whole.encoded_len(), &mut out), 0);
        assert_eq!(out, vec![whole]);
    }

    #[test]
    fn a_batch_too_large_is_split_in_order_into_parts_that_fit() {
        let whole = batch((0..8).map(|s| event(s, 100)).collect());
        let room = whole.encoded_len() / 3;
        let mut out = Vec::new();
        assert_eq!(fit(whole, room, &mut out), 0);
        assert!(out.len() >= 3, "{}", out.len());
        assert!(out.iter().all(|p| p.encoded_len() <= room));
        let order: Vec<u64> = seqs(&out).into_iter().flatten().collect();
        assert_eq!(order, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn what_cannot_fit_alone_is_left_out_and_counted() {
        // The fourth event alone is larger than the room: it is left out, the others go in order,
        // so the readers see a gap at 3 and take a snapshot over gRPC.
        let events: Vec<_> = (0..6)
            .map(|s| event(s, if s == 3 { 5_000 } else { 10 }))
            .collect();
        let room = Payload::Event(event(0, 1_000)).encoded_len();
        let mut out = Vec::new();
        assert_eq!(fit(batch(events), room, &mut out), 1);
        let order: Vec<u64> = seqs(&out).into_iter().flatten().collect();
        assert_eq!(order, vec![0, 1, 2, 4, 5]);
        // A snapshot larger than the room is left out whole.
        let snapshot = Payload::Snapshot(v1::Snapshot {
            next_seq: 9,
            blocks: (0..10_000)
                .map(|h| v1::SnapshotBlock {
                    hash: h << 30,
                    ..Default::default()
                })
                .collect(),
        });
        let mut out = Vec::new();
        assert_eq!(fit(snapshot, room, &mut out), 1);
        assert!(out.is_empty());
    }
}
