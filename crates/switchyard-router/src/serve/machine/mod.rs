//! The serving state machine: one request's whole life — route, the serving mode, the prefill
//! pool and its retries, generation, and what a failed attempt leads to (retry elsewhere,
//! migrate mid-stream, reroute, fail) — as pure transitions. No I/O, no clock, no locks: the
//! machine says what to do next ([`Step`]) and takes each outcome back.
//!
//! There is one serving sequence in the workspace and it is this one. Its drivers:
//!
//! - the gateway's dispatch (`switchyard-gateway`, `dispatch`) carries each step out over its
//!   worker transport, with the serving core behind the model's lock, bookings held by guards,
//!   the decision log, spans and metrics around it;
//! - [`ServingCore::serve`](super::ServingCore::serve) drives it with simulated outcomes
//!   (every prefill succeeds, generation is the caller's) for the replay lab's cluster and the
//!   planner's bench.
//!
//! ```text
//!        ┌──────────── Route ◄────────────── retry · migrate · reroute ───┐
//!        │ routed                                                         │
//!        ▼            aggregated                                          │
//!  serving mode ─────────────────────────────► Generate ── ended ─────────┤
//!        │ try the prefill pool                   ▲                       ▼
//!        ▼                saturated / fall back   │                 Finish · Fail · Stop
//!  ChoosePrefill ─────────────────────────────────┤
//!        │ chosen                                 │ prefilled
//!        ▼                                        │
//!     Prefill ── failed: another prefill worker ──┘ (up to the request's retries)
//! ```

use switchyard_core::{EngineKind, Sampling, TokenId, WorkerId};

use super::{Disaggregation, ModeChoice, ServeSettings, aggregated_only, serving_mode};
use crate::error::RouteError;

#[cfg(test)]
mod tests;

/// Why generation ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Length,
    Stop,
}

/// Why a request cannot be served, by who is at fault (the gateway's HTTP status follows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServeError {
    /// The request itself is wrong; no worker will take it (400).
    BadRequest(String),
    /// No worker can serve it now (503).
    Unavailable(String),
    /// The workers failed it (502).
    Upstream(String),
    /// The router itself failed (500).
    Internal(String),
}

impl ServeError {
    pub fn message(&self) -> &str {
        match self {
            Self::BadRequest(m) | Self::Unavailable(m) | Self::Upstream(m) | Self::Internal(m) => m,
        }
    }
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

/// Which attempt of a request this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptKind {
    First,
    /// Before any token: the request starts again elsewhere.
    Retry,
    /// After some tokens: the request continues elsewhere from prompt + generated.
    Migration,
}

impl AttemptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptKind::First => "first",
            AttemptKind::Retry => "retry",
            AttemptKind::Migration => "migration",
        }
    }
}

/// How an attempt's generation ended.
#[derive(Debug)]
pub enum AttemptEnd {
    /// Every token was generated and the end was sent.
    Done,
    /// The consumer is gone; stop quietly.
    ConsumerGone,
    /// A worker failed; another may succeed. `blame` says which one to avoid next.
    WorkerFailed { reason: String, blame: Blame },
    /// The request itself is bad, or the pair of workers must not pair: no retry.
    Refused(ServeError),
}

impl AttemptEnd {
    pub fn worker_failed(reason: impl Into<String>) -> Self {
        AttemptEnd::WorkerFailed {
            reason: reason.into(),
            blame: Blame::Answering,
        }
    }
}

/// Which worker a failed attempt is held against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The worker that answered (the decode worker, or the only one when aggregated).
    Answering,
    /// The KV source: the decode worker could not get the prompt's KV from the prefill worker,
    /// so the prefill worker is excluded and the decode worker stays eligible.
    KvSource,
}

/// What the request is, as far as the sequence is concerned.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The model, for error messages.
    pub model: String,
    pub settings: ServeSettings,
    /// Tokens to generate, across attempts.
    pub max_tokens: u32,
    /// Attempts that may fail before the first token (each prefill attempt has as many).
    pub max_retries: u32,
    /// Attempts that may fail after some tokens.
    pub max_migrations: u32,
    /// Log probabilities asked for: they are computed where the tokens are, and a prefill
    /// worker's first token comes without one, so the request is served aggregated.
    pub logprobs: bool,
}

/// Why an attempt follows another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum After {
    /// The last attempt's worker failed before the first token.
    Retry(String),
    /// The last attempt's worker failed mid-stream.
    Migrate(String),
    /// The last attempt's decode worker serves only with a prefill worker and could get none:
    /// from now on only workers that serve aggregated.
    Reroute(String),
}

/// Step: choose and book the attempt's generating worker.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteAsk {
    /// From 1.
    pub attempt: u32,
    pub kind: AttemptKind,
    /// What the previous attempt ended with (its decision's outcome).
    pub after: Option<After>,
    /// Workers that failed this request.
    pub exclude: Vec<WorkerId>,
    /// Leave out workers that serve only with a prefill worker.
    pub aggregated_only: bool,
    /// The serving mode is decided after routing (the prefill pool may follow).
    pub prefill_pool: bool,
    /// Tokens still to generate.
    pub max_tokens: u32,
    /// Why the candidates were narrowed (for the decision log): the reroute's reason.
    pub note: Option<String>,
}

/// What routing decided, as the machine needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    pub worker: WorkerId,
    /// Prompt tokens the worker would compute itself.
    pub uncached_prompt_tokens: u64,
    pub engine: EngineKind,
    /// The worker serves only with a prefill worker ([`super::needs_prefill`]).
    pub needs_prefill: bool,
    /// Sub-agent placement: the worker the decision priced copying the prompt's prefix from
    /// ([`Decision::peer_source`](crate::Decision::peer_source)), which then prefills the
    /// prompt (hitting its cache) while this worker pulls the KV, instead of recomputing it.
    pub peer: Option<WorkerId>,
}

/// Why routing found no worker.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteFailure {
    pub error: RouteError,
    /// A worker of the model that serves only with a prefill worker is registered (what a 503
    /// for want of an aggregated worker then explains).
    pub needs_prefill_registered: bool,
}

/// Step: choose and book a prefill worker for the attempt's decode worker.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillAsk {
    /// The decode worker's engine: only its kind exchanges KV with it.
    pub engine: EngineKind,
    pub needs_prefill: bool,
    /// Prefill workers that failed this request.
    pub exclude: Vec<WorkerId>,
    /// The prefill try of this attempt, from 1.
    pub try_number: u32,
    /// Sub-agent placement: book this worker (the peer holding the prefix, see
    /// [`Routed::peer`]) as the KV source, instead of choosing from the prefill pool.
    pub peer: Option<WorkerId>,
}

/// What the prefill pool gave.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillPick {
    /// Booked on this worker.
    Chosen(WorkerId),
    /// `auto` and the best prefill worker has too much queued: stay aggregated (the reason).
    Saturated(String),
    /// No prefill worker could be chosen.
    Unavailable(RouteError),
}

/// Why one prefill did not give a KV source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillFailure {
    /// The worker refused the prompt: no other prefill worker is tried.
    Refused(String),
    /// It failed or did not answer in time; another may succeed.
    Failed(String),
}

/// How an attempt generates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// The decode worker computes the prompt. `tried_prefill`: the prefill pool was tried and
    /// was saturated, empty or failing.
    Aggregated { why: String, tried_prefill: bool },
    /// The decode worker pulls the prompt's KV from `prefill`.
    Disaggregated { prefill: WorkerId },
}

/// What to do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Route(RouteAsk),
    ChoosePrefill(PrefillAsk),
    /// Run the prefill on the booked prefill worker. `why` explains the mode.
    Prefill {
        worker: WorkerId,
        try_number: u32,
        why: String,
    },
    /// Generate on the attempt's decode worker.
    Generate {
        worker: WorkerId,
        mode: Mode,
    },
    /// Every token asked for was generated before the last worker failed.
    Finish(Finish),
    Fail(ServeError),
    /// Nothing more to do (finished, or the consumer left).
    Stop,
}

/// Where the request is.
#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// The next step routes an attempt.
    Idle,
    /// An attempt's decode worker is routed; the prefill pool is being tried.
    Prefill(PrefillState),
    /// The attempt generates on `worker`.
    Generating {
        worker: WorkerId,
        prefill: Option<WorkerId>,
    },
    Over,
}

#[derive(Debug, Clone, PartialEq)]
struct PrefillState {
    decode: Routed,
    try_number: u32,
    chosen: Option<WorkerId>,
    last_failure: Option<String>,
    /// The KV source is the peer holding the prefix (placement), not a prefill-pool worker:
    /// when it fails the decode worker recomputes the prompt, no other worker is tried.
    placement: bool,
}

/// One request's serving sequence. Built with [`Serving::new`], started with
/// [`Serving::start`]; each outcome method takes what the driver observed and returns the next
/// [`Step`].
#[derive(Debug, Clone)]
pub struct Serving {
    plan: Plan,
    phase: Phase,
    /// Tokens generated so far, across attempts.
    generated: Vec<TokenId>,
    /// Generating workers that failed this request.
    excluded: Vec<WorkerId>,
    /// Prefill workers that failed this request.
    excluded_prefill: Vec<WorkerId>,
    /// Set by a reroute: from then on only workers that serve aggregated.
    rerouted: Option<String>,
    started: bool,
    attempt: u32,
    retries: u32,
    migrations: u32,
    /// The current attempt uses the prefill pool's decision after routing.
    prefill_pool: bool,
}

impl Serving {
    pub fn new(plan: Plan) -> Self {
        Self {
            plan,
            phase: Phase::Idle,
            generated: Vec::new(),
            excluded: Vec::new(),
            excluded_prefill: Vec::new(),
            rerouted: None,
            started: false,
            attempt: 0,
            retries: 0,
            migrations: 0,
            prefill_pool: false,
        }
    }

    /// The first step: route the first attempt.
    pub fn start(&mut self) -> Step {
        self.next_attempt(None)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Tokens generated so far, across attempts.
    pub fn generated(&self) -> &[TokenId] {
        &self.generated
    }

    /// The current attempt's input: the prompt plus what was generated so far.
    pub fn context(&self, prompt: &[TokenId]) -> Vec<TokenId> {
        let mut context = Vec::with_capacity(prompt.len() + self.generated.len());
        context.extend_from_slice(prompt);
        context.extend_from_slice(&self.generated);
        context
    }

    /// Tokens still to generate.
    pub fn remaining(&self) -> u32 {
        self.plan
            .max_tokens
            .saturating_sub(self.generated.len() as u32)
    }

    /// The request's sampling for the current attempt: a migration continues with what is left
    /// to generate, and with what is left of `min_tokens`.
    pub fn sampling(&self, request: &Sampling) -> Sampling {
        let done = self.generated.len() as u32;
        Sampling {
            max_tokens: self.remaining(),
            min_tokens: request.min_tokens.map(|m| m.saturating_sub(done)),
            ..request.clone()
        }
    }

    /// The generating worker sent tokens.
    pub fn tokens(&mut self, ids: &[TokenId]) {
        self.generated.extend_from_slice(ids);
    }

    /// Whether the consumer was told the request started.
    pub fn started(&self) -> bool {
        self.started
    }

    /// The first answer of any attempt arrived: true the first time only (the consumer is told
    /// once, whatever the attempts).
    pub fn mark_started(&mut self) -> bool {
        !std::mem::replace(&mut self.started, true)
    }

    /// Starts the next attempt.
    fn next_attempt(&mut self, after: Option<After>) -> Step {
        self.attempt += 1;
        self.phase = Phase::Idle;
        let kind = if self.attempt <= 1 {
            AttemptKind::First
        } else if self.generated.is_empty() {
            AttemptKind::Retry
        } else {
            AttemptKind::Migration
        };
        let settings = &self.plan.settings;
        let migrating = !self.generated.is_empty();
        // Only a fresh start can use a prefill worker: a migration continues from tokens the
        // failed worker produced, and the new worker recomputes that context itself.
        self.prefill_pool = !migrating && !self.plan.logprobs;
        Step::Route(RouteAsk {
            attempt: self.attempt,
            kind,
            after,
            exclude: self.excluded.clone(),
            aggregated_only: self.plan.logprobs
                || aggregated_only(settings, migrating, self.rerouted.is_some()),
            prefill_pool: self.prefill_pool && settings.disaggregation != Disaggregation::Off,
            max_tokens: self.remaining(),
            note: self.rerouted.clone(),
        })
    }

    fn over(&mut self, step: Step) -> Step {
        self.phase = Phase::Over;
        step
    }

    /// The attempt's decode worker was routed and booked, or could not be.
    pub fn routed(&mut self, routed: Result<Routed, RouteFailure>) -> Step {
        let routed = match routed {
            Ok(routed) => routed,
            Err(failure) => {
                let err = match failure.error {
                    RouteError::NoCandidates => {
                        self.no_candidates(failure.needs_prefill_registered)
                    }
                    err => ServeError::Internal(err.to_string()),
                };
                return self.over(Step::Fail(err));
            }
        };
        if !self.prefill_pool {
            return self.generate_aggregated(
                routed.worker,
                if self.plan.logprobs {
                    "log probabilities are computed where the tokens are generated"
                } else {
                    "a migration continues on one worker"
                }
                .to_owned(),
                false,
            );
        }
        if let Some(peer) = routed.peer.clone()
            && !routed.needs_prefill
            && !self.excluded_prefill.contains(&peer)
        {
            return self.place(routed, peer);
        }
        let uncached = routed.uncached_prompt_tokens;
        match serving_mode(&self.plan.settings, uncached, routed.needs_prefill) {
            ModeChoice::Aggregated(why) => self.generate_aggregated(routed.worker, why, false),
            ModeChoice::TryPrefill { .. } => {
                let ask = PrefillAsk {
                    engine: routed.engine,
                    needs_prefill: routed.needs_prefill,
                    exclude: self.excluded_prefill.clone(),
                    try_number: 1,
                    peer: None,
                };
                self.phase = Phase::Prefill(PrefillState {
                    decode: routed,
                    try_number: 1,
                    chosen: None,
                    last_failure: None,
                    placement: false,
                });
                Step::ChoosePrefill(ask)
            }
        }
    }

    /// Sub-agent placement: the decode worker pulls the prompt's KV from `peer`, which holds
    /// its prefix, through the disaggregated path (whatever the disaggregation mode: the peer
    /// is no prefill-pool worker).
    fn place(&mut self, routed: Routed, peer: WorkerId) -> Step {
        let ask = PrefillAsk {
            engine: routed.engine,
            needs_prefill: false,
            exclude: self.excluded_prefill.clone(),
            try_number: 1,
            peer: Some(peer),
        };
        self.phase = Phase::Prefill(PrefillState {
            decode: routed,
            try_number: 1,
            chosen: None,
            last_failure: None,
            placement: true,
        });
        Step::ChoosePrefill(ask)
    }

    fn generate_aggregated(&mut self, worker: WorkerId, why: String, tried_prefill: bool) -> Step {
        self.phase = Phase::Generating {
            worker: worker.clone(),
            prefill: None,
        };
        Step::Generate {
            worker,
            mode: Mode::Aggregated { why, tried_prefill },
        }
    }

    /// The prefill pool's answer to [`Step::ChoosePrefill`].
    pub fn prefill_picked(&mut self, pick: PrefillPick) -> Step {
        let Phase::Prefill(state) = &mut self.phase else {
            return self.out_of_order("a prefill pick");
        };
        match pick {
            PrefillPick::Chosen(worker) => {
                state.chosen = Some(worker.clone());
                let why = if state.placement {
                    format!(
                        "placement: {worker} holds the prompt's prefix and prefills it from its cache; {} pulls the KV instead of recomputing it",
                        state.decode.worker
                    )
                } else {
                    format!(
                        "{} uncached prompt tokens on the decode worker",
                        state.decode.uncached_prompt_tokens
                    )
                };
                Step::Prefill {
                    worker,
                    try_number: state.try_number,
                    why,
                }
            }
            PrefillPick::Saturated(why) => {
                let worker = state.decode.worker.clone();
                self.generate_aggregated(worker, why, true)
            }
            PrefillPick::Unavailable(err) if state.placement => {
                let worker = state.decode.worker.clone();
                let why = format!(
                    "placement: the prefix's holder cannot be booked ({err}); recomputing it here"
                );
                self.generate_aggregated(worker, why, true)
            }
            PrefillPick::Unavailable(err) => {
                let state = state.clone();
                if self.plan.settings.disaggregation == Disaggregation::Enforce {
                    let err = match &state.last_failure {
                        None => no_prefill_worker(&self.plan.model, state.decode.engine),
                        Some(last) => ServeError::Unavailable(format!(
                            "disaggregation is enforced and every prefill worker failed; last: {last}"
                        )),
                    };
                    return self.over(Step::Fail(err));
                }
                let why = match &state.last_failure {
                    None => format!("no prefill worker: {err}"),
                    Some(last) => format!("prefill failed everywhere, last: {last}"),
                };
                self.fall_back(&state.decode, why)
            }
        }
    }

    /// Where `auto` would fall back to aggregated, a decode worker that cannot serve that way
    /// sends the request elsewhere instead.
    fn fall_back(&mut self, decode: &Routed, why: String) -> Step {
        if decode.needs_prefill {
            let why = format!("{}, and {why}", serves_only_with_prefill(&decode.worker));
            self.rerouted = Some(why.clone());
            self.next_attempt(Some(After::Reroute(why)))
        } else {
            self.generate_aggregated(decode.worker.clone(), why, true)
        }
    }

    /// The prefill of [`Step::Prefill`] ran: it gave a KV source, or failed.
    pub fn prefilled(&mut self, result: Result<(), PrefillFailure>) -> Step {
        let Phase::Prefill(state) = &mut self.phase else {
            return self.out_of_order("a prefill result");
        };
        let Some(prefill) = state.chosen.take() else {
            return self.out_of_order("a prefill result before a prefill worker was chosen");
        };
        if state.placement
            && let Err(failure) = &result
        {
            let why = match failure {
                PrefillFailure::Refused(message) => format!("refused the prompt: {message}"),
                PrefillFailure::Failed(failure) => {
                    self.excluded_prefill.push(prefill.clone());
                    failure.clone()
                }
            };
            let why = format!(
                "placement: the prefix's holder {prefill} could not hand its KV over ({why}); recomputing it here"
            );
            let worker = state.decode.worker.clone();
            return self.generate_aggregated(worker, why, true);
        }
        match result {
            Ok(()) => {
                let worker = state.decode.worker.clone();
                self.phase = Phase::Generating {
                    worker: worker.clone(),
                    prefill: Some(prefill.clone()),
                };
                Step::Generate {
                    worker,
                    mode: Mode::Disaggregated { prefill },
                }
            }
            Err(PrefillFailure::Refused(message)) => {
                // The prompt does not fit this prefill worker (e.g. a shorter context); the
                // decode worker already accepted it, so serve it there.
                let decode = state.decode.clone();
                self.fall_back(
                    &decode,
                    format!("prefill worker {prefill} refused the prompt: {message}"),
                )
            }
            Err(PrefillFailure::Failed(failure)) => {
                self.excluded_prefill.push(prefill);
                state.last_failure = Some(failure);
                let tries = self.plan.max_retries + 1;
                if state.try_number < tries {
                    state.try_number += 1;
                    return Step::ChoosePrefill(PrefillAsk {
                        engine: state.decode.engine,
                        needs_prefill: state.decode.needs_prefill,
                        exclude: self.excluded_prefill.clone(),
                        try_number: state.try_number,
                        peer: None,
                    });
                }
                let state = state.clone();
                let last = state.last_failure.unwrap_or_default();
                if self.plan.settings.disaggregation == Disaggregation::Enforce {
                    return self.over(Step::Fail(ServeError::Upstream(format!(
                        "disaggregation is enforced and {tries} prefill attempts failed; last: {last}"
                    ))));
                }
                if state.decode.needs_prefill {
                    return self.fall_back(
                        &state.decode,
                        format!("{tries} prefill attempts failed; last: {last}"),
                    );
                }
                self.generate_aggregated(
                    state.decode.worker,
                    format!("prefill failed, falling back to aggregated; last: {last}"),
                    true,
                )
            }
        }
    }

    /// The attempt's generation ended with `end`: what happens next.
    pub fn ended(&mut self, end: AttemptEnd) -> Step {
        let Phase::Generating { worker, prefill } = std::mem::replace(&mut self.phase, Phase::Over)
        else {
            return self.out_of_order("the end of an attempt that was not generating");
        };
        let (reason, blame) = match end {
            AttemptEnd::Done | AttemptEnd::ConsumerGone => return Step::Stop,
            AttemptEnd::Refused(err) => return Step::Fail(err),
            AttemptEnd::WorkerFailed { reason, blame } => (reason, blame),
        };
        match (blame, prefill) {
            (Blame::KvSource, Some(prefill)) => self.excluded_prefill.push(prefill),
            _ => self.excluded.push(worker),
        }
        if self.generated.is_empty() {
            self.retries += 1;
            if self.retries > self.plan.max_retries {
                return Step::Fail(ServeError::Upstream(format!(
                    "{} workers failed before the first token; last: {reason}",
                    self.retries
                )));
            }
            return self.next_attempt(Some(After::Retry(reason)));
        }
        self.migrations += 1;
        if self.migrations > self.plan.max_migrations {
            return Step::Fail(ServeError::Upstream(format!(
                "the stream failed {} times; last: {reason}",
                self.migrations
            )));
        }
        if self.remaining() == 0 {
            return Step::Finish(Finish::Length);
        }
        self.next_attempt(Some(After::Migrate(reason)))
    }

    /// A driver fed an outcome the machine did not ask for: the request fails rather than
    /// guess (a driver's bug, reported as the router's).
    fn out_of_order(&mut self, what: &str) -> Step {
        self.over(Step::Fail(ServeError::Internal(format!(
            "the serving sequence received {what} out of order"
        ))))
    }

    /// The error when routing found no worker for the attempt.
    fn no_candidates(&self, needs_prefill_registered: bool) -> ServeError {
        let model = &self.plan.model;
        let aggregated_only = self.plan.logprobs
            || aggregated_only(
                &self.plan.settings,
                !self.generated.is_empty(),
                self.rerouted.is_some(),
            );
        let message = if let Some(why) = &self.rerouted {
            format!(
                "{why}, and no worker that serves without a prefill worker (role both, or a vllm \
                 or sim decode worker) is available for model `{model}`"
            )
        } else if aggregated_only && self.excluded.is_empty() && needs_prefill_registered {
            format!(
                "no worker that serves without a prefill worker is available for model `{model}` \
                 ({}; its sglang decode workers serve only with one)",
                if !self.generated.is_empty() {
                    "a migration continues on one worker"
                } else if self.plan.logprobs {
                    "log probabilities are computed where the tokens are generated"
                } else {
                    "disaggregation is off"
                }
            )
        } else if self.excluded.is_empty() {
            format!("no worker is available for model `{model}`")
        } else {
            format!(
                "no other worker is available for model `{model}` after {} failed",
                self.excluded.len()
            )
        };
        ServeError::Unavailable(message)
    }
}

/// The 503 of `enforce` without a prefill worker for the decode worker's engine.
pub fn no_prefill_worker(model: &str, engine: EngineKind) -> ServeError {
    ServeError::Unavailable(format!(
        "disaggregation is enforced but no prefill worker is available for model `{model}` \
         (engine {engine}, the decode worker's)"
    ))
}

/// Why a worker that [`super::needs_prefill`] is treated apart, for explanations and errors.
pub fn serves_only_with_prefill(worker: &WorkerId) -> String {
    format!(
        "decode worker {worker} (sglang, role decode) serves only requests whose KV comes from a prefill worker"
    )
}
