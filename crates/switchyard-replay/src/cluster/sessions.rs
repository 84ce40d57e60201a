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

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;
use switchyard_core::BlockHash;
use switchyard_engine_sim::SimConfig;

use crate::workload::Micros;

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

#[derive(Debug, Default)]
struct Session {
    /// Context (first block of its prompts) → (blocks, worker holding it, if routed yet).
    contexts: BTreeMap<BlockHash, (u64, Option<usize>)>,
    resident: bool,
    /// When it last became resident (order of admission; the oldest resident keeps going).
    admitted: u64,
    in_flight: usize,
    /// When its last turn ended (for choosing whom to demote).
    idle_since: Micros,
}

#[derive(Debug)]
struct Held {
    id: u64,
    session: String,
    context: BlockHash,
    blocks: u64,
    since: Micros,
}

/// The admission state; see the module docs.
#[derive(Debug)]
pub struct SessionScheduler {
    capacity: Vec<u64>,
    /// Device blocks counted for resident sessions, per worker.
    used: Vec<u64>,
    sessions: HashMap<String, Session>,
    /// Held turns in arrival order.
    held: Vec<Held>,
    sim: SimConfig,
    stats: SessionStats,
    /// Admissions so far (orders residents).
    admissions: u64,
    /// Held turns admitted by the last [`SessionScheduler::offer`] (room a demotion freed).
    ready: Vec<u64>,
}

impl SessionScheduler {
    /// `workers` workers of `sim`'s device blocks each.
    pub fn new(workers: usize, sim: &SimConfig) -> Self {
        Self {
            capacity: vec![sim.num_device_blocks; workers],
            used: vec![0; workers],
            sessions: HashMap::default(),
            held: Vec::new(),
            sim: sim.clone(),
            stats: SessionStats::default(),
            admissions: 0,
            ready: Vec::new(),
        }
    }

    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// Blocks counted on worker `w` for resident sessions.
    pub fn used(&self, w: usize) -> u64 {
        self.used.get(w).copied().unwrap_or(0)
    }

    /// Turns waiting now.
    pub fn waiting(&self) -> usize {
        self.held.len()
    }

    /// The blocks `session` would need on each worker with context `context` at `blocks`, and
    /// the worker that context is on (or would go to).
    fn need(&self, session: &str, context: BlockHash, blocks: u64) -> (Vec<u64>, usize) {
        let mut need = vec![0; self.capacity.len()];
        let mut target = None;
        if let Some(s) = self.sessions.get(session) {
            for (&c, &(b, w)) in &s.contexts {
                let Some(w) = w.filter(|&w| w < need.len()) else {
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
        let target = target.unwrap_or_else(|| {
            let free = |w: usize| self.capacity[w].saturating_sub(self.used[w] + need[w]);
            (0..need.len())
                .max_by_key(|&w| (free(w), std::cmp::Reverse(w)))
                .unwrap_or(0)
        });
        if let Some(n) = need.get_mut(target) {
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
        let tokens = overflow.saturating_mul(u64::from(self.sim.block_size.get()));
        self.sim
            .timing
            .chunked_prefill_time(tokens, 0, self.sim.max_batched_tokens as u64)
            .as_micros()
            .max(1) as Micros
    }

    fn count(&mut self, session: &str, sign: bool) {
        let Some(s) = self.sessions.get(session) else {
            return;
        };
        for &(b, w) in s.contexts.values() {
            if let Some(w) = w.filter(|&w| w < self.used.len()) {
                self.used[w] = if sign {
                    self.used[w] + b
                } else {
                    self.used[w].saturating_sub(b)
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

    /// `session` becomes resident with its turn on `context` (`blocks` long) counted on
    /// `target` until the turn is routed.
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
            let own: u64 = s
                .contexts
                .values()
                .filter(|&&(_, cw)| cw == Some(w))
                .map(|&(b, _)| b)
                .sum();
            let over = self.used[w].saturating_sub(own) + n > self.capacity[w];
            over && self.sessions.iter().any(|(name, o)| {
                name != session
                    && o.resident
                    && o.admitted < s.admitted
                    && o.contexts.values().any(|&(_, cw)| cw == Some(w))
            })
        })
    }

    /// Held turns that a demotion in the last [`SessionScheduler::offer`] let in, in arrival
    /// order.
    pub fn take_ready(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.ready)
    }

    fn make_resident(&mut self, session: &str, context: BlockHash, blocks: u64, target: usize) {
        self.admissions += 1;
        let admitted = self.admissions;
        let s = self.sessions.entry(session.to_owned()).or_default();
        if s.resident {
            return;
        }
        s.admitted = admitted;
        let placed = s.contexts.get(&context).and_then(|&(_, w)| w);
        s.contexts
            .insert(context, (blocks, Some(placed.unwrap_or(target))));
        s.resident = true;
        self.count(session, true);
    }

    /// Turn of `session` on `context` (`blocks` long) was routed to `worker` and starts.
    pub fn routed(&mut self, session: &str, context: BlockHash, blocks: u64, worker: usize) {
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
        let mut idle: Vec<(Micros, String)> = self
            .sessions
            .iter()
            .filter(|(name, s)| s.resident && s.in_flight == 0 && **name != held.session)
            .filter(|(_, s)| {
                s.contexts
                    .values()
                    .any(|&(_, w)| w.is_some_and(|w| need.get(w).is_some_and(|&n| n > 0)))
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
    use switchyard_core::BlockSize;

    fn sim(blocks: u64) -> SimConfig {
        SimConfig {
            block_size: BlockSize::new(64).unwrap(),
            num_device_blocks: blocks,
            ..SimConfig::default()
        }
    }

    const A: BlockHash = BlockHash(1);
    const B: BlockHash = BlockHash(2);
    const C: BlockHash = BlockHash(3);

    #[test]
    fn with_room_for_every_working_set_nothing_is_held() {
        let mut s = SessionScheduler::new(2, &sim(100));
        for (i, (name, ctx)) in [("a", A), ("b", B), ("c", C)].into_iter().enumerate() {
            assert_eq!(s.offer(i as u64, name, ctx, 50, 0), Offer::Admit);
            s.routed(name, ctx, 50, i % 2);
        }
        assert_eq!((s.used(0), s.used(1)), (100, 50));
        // a grows past worker 0's 100 blocks, but it is the oldest resident there: it goes on.
        assert_eq!(s.offer(9, "a", A, 70, 5), Offer::Admit);
        assert_eq!(s.stats(), SessionStats::default());
    }

    #[test]
    fn a_turn_that_does_not_fit_waits_and_reserves_nothing() {
        let mut s = SessionScheduler::new(1, &sim(100));
        assert_eq!(s.offer(0, "a", A, 80, 0), Offer::Admit);
        s.routed("a", A, 80, 0);
        let Offer::Hold { until } = s.offer(1, "b", B, 40, 10) else {
            panic!("b does not fit beside a");
        };
        // The bound is the recompute time of the 20 blocks b would push out of a's set.
        let sim = sim(100);
        let twenty = sim
            .timing
            .chunked_prefill_time(20 * 64, 0, sim.max_batched_tokens as u64)
            .as_micros() as Micros;
        assert_eq!(until, 10 + twenty);
        assert_eq!(s.used(0), 80, "the held turn counts nothing");
        // A later session queues behind b, even one that would fit.
        assert!(matches!(s.offer(2, "c", C, 10, 11), Offer::Hold { .. }));
        // a ends: b and then c go in, in arrival order.
        s.turn_ended("a", 20);
        assert_eq!(s.session_ended("a", 30), vec![1, 2]);
        assert_eq!(s.stats().held_turns, 2);
        assert_eq!(s.stats().longest_hold_us, 20);
    }

    #[test]
    fn a_younger_resident_that_outgrows_its_worker_yields_at_its_next_turn() {
        let mut s = SessionScheduler::new(1, &sim(100));
        for (id, name, ctx) in [(0, "a", A), (1, "b", B)] {
            assert_eq!(s.offer(id, name, ctx, 40, 0), Offer::Admit);
            s.routed(name, ctx, 40, 0);
            s.turn_ended(name, 1);
        }
        // b, the younger, would take the worker to 40 + 70 blocks: it waits, counting nothing.
        assert!(matches!(s.offer(2, "b", B, 70, 2), Offer::Hold { .. }));
        assert_eq!((s.used(0), s.stats().demotions), (40, 1));
        // a, the older, grows past the capacity alone with b out: it goes on.
        assert_eq!(s.offer(3, "a", A, 90, 3), Offer::Admit);
        s.routed("a", A, 90, 0);
        assert_eq!(s.used(0), 90);
        // a ends: b goes in.
        assert_eq!(s.session_ended("a", 4), vec![2]);
        assert!(s.take_ready().is_empty());
    }

    #[test]
    fn an_aged_turn_goes_in_and_idle_residents_make_room() {
        let mut s = SessionScheduler::new(1, &sim(100));
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
        assert_eq!(s.used(0), 50 + 30);
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
}
