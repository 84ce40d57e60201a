//! The live subscriber: one resumable KV-event stream and one load stream per worker.
//!
//! The event stream resumes after the last applied sequence number when it reconnects; the
//! worker answers with the missed events or, when they are gone, a snapshot. A gap (or an
//! invalid event) makes the subscriber ask for a fresh snapshot. A worker restart shows up as a
//! new incarnation, whose snapshot replaces everything known of the worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use switchyard_core::{LoadStats, WorkerId};
use switchyard_proto::convert::{kv_event_from_wire, snapshot_block_from_wire};
use switchyard_proto::v1::{self, KvEventsRequest, LoadStatsRequest, kv_events_response::Payload};
use switchyard_router::ApplyOutcome;

use crate::metrics::WorkerLabels;
use crate::pool::{ModelRoutes, WorkerHandle, WorkerPool};

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Starts the two subscriber tasks of `worker`; they stop when the worker's token is cancelled.
pub fn spawn(pool: &Arc<WorkerPool>, worker: Arc<WorkerHandle>, routes: Arc<ModelRoutes>) {
    let events = follow_events(Arc::clone(pool), Arc::clone(&worker), Arc::clone(&routes));
    let load = follow_load(Arc::clone(pool), Arc::clone(&worker), routes);
    let cancel = worker.cancel.clone();
    pool.tasks.spawn({
        let cancel = cancel.clone();
        async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = events => {}
            }
        }
    });
    pool.tasks.spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = load => {}
        }
    });
}

/// Where the event stream stands.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    incarnation: u64,
    /// Next sequence number wanted; `None` asks for a snapshot.
    next_seq: Option<u64>,
}

async fn follow_events(pool: Arc<WorkerPool>, worker: Arc<WorkerHandle>, routes: Arc<ModelRoutes>) {
    let id = worker.id();
    let mut cursor = Cursor::default();
    let mut backoff = BACKOFF_MIN;
    loop {
        let request = KvEventsRequest {
            from_seq: cursor.next_seq,
            incarnation: cursor.incarnation,
        };
        let mut client = worker.client.clone();
        match client.kv_events(request).await {
            Ok(response) => {
                let mut stream = response.into_inner();
                while let Some(message) = stream.next().await {
                    match message {
                        Ok(message) => {
                            backoff = BACKOFF_MIN;
                            if !apply(&pool, &routes, &id, &mut cursor, message) {
                                // Ask again from a snapshot.
                                cursor.next_seq = None;
                                break;
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

/// Applies one message; returns false when the subscriber must resynchronise.
fn apply(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    id: &WorkerId,
    cursor: &mut Cursor,
    message: v1::KvEventsResponse,
) -> bool {
    let incarnation = message.incarnation;
    match message.payload {
        Some(Payload::Snapshot(snapshot)) => {
            let blocks: Result<Vec<_>, _> = snapshot
                .blocks
                .iter()
                .map(snapshot_block_from_wire)
                .collect();
            let blocks = match blocks {
                Ok(blocks) => blocks,
                Err(err) => {
                    tracing::warn!(worker = %id, error = %err, "invalid snapshot; dropping the worker's blocks");
                    routes.lock().index.remove_worker(id);
                    return false;
                }
            };
            let mut core = routes.lock();
            match core
                .index
                .apply_snapshot(id, incarnation, snapshot.next_seq, &blocks)
            {
                Ok(()) => {
                    pool.metrics.resyncs.inc();
                    let entries = core.index.worker_entries(id);
                    drop(core);
                    set_indexed(pool, id, entries);
                    *cursor = Cursor {
                        incarnation,
                        next_seq: Some(snapshot.next_seq),
                    };
                    tracing::debug!(worker = %id, blocks = blocks.len(), next_seq = snapshot.next_seq, "index resynchronised from snapshot");
                    true
                }
                Err(err) => {
                    tracing::warn!(worker = %id, error = %err, "snapshot refused");
                    false
                }
            }
        }
        Some(Payload::Event(event)) => {
            let (seq, event) = match kv_event_from_wire(event) {
                Ok(decoded) => decoded,
                Err(err) => {
                    pool.metrics.kv_events_invalid.inc();
                    tracing::warn!(worker = %id, error = %err, "undecodable kv event; resyncing");
                    return false;
                }
            };
            let mut core = routes.lock();
            match core.index.apply(id, incarnation, seq, &event) {
                Ok(ApplyOutcome::Applied) => {
                    pool.metrics.kv_events_applied.inc();
                    let entries = core.index.worker_entries(id);
                    drop(core);
                    set_indexed(pool, id, entries);
                    *cursor = Cursor {
                        incarnation,
                        next_seq: Some(seq + 1),
                    };
                    true
                }
                Ok(ApplyOutcome::Stale { .. }) => true,
                Ok(ApplyOutcome::ResyncNeeded { expected, got }) => {
                    tracing::info!(worker = %id, ?expected, got, "kv event gap; resyncing");
                    false
                }
                Err(err) => {
                    pool.metrics.kv_events_invalid.inc();
                    tracing::warn!(worker = %id, error = %err, "invalid kv event refused; resyncing");
                    false
                }
            }
        }
        None => true,
    }
}

fn set_indexed(pool: &WorkerPool, id: &WorkerId, entries: usize) {
    pool.metrics
        .worker_indexed_blocks
        .get_or_create(&WorkerLabels {
            worker: id.to_string(),
        })
        .set(entries as i64);
}

async fn follow_load(pool: Arc<WorkerPool>, worker: Arc<WorkerHandle>, routes: Arc<ModelRoutes>) {
    let id = worker.id();
    let labels = WorkerLabels {
        worker: id.to_string(),
    };
    let mut backoff = BACKOFF_MIN;
    loop {
        let mut client = worker.client.clone();
        let request = LoadStatsRequest {
            interval_ms: pool.load_interval_ms,
        };
        if let Ok(response) = client.load_stats(request).await {
            let mut stream = response.into_inner();
            while let Some(Ok(report)) = stream.next().await {
                backoff = BACKOFF_MIN;
                worker.draining.store(report.draining, Ordering::Relaxed);
                let stats = LoadStats::from(&report);
                routes.lock().load.report(&id, stats, pool.now_tick());
                let m = &pool.metrics;
                m.worker_queued_prefill_tokens
                    .get_or_create(&labels)
                    .set(stats.queued_prefill_tokens as i64);
                m.worker_running_requests
                    .get_or_create(&labels)
                    .set(stats.running_requests as i64);
                m.worker_active_blocks
                    .get_or_create(&labels)
                    .set(stats.active_blocks as i64);
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}
