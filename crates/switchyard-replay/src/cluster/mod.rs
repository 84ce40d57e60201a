//! The offline simulated cluster, in virtual time.
//!
//! N [`Simulator`]s behind the real router: a [`PrefixIndex`] fed by the simulators' KV events
//! (applied when the step that produced them ends, plus an optional propagation delay), a
//! [`LoadView`] fed by their [`Simulator::load`] reports, and a routing [`Policy`]. A
//! discrete-event loop pops `(time, seq)`-ordered events from a binary heap: request arrivals,
//! worker step completions and delayed KV-event deliveries. A worker steps only while it has
//! work, each step lasting its simulated duration; a step's outputs and events become visible
//! when it ends. Nothing iterates a hash map, and ties break on the insertion sequence, so a
//! run is a pure function of its inputs and seed.
//!
//! With a [`DisaggConfig`] the workers take roles and requests are served the way the gateway
//! serves them disaggregated ([`disagg`]): the decode worker is chosen first among the workers
//! that decode, and a long uncached prompt is prefilled on a prefill worker whose KV then moves
//! to it, chunk by chunk, on a simulated link costed from the same transfer plan the workers use.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

use indicatif::ProgressBar;
// Request ids are looked up for every token of every step: FxHash, not SipHash. No map here
// is iterated, so the hasher cannot change a result.
use rustc_hash::FxHashMap as HashMap;
mod control;
mod disagg;
mod floor;
mod peer;
mod steps;
mod tiers;

use switchyard_core::{
    BlockHash, BlockSize, EngineKind, KvEvent, Retention, Role, TokenId, WorkerId,
};
use switchyard_engine_sim::{SimConfig, SimRequest, Simulator, StagingArea, StepOutcome};
use switchyard_router::serve::{
    self, Booking, RetentionConfig, Served, ServingCore, ThinkTimes, WorkerFacts,
};
use switchyard_router::{IndexConfig, LoadConfig, PolicyConfig, PolicyKind};

use crate::error::ReplayError;
use crate::metrics::RequestRecord;
use crate::workload::{Micros, Outbox, RequestSpec, Workload};
pub use control::{Control, Controller};
pub use disagg::{DisaggConfig, DisaggMode, DisaggStats, WorkerStats};
pub use switchyard_router::serve::{Offer, SessionStats};

/// Session scheduling over the cluster's workers, by index.
pub type SessionScheduler = serve::SessionScheduler<usize>;

/// Shape of the simulated cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    pub workers: usize,
    /// Every worker's simulator; worker *i* gets `seed + i`.
    pub sim: SimConfig,
    pub policy: PolicyKind,
    pub policy_config: PolicyConfig,
    /// Extra virtual time between a step's end and its KV events reaching the index.
    pub event_delay_us: Micros,
    /// Workers report their load at most this often (0: a fresh report before every routing
    /// decision); between reports the load view adds the router's in-flight bookkeeping.
    pub load_report_interval_us: Micros,
    /// Worker roles and how requests use the prefill pool; `None`: every worker serves
    /// aggregated (role `both`).
    pub disagg: Option<DisaggConfig>,
    /// Record every gap between two tokens of a request ([`ClusterRun::token_gaps`]).
    pub token_gaps: bool,
    /// Retention hints from each session's think times, as the gateway sets them (aggregated
    /// requests with a session); `None`: no hints.
    pub retention: Option<RetentionConfig>,
    /// Sessions scheduled as programs ([`SessionScheduler`]): a turn whose session's working
    /// set does not fit beside the resident sessions' waits at its tool-call boundary, up to
    /// its aging bound; off: every turn is routed when it arrives.
    pub session_scheduling: bool,
}

impl Default for ClusterConfig {
    /// Four aggregated simulated workers of the simulator's defaults under the `kv` policy, KV
    /// events and load reports seen at once, no token gaps recorded, no retention hints.
    fn default() -> Self {
        Self {
            workers: 4,
            sim: SimConfig::default(),
            policy: PolicyKind::Kv,
            policy_config: PolicyConfig::default(),
            event_delay_us: 0,
            load_report_interval_us: 0,
            disagg: None,
            token_gaps: false,
            retention: None,
            session_scheduling: false,
        }
    }
}

impl ClusterConfig {
    /// The run's label: the policy, plus `+host` with a host tier and `+retention` with hints.
    pub fn label(&self) -> String {
        let mut label = self.policy.as_str().to_owned();
        if self.sim.num_host_blocks > 0 {
            label.push_str("+host");
        }
        if self.retention.is_some() {
            label.push_str("+retention");
        }
        if self.policy_config.kv.peer_link.is_some() {
            label.push_str("+placement");
        }
        if self.session_scheduling {
            label.push_str("+sessions");
        }
        label
    }
}

/// What a replay produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterRun {
    /// One record per request, ordered by request id.
    pub records: Vec<RequestRecord>,
    pub steps: u64,
    pub kv_events: u64,
    /// Virtual time of the last event.
    pub end: Micros,
    /// Per worker, in worker order.
    pub workers: Vec<WorkerStats>,
    pub disagg: DisaggStats,
    /// Every gap between consecutive tokens of a request, with that request's prompt length,
    /// when [`ClusterConfig::token_gaps`] is set: a stall shows here even where a request's
    /// mean time per token hides it.
    pub token_gaps: Vec<TokenGap>,
    /// Per record, in `records`' order: its TTFT floor (`floor`), in microseconds.
    pub ttft_floor_us: Vec<Micros>,
    /// What session scheduling did (all 0 without it).
    pub sessions: SessionStats,
}

/// One gap between two consecutive tokens of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenGap {
    pub prompt_tokens: u32,
    pub gap_us: u32,
}

#[derive(Debug)]
enum Event {
    Arrival(Box<RequestSpec>),
    StepDone(usize),
    KvEvents(usize, Vec<KvEvent>),
    /// A chunk of a disaggregated request's KV lands on its decode worker.
    Import(u64, Vec<(BlockHash, Vec<TokenId>)>),
    /// A disaggregated request's KV has all landed after its prefill: first token, decode.
    Emit(u64),
    /// The controller's turn ([`Cluster::run_with`]).
    Tick,
    /// A prefix copied from a peer lands; its request is admitted ([`peer`]).
    PeerLanded(Box<peer::PeerCopy>),
    /// A held turn's aging bound ([`SessionScheduler`]).
    Release(u64),
}

#[derive(Debug)]
struct Scheduled {
    at: Micros,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed, so the max-heap pops the earliest `(at, seq)` first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Debug)]
struct Worker {
    id: WorkerId,
    sim: Simulator,
    /// The step in progress; its effects land when its `StepDone` pops.
    pending: Option<StepOutcome>,
    next_event_seq: u64,
    last_report: Option<Micros>,
    role: Role,
    /// Plans the KV transfers into this worker (one staging area per worker, as live).
    staging: StagingArea,
    stats: WorkerStats,
    /// The role it moves to once idle; while set it takes no new work (draining).
    moving_to: Option<Role>,
    /// Bookings the serving core holds on it (its requests not yet ended).
    booked: usize,
    /// When its link is free of the prefix copies queued into it.
    peer_link_free_at: Micros,
}

/// The simulated cluster; see the module docs.
#[derive(Debug)]
pub struct Cluster {
    config: ClusterConfig,
    block_size: BlockSize,
    workers: Vec<Worker>,
    /// The serving decision, as the gateway makes it: index, load view, policies, bookings.
    core: ServingCore,
    /// Each request's booking on its generating worker, while it runs.
    bookings: HashMap<u64, Booking>,
    /// Record slots in the order their requests finished.
    finished: Vec<usize>,
    flows: disagg::Flows,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    records: Vec<RequestRecord>,
    /// Per record: when its last token came out (for the token gaps).
    last_token_at: Vec<Micros>,
    token_gaps: Vec<TokenGap>,
    /// Request id → index in `records`, for requests in flight.
    live: HashMap<u64, usize>,
    think_times: Option<ThinkTimes>,
    /// Session of each request in flight that carried a retention hint.
    sessions: HashMap<u64, String>,
    /// Request id → (worker, hold) of a copied prefix, until the request's first token.
    peer_holds: HashMap<u64, (usize, u64)>,
    /// Session scheduling, when on.
    scheduler: Option<SessionScheduler>,
    /// Turns the scheduler holds, by request id, with when they arrived.
    held: HashMap<u64, (RequestSpec, Micros)>,
    /// Session of each routed request while it runs (session scheduling).
    turn_sessions: HashMap<u64, String>,
    ttft_floor: floor::TtftFloor,
    steps: u64,
    kv_events: u64,
    now: Micros,
}

impl Cluster {
    pub fn new(config: ClusterConfig) -> Result<Self, ReplayError> {
        if config.workers == 0 {
            return Err(ReplayError::InvalidConfig(
                "at least one worker is needed".into(),
            ));
        }
        let roles = disagg::roles(&config)?;
        let mut workers = Vec::with_capacity(config.workers);
        for (i, role) in roles.into_iter().enumerate() {
            let sim = Simulator::new(SimConfig {
                seed: config.sim.seed.wrapping_add(i as u64),
                ..config.sim.clone()
            })
            .map_err(|e| ReplayError::Cluster(e.to_string()))?;
            let id = WorkerId::new(format!("sim-{i}"))
                .map_err(|e| ReplayError::Cluster(e.to_string()))?;
            workers.push(Worker {
                id,
                sim,
                pending: None,
                next_event_seq: 0,
                last_report: None,
                role,
                staging: StagingArea::new(
                    config
                        .disagg
                        .as_ref()
                        .map_or(disagg::DEFAULT_STAGING_BYTES, |d| d.staging_bytes),
                ),
                stats: WorkerStats {
                    role: role.as_str(),
                    ..WorkerStats::default()
                },
                moving_to: None,
                booked: 0,
                peer_link_free_at: 0,
            });
        }
        let block_size = config.sim.block_size;
        let mut policy_config = config.policy_config.clone();
        if policy_config.kv.host_link.is_none() {
            policy_config.kv.host_link = tiers::host_link(&config.sim);
        }
        let core = ServingCore::new(
            block_size,
            IndexConfig {
                // Events come from the in-process simulators: known good.
                verify_hashes: false,
                ..IndexConfig::new(block_size)
            },
            // Requests reach a simulator the instant they are routed, so a report reflects
            // every request routed before it.
            LoadConfig {
                report_lag: 0,
                ..LoadConfig::default()
            },
            config.policy,
            &policy_config,
        )
        .map_err(|e| ReplayError::Cluster(e.to_string()))?;
        if let Some(retention) = &config.retention {
            retention.validate().map_err(ReplayError::InvalidConfig)?;
        }
        let think_times = config.retention.map(ThinkTimes::new);
        if !workers.iter().any(|w| w.role.serves_decode()) {
            return Err(ReplayError::InvalidConfig(
                "at least one worker must decode (role both or decode)".into(),
            ));
        }
        let scheduler = config
            .session_scheduling
            .then(|| session_scheduler(config.workers, &config.sim));
        Ok(Self {
            scheduler,
            held: HashMap::default(),
            turn_sessions: HashMap::default(),
            core,
            bookings: HashMap::default(),
            finished: Vec::new(),
            flows: disagg::Flows::default(),
            config,
            block_size,
            workers,
            heap: BinaryHeap::new(),
            seq: 0,
            records: Vec::new(),
            last_token_at: Vec::new(),
            token_gaps: Vec::new(),
            live: HashMap::default(),
            think_times,
            sessions: HashMap::default(),
            peer_holds: HashMap::default(),
            ttft_floor: floor::TtftFloor::default(),
            steps: 0,
            kv_events: 0,
            now: 0,
        })
    }

    fn schedule(&mut self, at: Micros, event: Event) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at,
            seq: self.seq,
            event,
        });
    }

    fn flush(
        &mut self,
        out: &mut Outbox,
        workload: &mut dyn Workload,
        progress: &ProgressBar,
    ) -> Result<(), ReplayError> {
        loop {
            let sends: Vec<_> = out.drain().collect();
            for (at, spec) in sends {
                let at = at.max(self.now);
                self.schedule(at, Event::Arrival(Box::new(spec)));
            }
            let ended: Vec<String> = out.drain_ended().collect();
            if ended.is_empty() {
                return Ok(());
            }
            let Some(scheduler) = self.scheduler.as_mut() else {
                continue;
            };
            let mut admitted = Vec::new();
            for session in ended {
                admitted.extend(scheduler.session_ended(&session, self.now));
            }
            for id in admitted {
                self.release_held(id, workload, out, progress)?;
            }
        }
    }

    /// A held turn goes on: routed and served as if it arrived now, its TTFT counted from
    /// when it did arrive.
    fn release_held(
        &mut self,
        id: u64,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) -> Result<(), ReplayError> {
        let Some((spec, arrived)) = self.held.remove(&id) else {
            return Ok(());
        };
        let tokens = spec.prompt.tokens_with_room(spec.max_tokens as usize);
        let request =
            serve::route_request(&tokens, self.block_size, spec.session.clone(), self.now);
        self.serve_turn(spec, tokens, request, arrived, workload, out, progress)
    }

    /// Runs `workload` to completion.
    pub fn run(
        self,
        workload: &mut dyn Workload,
        progress: &ProgressBar,
    ) -> Result<ClusterRun, ReplayError> {
        self.run_controlled(workload, progress, None)
    }

    /// Runs `workload` to completion while `controller` acts on the cluster at the times it
    /// asks for (the planner's bench moving workers between the pools).
    pub fn run_with(
        self,
        workload: &mut dyn Workload,
        progress: &ProgressBar,
        controller: &mut dyn Controller,
    ) -> Result<ClusterRun, ReplayError> {
        self.run_controlled(workload, progress, Some(controller))
    }

    fn run_controlled(
        mut self,
        workload: &mut dyn Workload,
        progress: &ProgressBar,
        mut controller: Option<&mut dyn Controller>,
    ) -> Result<ClusterRun, ReplayError> {
        let mut out = Outbox::default();
        workload.start(&mut out);
        self.flush(&mut out, workload, progress)?;
        if controller.is_some() {
            self.schedule(0, Event::Tick);
        }
        while let Some(Scheduled { at, event, .. }) = self.heap.pop() {
            self.now = at;
            match event {
                Event::Arrival(spec) => self.arrive(*spec, workload, &mut out, progress)?,
                Event::StepDone(w) => self.complete_step(w, workload, &mut out, progress),
                Event::KvEvents(w, events) => self.apply_events(w, &events)?,
                Event::Import(request, blocks) => self.import(request, &blocks),
                Event::Emit(request) => self.emit(request, workload, &mut out, progress),
                Event::PeerLanded(copy) => self.peer_landed(*copy, workload, &mut out, progress),
                Event::Release(id) => {
                    let admitted = match self.scheduler.as_mut() {
                        Some(scheduler) => {
                            let (held, behind) = scheduler.expire(id, self.now);
                            held.then_some(id).into_iter().chain(behind).collect()
                        }
                        None => Vec::new(),
                    };
                    for id in admitted {
                        self.release_held(id, workload, &mut out, progress)?;
                    }
                }
                Event::Tick => {
                    if let Some(controller) = controller.as_deref_mut() {
                        let next = controller.tick(self.now, &mut Control { cluster: &mut self });
                        if let Some(next) = next {
                            self.schedule(next.max(self.now + 1), Event::Tick);
                        }
                    }
                }
            }
            self.settle_moves();
            self.flush(&mut out, workload, progress)?;
        }
        let mut records = self.records;
        records.sort_by_key(|r| r.id);
        let ttft_floor_us = self.ttft_floor.of(&records);
        Ok(ClusterRun {
            records,
            steps: self.steps,
            kv_events: self.kv_events,
            end: self.now,
            workers: self.workers.into_iter().map(|w| w.stats).collect(),
            disagg: self.flows.stats,
            token_gaps: self.token_gaps,
            ttft_floor_us,
            sessions: self.scheduler.map(|s| s.stats()).unwrap_or_default(),
        })
    }

    fn refresh_loads(&mut self) {
        let now = self.now;
        let interval = self.config.load_report_interval_us;
        for w in &mut self.workers {
            let due = match w.last_report {
                None => true,
                Some(last) => interval == 0 || now.saturating_sub(last) >= interval,
            };
            if due {
                self.core.load.report(&w.id, w.sim.load(), now);
                w.last_report = Some(now);
            }
        }
    }

    /// The booked request ended: the core releases it, and its worker has one fewer.
    fn release(&mut self, booking: &Booking) {
        self.core.finished(booking);
        if let Ok(w) = self.worker_index(&booking.worker) {
            self.workers[w].booked = self.workers[w].booked.saturating_sub(1);
        }
    }

    fn worker_index(&self, id: &WorkerId) -> Result<usize, ReplayError> {
        self.workers
            .iter()
            .position(|w| w.id == *id)
            .ok_or_else(|| ReplayError::Cluster("the router chose an unknown worker".into()))
    }

    fn arrive(
        &mut self,
        spec: RequestSpec,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) -> Result<(), ReplayError> {
        let tokens = spec.prompt.tokens_with_room(spec.max_tokens as usize);
        let request =
            serve::route_request(&tokens, self.block_size, spec.session.clone(), self.now);
        self.ttft_floor.arrive(
            spec.id,
            &request.block_hashes,
            tokens.len() as u64,
            &self.config.sim,
        );
        if let (Some(scheduler), Some(session), Some(&context)) = (
            self.scheduler.as_mut(),
            &spec.session,
            request.block_hashes.first(),
        ) {
            let blocks = tokens.len().div_ceil(self.block_size.as_usize()) as u64;
            let offer = scheduler.offer(spec.id, session, context, blocks, self.now);
            let ready = scheduler.take_ready();
            for id in ready {
                self.release_held(id, workload, out, progress)?;
            }
            if let Offer::Hold { until } = offer {
                let id = spec.id;
                self.held.insert(id, (spec, self.now));
                self.schedule(until, Event::Release(id));
                return Ok(());
            }
        }
        let arrived = self.now;
        self.serve_turn(spec, tokens, request, arrived, workload, out, progress)
    }

    /// Routes and serves `spec` (its prompt `tokens`, hashed in `request`), which arrived at
    /// `arrived` (earlier than now when it was held).
    #[allow(clippy::too_many_arguments)]
    fn serve_turn(
        &mut self,
        spec: RequestSpec,
        tokens: Vec<TokenId>,
        request: switchyard_router::RouteRequest,
        arrived: Micros,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) -> Result<(), ReplayError> {
        self.refresh_loads();
        let settings = self.serve_settings();
        // The serving core's one decision, exactly as the gateway takes it (tested against the
        // gateway's path in `switchyard-gateway/tests/fidelity.rs`).
        let facts: Vec<WorkerFacts<'_>> = self
            .workers
            .iter()
            .map(|w| WorkerFacts {
                id: &w.id,
                role: w.role,
                engine: EngineKind::Sim,
                draining: w.moving_to.is_some(),
                adapters: &[],
            })
            .collect();
        let served = self
            .core
            .serve(&settings, &request, spec.max_tokens, &facts)
            .map_err(|e| ReplayError::Cluster(e.to_string()))?
            .served;
        drop(facts);
        let prompt_tokens = tokens.len() as u64;
        let (w, booking, copy) = match served {
            Served::Aggregated {
                decision,
                booking,
                wanted_prefill,
            } => {
                if wanted_prefill {
                    self.flows.stats.kept_aggregated += 1;
                }
                let copy = peer::copy_range(&decision);
                (self.worker_index(&decision.worker)?, booking, copy)
            }
            Served::Disaggregated {
                decision,
                decode,
                prefill_decision,
                prefill,
            } => {
                let d = self.worker_index(&decision.worker)?;
                let p = self.worker_index(&prefill_decision.worker)?;
                self.workers[d].booked += 1;
                self.workers[p].booked += 1;
                self.turn_routed(&spec, &request.block_hashes, tokens.len(), d);
                let id = spec.id;
                self.start_disaggregated(
                    spec, tokens, d, p, decode, prefill, workload, out, progress,
                )?;
                if let Some(record) = self.records.last_mut().filter(|r| r.id == id) {
                    record.arrival = arrived;
                }
                return Ok(());
            }
            Served::Refused { .. } => {
                // `enforce` without a prefill worker: refused, as the gateway refuses it (503).
                self.records.push(RequestRecord {
                    id: spec.id,
                    worker: 0,
                    arrival: arrived,
                    first_token: None,
                    finished: None,
                    prompt_tokens,
                    cached_tokens: 0,
                    output_tokens: 0,
                    ok: false,
                });
                self.last_token_at.push(self.now);
                progress.inc(1);
                workload.on_finished(spec.id, false, self.now, out);
                return Ok(());
            }
        };
        self.workers[w].booked += 1;
        self.turn_routed(&spec, &request.block_hashes, tokens.len(), w);
        let retention = match (&mut self.think_times, &spec.session) {
            (Some(think_times), Some(session)) => {
                self.sessions.insert(spec.id, session.clone());
                think_times.arrive(session, self.now)
            }
            _ => Retention::default(),
        };
        let sim_request = SimRequest {
            ignore_eos: true,
            retention,
            // Hashed once, for routing: the simulator takes the same hashes.
            prompt_hashes: Some(request.block_hashes.clone()),
            ..SimRequest::new(spec.id, tokens, spec.max_tokens)
        };
        self.records.push(RequestRecord {
            id: spec.id,
            worker: w as u32,
            arrival: arrived,
            first_token: None,
            finished: None,
            prompt_tokens,
            cached_tokens: 0,
            output_tokens: 0,
            ok: false,
        });
        let slot = self.records.len() - 1;
        self.last_token_at.push(self.now);
        match copy {
            Some(range) => {
                self.start_peer_copy(w, range, &request.block_hashes, sim_request, slot, booking)
            }
            None => self.admit(w, sim_request, slot, booking, workload, out, progress),
        }
        Ok(())
    }

    /// Hands `request` (record `slot`, booked as `booking`) to worker `w`'s simulator.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        w: usize,
        request: SimRequest,
        slot: usize,
        booking: Booking,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) {
        let id = request.id;
        let worker = &mut self.workers[w];
        worker.sim.set_clock(Duration::from_micros(self.now));
        if worker.sim.add_request(request).is_err() {
            // Refused by the engine (too long for its context or cache): a failed request.
            self.session_ended(id);
            self.release(&booking);
            progress.inc(1);
            workload.on_finished(id, false, self.now, out);
            return;
        }
        self.bookings.insert(id, booking);
        self.live.insert(id, slot);
        if worker.pending.is_none() {
            self.start_step(w);
        }
    }

    /// Session scheduling learns where a turn of `spec`'s session runs (worker `w`).
    fn turn_routed(&mut self, spec: &RequestSpec, hashes: &[BlockHash], tokens: usize, w: usize) {
        if let (Some(scheduler), Some(session), Some(&context)) =
            (self.scheduler.as_mut(), &spec.session, hashes.first())
        {
            let blocks = tokens.div_ceil(self.block_size.as_usize()) as u64;
            scheduler.routed(session, context, blocks, w);
            self.turn_sessions.insert(spec.id, session.clone());
        }
    }

    /// Request `id` ended (done or failed): a session that carried a retention hint starts
    /// its pause, and session scheduling sees the session between turns.
    fn session_ended(&mut self, id: u64) {
        if let (Some(think_times), Some(session)) =
            (&mut self.think_times, self.sessions.remove(&id))
        {
            think_times.finished(&session, self.now);
        }
        if let (Some(scheduler), Some(session)) =
            (self.scheduler.as_mut(), self.turn_sessions.remove(&id))
        {
            scheduler.turn_ended(&session, self.now);
        }
    }
}

/// Session scheduling over `workers` workers of `sim`'s device blocks each, a turn's aging bound
/// the time one of them takes to recompute the blocks it would push out (in `sim`'s chunks).
fn session_scheduler(workers: usize, sim: &SimConfig) -> SessionScheduler {
    let blocks = sim.num_device_blocks;
    let sim = sim.clone();
    let mut scheduler = SessionScheduler::new(move |blocks| {
        let tokens = blocks.saturating_mul(u64::from(sim.block_size.get()));
        sim.timing
            .chunked_prefill_time(tokens, 0, sim.max_batched_tokens as u64)
            .as_micros() as Micros
    });
    scheduler.set_workers((0..workers).map(|w| (w, blocks)), 0);
    scheduler
}
