//! The workers a request may go to, read from the pool through the serving core's filters
//! (`switchyard_router::serve::candidates`), preferring those that answer.

use std::sync::Arc;

use switchyard_core::{EngineKind, WorkerId, WorkerInfo};
use switchyard_router::Candidate;
use switchyard_router::serve::{self, DecodeFilter, WorkerFacts, may_decode, may_prefill_for};

use crate::cluster::pool::members::{Member, MemberList};
use crate::cluster::pool::{ModelRoutes, WorkerHandle, WorkerPool};

/// The workers a request may go to: what the policy sees, and which of the model's members
/// they are, in the same order. When every member may take the request, the policy reads the
/// model's own candidate list (no copy of any worker's id); otherwise the eligible ones are
/// copied out.
#[derive(Debug)]
pub struct Candidates {
    list: Arc<MemberList>,
    chosen: Chosen,
}

/// Which of a member list's members are the candidates.
#[derive(Debug)]
enum Chosen {
    All,
    /// The list's roster (`members`): the serving core ranks them.
    Roster,
    /// These candidates, at these positions in the list (ascending).
    Some(Vec<Candidate>, Vec<usize>),
}

impl Candidates {
    /// The workers of `routes`' model for which the core's filter `eligible` holds, leaving
    /// out those that stopped answering ([`crate::cluster::health`]) unless none answers: then all are
    /// tried rather than the request refused (a moment when the gateway reaches no worker
    /// should not become 503s; attempts on workers that are really gone fail fast).
    pub(super) fn select(
        pool: &WorkerPool,
        routes: &ModelRoutes,
        eligible: impl Fn(WorkerFacts<'_>) -> bool,
    ) -> Self {
        Self::select_within(pool, routes, eligible, &|_| true)
    }

    /// [`Candidates::select`] among the workers `within` admits (an endpoint subset).
    pub(super) fn select_within(
        pool: &WorkerPool,
        routes: &ModelRoutes,
        eligible: impl Fn(WorkerFacts<'_>) -> bool,
        within: &dyn Fn(&WorkerInfo) -> bool,
    ) -> Self {
        // The model's own list ([`crate::cluster::pool::members`]): no sweep of every model's workers
        // and no worker lock per request; draining and answering are read live below.
        let list = routes.members.snapshot();
        let eligible = |m: &Member| {
            pool.deliverable(&m.info)
                && within(&m.info)
                && eligible(facts(&m.info, m.handle.is_draining()))
        };
        let answering = |m: &Member| m.handle.health.is_answering() && eligible(m);
        if list.members.iter().all(answering) {
            return Self {
                list,
                chosen: Chosen::All,
            };
        }
        let mut some = Self::positions(&list, answering);
        if some.is_empty() {
            some = Self::positions(&list, eligible);
        }
        if some == list.roster_positions {
            return Self {
                list,
                chosen: Chosen::Roster,
            };
        }
        let ids = some.iter().map(|&i| list.candidates[i].clone()).collect();
        Self {
            list,
            chosen: Chosen::Some(ids, some),
        }
    }

    fn positions(list: &MemberList, keep: impl Fn(&Member) -> bool) -> Vec<usize> {
        (list.members.iter().enumerate())
            .filter(|(_, m)| keep(m))
            .map(|(i, _)| i)
            .collect()
    }

    pub fn ids(&self) -> &[Candidate] {
        match &self.chosen {
            Chosen::All => &self.list.candidates,
            Chosen::Roster => &self.list.roster,
            Chosen::Some(ids, _) => ids,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ids().is_empty()
    }

    /// The handle of the chosen worker, when it is a candidate.
    pub(super) fn take(self, worker: &WorkerId) -> Option<Arc<WorkerHandle>> {
        let member = self.list.position(worker)?;
        match &self.chosen {
            Chosen::All => {}
            Chosen::Roster => {
                self.list.roster_positions.binary_search(&member).ok()?;
            }
            Chosen::Some(_, positions) => {
                positions.binary_search(&member).ok()?;
            }
        }
        Some(Arc::clone(&self.list.members[member].handle))
    }
}

/// The serving core's view of a registered worker.
fn facts(info: &WorkerInfo, draining: bool) -> WorkerFacts<'_> {
    WorkerFacts {
        id: &info.id,
        role: info.role,
        engine: info.engine,
        draining,
        adapters: &info.adapters,
    }
}

/// Whether `info`'s worker can generate only from a prefill worker's KV
/// ([`serve::needs_prefill`]). The gateway learns this from the registry entry alone (engine
/// kind and role), so it holds for workers of any version.
pub fn needs_prefill(info: &WorkerInfo) -> bool {
    serve::needs_prefill(info.role, info.engine)
}

/// Workers of the model that can take a generation now under `filter`. A generation with no
/// exclusion nor adapter goes to every member as long as the list found them all open at the
/// pool's routing epoch (`members`), without reading any member.
pub fn candidates(pool: &WorkerPool, routes: &ModelRoutes, filter: DecodeFilter<'_>) -> Candidates {
    let plain = filter.exclude.is_empty() && filter.adapter.is_none();
    if !plain {
        return Candidates::select(pool, routes, |w| may_decode(w, filter));
    }
    // Read before looking: a change while looking moves the epoch past the one remembered.
    let epoch = pool.routing_epoch();
    let list = routes.members.snapshot();
    if list.open_at(filter.aggregated_only, epoch) {
        return Candidates {
            list,
            chosen: Chosen::Roster,
        };
    }
    let chosen = Candidates::select(pool, routes, |w| may_decode(w, filter));
    // `All`: every member can generate, so the roster is every member, the same list.
    let rostered = matches!(chosen.chosen, Chosen::All | Chosen::Roster);
    if rostered && Arc::ptr_eq(&chosen.list, &list) {
        list.set_open_at(filter.aggregated_only, epoch);
    }
    chosen
}

/// Prefill-pool workers of the model that can prefill now for a decode worker in front of
/// `engine`, under the request's LoRA `adapter` if it has one.
pub fn prefill_candidates(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    engine: EngineKind,
    exclude: &[WorkerId],
    adapter: Option<&str>,
) -> Candidates {
    Candidates::select(pool, routes, |w| {
        may_prefill_for(w, engine, exclude, adapter)
    })
}

#[cfg(test)]
#[path = "candidates_tests.rs"]
mod tests;
