//! A model's workers as routing reads them: one list per model, kept in worker-id order (the
//! order the pool's map gives, so tie-breaks do not move) and replaced whole when a worker of
//! the model joins, changes its description (role, adapters, engine endpoint) or leaves.
//!
//! Routing reads the list without taking any worker's lock and without sweeping the other
//! models' workers: building the candidates from the whole pool on every request was a fifth
//! of a decision at 1,000 workers. What changes from one request to the next (draining,
//! answering) is not in the list: it is read from each handle's flags as the candidates are
//! chosen. A list that found every member open (answering, not draining) remembers it with the
//! pool's routing epoch, which every such change moves ([`MemberList::open_at`]): until it
//! moves, a request that may go to every member takes the list as it is without reading any
//! member, so choosing the candidates does not grow with the fleet.
//!
//! The list's *roster* — the members that can generate for a plain request: those serving
//! decode that this pool can deliver to — is also the model's roster in its serving core
//! ([`switchyard_router::serve::ServingCore::set_roster`]), set with every rebuild: a decision
//! among all of them reads the load view's ranking instead of scoring each.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use switchyard_core::WorkerId;

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
    pub candidates: Arc<[Candidate]>,
    /// The candidates of the members that can generate for a plain request (module docs), and
    /// their positions; the same allocation as `candidates` when that is every member.
    pub roster: Arc<[Candidate]>,
    pub roster_positions: Vec<usize>,
    /// Each member's position.
    positions: HashMap<WorkerId, usize>,
    /// One more than the routing epoch at which every member was found open and eligible for
    /// a generation with no exclusion nor adapter, with `aggregated_only` false and true; 0:
    /// not known.
    open: [AtomicU64; 2],
}

impl MemberList {
    /// The position of `worker` among the members.
    pub fn position(&self, worker: &WorkerId) -> Option<usize> {
        self.positions.get(worker).copied()
    }

    /// Whether every member was found open and eligible at routing epoch `epoch` for a plain
    /// generation (`aggregated_only` or not); see the module docs.
    pub fn open_at(&self, aggregated_only: bool, epoch: u64) -> bool {
        self.open[usize::from(aggregated_only)].load(Ordering::Relaxed) == epoch + 1
    }

    /// Remembers that every member was open and eligible at `epoch` (read before looking).
    pub fn set_open_at(&self, aggregated_only: bool, epoch: u64) {
        self.open[usize::from(aggregated_only)].store(epoch + 1, Ordering::Relaxed);
    }
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
    /// change made before it was asked for. `rebuilt` is given the new candidates under the
    /// same lock, so the serving core's roster follows the lists in the same order. The roster
    /// is the members for which `in_roster` holds.
    pub(super) fn rebuild(
        &self,
        model: &str,
        workers: impl FnOnce() -> Vec<Arc<WorkerHandle>>,
        in_roster: impl Fn(&WorkerInfo) -> bool,
        rebuilt: impl FnOnce(Arc<[Candidate]>),
    ) {
        let mut list = self.list.write();
        let members: Vec<Member> = workers()
            .into_iter()
            .filter_map(|handle| {
                let info = handle.info();
                (info.model == model).then_some(Member { info, handle })
            })
            .collect();
        let candidates: Arc<[Candidate]> = members.iter().map(|m| Candidate::of(&m.info)).collect();
        let positions = (members.iter().enumerate())
            .map(|(i, m)| (m.info.id.clone(), i))
            .collect();
        let roster_positions: Vec<usize> = (members.iter().enumerate())
            .filter(|(_, m)| in_roster(&m.info))
            .map(|(i, _)| i)
            .collect();
        let roster = if roster_positions.len() == members.len() {
            Arc::clone(&candidates)
        } else {
            roster_positions
                .iter()
                .map(|&i| candidates[i].clone())
                .collect()
        };
        rebuilt(Arc::clone(&roster));
        *list = Arc::new(MemberList {
            members,
            candidates,
            roster,
            roster_positions,
            positions,
            open: Default::default(),
        });
    }
}
