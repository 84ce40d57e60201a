//! The gateway's observers, made once at start and handed to each part that writes to them:
//! the Prometheus metrics, the decision log, the recorder of the router's inputs and the
//! audit's settings. Dispatch and routing take them as an argument, the admin API reads them
//! from its state, and the pool's follower tasks take the metrics and the recorder in their
//! own context ([`crate::cluster::pool::follow`]); none of them reaches them through the pool.

use std::sync::Arc;

use tokio::time::Instant;

use super::audit::{AuditConfig, DecisionLog};
use super::metrics::Metrics;
use super::recorder::Recorder;

/// What the gateway records for operators; cloning shares the same metrics, log and recorder.
#[derive(Debug, Clone)]
pub struct Observers {
    pub metrics: Arc<Metrics>,
    /// Every routing decision with what then happened ([`super::audit::decisions`]).
    pub decisions: Arc<DecisionLog>,
    /// Records the router's inputs while a recording runs (admin API).
    pub recorder: Arc<Recorder>,
    /// The audit's settings (`[audit]`): how long a worker may owe KV events, the digest
    /// interval, the decision log's copy on disk.
    pub audit: AuditConfig,
}

impl Observers {
    pub fn new(
        metrics: Arc<Metrics>,
        decisions: DecisionLog,
        recorder: Recorder,
        audit: AuditConfig,
    ) -> Self {
        Self {
            metrics,
            decisions: Arc::new(decisions),
            recorder: Arc::new(recorder),
            audit,
        }
    }

    /// Observers with the default audit settings and a decision log of `decision_log_size`
    /// entries kept in memory only, recording ticks from `epoch` (the pool's: see
    /// [`crate::cluster::pool::WorkerPool::epoch`]).
    pub fn in_memory(decision_log_size: usize, metrics: Arc<Metrics>, epoch: Instant) -> Self {
        let decisions = DecisionLog::new(decision_log_size, None)
            .counting_outcomes(metrics.audit.decision_outcomes.clone());
        Self::new(
            metrics,
            decisions,
            Recorder::new(epoch),
            AuditConfig::default(),
        )
    }
}
