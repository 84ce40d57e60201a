//! The pool's side of the KV audit ([`crate::observe::audit::kv`]): the periodic check for
//! workers whose events stopped, the note that one arrived, and the comparison of a worker's
//! digest with what the model's index holds for it. Findings go to each worker's
//! [`KvAudit`](crate::observe::audit::kv::KvAudit) and to the audit metrics.

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::WorkerId;
use switchyard_proto::v1;
use tokio::time::Instant;

use super::follow::FollowContext;
use super::{ModelRoutes, WorkerPool};
use crate::observe::audit::kv::identity_problem;
use crate::observe::metrics::WorkerLabels;

/// How often the silence check runs.
const SILENCE_CHECK: Duration = Duration::from_millis(250);

/// Reports workers whose KV events stopped (or never started) until the context is cancelled.
pub async fn watch_silence(pool: Arc<WorkerPool>, cx: Arc<FollowContext>) {
    let after = cx.kv_silence_after;
    let mut tick = tokio::time::interval(SILENCE_CHECK);
    loop {
        tokio::select! {
            () = cx.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        for worker in pool.workers() {
            if let Some(reason) = worker.kv.check_silence(now, after) {
                let id = worker.id();
                tracing::warn!(worker = %id, %reason, "worker publishes no kv events; its cache hits are invisible to the router");
                cx.metrics
                    .audit
                    .kv_silent
                    .get_or_create(&labels(&id))
                    .set(1);
            }
        }
    }
}

/// An event of `id` was applied (called by the subscriber).
pub fn note_event(pool: &WorkerPool, cx: &FollowContext, id: &WorkerId) {
    let Some(worker) = pool.worker(id) else {
        return;
    };
    if worker.kv.event_applied() {
        tracing::info!(worker = %id, "kv events arrive again");
        cx.metrics.audit.kv_silent.get_or_create(&labels(id)).set(0);
    }
}

fn labels(id: &WorkerId) -> WorkerLabels {
    WorkerLabels {
        worker: id.to_string(),
    }
}

/// What the subscriber should do after a digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestVerdict {
    /// Nothing to compare or it matched: carry on.
    Keep,
    /// The index diverged from the worker's own view: resynchronise from a snapshot.
    Resync,
}

/// Checks one digest of `id`'s stream, taken when the subscriber's next expected event is
/// `next_seq`: the worker's identity, then its blocks against the index.
pub fn check_digest(
    pool: &WorkerPool,
    cx: &FollowContext,
    routes: &ModelRoutes,
    id: &WorkerId,
    next_seq: Option<u64>,
    digest: &v1::KvDigest,
) -> DigestVerdict {
    let Some(worker) = pool.worker(id) else {
        return DigestVerdict::Keep;
    };
    let info = worker.info();
    let problem = identity_problem(&info.model, info.block_size, digest);
    if worker.kv.set_identity(problem.clone()) {
        let gauge = cx.metrics.audit.kv_mismatch.get_or_create(&labels(id));
        match &problem {
            Some(problem) => {
                tracing::warn!(worker = %id, %problem, "worker's kv digests do not match its registration");
                gauge.set(1);
            }
            None => {
                gauge.set(0);
            }
        }
    }
    if next_seq != Some(digest.next_seq) {
        // Not at the digest's point of the stream (a resync is under way): nothing to compare.
        return DigestVerdict::Keep;
    }
    let (index_digest, evicted) = {
        let core = routes.lock();
        let index = &core.serving.index;
        if index.awaiting_snapshot(id) {
            return DigestVerdict::Keep;
        }
        (index.worker_digest(id), index.evicted_entries())
    };
    // An index at its entry cap evicts pairs on purpose (module docs of the index): it is then
    // expected to hold less than the worker, and a resync would not change that.
    if evicted > 0 {
        return DigestVerdict::Keep;
    }
    let index_digest = index_digest.unwrap_or_default();
    let matched = index_digest.blocks == digest.blocks && index_digest.sum == digest.sum;
    let m = &cx.metrics.audit;
    let l = labels(id);
    m.digest_checks
        .get_or_create(&crate::observe::audit::metrics::DigestLabels {
            result: if matched { "match" } else { "mismatch" },
        })
        .inc();
    m.index_divergence_blocks
        .get_or_create(&l)
        .set(index_digest.blocks as i64 - digest.blocks as i64);
    m.index_diverged.get_or_create(&l).set(i64::from(!matched));
    if worker
        .kv
        .digest_checked(matched, digest.blocks, index_digest.blocks)
    {
        m.index_repairs.inc();
        tracing::info!(worker = %id, blocks = digest.blocks, "index matches the worker again after its resync");
    }
    if matched {
        DigestVerdict::Keep
    } else {
        tracing::warn!(
            worker = %id,
            worker_blocks = digest.blocks,
            index_blocks = index_digest.blocks,
            next_seq = digest.next_seq,
            "index diverged from the worker's own view of its cache (events lost or altered on the way); resyncing from a snapshot"
        );
        DigestVerdict::Resync
    }
}
