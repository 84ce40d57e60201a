//! The unit tests' pool: a [`WorkerPool`] with its followers and in-memory observers, read
//! like the pool (it derefs to it) and changed like the registry watch changes it.

use std::sync::Arc;

use switchyard_core::{WorkerId, WorkerInfo};
use switchyard_router::{PolicyConfig, PolicyKind};

use super::follow::FollowContext;
use super::followers::Followers;
use super::{WorkerHandle, WorkerPool};
use crate::observe::Observers;
use crate::observe::metrics::Metrics;

pub(crate) struct TestPool {
    pub pool: Arc<WorkerPool>,
    pub followers: Followers,
    pub observers: Arc<Observers>,
}

impl std::ops::Deref for TestPool {
    type Target = Arc<WorkerPool>;
    fn deref(&self) -> &Arc<WorkerPool> {
        &self.pool
    }
}

impl TestPool {
    /// A KV-policy pool keeping `decision_log_size` decisions, its workers reporting load every
    /// 100 ms, holding `workers`.
    pub fn new(decision_log_size: usize, workers: &[WorkerInfo]) -> Self {
        let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
        let observers = Arc::new(Observers::in_memory(
            decision_log_size,
            Arc::new(Metrics::new()),
            pool.epoch(),
        ));
        let followers = Followers::new(
            Arc::clone(&pool),
            Arc::new(FollowContext::new(&observers, 100)),
        );
        for w in workers {
            followers.upsert_worker(w.clone());
        }
        Self {
            pool,
            followers,
            observers,
        }
    }

    pub fn upsert_worker(&self, info: WorkerInfo) {
        self.followers.upsert_worker(info);
    }

    pub fn remove_worker(&self, id: &WorkerId) {
        self.followers.remove_worker(id);
    }

    pub fn worker_failed(&self, worker: &WorkerHandle, reason: &str) {
        worker.mark_failed(&self.observers.metrics, reason);
    }

    pub fn worker_answered(&self, worker: &WorkerHandle) {
        worker.mark_answered(&self.observers.metrics);
    }

    pub async fn shutdown(&self) {
        self.followers.shutdown().await;
    }
}
