//! `[sessions]`: sessions scheduled as programs on the live gateway.
//!
//! With `schedule = true`, every turn of a session (a request naming one, see
//! `api::http::fields::SessionSource`) is offered to the serving core's
//! [`SessionScheduler`](switchyard_router::serve::SessionScheduler) once its prompt is hashed
//! and before it is dispatched — the same scheduler the replay lab measures (its module docs
//! say the policy). A turn whose session's working set does not fit beside the resident
//! sessions' on the model's workers waits here, between turns (the agent is in a tool call
//! anyway): no thread is blocked and the client's connection stays open. It goes on when room
//! appears (a session leaves, a worker joins) or at its aging bound, whichever comes first; a
//! client that goes away while its turn waits only takes that turn out of the queue.
//!
//! What the scheduler is given, live: one scheduler per model; its workers and their device
//! blocks are the model's decode-serving workers as they announce themselves
//! (`kv_capacity_blocks`), read again at every arrival, turn end and timer so that workers
//! joining and leaving count;
//! a turn's context is its prompt's first block and its size the prompt's blocks; the aging
//! bound's recompute rate is the slowest announced prefill rate among the model's workers
//! (`kv_tiers.prefill_tokens_per_s`, the typical figure for a worker that announces none). A
//! live session never says it ended: it leaves after `idle_seconds` with no turn in flight or
//! waiting, which lets in what waits behind it.
//!
//! A held turn keeps the admission slot it was given (it is counted in the gateway's
//! concurrency while it waits), so the concurrency limit also bounds how many turns wait.

mod settings;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use switchyard_core::{BlockHash, BlockSize, KvTierCosts, WorkerId, WorkerInfo};
use switchyard_router::serve::{Offer, SessionScheduler, sessions::Micros};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::cluster::pool::WorkerPool;
use crate::cluster::pool::members::MemberList;
use crate::observe::session_metrics::SessionMetrics;

pub use settings::{SessionArgs, SessionSettings};

/// The turn a request of a session is, as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct TurnAsk<'a> {
    pub model: &'a str,
    pub block_size: BlockSize,
    pub session: &'a str,
    /// The prompt's first block (the context its turns grow).
    pub context: BlockHash,
    /// The prompt's blocks.
    pub blocks: u64,
}

/// How a held turn was let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Room appeared (a session left, a worker joined, a demotion freed some).
    Room,
    /// Its aging bound passed: it went in regardless.
    Aged,
}

impl Release {
    pub fn as_str(self) -> &'static str {
        match self {
            Release::Room => "room",
            Release::Aged => "aged",
        }
    }
}

/// Session scheduling of the gateway (off unless `[sessions] schedule = true`).
#[derive(Debug)]
pub struct SessionSchedule {
    /// `None`: scheduling is off and every turn goes on at once.
    state: Option<Mutex<Models>>,
    idle: Micros,
    pool: Arc<WorkerPool>,
    metrics: SessionMetrics,
    epoch: Instant,
    /// Told when a turn ends: a session may now go idle, so held turns set their timers again
    /// (to its leaving, if that comes before their bounds).
    idle_changed: Notify,
}

#[derive(Debug, Default)]
struct Models {
    by_model: HashMap<String, ModelSchedule>,
    next_id: u64,
    /// The schedulers' counts already added to the metrics' counters.
    exported: switchyard_router::serve::SessionStats,
}

/// One model's scheduler and the turns waiting on it.
#[derive(Debug)]
struct ModelSchedule {
    scheduler: SessionScheduler<WorkerId>,
    /// The slowest announced prefill rate of the model's workers, tokens per second (read by
    /// the scheduler's recompute time).
    rate: Arc<AtomicU64>,
    /// Held turns, by id: the sender lets the turn go.
    waiters: HashMap<u64, oneshot::Sender<()>>,
    /// Sessions with turns, held or running, and when each was last seen.
    presence: HashMap<String, Presence>,
    /// The model's member list the workers were last read from: until the pool rebuilds it
    /// (a worker joins, leaves or changes), there is nothing new to read.
    synced: Option<Arc<MemberList>>,
}

#[derive(Debug, Clone, Copy)]
struct Presence {
    turns: usize,
    last: Micros,
}

/// Prefill rate assumed for a worker that announces none (as the router's cost model does).
fn announced_rate(costs: Option<KvTierCosts>) -> u64 {
    costs
        .unwrap_or_else(|| KvTierCosts::typical(1))
        .prefill_tokens_per_s
        .max(1)
}

impl ModelSchedule {
    fn new(block_size: BlockSize) -> Self {
        let rate = Arc::new(AtomicU64::new(announced_rate(None)));
        let tokens_per_block = u64::from(block_size.get());
        let per_s = Arc::clone(&rate);
        let scheduler = SessionScheduler::new(move |blocks: u64| {
            let tokens = u128::from(blocks) * u128::from(tokens_per_block);
            let rate = u128::from(per_s.load(Ordering::Relaxed).max(1));
            u64::try_from(tokens * 1_000_000 / rate).unwrap_or(u64::MAX)
        });
        Self {
            scheduler,
            rate,
            waiters: HashMap::new(),
            presence: HashMap::new(),
            synced: None,
        }
    }

    /// Lets the held turns `ids` go.
    fn wake(&mut self, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            if let Some(tx) = self.waiters.remove(&id) {
                // A waiter that went away has withdrawn (or is withdrawing) its turn.
                let _ = tx.send(());
            }
        }
    }

    /// The model's workers as they are now (read again only when the pool rebuilt the model's
    /// member list, not at every arrival); room they bring lets held turns go.
    fn sync_workers(&mut self, pool: &WorkerPool, model: &str, now: Micros) {
        let list = pool.model(model).map(|routes| routes.members.snapshot());
        let unchanged = match (&list, &self.synced) {
            (Some(list), Some(synced)) => Arc::ptr_eq(list, synced),
            _ => false,
        };
        if !unchanged {
            let workers: Vec<&WorkerInfo> = list
                .iter()
                .flat_map(|list| list.members.iter().map(|m| &m.info))
                .filter(|info| info.role.serves_decode())
                .collect();
            if let Some(slowest) = workers.iter().map(|i| announced_rate(i.kv_tiers)).min() {
                self.rate.store(slowest, Ordering::Relaxed);
            }
            self.scheduler.set_workers(
                workers.iter().map(|i| (i.id.clone(), i.kv_capacity_blocks)),
                now,
            );
            self.synced = list;
        }
        let ready = self.scheduler.take_ready();
        self.wake(ready);
    }

    /// Sessions idle (nothing held or running) for `idle` leave; what waits behind them and
    /// now fits goes on.
    fn sweep(&mut self, idle: Micros, now: Micros) {
        let gone: Vec<String> = self
            .presence
            .iter()
            .filter(|(_, p)| p.turns == 0 && now.saturating_sub(p.last) >= idle)
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            self.presence.remove(&name);
            let admitted = self.scheduler.session_ended(&name, now);
            self.wake(admitted);
        }
    }

    /// When the next idle session leaves, if any does.
    fn next_leave(&self, idle: Micros) -> Option<Micros> {
        self.presence
            .values()
            .filter(|p| p.turns == 0)
            .map(|p| p.last.saturating_add(idle))
            .min()
    }

    fn presence(&mut self, session: &str, now: Micros) -> &mut Presence {
        let p = self.presence.entry(session.to_owned()).or_insert(Presence {
            turns: 0,
            last: now,
        });
        p.last = p.last.max(now);
        p
    }
}

impl SessionSchedule {
    /// Scheduling as `settings` say over `pool`'s workers, counted in `metrics`.
    pub fn new(settings: &SessionSettings, pool: Arc<WorkerPool>, metrics: SessionMetrics) -> Self {
        Self {
            state: settings.schedule.then(|| Mutex::new(Models::default())),
            idle: settings.idle_micros(),
            pool,
            metrics,
            epoch: Instant::now(),
            idle_changed: Notify::new(),
        }
    }

    fn now(&self) -> Micros {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn at(&self, micros: Micros) -> Instant {
        self.epoch + Duration::from_micros(micros)
    }

    /// Whether turns are scheduled at all.
    pub fn is_on(&self) -> bool {
        self.state.is_some()
    }

    /// Turn `ask` asks to go on: returns at once when it may (or scheduling is off), else when
    /// room appears or its aging bound passes. Dropping the future while the turn waits
    /// withdraws it. The returned turn marks its end when dropped.
    pub async fn turn(self: &Arc<Self>, ask: TurnAsk<'_>) -> ScheduledTurn {
        let Some(state) = &self.state else {
            return ScheduledTurn::default();
        };
        let now = self.now();
        let (id, until, mut rx) = {
            let mut models = state.lock();
            models.next_id += 1;
            let id = models.next_id;
            let m = models
                .by_model
                .entry(ask.model.to_owned())
                .or_insert_with(|| ModelSchedule::new(ask.block_size));
            m.sync_workers(&self.pool, ask.model, now);
            m.sweep(self.idle, now);
            m.presence(ask.session, now).turns += 1;
            let offer = m
                .scheduler
                .offer(id, ask.session, ask.context, ask.blocks, now);
            let ready = m.scheduler.take_ready();
            m.wake(ready);
            let held = match offer {
                Offer::Admit => None,
                Offer::Hold { until } => {
                    let (tx, rx) = oneshot::channel();
                    m.waiters.insert(id, tx);
                    Some((until, rx))
                }
            };
            self.observe(&mut models);
            match held {
                None => return self.scheduled(&ask, None),
                Some((until, rx)) => (id, until, rx),
            }
        };
        let mut waiting = Waiting {
            schedule: self,
            model: ask.model,
            session: ask.session,
            id,
            armed: true,
        };
        let release = loop {
            let idle_changed = self.idle_changed.notified();
            tokio::pin!(idle_changed);
            // Registered before the timer is read, so a turn ending in between is not missed.
            idle_changed.as_mut().enable();
            let wake_at = self.next_wake(ask.model, until);
            tokio::select! {
                biased;
                _ = &mut rx => break Release::Room,
                () = idle_changed => continue,
                () = tokio::time::sleep_until(self.at(wake_at)) => {}
            }
            if let Some(release) = self.on_timer(ask.model, id, until) {
                break release;
            }
        };
        waiting.armed = false;
        let held_for = self.now().saturating_sub(now);
        self.metrics
            .held_seconds
            .observe(Duration::from_micros(held_for).as_secs_f64());
        self.scheduled(&ask, Some((Duration::from_micros(held_for), release)))
    }

    /// The earliest of `until` and the next idle session's leaving on `model`.
    fn next_wake(&self, model: &str, until: Micros) -> Micros {
        let Some(state) = &self.state else {
            return until;
        };
        let models = state.lock();
        models
            .by_model
            .get(model)
            .and_then(|m| m.next_leave(self.idle))
            .map_or(until, |leave| leave.min(until))
    }

    /// A held turn's timer fired: idle sessions leave, and at its bound the turn goes in.
    /// Returns what let it go, or `None` while it waits on.
    fn on_timer(&self, model: &str, id: u64, until: Micros) -> Option<Release> {
        let Some(state) = &self.state else {
            return Some(Release::Room);
        };
        let now = self.now();
        let mut models = state.lock();
        let Some(m) = models.by_model.get_mut(model) else {
            // Nothing schedules the model (cannot happen: schedulers are never dropped).
            return Some(Release::Room);
        };
        m.sync_workers(&self.pool, model, now);
        m.sweep(self.idle, now);
        let release = if !m.waiters.contains_key(&id) {
            // The sweep let it go.
            Some(Release::Room)
        } else if now < until {
            None
        } else {
            let (held, behind) = m.scheduler.expire(id, now);
            m.waiters.remove(&id);
            m.wake(behind);
            Some(if held { Release::Aged } else { Release::Room })
        };
        self.observe(&mut models);
        release
    }

    /// A held turn's client went away: the turn leaves the queue.
    fn withdraw(&self, model: &str, session: &str, id: u64) {
        let Some(state) = &self.state else {
            return;
        };
        let now = self.now();
        let mut models = state.lock();
        if let Some(m) = models.by_model.get_mut(model) {
            m.waiters.remove(&id);
            let admitted = m.scheduler.withdraw(id, now);
            m.wake(admitted);
            if let Some(p) = m.presence.get_mut(session) {
                p.turns = p.turns.saturating_sub(1);
                p.last = now;
            }
        }
        self.metrics.withdrawn.inc();
        self.observe(&mut models);
    }

    fn scheduled(
        self: &Arc<Self>,
        ask: &TurnAsk<'_>,
        held: Option<(Duration, Release)>,
    ) -> ScheduledTurn {
        ScheduledTurn {
            owner: Some(TurnOwner {
                schedule: Arc::clone(self),
                model: ask.model.to_owned(),
                session: ask.session.to_owned(),
                context: ask.context,
                blocks: ask.blocks,
                routed: false,
            }),
            held,
        }
    }

    /// The turn was routed to `worker` and runs.
    fn routed(&self, owner: &TurnOwner, worker: &WorkerId) {
        let Some(state) = &self.state else {
            return;
        };
        let mut models = state.lock();
        if let Some(m) = models.by_model.get_mut(&owner.model) {
            m.scheduler
                .routed(&owner.session, owner.context, owner.blocks, worker.clone());
        }
    }

    /// The turn ended (finished, failed or its client went away).
    fn ended(&self, owner: &TurnOwner) {
        let Some(state) = &self.state else {
            return;
        };
        let now = self.now();
        let mut models = state.lock();
        if let Some(m) = models.by_model.get_mut(&owner.model) {
            if owner.routed {
                m.scheduler.turn_ended(&owner.session, now);
            }
            if let Some(p) = m.presence.get_mut(&owner.session) {
                p.turns = p.turns.saturating_sub(1);
                p.last = now;
            }
            m.sync_workers(&self.pool, &owner.model, now);
            m.sweep(self.idle, now);
        }
        self.observe(&mut models);
        drop(models);
        self.idle_changed.notify_waiters();
    }

    /// The metrics, from the schedulers as they are now (under their lock, so the counters'
    /// increments follow the schedulers' own counts exactly).
    fn observe(&self, models: &mut Models) {
        let (mut waiting, mut resident) = (0, 0);
        let mut stats = switchyard_router::serve::SessionStats::default();
        for m in models.by_model.values() {
            waiting += m.scheduler.waiting();
            resident += m.scheduler.resident();
            let s = m.scheduler.stats();
            stats.held_turns += s.held_turns;
            stats.aged_turns += s.aged_turns;
            stats.demotions += s.demotions;
        }
        self.metrics.waiting.set(waiting as i64);
        self.metrics.resident.set(resident as i64);
        let exported = &mut models.exported;
        self.metrics
            .held
            .inc_by(stats.held_turns.saturating_sub(exported.held_turns));
        self.metrics
            .aged
            .inc_by(stats.aged_turns.saturating_sub(exported.aged_turns));
        self.metrics
            .demotions
            .inc_by(stats.demotions.saturating_sub(exported.demotions));
        *exported = stats;
    }
}

/// A held turn's wait: dropped before it was let go (the client went away), it withdraws the
/// turn.
struct Waiting<'a> {
    schedule: &'a SessionSchedule,
    model: &'a str,
    session: &'a str,
    id: u64,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.schedule.withdraw(self.model, self.session, self.id);
        }
    }
}

#[derive(Debug)]
struct TurnOwner {
    schedule: Arc<SessionSchedule>,
    model: String,
    session: String,
    context: BlockHash,
    blocks: u64,
    routed: bool,
}

/// A session's turn let go by the scheduler, until it ends (dropped); empty when the request
/// is not scheduled.
#[derive(Debug, Default)]
pub struct ScheduledTurn {
    owner: Option<TurnOwner>,
    held: Option<(Duration, Release)>,
}

impl ScheduledTurn {
    /// How long the turn waited and what let it go; `None` when it did not wait.
    pub fn held(&self) -> Option<(Duration, Release)> {
        self.held
    }

    /// The turn started on `worker` (its first routed attempt; later ones change nothing).
    pub fn routed(&mut self, worker: &WorkerId) {
        if let Some(owner) = self.owner.as_mut().filter(|o| !o.routed) {
            owner.schedule.routed(owner, worker);
            owner.routed = true;
        }
    }
}

impl Drop for ScheduledTurn {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            owner.schedule.ended(&owner);
        }
    }
}
