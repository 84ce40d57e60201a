//! Sessions scheduled as programs: admission at tool-call boundaries by working set.
//!
//! An agent session's turns resend its whole growing history, so what the session needs to run
//! without misses is its *working set*: every context (parent history, each sub-agent's) at its
//! latest size, kept on the worker that holds it. When the working sets of every live session
//! fit in the fleet's device KV, nothing here acts. When they do not, letting every turn in
//! makes sessions evict each other's prefixes and recompute them turn after turn (thrashing).
//! Instead, as Dynamo's ThunderAgent pauses whole agent runs at tool-call boundaries, a session
//! is either *resident* (its working set is counted on the workers holding it, and its turns are
//! admitted at once) or not; a turn of a session that is not resident becomes resident only if
//! its working set fits beside the residents' on the worker it would use, and otherwise waits
//! between turns (where the agent is in a tool call anyway), never in the middle of one. Working
//! sets grow: a resident whose next turn would take its worker past capacity while an older
//! resident shares that worker yields there (it stops being resident and its turn asks again),
//! so the oldest session on a worker always goes on.
//!
//! Nothing is tuned per trace: the capacities are the workers' device blocks, the working sets
//! come from the requests' own blocks, and the longest a turn waits (its aging bound, which
//! makes every wait finite) is the time one worker takes to recompute the blocks that admitting
//! it at once would push out of the others' working sets — holding it longer costs more than the
//! eviction it avoids. At the bound the turn goes in regardless; residents that are between
//! turns on its worker, idle longest first, give up their residency to make room for it (their
//! next turn asks again), so the waiting sessions take turns instead of queueing behind sessions
//! that never end. A session leaves when the workload says it ended, and the turns waiting
//! behind it are admitted in arrival order as far as they fit.
//!
//! The scheduler is the caller's clock's and the caller's workers': times are microseconds of
//! whatever clock the caller keeps (the replay's simulated one, the gateway's since its start),
//! workers are whatever the caller names them by (`W`: the replay's indices, the gateway's
//! [`WorkerId`](switchyard_core::WorkerId)s) with the device blocks each holds, and the time to
//! recompute a number of blocks is the caller's function (the simulator's timing model in the
//! replay, the workers' announced prefill rate live). The replay lab and the live gateway both
//! drive this one scheduler.

use std::collections::BTreeMap;

use switchyard_core::BlockHash;

use crate::hasher::FxHashMap as HashMap;

/// Microseconds of the caller's clock.
pub type Micros = u64;

/// What to do with a turn now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Send it on.
    Admit,
    /// Keep it until `until` at the latest (its aging bound).
    Hold { until: Micros },
}

/// What session scheduling did in a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SessionStats {
    /// Turns that waited at a tool-call boundary.
    pub held_turns: u64,
    /// Of those, turns admitted at their aging bound rather than because room appeared.
    pub aged_turns: u64,
    /// Residencies given up to make room for an aged turn.
    pub demotions: u64,
    /// The longest any turn waited, in microseconds.
    pub longest_hold_us: Micros,
    /// Total wait of the held turns, in microseconds.
    pub held_us: Micros,
}

#[derive(Debug)]
struct Session<W> {
    /// Context (first block of its prompts) → (blocks, worker holding it, if routed yet).
    contexts: BTreeMap<BlockHash, (u64, Option<W>)>,
    resident: bool,
    /// When it last became resident (order of admission; the oldest resident keeps going).
    admitted: u64,
    in_flight: usize,
    /// When its last turn ended (for choosing whom to demote).
    idle_since: Micros,
}

impl<W> Default for Session<W> {
    fn default() -> Self {
        Self {
            contexts: BTreeMap::new(),
            resident: false,
            admitted: 0,
            in_flight: 0,
            idle_since: 0,
        }
    }
}

#[derive(Debug)]
struct Held {
    id: u64,
    session: String,
    context: BlockHash,
    blocks: u64,
    since: Micros,
}

/// The time one worker takes to recompute a number of blocks, in microseconds.
pub type RecomputeTime = Box<dyn Fn(u64) -> Micros + Send + Sync>;

/// The admission state; see the module docs.
pub struct SessionScheduler<W> {
    /// The workers, in order, with their device blocks.
    workers: Vec<W>,
    capacity: Vec<u64>,
    /// Device blocks counted for resident sessions, per worker.
    used: Vec<u64>,
    sessions: HashMap<String, Session<W>>,
    /// Held turns in arrival order.
    held: Vec<Held>,
    recompute: RecomputeTime,
    stats: SessionStats,
    /// Admissions so far (orders residents).
    admissions: u64,
    /// Held turns admitted as a side effect of the last call (room a demotion freed, room a
    /// worker brought): see [`SessionScheduler::take_ready`].
    ready: Vec<u64>,
}

impl<W: std::fmt::Debug> std::fmt::Debug for SessionScheduler<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionScheduler")
            .field("workers", &self.workers)
            .field("capacity", &self.capacity)
            .field("used", &self.used)
            .field("sessions", &self.sessions.len())
            .field("held", &self.held.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<W: Ord + Clone> SessionScheduler<W> {
    /// No workers yet ([`SessionScheduler::set_workers`]); `recompute` is the time one worker
    /// takes to recompute a number of blocks (what a turn's aging bound is made of).
    pub fn new(recompute: impl Fn(u64) -> Micros + Send + Sync + 'static) -> Self {
        Self {
            workers: Vec::new(),
            capacity: Vec::new(),
            used: Vec::new(),
            sessions: HashMap::default(),
            held: Vec::new(),
            recompute: Box::new(recompute),
            stats: SessionStats::default(),
            admissions: 0,
            ready: Vec::new(),
        }
    }

    /// The workers are now `workers` (each with its device blocks) at `now`. A context on a
    /// worker that left is no longer placed (its session's next turn goes where there is room),
    /// and held turns that fit in the room a change made are admitted (see
    /// [`SessionScheduler::take_ready`]). Returns whether anything changed.
    pub fn set_workers(
        &mut self,
        workers: impl IntoIterator<Item = (W, u64)>,
        now: Micros,
    ) -> bool {
        let mut workers: Vec<(W, u64)> = workers.into_iter().collect();
        workers.sort_by(|a, b| a.0.cmp(&b.0));
        workers.dedup_by(|a, b| a.0 == b.0);
        let same = workers.len() == self.workers.len()
            && workers
                .iter()
                .zip(self.workers.iter().zip(&self.capacity))
                .all(|((w, c), (ow, oc))| w == ow && c == oc);
        if same {
            return false;
        }
        let (ids, capacity): (Vec<W>, Vec<u64>) = workers.into_iter().unzip();
        self.workers = ids;
        self.capacity = capacity;
        self.used = vec![0; self.workers.len()];
        let workers = &self.workers;
        for s in self.sessions.values_mut() {
            for (_, w) in s.contexts.values_mut() {
                if w.as_ref()
                    .is_some_and(|w| workers.binary_search(w).is_err())
                {
                    *w = None;
                }
            }
        }
        let residents: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.resident)
            .map(|(name, _)| name.clone())
            .collect();
        for name in residents {
            self.count(&name, true);
        }
        let ready = self.admit_fitting(now);
        self.ready.extend(ready);
        true
    }

    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// Blocks counted on worker `w` for resident sessions.
    pub fn used(&self, w: &W) -> u64 {
        self.slot(w).map_or(0, |i| self.used[i])
    }

    /// Turns waiting now.
    pub fn waiting(&self) -> usize {
        self.held.len()
    }

    /// Sessions resident now.
    pub fn resident(&self) -> usize {
        self.sessions.values().filter(|s| s.resident).count()
    }

    fn slot(&self, w: &W) -> Option<usize> {
        self.workers.binary_search(w).ok()
    }

    /// The blocks `session` would need on each worker with context `context` at `blocks`, and
    /// the worker that context is on (or would go to; none without workers).
    fn need(&self, session: &str, context: BlockHash, blocks: u64) -> (Vec<u64>, Option<usize>) {
        let mut need = vec![0; self.capacity.len()];
        let mut target = None;
        if let Some(s) = self.sessions.get(session) {
            for (&c, (b, w)) in &s.contexts {
                let Some(w) = w.as_ref().and_then(|w| self.slot(w)) else {
                    continue;
                };
                if c == context {
                    target = Some(w);
                } else {
                    need[w] += b;
                }
            }
        }
        // A context no worker holds yet goes where the most room is left.
        let target = target.or_else(|| {
            let free = |w: usize| self.capacity[w].saturating_sub(self.used[w] + need[w]);
            (0..need.len()).max_by_key(|&w| (free(w), std::cmp::Reverse(w)))
        });
        if let Some(n) = target.and_then(|t| need.get_mut(t)) {
            *n += blocks;
        }
        (need, target)
    }

    /// Blocks by which admitting `need` overflows the workers (0: it fits).
    fn overflow(&self, need: &[u64]) -> u64 {
        need.iter()
            .enumerate()
            .map(|(w, &n)| {
                if n == 0 {
                    0
                } else {
                    (self.used[w] + n).saturating_sub(self.capacity[w]).min(n)
                }
            })
            .sum()
    }

    /// The aging bound of a turn that would push `overflow` blocks out: the time one worker
    /// takes to recompute them.
    fn bound(&self, overflow: u64) -> Micros {
        (self.recompute)(overflow).max(1)
    }

    fn count(&mut self, session: &str, sign: bool) {
        let Some(s) = self.sessions.get(session) else {
            return;
        };
        for (b, w) in s.contexts.values() {
            if let Some(w) = w.as_ref().and_then(|w| self.workers.binary_search(w).ok()) {
                self.used[w] = if sign {
                    self.used[w] + b
                } else {
                    self.used[w].saturating_sub(*b)
                };
            }
        }
    }

    /// Turn `id` of `session` arrives at `now`, its prompt and output `blocks` long on the
    /// context that starts with `context`.
    pub fn offer(
        &mut self,
        id: u64,
        session: &str,
        context: BlockHash,
        blocks: u64,
        now: Micros,
    ) -> Offer {
        let entry = self.sessions.entry(session.to_owned()).or_default();
        if entry.resident {
            if !self.outgrown(session, context, blocks) {
                return Offer::Admit;
            }
            // Its worker can no longer hold every resident's working set: at this tool-call
            // boundary the session yields, as a younger resident, and asks again.
            self.count(session, false);
            if let Some(s) = self.sessions.get_mut(session) {
                s.resident = false;
            }
            self.stats.demotions += 1;
            let ready = self.admit_fitting(now);
            self.ready.extend(ready);
        }
        let (need, target) = self.need(session, context, blocks);
        let overflow = self.overflow(&need);
        // Turns wait in arrival order: one does not overtake a session already waiting.
        let queued = self.held.iter().any(|h| h.session != session);
        if overflow == 0 && !queued {
            self.make_resident(session, context, blocks, target);
            return Offer::Admit;
        }
        self.stats.held_turns += 1;
        self.held.push(Held {
            id,
            session: session.to_owned(),
            context,
            blocks,
            since: now,
        });
        // With nobody resident to wait for, nothing frees room: the bound is all there is.
        Offer::Hold {
            until: now + self.bound(overflow.max(1)),
        }
    }

    /// Whether resident `session`'s turn on `context` at `blocks` takes a worker past its
    /// capacity while an older resident shares that worker.
    fn outgrown(&self, session: &str, context: BlockHash, blocks: u64) -> bool {
        let Some(s) = self.sessions.get(session) else {
            return false;
        };
        let (need, _) = self.need(session, context, blocks);
        need.iter().enumerate().any(|(w, &n)| {
            if n == 0 {
                return false;
            }
            let on_w = |cw: &Option<W>| cw.as_ref() == Some(&self.workers[w]);
            let own: u64 = s
                .contexts
                .values()
                .filter(|(_, cw)| on_w(cw))
                .map(|&(b, _)| b)
                .sum();
            let over = self.used[w].saturating_sub(own) + n > self.capacity[w];
            over && self.sessions.iter().any(|(name, o)| {
                name != session
                    && o.resident
                    && o.admitted < s.admitted
                    && o.contexts.values().any(|(_, cw)| on_w(cw))
            })
        })
    }

    /// Held turns that the last call let in besides its own answer (room a demotion in
    /// [`SessionScheduler::offer`] freed, room [`SessionScheduler::set_workers`] brought), in
    /// arrival order.
    pub fn take_ready(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.ready)
    }

    /// `session` becomes resident with its turn on `context` (`blocks` long) counted on
    /// `target` until the turn is routed.
    fn make_resident(
        &mut self,
        session: &str,
        context: BlockHash,
        blocks: u64,
        target: Option<usize>,
    ) {
        self.admissions += 1;
        let admitted = self.admissions;
        let target = target.and_then(|t| self.workers.get(t).cloned());
        let s = self.sessions.entry(session.to_owned()).or_default();
        if s.resident {
            return;
        }
        s.admitted = admitted;
        let placed = s.contexts.get(&context).and_then(|(_, w)| w.clone());
        s.contexts.insert(context, (blocks, placed.or(target)));
        s.resident = true;
        self.count(session, true);
    }

    /// Turn of `session` on `context` (`blocks` long) was routed to `worker` and starts.
    pub fn routed(&mut self, session: &str, context: BlockHash, blocks: u64, worker: W) {
        let resident = self.sessions.get(session).is_some_and(|s| s.resident);
        if resident {
            self.count(session, false);
        }
        let s = self.sessions.entry(session.to_owned()).or_default();
        s.contexts.insert(context, (blocks, Some(worker)));
        s.in_flight += 1;
        if resident {
            self.count(session, true);
        }
    }

    /// A turn of `session` ended at `now`.
    pub fn turn_ended(&mut self, session: &str, now: Micros) {
        if let Some(s) = self.sessions.get_mut(session) {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.idle_since = now;
        }
    }

    /// `session` ended at `now`: its working set goes, and the held turns that now fit are
    /// admitted (returned in arrival order).
    pub fn session_ended(&mut self, session: &str, now: Micros) -> Vec<u64> {
        self.count(session, false);
        self.sessions.remove(session);
        self.admit_fitting(now)
    }

    /// Held turn `id` is no longer wanted (its client went away): it leaves the queue without
    /// counting as admitted, and the held turns behind it that fit now are admitted (returned
    /// in arrival order). Nothing else of its session changes.
    pub fn withdraw(&mut self, id: u64, now: Micros) -> Vec<u64> {
        let Some(at) = self.held.iter().position(|h| h.id == id) else {
            return Vec::new();
        };
        let held = self.held.remove(at);
        self.note_wait(held.since, now);
        self.admit_fitting(now)
    }

    /// Admits, in arrival order, every held turn whose working set fits now; stops at the
    /// first that does not, so no session overtakes an earlier one.
    fn admit_fitting(&mut self, now: Micros) -> Vec<u64> {
        let mut admitted = Vec::new();
        while let Some(first) = self.held.first() {
            let resident = self
                .sessions
                .get(&first.session)
                .is_some_and(|s| s.resident);
            let (need, target) = self.need(&first.session, first.context, first.blocks);
            if !resident && self.overflow(&need) > 0 {
                break;
            }
            let held = self.held.remove(0);
            self.make_resident(&held.session, held.context, held.blocks, target);
            self.note_wait(held.since, now);
            admitted.push(held.id);
        }
        admitted
    }

    fn note_wait(&mut self, since: Micros, now: Micros) {
        let waited = now.saturating_sub(since);
        self.stats.held_us += waited;
        self.stats.longest_hold_us = self.stats.longest_hold_us.max(waited);
    }

    /// Held turn `id` reached its aging bound at `now`: it goes in, and residents between turns
    /// on its workers, idle longest first, give up their residency until it fits. Returns
    /// whether `id` was still held (it may have been admitted already), then any held turns
    /// that fit behind it.
    pub fn expire(&mut self, id: u64, now: Micros) -> (bool, Vec<u64>) {
        let Some(at) = self.held.iter().position(|h| h.id == id) else {
            return (false, Vec::new());
        };
        let held = self.held.remove(at);
        self.stats.aged_turns += 1;
        self.note_wait(held.since, now);
        let (need, target) = self.need(&held.session, held.context, held.blocks);
        let needed = |w: &W| {
            self.workers
                .binary_search(w)
                .is_ok_and(|w| need.get(w).is_some_and(|&n| n > 0))
        };
        let mut idle: Vec<(Micros, String)> = self
            .sessions
            .iter()
            .filter(|(name, s)| s.resident && s.in_flight == 0 && **name != held.session)
            .filter(|(_, s)| {
                s.contexts
                    .values()
                    .any(|(_, w)| w.as_ref().is_some_and(needed))
            })
            .map(|(name, s)| (s.idle_since, name.clone()))
            .collect();
        idle.sort();
        for (_, name) in idle {
            if self.overflow(&need) == 0 {
                break;
            }
            self.count(&name, false);
            if let Some(s) = self.sessions.get_mut(&name) {
                s.resident = false;
            }
            self.stats.demotions += 1;
        }
        self.make_resident(&held.session, held.context, held.blocks, target);
        (true, self.admit_fitting(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Microseconds to recompute a block in these tests.
    const US_PER_BLOCK: u64 = 640;

    /// `workers` workers of `blocks` device blocks each.
    fn scheduler(workers: usize, blocks: u64) -> SessionScheduler<usize> {
        let mut s = SessionScheduler::new(|b| b * US_PER_BLOCK);
        assert!(s.set_workers((0..workers).map(|w| (w, blocks)), 0));
        s
    }

    const A: BlockHash = BlockHash(1);
    const B: BlockHash = BlockHash(2);
    const C: BlockHash = BlockHash(3);

    #[test]
    fn with_room_for_every_working_set_nothing_is_held() {
        let mut s = scheduler(2, 100);
        for (i, (name, ctx)) in [("a", A), ("b", B), ("c", C)].into_iter().enumerate() {
            assert_eq!(s.offer(i as u64, name, ctx, 50, 0), Offer::Admit);
            s.routed(name, ctx, 50, i % 2);
        }
        assert_eq!((s.used(&0), s.used(&1)), (100, 50));
        // a grows past worker 0's 100 blocks, but it is the oldest resident there: it goes on.
        assert_eq!(s.offer(9, "a", A, 70, 5), Offer::Admit);
        assert_eq!(s.stats(), SessionStats::default());
    }

    #[test]
    fn a_turn_that_does_not_fit_waits_and_reserves_nothing() {
        let mut s = scheduler(1, 100);
        assert_eq!(s.offer(0, "a", A, 80, 0), Offer::Admit);
        s.routed("a", A, 80, 0);
        let Offer::Hold { until } = s.offer(1, "b", B, 40, 10) else {
            panic!("b does not fit beside a");
        };
        // The bound is the recompute time of the 20 blocks b would push out of a's set.
        assert_eq!(until, 10 + 20 * US_PER_BLOCK);
        assert_eq!(s.used(&0), 80, "the held turn counts nothing");
        // A later session queues behind b, even one that would fit.
        assert!(matches!(s.offer(2, "c", C, 10, 11), Offer::Hold { .. }));
        assert_eq!(s.waiting(), 2);
        // a ends: b and then c go in, in arrival order.
        s.turn_ended("a", 20);
        assert_eq!(s.session_ended("a", 30), vec![1, 2]);
        assert_eq!(s.stats().held_turns, 2);
        assert_eq!(s.stats().longest_hold_us, 20);
        assert_eq!((s.waiting(), s.resident()), (0, 2));
    }

    #[test]
    fn a_younger_resident_that_outgrows_its_worker_yields_at_its_next_turn() {
        let mut s = scheduler(1, 100);
        for (id, name, ctx) in [(0, "a", A), (1, "b", B)] {
            assert_eq!(s.offer(id, name, ctx, 40, 0), Offer::Admit);
            s.routed(name, ctx, 40, 0);
            s.turn_ended(name, 1);
        }
        // b, the younger, would take the worker to 40 + 70 blocks: it waits, counting nothing.
        assert!(matches!(s.offer(2, "b", B, 70, 2), Offer::Hold { .. }));
        assert_eq!((s.used(&0), s.stats().demotions), (40, 1));
        // a, the older, grows past the capacity alone with b out: it goes on.
        assert_eq!(s.offer(3, "a", A, 90, 3), Offer::Admit);
        s.routed("a", A, 90, 0);
        assert_eq!(s.used(&0), 90);
        // a ends: b goes in.
        assert_eq!(s.session_ended("a", 4), vec![2]);
        assert!(s.take_ready().is_empty());
    }

    #[test]
    fn an_aged_turn_goes_in_and_idle_residents_make_room() {
        let mut s = scheduler(1, 100);
        for (name, ctx, at) in [("a", A, 0), ("b", B, 1)] {
            assert_eq!(s.offer(0, name, ctx, 50, at), Offer::Admit);
            s.routed(name, ctx, 50, 0);
        }
        s.turn_ended("a", 5);
        let Offer::Hold { until } = s.offer(7, "c", C, 30, 6) else {
            panic!("c does not fit");
        };
        // b is still in a turn: only a, idle, can give up its residency.
        assert_eq!(s.expire(7, until), (true, vec![]));
        assert_eq!(s.used(&0), 50 + 30);
        assert_eq!(s.stats().demotions, 1);
        assert_eq!(s.stats().aged_turns, 1);
        // a's next turn now asks again, and waits behind nobody but the room.
        assert!(matches!(
            s.offer(8, "a", A, 60, until + 1),
            Offer::Hold { .. }
        ));
        // Expiring a turn already admitted changes nothing.
        assert_eq!(s.expire(7, until + 2), (false, vec![]));
    }

    #[test]
    fn a_withdrawn_turn_leaves_the_queue_and_lets_the_turns_behind_it_in() {
        let mut s = scheduler(1, 100);
        assert_eq!(s.offer(0, "a", A, 80, 0), Offer::Admit);
        s.routed("a", A, 80, 0);
        assert!(matches!(s.offer(1, "b", B, 40, 1), Offer::Hold { .. }));
        // c would fit beside a but waits behind b.
        assert!(matches!(s.offer(2, "c", C, 10, 2), Offer::Hold { .. }));
        // b's client goes away: c goes in, b's session counts nothing, a keeps its place.
        assert_eq!(s.withdraw(1, 3), vec![2]);
        assert_eq!((s.waiting(), s.used(&0), s.resident()), (0, 90, 2));
        // Withdrawing it again, or expiring it, changes nothing.
        assert!(s.withdraw(1, 4).is_empty());
        assert_eq!(s.expire(1, 5), (false, vec![]));
        assert_eq!(s.stats().aged_turns, 0);
    }

    #[test]
    fn workers_joining_let_held_turns_in_and_a_leaving_worker_unplaces_its_contexts() {
        let mut s = scheduler(1, 100);
        assert_eq!(s.offer(0, "a", A, 80, 0), Offer::Admit);
        s.routed("a", A, 80, 0);
        assert!(matches!(s.offer(1, "b", B, 40, 1), Offer::Hold { .. }));
        // The same workers again change nothing.
        assert!(!s.set_workers([(0, 100)], 2));
        assert!(s.take_ready().is_empty());
        // A second worker joins: b fits there.
        assert!(s.set_workers([(0, 100), (1, 100)], 3));
        assert_eq!(s.take_ready(), vec![1]);
        assert_eq!((s.used(&0), s.used(&1)), (80, 40));
        s.routed("b", B, 40, 1);
        // Worker 0 leaves: a's context is no longer counted anywhere, b's stays.
        assert!(s.set_workers([(1, 100)], 4));
        assert_eq!((s.used(&0), s.used(&1)), (0, 40));
        // a's next turn goes where the room is, beside b.
        assert_eq!(s.offer(2, "a", A, 60, 5), Offer::Admit);
        s.routed("a", A, 60, 1);
        assert_eq!(s.used(&1), 100);
    }

    #[test]
    fn without_workers_every_turn_goes_in() {
        let mut s = SessionScheduler::<usize>::new(|b| b);
        assert_eq!(s.offer(0, "a", A, 1_000, 0), Offer::Admit);
        assert_eq!(s.offer(1, "b", B, 1_000, 0), Offer::Admit);
        assert_eq!(s.waiting(), 0);
    }
}
