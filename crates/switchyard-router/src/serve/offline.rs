//! The serving decision in one call, for callers with no I/O between its steps (the replay
//! lab's cluster, the planner's bench): exactly the steps the gateway takes across its awaits
//! — decode worker, mode, prefill worker, bookings, and the reroute of a decode worker that
//! needs a prefill worker and can get none — with every prefill succeeding.

use switchyard_core::{EngineKind, WorkerId};

use super::{
    Booking, DecodeFilter, ModeChoice, PrefillChoice, ServeSettings, ServingCore, WorkerFacts,
    aggregated_only, may_decode, may_prefill_for, needs_prefill, serving_mode,
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

impl ServingCore {
    /// Serves `request` over `workers` (the model's), as a gateway's first attempt does.
    pub fn serve(
        &mut self,
        settings: &ServeSettings,
        request: &RouteRequest,
        max_tokens: u32,
        workers: &[WorkerFacts<'_>],
    ) -> Result<ServeOutcome, RouteError> {
        let mut rerouted_from = None;
        loop {
            let rerouted = rerouted_from.is_some();
            let done = |served| {
                Ok(ServeOutcome {
                    served,
                    rerouted_from: rerouted_from.clone(),
                })
            };
            let filter = DecodeFilter {
                exclude: &[],
                aggregated_only: aggregated_only(settings, false, rerouted),
                adapter: request.adapter.as_deref(),
            };
            let candidates = ids(workers, |w| may_decode(w, filter));
            let (decision, mut booking) = match self.route_decode(request, &candidates, max_tokens)
            {
                Ok(routed) => routed,
                Err(err) => match rerouted_from.take() {
                    // The reroute found no worker that serves aggregated: the first decision
                    // stands, refused, as the gateway logs it and answers 503.
                    Some(decision) => {
                        return Ok(ServeOutcome {
                            served: Served::Refused {
                                decision,
                                why: format!(
                                    "the decode worker needs a prefill worker, none is free, \
                                     and no worker serves aggregated: {err}"
                                ),
                            },
                            rerouted_from: None,
                        });
                    }
                    None => return Err(err),
                },
            };
            let Some(facts) = workers.iter().find(|w| *w.id == decision.worker) else {
                self.finished(&booking);
                return Err(RouteError::NoCandidates);
            };
            let needs = needs_prefill(facts.role, facts.engine);
            let forced = match serving_mode(settings, booking.uncached_prompt_tokens, needs) {
                ModeChoice::Aggregated(_) => {
                    return done(Served::Aggregated {
                        decision,
                        booking,
                        wanted_prefill: false,
                    });
                }
                ModeChoice::TryPrefill { forced } => forced,
            };
            let prefill_candidates = prefill_ids(workers, facts.engine, request.adapter.as_deref());
            match self.choose_prefill(settings, request, &prefill_candidates, needs) {
                PrefillChoice::Chosen(prefill_decision) => {
                    let prefill = self.book_prefill(&prefill_decision, request, &mut booking);
                    return done(Served::Disaggregated {
                        decision,
                        decode: booking,
                        prefill_decision,
                        prefill,
                    });
                }
                PrefillChoice::Unavailable(err)
                    if settings.disaggregation == super::Disaggregation::Enforce =>
                {
                    self.finished(&booking);
                    return done(Served::Refused {
                        decision,
                        why: format!("disaggregation is enforced and no prefill worker: {err}"),
                    });
                }
                PrefillChoice::Unavailable(_) if forced && !rerouted => {
                    // The decode worker serves only with a prefill worker: route again among
                    // the workers that serve aggregated, as the gateway reroutes.
                    self.finished(&booking);
                    rerouted_from = Some(decision);
                }
                PrefillChoice::Saturated { .. } | PrefillChoice::Unavailable(_) => {
                    return done(Served::Aggregated {
                        decision,
                        booking,
                        wanted_prefill: true,
                    });
                }
            }
        }
    }
}

fn ids(workers: &[WorkerFacts<'_>], eligible: impl Fn(WorkerFacts<'_>) -> bool) -> Vec<Candidate> {
    workers
        .iter()
        .filter(|w| eligible(**w))
        .map(|w| Candidate::from(w.id.clone()))
        .collect()
}

fn prefill_ids(
    workers: &[WorkerFacts<'_>],
    engine: EngineKind,
    adapter: Option<&str>,
) -> Vec<Candidate> {
    let none: [WorkerId; 0] = [];
    ids(workers, |w| may_prefill_for(w, engine, &none, adapter))
}
