//! Acting on a running cluster: a [`Controller`] gets a turn at the virtual times it asks for
//! and sees the cluster through [`Control`] — its pools, the requests that finished, the
//! backlog — and can move workers between roles the way the planner's local connector does
//! (drained first: no new work; switched once idle). The planner's bench runs its planner on
//! the replay cluster this way, so its figures come from the same serving core as the gateway.

use switchyard_core::Role;

use super::Cluster;
use crate::metrics::RequestRecord;
use crate::workload::Micros;

/// Something that acts on the cluster while it runs ([`Cluster::run_with`]).
pub trait Controller {
    /// The controller's turn at virtual time `now` (the first at 0); returns when the next turn
    /// is, or `None` for no more turns.
    fn tick(&mut self, now: Micros, cluster: &mut Control<'_>) -> Option<Micros>;
}

/// The cluster as a controller sees and moves it.
pub struct Control<'a> {
    pub(super) cluster: &'a mut Cluster,
}

impl std::fmt::Debug for Control<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("now", &self.cluster.now)
            .finish_non_exhaustive()
    }
}

impl Control<'_> {
    /// Workers per role: (prefill, decode, both). A moving worker counts in its old pool, as
    /// the planner's connectors report it.
    pub fn pools(&self) -> (u32, u32, u32) {
        let count = |role| {
            self.cluster
                .workers
                .iter()
                .filter(|w| w.role == role)
                .count() as u32
        };
        (count(Role::Prefill), count(Role::Decode), count(Role::Both))
    }

    /// Whether a move is under way.
    pub fn moving(&self) -> bool {
        self.cluster.workers.iter().any(|w| w.moving_to.is_some())
    }

    /// Requests finished so far.
    pub fn finished_count(&self) -> usize {
        self.cluster.finished.len()
    }

    /// The requests that finished after the first `from`, in the order they finished.
    pub fn finished_since(&self, from: usize) -> Vec<&RequestRecord> {
        self.cluster
            .finished
            .get(from..)
            .unwrap_or_default()
            .iter()
            .map(|&slot| &self.cluster.records[slot])
            .collect()
    }

    /// Sequences decoding on the workers that decode.
    pub fn active_decode_sequences(&self) -> u64 {
        self.cluster
            .workers
            .iter()
            .filter(|w| w.role.serves_decode())
            .map(|w| w.sim.load().active_decode_sequences)
            .sum()
    }

    /// Prefill tokens queued in the prefill pool.
    pub fn prefill_pool_queued_tokens(&self) -> u64 {
        self.cluster
            .workers
            .iter()
            .filter(|w| w.role == Role::Prefill)
            .map(|w| w.sim.load().queued_prefill_tokens)
            .sum()
    }

    /// Workers of `role` that are not moving, least booked first (ties by index): the ones a
    /// move takes first.
    pub fn movable(&self, role: Role) -> Vec<usize> {
        let mut out: Vec<(usize, usize)> = self
            .cluster
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.role == role && w.moving_to.is_none())
            .map(|(i, w)| (w.booked, i))
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, i)| i).collect()
    }

    /// Starts moving worker `w` to `role`: it takes no new work from now and switches once it
    /// has none left.
    pub fn move_worker(&mut self, w: usize, role: Role) {
        if let Some(worker) = self.cluster.workers.get_mut(w) {
            worker.moving_to = Some(role);
        }
        self.cluster.settle_moves();
    }
}

impl Cluster {
    /// Switches every moving worker that has become idle.
    pub(super) fn settle_moves(&mut self) {
        for w in &mut self.workers {
            if let Some(role) = w.moving_to
                && w.booked == 0
                && w.pending.is_none()
                && !w.sim.has_work()
            {
                w.role = role;
                w.stats.role = role.as_str();
                w.moving_to = None;
            }
        }
    }
}
