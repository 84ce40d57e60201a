//! The serving sequence driven with simulated outcomes, for callers with no I/O between its
//! steps (the replay lab's cluster, the planner's bench): the [`Serving`] machine's steps
//! carried out on the core at once — decode worker, mode, prefill worker, bookings, and the
//! reroute of a decode worker that needs a prefill worker and can get none — with every
//! prefill succeeding. The request is served once the machine says where it generates.

use std::ops::ControlFlow;

use super::machine::{
    After, Mode, Plan, PrefillAsk, PrefillPick, RouteAsk, RouteFailure, Routed, Serving, Step,
};
use super::{
    Booking, DecodeFilter, PrefillChoice, ServeSettings, ServingCore, WorkerFacts, may_decode,
    may_prefill_for, needs_prefill,
};
use crate::error::RouteError;
use crate::policy::{Candidate, Decision, RouteRequest};

/// How one request is served, and the decode decision a reroute replaced (a decode worker
/// that needs a prefill worker and could get none).
#[derive(Debug, Clone, PartialEq)]
pub struct ServeOutcome {
    pub served: Served,
    pub rerouted_from: Option<Decision>,
}

/// How one request is served.
// One value per request, returned and matched at once, never stored in bulk: boxing the larger
// variant would only add an allocation per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Served {
    /// On the decode worker alone. `wanted_prefill`: the mode tried the prefill pool, which
    /// was saturated or empty.
    Aggregated {
        decision: Decision,
        booking: Booking,
        wanted_prefill: bool,
    },
    /// Prefilled on `prefill`'s worker, decoded on `decode`'s.
    Disaggregated {
        decision: Decision,
        decode: Booking,
        prefill_decision: Decision,
        prefill: Booking,
    },
    /// `enforce` and no prefill worker for the decision's decode worker, or a decode worker
    /// that serves only with a prefill worker, none free, and no other worker to reroute to:
    /// the gateway answers 503. Nothing stays booked.
    Refused { decision: Decision, why: String },
}

/// What one offline request holds between the machine's steps.
struct Offline<'a> {
    core: &'a mut ServingCore,
    settings: &'a ServeSettings,
    request: &'a RouteRequest,
    workers: &'a [WorkerFacts<'a>],
    serving: Serving,
    decode: Option<(Decision, Booking)>,
    prefill: Option<(Decision, Booking)>,
    rerouted_from: Option<Decision>,
}

/// The request is served (or refused, or could not be routed): the sequence stops here.
type Stopped = Result<ServeOutcome, RouteError>;

impl ServingCore {
    /// Serves `request` over `workers` (the model's), as a gateway's first attempt does: the
    /// [`Serving`] machine's steps with every prefill succeeding.
    pub fn serve(
        &mut self,
        settings: &ServeSettings,
        request: &RouteRequest,
        max_tokens: u32,
        workers: &[WorkerFacts<'_>],
    ) -> Result<ServeOutcome, RouteError> {
        let mut offline = Offline {
            core: self,
            settings,
            request,
            workers,
            serving: Serving::new(Plan {
                model: "the replayed model".into(),
                settings: *settings,
                max_tokens,
                max_retries: 0,
                max_migrations: 0,
                logprobs: false,
            }),
            decode: None,
            prefill: None,
            rerouted_from: None,
        };
        let mut step = offline.serving.start();
        loop {
            let next = match step {
                Step::Route(ask) => offline.route(&ask),
                Step::ChoosePrefill(ask) => offline.choose_prefill(&ask),
                // Offline, every prefill succeeds.
                Step::Prefill { .. } => ControlFlow::Continue(offline.serving.prefilled(Ok(()))),
                Step::Generate { mode, .. } => ControlFlow::Break(offline.generate(mode)),
                // `enforce` and no prefill worker: the decision is refused.
                step @ (Step::Fail(_) | Step::Finish(_) | Step::Stop) => {
                    ControlFlow::Break(offline.refuse(step))
                }
            };
            step = match next {
                ControlFlow::Continue(step) => step,
                ControlFlow::Break(served) => return served,
            };
        }
    }
}

impl Offline<'_> {
    /// [`Step::Route`]: the decode decision among the workers the ask admits, booked.
    fn route(&mut self, ask: &RouteAsk) -> ControlFlow<Stopped, Step> {
        if matches!(ask.after, Some(After::Reroute(_))) {
            // The decode worker gave up: its booking ends, its decision is the one the reroute
            // replaced.
            if let Some((decision, booking)) = self.decode.take() {
                self.core.finished(&booking);
                self.rerouted_from = Some(decision);
            }
        }
        let request = self.request;
        let filter = DecodeFilter {
            exclude: &ask.exclude,
            aggregated_only: ask.aggregated_only,
            adapter: request.adapter.as_deref(),
        };
        let candidates = ids(self.workers, |w| may_decode(w, filter));
        let routed = self
            .core
            .route_decode(request, &candidates, ask.max_tokens)
            .and_then(|(decision, booking)| {
                let Some(facts) = self.workers.iter().find(|w| *w.id == decision.worker) else {
                    self.core.finished(&booking);
                    return Err(RouteError::NoCandidates);
                };
                let routed = Routed {
                    worker: decision.worker.clone(),
                    uncached_prompt_tokens: booking.uncached_prompt_tokens,
                    engine: facts.engine,
                    needs_prefill: needs_prefill(facts.role, facts.engine),
                    // The replay lab's cluster carries a priced copy out itself (its
                    // `peer` module), as DMA into the chosen worker: no prefill on the holder.
                    peer: None,
                };
                self.decode = Some((decision, booking));
                Ok(routed)
            });
        match routed {
            Ok(routed) => ControlFlow::Continue(self.serving.routed(Ok(routed))),
            Err(error) => {
                // The reroute found no worker that serves aggregated: the first decision
                // stands, refused, as the gateway logs it and answers 503.
                let Some(decision) = self.rerouted_from.take() else {
                    return ControlFlow::Break(Err(error));
                };
                let why = failure_of(self.serving.routed(Err(RouteFailure {
                    error,
                    needs_prefill_registered: true,
                })));
                ControlFlow::Break(Ok(ServeOutcome {
                    served: Served::Refused { decision, why },
                    rerouted_from: None,
                }))
            }
        }
    }

    /// [`Step::ChoosePrefill`]: the prefill decision, booked with the decode worker's booking
    /// made disaggregated.
    fn choose_prefill(&mut self, ask: &PrefillAsk) -> ControlFlow<Stopped, Step> {
        let Some((_, booking)) = self.decode.as_mut() else {
            return ControlFlow::Break(Err(RouteError::NoCandidates));
        };
        let request = self.request;
        let candidates = ids(self.workers, |w| {
            may_prefill_for(w, ask.engine, &ask.exclude, request.adapter.as_deref())
        });
        let pick =
            match self
                .core
                .choose_prefill(self.settings, request, &candidates, ask.needs_prefill)
            {
                PrefillChoice::Chosen(decision) => {
                    let prefill = self.core.book_prefill(&decision, request, booking);
                    let worker = decision.worker.clone();
                    self.prefill = Some((decision, prefill));
                    PrefillPick::Chosen(worker)
                }
                PrefillChoice::Saturated { why, .. } => PrefillPick::Saturated(why),
                PrefillChoice::Unavailable(err) => PrefillPick::Unavailable(err),
            };
        ControlFlow::Continue(self.serving.prefill_picked(pick))
    }

    /// [`Step::Generate`]: the request is served as the mode says.
    fn generate(&mut self, mode: Mode) -> Stopped {
        let Some((decision, booking)) = self.decode.take() else {
            return Err(RouteError::NoCandidates);
        };
        let served = match (mode, self.prefill.take()) {
            (Mode::Disaggregated { .. }, Some((prefill_decision, prefill))) => {
                Served::Disaggregated {
                    decision,
                    decode: booking,
                    prefill_decision,
                    prefill,
                }
            }
            (Mode::Aggregated { tried_prefill, .. }, _) => Served::Aggregated {
                decision,
                booking,
                wanted_prefill: tried_prefill,
            },
            (Mode::Disaggregated { .. }, None) => {
                self.core.finished(&booking);
                return Err(RouteError::NoCandidates);
            }
        };
        Ok(ServeOutcome {
            served,
            rerouted_from: self.rerouted_from.take(),
        })
    }

    /// The sequence ended without generating: the decode decision is refused and nothing stays
    /// booked.
    fn refuse(&mut self, step: Step) -> Stopped {
        let Some((decision, booking)) = self.decode.take() else {
            return Err(RouteError::NoCandidates);
        };
        self.core.finished(&booking);
        Ok(ServeOutcome {
            served: Served::Refused {
                decision,
                why: failure_of(step),
            },
            rerouted_from: self.rerouted_from.take(),
        })
    }
}

/// The reason of a step that ends the request.
fn failure_of(step: Step) -> String {
    match step {
        Step::Fail(err) => err.message().to_owned(),
        other => format!("the serving sequence ended with {other:?}"),
    }
}

fn ids(workers: &[WorkerFacts<'_>], eligible: impl Fn(WorkerFacts<'_>) -> bool) -> Vec<Candidate> {
    workers
        .iter()
        .filter(|w| eligible(**w))
        .map(|w| Candidate::from(w.id.clone()))
        .collect()
}
