//! The unit tests' pool: a [`WorkerPool`] with its followers and in-memory observers, read
//! like the pool (it derefs to it) and changed like the registry watch changes it.

use std::sync::Arc;

use switchyard_core::{BlockSize, EngineKind, Role, WorkerId, WorkerInfo};
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

/// A vLLM worker `id` serving `model` (block size 4, 100 blocks) at an address nothing listens
/// on (port 1): its followers fail and retry, harmlessly.
pub(crate) fn worker_info(id: &str, model: &str) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).expect("a valid worker id"),
        address: "127.0.0.1:1".into(),
        model: model.into(),
        role: Role::Both,
        block_size: BlockSize::new(4).expect("a valid block size"),
        kv_capacity_blocks: 100,
        max_context_tokens: 10_000,
        engine: EngineKind::Vllm,
        incarnation: 1,
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    }
}
