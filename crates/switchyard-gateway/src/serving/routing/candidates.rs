//! The workers a request may go to, read from the pool through the serving core's filters
//! (`switchyard_router::serve::candidates`), preferring those that answer.

use std::sync::Arc;

use switchyard_core::{EngineKind, WorkerId, WorkerInfo};
use switchyard_router::Candidate;
use switchyard_router::serve::{self, DecodeFilter, WorkerFacts, may_decode, may_prefill_for};

use crate::cluster::pool::members::Member;
use crate::cluster::pool::{ModelRoutes, WorkerHandle, WorkerPool};

/// The workers a request may go to: what the policy sees, and their handles in the same
/// order. Two lists rather than pairs, so the policy gets its slice without a copy of every
/// worker id.
#[derive(Debug, Default)]
pub struct Candidates {
    pub(super) ids: Vec<Candidate>,
    handles: Vec<Arc<WorkerHandle>>,
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
        let members = routes.members.snapshot();
        let eligible = |m: &Member| {
            pool.deliverable(&m.info)
                && within(&m.info)
                && eligible(facts(&m.info, m.handle.is_draining()))
        };
        let answering = members.iter().filter(|m| m.handle.health.is_answering());
        let answering = Self::select_from(answering, members.len(), &eligible);
        if !answering.is_empty() {
            return answering;
        }
        Self::select_from(members.iter(), members.len(), &eligible)
    }

    fn select_from<'a>(
        members: impl Iterator<Item = &'a Member>,
        most: usize,
        eligible: &impl Fn(&Member) -> bool,
    ) -> Self {
        let mut out = Candidates {
            ids: Vec::with_capacity(most),
            handles: Vec::with_capacity(most),
        };
        for m in members.filter(|m| eligible(m)) {
            out.ids.push(m.candidate.clone());
            out.handles.push(Arc::clone(&m.handle));
        }
        out
    }

    pub fn ids(&self) -> &[Candidate] {
        &self.ids
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The handle of the chosen worker.
    pub(super) fn take(mut self, worker: &WorkerId) -> Option<Arc<WorkerHandle>> {
        let at = self.ids.iter().position(|c| c.worker == *worker)?;
        Some(self.handles.swap_remove(at))
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

/// Workers of the model that can take a generation now under `filter`.
pub fn candidates(pool: &WorkerPool, routes: &ModelRoutes, filter: DecodeFilter<'_>) -> Candidates {
    Candidates::select(pool, routes, |w| may_decode(w, filter))
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
