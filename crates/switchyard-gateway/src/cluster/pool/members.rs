//! A model's workers as routing reads them: one list per model, kept in worker-id order (the
//! order the pool's map gives, so tie-breaks do not move) and replaced whole when a worker of
//! the model joins, changes its description (role, adapters, engine endpoint) or leaves.
//!
//! Routing reads the list without taking any worker's lock and without sweeping the other
//! models' workers: building the candidates from the whole pool on every request was a fifth
//! of a decision at 1,000 workers. What changes from one request to the next (draining,
//! answering) is not in the list: it is read from each handle's flags as the candidates are
//! chosen, so it needs no invalidation.

use std::sync::Arc;

use switchyard_core::WorkerInfo;
use switchyard_router::Candidate;

use super::WorkerHandle;

/// One worker of a model, with what its registration said when the list was built.
#[derive(Debug)]
pub struct Member {
    pub handle: Arc<WorkerHandle>,
    /// The worker's description as of the list's build (the list is rebuilt when it changes).
    pub info: WorkerInfo,
}

/// A model's workers, and what the policy sees of each in the same order: when every worker
/// may take a request (the common case), routing hands the policy `candidates` as it is,
/// without a copy of any worker's id.
#[derive(Debug, Default)]
pub struct MemberList {
    pub members: Vec<Member>,
    pub candidates: Vec<Candidate>,
}

/// The workers of one model, in worker-id order.
#[derive(Debug, Default)]
pub struct ModelMembers {
    list: parking_lot::RwLock<Arc<MemberList>>,
}

impl ModelMembers {
    /// The current list (a shared snapshot: holding it blocks no one).
    pub fn snapshot(&self) -> Arc<MemberList> {
        Arc::clone(&self.list.read())
    }

    /// Rebuilds the list from `workers` (every worker of the pool, in id order), keeping those
    /// of `model`. `workers` is called under the list's write lock, so rebuilds that race
    /// store their lists in the order they read the pool: the last one stored saw every
    /// change made before it was asked for.
    pub(super) fn rebuild(&self, model: &str, workers: impl FnOnce() -> Vec<Arc<WorkerHandle>>) {
        let mut list = self.list.write();
        let members: Vec<Member> = workers()
            .into_iter()
            .filter_map(|handle| {
                let info = handle.info();
                (info.model == model).then_some(Member { info, handle })
            })
            .collect();
        let candidates = members.iter().map(|m| Candidate::of(&m.info)).collect();
        *list = Arc::new(MemberList {
            members,
            candidates,
        });
    }
}
