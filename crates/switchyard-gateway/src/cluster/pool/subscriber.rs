//! The live subscriber: one resumable KV-event stream and one load stream per worker.
//!
//! The event stream resumes after the last applied sequence number when it reconnects; the
//! worker answers with the missed events or, when they are gone, a snapshot. A gap (or an
//! invalid event) makes the subscriber ask for a fresh snapshot. A worker restart shows up as a
//! new incarnation, whose snapshot replaces everything known of the worker. The worker's
//! periodic digests of its own view are compared with the index at the same point of the
//! stream ([`crate::observe::audit::kv`]); a mismatch asks for a snapshot too.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use switchyard_core::{LoadStats, WorkerId};
use switchyard_proto::v1::{self, KvEventsRequest, LoadStatsRequest};

use super::follow::FollowContext;
use super::ingest::{Cursor, Ingested, Resync, ingest};
use super::subscriptions::Stream;
use super::{ModelRoutes, WorkerHandle, WorkerPool};
use crate::observe::metrics::WorkerLabels;
use crate::observe::recorder::Record;

/// Most KV events a worker may send in one message: with a busy worker the per-message cost
/// (gRPC framing, decoding, the routes lock, metrics) is paid once per batch
/// (`benches/ingest.rs`). Events are never held back to fill one. A batch is applied under one
/// hold of the model's routes lock, so this also bounds how long routing waits behind it
/// (≈ 2 µs of index work per 16-block event).
const MAX_BATCH_EVENTS: u32 = 64;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// `unresponsive_after` windows a worker's first load-stream open and first report get in all
/// before the subscriber gives up and opens again (a hung open is retried, a slow one is not
/// thrown away at the first window).
const FIRST_OPEN_PATIENCE: u32 = 5;

/// Follows `worker`'s KV events on a resumable gRPC stream (started by [`super::followers`];
/// it stops with the worker's token).
pub(super) async fn follow_events(
    pool: Arc<WorkerPool>,
    cx: Arc<FollowContext>,
    worker: Arc<WorkerHandle>,
    routes: Arc<ModelRoutes>,
) {
    let id = worker.id();
    let mut cursor = Cursor::default();
    let mut backoff = BACKOFF_MIN;
    // A recording starts from a fresh snapshot of every worker.
    let mut resync_rx = cx.recorder.resync_requests();
    loop {
        let request = KvEventsRequest {
            from_seq: cursor.next_seq,
            incarnation: cursor.incarnation,
            digest_interval_ms: cx.digest_interval_ms,
            max_batch_events: MAX_BATCH_EVENTS,
        };
        let Some(mut client) = cx.connections.client(&id) else {
            return; // The worker left.
        };
        // Opening the stream, up to its first message (the snapshot), holds one of the
        // gateway's subscription permits, for `unresponsive_after` at most.
        let mut opening = Some(cx.subscriptions.open().await);
        let window = tokio::time::sleep(cx.unresponsive_after);
        tokio::pin!(window);
        let open = client.kv_events(request);
        tokio::pin!(open);
        let opened = loop {
            tokio::select! {
                opened = &mut open => break opened,
                () = &mut window, if opening.is_some() => opening = None,
            }
        };
        match opened {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    let message = tokio::select! {
                        message = stream.next() => message,
                        Ok(()) = resync_rx.changed() => {
                            cursor.next_seq = None;
                            break;
                        }
                        () = &mut window, if opening.is_some() => {
                            opening = None;
                            continue;
                        }
                    };
                    let Some(message) = message else { break };
                    match message {
                        Ok(message) => {
                            backoff = BACKOFF_MIN;
                            opening = None;
                            if !apply(&pool, &cx, &routes, &id, &mut cursor, message) {
                                // Ask again from a snapshot.
                                cursor.next_seq = None;
                                break;
                            }
                            if cursor.next_seq.is_some() {
                                cx.subscriptions
                                    .delivered(&worker.subscription, Stream::Events);
                            }
                        }
                        Err(status) => {
                            tracing::debug!(worker = %id, error = %status, "kv event stream broke; resuming");
                            break;
                        }
                    }
                }
            }
            Err(status) => {
                tracing::debug!(worker = %id, error = %status, "cannot open kv event stream; retrying");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Applies one message ([`ingest`]) and does what follows from it: metrics, the recorder, the
/// audit, logs (the context's). Returns false when the subscriber must resynchronise (the cursor then asks for
/// a snapshot). Public for the ingestion bench, which feeds it a recorded stream.
pub fn apply(
    pool: &WorkerPool,
    cx: &FollowContext,
    routes: &ModelRoutes,
    id: &WorkerId,
    cursor: &mut Cursor,
    message: v1::KvEventsResponse,
) -> bool {
    let logged_at = message.logged_at_unix_us;
    let mut core = routes.lock();
    let ingested = ingest(&mut core.serving.index, id, cursor, message);
    let entries = match &ingested {
        Ingested::Snapshot { .. } => Some(core.serving.index.worker_entries(id)),
        Ingested::Events { applied, .. } if !applied.is_empty() => {
            Some(core.serving.index.worker_entries(id))
        }
        _ => None,
    };
    drop(core);
    if let Some(entries) = entries {
        set_indexed(cx, id, entries);
    }
    match ingested {
        Ingested::Snapshot {
            incarnation,
            next_seq,
            blocks,
        } => {
            cx.metrics.resyncs.inc();
            tracing::debug!(worker = %id, blocks = blocks.len(), next_seq, "index resynchronised from snapshot");
            cx.recorder.record(|| Record::Snapshot {
                tick: pool.now_tick(),
                model: routes.model.clone(),
                worker: id.clone(),
                incarnation,
                next_seq,
                blocks,
            });
            // A snapshot past sequence 0 shows the worker has published events (one that
            // never publishes stays at 0 however much it serves).
            if next_seq > 0 {
                super::kv_checks::note_event(pool, cx, id);
            }
            true
        }
        Ingested::Events {
            incarnation,
            applied,
            stop,
        } => {
            if !applied.is_empty() {
                cx.metrics.kv_events_applied.inc_by(applied.len() as u64);
                if logged_at > 0 {
                    let now = switchyard_core::time::unix_micros();
                    cx.metrics
                        .kv_event_lag
                        .observe(switchyard_core::time::seconds_since(logged_at, now));
                }
                super::kv_checks::note_event(pool, cx, id);
            }
            for (seq, event) in applied {
                cx.recorder.record(|| Record::KvEvent {
                    tick: pool.now_tick(),
                    model: routes.model.clone(),
                    worker: id.clone(),
                    incarnation,
                    seq,
                    event,
                });
            }
            match stop {
                Some(why) => {
                    resync(pool, cx, routes, id, why);
                    false
                }
                None => true,
            }
        }
        Ingested::Nothing => true,
        Ingested::Digest { at, digest } => {
            super::kv_checks::check_digest(pool, cx, routes, id, at, &digest)
                == super::kv_checks::DigestVerdict::Keep
        }
        Ingested::Resync(why) => {
            resync(pool, cx, routes, id, why);
            false
        }
    }
}

/// Counts and logs why the stream starts again from a snapshot.
fn resync(pool: &WorkerPool, cx: &FollowContext, routes: &ModelRoutes, id: &WorkerId, why: Resync) {
    if why.invalid_event() {
        cx.metrics.kv_events_invalid.inc();
    }
    match why {
        Resync::InvalidSnapshot(error) => {
            tracing::warn!(worker = %id, %error, "invalid snapshot; dropping the worker's blocks");
            cx.recorder.record(|| Record::IndexDropped {
                tick: pool.now_tick(),
                model: routes.model.clone(),
                worker: id.clone(),
            });
            set_indexed(cx, id, 0);
        }
        Resync::SnapshotRefused(error) => {
            tracing::warn!(worker = %id, %error, "snapshot refused");
        }
        Resync::Undecodable(error) => {
            tracing::warn!(worker = %id, %error, "undecodable kv event; resyncing");
        }
        Resync::Gap { expected, got } => {
            tracing::info!(worker = %id, ?expected, got, "kv event gap; resyncing");
        }
        Resync::Invalid(error) => {
            tracing::warn!(worker = %id, %error, "invalid kv event refused; resyncing");
        }
    }
}

fn set_indexed(cx: &FollowContext, id: &WorkerId, entries: usize) {
    cx.metrics
        .worker_indexed_blocks
        .get_or_create(&WorkerLabels {
            worker: id.to_string(),
        })
        .set(entries as i64);
}

/// Follows `worker`'s load reports (started by [`super::followers`]; it stops with the
/// worker's token).
pub(super) async fn follow_load(
    pool: Arc<WorkerPool>,
    cx: Arc<FollowContext>,
    worker: Arc<WorkerHandle>,
    routes: Arc<ModelRoutes>,
) {
    let id = worker.id();
    let labels = WorkerLabels {
        worker: id.to_string(),
    };
    // Looked up once, not per report (each lookup locks the family and hashes the label).
    let m = &cx.metrics;
    let queued_prefill = m
        .worker_queued_prefill_tokens
        .get_or_create(&labels)
        .clone();
    let running = m.worker_running_requests.get_or_create(&labels).clone();
    let active_blocks = m.worker_active_blocks.get_or_create(&labels).clone();
    let silence = cx.unresponsive_after;
    let mut backoff = BACKOFF_MIN;
    // Until its first report, a worker the load stream cannot reach is left to dispatch to
    // judge (a request that cannot connect marks it): its stream may still be coming up.
    let mut reported = false;
    loop {
        let Some(mut client) = cx.connections.client(&id) else {
            return; // The worker left.
        };
        let request = LoadStatsRequest {
            interval_ms: cx.load_interval_ms,
            push_min_interval_ms: cx.load_push_min_ms,
        };
        // The open, up to the first report, holds a subscription permit for `silence` at most.
        // A worker that answered before and is now frozen (it accepts the connection and never
        // answers) is given up on after `silence`; one that never answered yet gets
        // FIRST_OPEN_PATIENCE windows, the later ones without the permit: abandoning a slow
        // first open on a busy machine sent it to the back of the queue, redoing the work it
        // had cost, again and again.
        let mut opening = Some(cx.subscriptions.open().await);
        let mut windows = 0;
        let window = tokio::time::sleep(silence);
        tokio::pin!(window);
        let open = client.load_stats(request);
        tokio::pin!(open);
        let opened = loop {
            tokio::select! {
                opened = &mut open => break Some(opened),
                () = &mut window => {
                    opening = None;
                    windows += 1;
                    if reported || windows >= FIRST_OPEN_PATIENCE {
                        break None;
                    }
                    window.as_mut().reset(tokio::time::Instant::now() + silence);
                }
            }
        };
        let why = match opened {
            None => format!("its load stream did not open within {silence:?}"),
            Some(Err(status)) => format!("cannot open its load stream: {}", status.message()),
            Some(Ok(response)) => {
                let mut stream = response.into_inner();
                loop {
                    let report = match tokio::time::timeout(silence, stream.next()).await {
                        Err(_) if !reported && windows + 1 < FIRST_OPEN_PATIENCE => {
                            opening = None;
                            windows += 1;
                            continue;
                        }
                        Err(_) => break format!("no load report for {silence:?}"),
                        Ok(None) => break "its load stream ended".to_owned(),
                        Ok(Some(Err(status))) => {
                            break format!("its load stream failed: {}", status.message());
                        }
                        Ok(Some(Ok(report))) => report,
                    };
                    opening = None;
                    // Counted on the first report, whether or not its permit is still held
                    // (a slow open gives it back after one window).
                    cx.subscriptions
                        .delivered(&worker.subscription, Stream::Load);
                    backoff = BACKOFF_MIN;
                    reported = true;
                    cx.metrics.load_reports.inc();
                    worker.mark_answered(&cx.metrics);
                    worker.set_draining(report.draining);
                    let stats = LoadStats::from(&report);
                    let tick = pool.now_tick();
                    let mut core = routes.lock();
                    core.serving.load.report(&id, stats, tick);
                    cx.recorder.record(|| Record::Load {
                        tick,
                        model: routes.model.clone(),
                        worker: id.clone(),
                        stats,
                    });
                    drop(core);
                    queued_prefill.set(stats.queued_prefill_tokens as i64);
                    running.set(stats.running_requests as i64);
                    active_blocks.set(stats.active_blocks as i64);
                }
            }
        };
        drop(opening);
        if reported {
            worker.mark_failed(&cx.metrics, why);
        } else {
            tracing::debug!(worker = %id, %why, "no load report yet");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{
        BlockHash, BlockSize, EngineKind, KvEvent, Role, StorageTier, StoredBlock, WorkerInfo,
        block_hashes,
    };
    use switchyard_proto::convert::kv_event_to_wire;
    use switchyard_proto::v1::kv_events_response::Payload;
    use switchyard_router::{PolicyConfig, PolicyKind};

    use crate::observe::Observers;
    use crate::observe::metrics::Metrics;

    /// A pool with one sim worker `w` of the model `m`, and what `apply` takes beside it.
    struct Fixture {
        pool: Arc<WorkerPool>,
        cx: FollowContext,
        routes: Arc<ModelRoutes>,
        id: WorkerId,
    }

    impl Fixture {
        fn apply(&self, cursor: &mut Cursor, message: v1::KvEventsResponse) -> bool {
            apply(
                &self.pool,
                &self.cx,
                &self.routes,
                &self.id,
                cursor,
                message,
            )
        }
    }

    fn setup() -> Fixture {
        let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
        let observers = Observers::in_memory(8, Arc::new(Metrics::new()), pool.epoch());
        let cx = FollowContext::new(&observers, 100);
        let id = WorkerId::new("w").unwrap();
        let info = WorkerInfo {
            id: id.clone(),
            address: "127.0.0.1:1".into(),
            model: "m".into(),
            role: Role::Both,
            block_size: BlockSize::new(4).unwrap(),
            kv_capacity_blocks: 100,
            max_context_tokens: 1000,
            engine: EngineKind::Sim,
            incarnation: 1,
            adapters: Vec::new(),
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        };
        let routes = pool.routes_for(&info).unwrap();
        Fixture {
            pool,
            cx,
            routes,
            id,
        }
    }

    fn stored(tokens: &[u32]) -> KvEvent {
        let hashes = block_hashes(tokens, BlockSize::new(4).unwrap());
        KvEvent::Stored {
            parent: None,
            blocks: hashes
                .iter()
                .zip(tokens.chunks(4))
                .map(|(&hash, t)| StoredBlock {
                    hash,
                    tokens: t.to_vec(),
                })
                .collect(),
            tier: StorageTier::Device,
        }
    }

    fn event(incarnation: u64, seq: u64, e: &KvEvent) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation,
            payload: Some(Payload::Event(kv_event_to_wire(seq, e))),
        }
    }

    fn snapshot(incarnation: u64, next_seq: u64, hashes: &[BlockHash]) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation,
            payload: Some(Payload::Snapshot(v1::Snapshot {
                next_seq,
                blocks: hashes
                    .iter()
                    .map(|h| v1::SnapshotBlock {
                        hash: h.get(),
                        parent: None,
                        tier: 0,
                    })
                    .collect(),
            })),
        }
    }

    #[test]
    fn snapshot_then_events_then_gap_asks_for_a_resync() {
        let f = setup();
        let (routes, id) = (&f.routes, f.id.clone());
        let mut cursor = Cursor::default();
        let first = block_hashes(&[1, 2, 3, 4], BlockSize::new(4).unwrap());
        assert!(f.apply(&mut cursor, snapshot(1, 5, &first)));
        assert_eq!(cursor.next_seq, Some(5));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 1);

        assert!(f.apply(&mut cursor, event(1, 5, &stored(&[9, 9, 9, 9, 8, 8, 8, 8]))));
        assert_eq!(cursor.next_seq, Some(6));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 3);

        // A stale duplicate changes nothing and needs nothing.
        assert!(f.apply(&mut cursor, event(1, 4, &stored(&[7, 7, 7, 7]))));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 3);

        // A gap: the subscriber must resync, and the event is not applied.
        assert!(!f.apply(&mut cursor, event(1, 7, &stored(&[6, 6, 6, 6]))));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 3);

        // The resync snapshot replaces what was known.
        assert!(f.apply(&mut cursor, snapshot(1, 9, &first)));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 1);
        assert_eq!(cursor.next_seq, Some(9));
    }

    fn batch(incarnation: u64, events: &[(u64, &KvEvent)]) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation,
            payload: Some(Payload::Batch(v1::KvEventBatch {
                events: events
                    .iter()
                    .map(|(s, e)| kv_event_to_wire(*s, e))
                    .collect(),
            })),
        }
    }

    /// The event-lag histogram's (sum, count), as scraped.
    fn lag(cx: &FollowContext) -> (f64, u64) {
        let samples = switchyard_core::promtext::parse(&cx.metrics.encode());
        let value = |name: &str| {
            samples
                .iter()
                .find(|s| s.name == name)
                .map_or(0.0, |s| s.value)
        };
        (
            value("switchyard_kv_event_lag_seconds_sum"),
            value("switchyard_kv_event_lag_seconds_count") as u64,
        )
    }

    #[test]
    fn a_live_message_s_lag_is_measured_from_its_worker_s_stamp() {
        let f = setup();
        let mut cursor = Cursor::default();
        assert!(f.apply(&mut cursor, snapshot(1, 0, &[])));
        // A snapshot carries no stamp and is not a lag.
        assert_eq!(lag(&f.cx).1, 0);
        let logged = switchyard_core::time::unix_micros() - 3_000_000;
        let mut message = event(1, 0, &stored(&[1, 2, 3, 4]));
        message.logged_at_unix_us = logged;
        assert!(f.apply(&mut cursor, message));
        let (sum, count) = lag(&f.cx);
        assert_eq!(count, 1);
        assert!(sum >= 3.0, "lag {sum} s for an event logged 3 s before");
        // Unstamped (an older worker) and stamped in the future (a clock ahead): no lag
        // recorded, and no negative one.
        assert!(f.apply(&mut cursor, event(1, 1, &stored(&[5, 6, 7, 8]))));
        let mut ahead = event(1, 2, &stored(&[9, 9, 9, 9]));
        ahead.logged_at_unix_us = switchyard_core::time::unix_micros() + 60_000_000;
        assert!(f.apply(&mut cursor, ahead));
        let (later_sum, count) = lag(&f.cx);
        assert_eq!(count, 2);
        assert!(later_sum >= sum && later_sum < sum + 1.0);
    }

    #[test]
    fn a_batch_applies_in_order_up_to_a_gap_and_is_counted_per_event() {
        let f = setup();
        let (cx, routes, id) = (&f.cx, &f.routes, f.id.clone());
        let mut cursor = Cursor::default();
        assert!(f.apply(&mut cursor, snapshot(1, 0, &[])));
        let (a, b, c) = (
            stored(&[1, 1, 1, 1]),
            stored(&[2, 2, 2, 2]),
            stored(&[3, 3, 3, 3]),
        );
        // A duplicate of an applied event first (a resume), then two new ones.
        assert!(f.apply(&mut cursor, event(1, 0, &a)));
        assert!(f.apply(&mut cursor, batch(1, &[(0, &a), (1, &b), (2, &c)])));
        assert_eq!(cursor.next_seq, Some(3));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 3);
        assert_eq!(cx.metrics.kv_events_applied.get(), 3);
        // A gap inside a batch: the events before it stay applied, the rest waits for the
        // snapshot the subscriber asks for.
        let (d, e) = (stored(&[4, 4, 4, 4]), stored(&[5, 5, 5, 5]));
        assert!(!f.apply(&mut cursor, batch(1, &[(3, &d), (5, &e)])));
        assert_eq!(cursor.next_seq, None);
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 4);
        assert_eq!(cx.metrics.kv_events_applied.get(), 4);
    }

    #[test]
    fn forged_events_are_refused_and_counted() {
        let f = setup();
        let (cx, routes, id) = (&f.cx, &f.routes, f.id.clone());
        let mut cursor = Cursor::default();
        assert!(f.apply(&mut cursor, snapshot(1, 0, &[])));
        let forged = KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                hash: BlockHash(42),
                tokens: vec![1, 2, 3, 4],
            }],
            tier: StorageTier::Device,
        };
        assert!(!f.apply(&mut cursor, event(1, 0, &forged)));
        assert_eq!(cx.metrics.kv_events_invalid.get(), 1);
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 0);
        // An event without a payload kind is undecodable: resync, counted.
        let empty = v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation: 1,
            payload: Some(Payload::Event(v1::KvEvent { seq: 0, kind: None })),
        };
        assert!(!f.apply(&mut cursor, empty));
        assert_eq!(cx.metrics.kv_events_invalid.get(), 2);
    }

    #[test]
    fn a_restarted_worker_is_rebuilt_from_its_new_snapshot() {
        let f = setup();
        let (routes, id) = (&f.routes, f.id.clone());
        let mut cursor = Cursor::default();
        assert!(f.apply(&mut cursor, snapshot(1, 0, &[])));
        assert!(f.apply(&mut cursor, event(1, 0, &stored(&[1, 1, 1, 1]))));
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 1);
        assert!(f.apply(&mut cursor, snapshot(2, 0, &[])));
        assert_eq!(cursor.incarnation, 2);
        assert_eq!(routes.lock().serving.index.worker_entries(&id), 0);
    }
}
