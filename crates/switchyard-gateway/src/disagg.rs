//! Disaggregated prefill/decode serving: the per-request choice between running a prompt's
//! prefill on the decode worker itself (aggregated) or on a prefill-pool worker whose KV the
//! decode worker then pulls.
//!
//! The decode worker is chosen first, as for any request; what it would have to compute (its
//! uncached prompt tokens) decides whether a separate prefill pays: a short uncached suffix is
//! cheaper to compute in place than to prefill elsewhere and transfer. A prefill that fails or
//! times out is retried on another prefill worker, then falls back to aggregated (`auto`) or
//! fails the request (`enforce`); the prefill worker's hold expires by itself, so an abandoned
//! handle pins nothing for long. By default the prefill is pipelined ([`KvTransfer`]): the
//! prefill worker answers at once and the decode worker pulls the KV chunk by chunk while the
//! prefill runs, so a prefill worker that dies mid-way surfaces as a failed pull on the decode
//! worker, marked as the KV source's fault (`switchyard_proto::fault`), which dispatch retries
//! with another prefill worker on the same decode worker.
//!
//! Some decode workers cannot serve aggregated at all ([`routing::needs_prefill`]: SGLang
//! servers in `--disaggregation-mode decode` only take bootstrapped requests). Under `auto`
//! such a worker's requests always go through the prefill pool, whatever the threshold or the
//! pool's queue; when no prefill worker can serve one, the stage says [`Prefilled::Reroute`] and
//! dispatch routes the request again among workers that serve aggregated (or answers 503),
//! rather than send a bare prompt to a server that would reject it.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use switchyard_core::{EngineKind, TokenId, WorkerId};
use switchyard_proto::v1::{self, PrefillRequest};
use switchyard_router::{Decision, RouteError};
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tonic::Code;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::error::ApiError;
use crate::pool::{ModelRoutes, WorkerPool};
use crate::routing::{self, RoutedRequest};

/// Whether the gateway uses the prefill pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Disaggregation {
    /// Every request prefills on its decode worker.
    #[default]
    Off,
    /// Per request: through the prefill pool when the uncached prompt is long enough and the
    /// pool has a worker that is not saturated; aggregated otherwise.
    Auto,
    /// Every request through the prefill pool; 503 when it has no worker.
    Enforce,
}

impl FromStr for Disaggregation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "enforce" => Ok(Self::Enforce),
            _ => Err(format!(
                "unknown disaggregation mode {s:?} (off, auto or enforce)"
            )),
        }
    }
}

/// When the decode worker pulls a disaggregated prompt's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvTransfer {
    /// While the prefill runs, chunk by chunk: the prefill worker answers at once and only the
    /// last chunk's transfer stays on the critical path.
    #[default]
    Pipelined,
    /// Once the prefill has finished: Prefill answers at the end, then the whole KV moves.
    AfterPrefill,
}

impl FromStr for KvTransfer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "pipelined" => Ok(Self::Pipelined),
            "after-prefill" => Ok(Self::AfterPrefill),
            _ => Err(format!(
                "unknown kv transfer mode {s:?} (pipelined or after-prefill)"
            )),
        }
    }
}

/// The disaggregation settings a request runs under (from the gateway configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggSettings {
    pub mode: Disaggregation,
    pub min_uncached_tokens: u64,
    pub max_prefill_queue_tokens: u64,
    pub prefill_timeout: Duration,
    pub kv_transfer: KvTransfer,
}

impl Default for DisaggSettings {
    fn default() -> Self {
        Self {
            mode: Disaggregation::Off,
            min_uncached_tokens: 2048,
            max_prefill_queue_tokens: 262_144,
            prefill_timeout: Duration::from_secs(60),
            kv_transfer: KvTransfer::Pipelined,
        }
    }
}

/// How a request is served and why, as the admin explain shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ModeExplanation {
    /// `aggregated`, `disaggregated`, or `rerouted` (the decode worker serves only with a
    /// prefill worker and none is available).
    pub mode: &'static str,
    pub why: String,
    /// The prefill worker decision, when the prefill pool was consulted.
    pub prefill: Option<Decision>,
}

/// The first, synchronous part of the choice: whether the prefill pool should be tried at all.
/// `Err` carries the reason to stay aggregated. A decode worker that `needs_prefill` always
/// tries it under `auto` (dispatch never routes to one when disaggregation is off).
fn wants_prefill(
    settings: &DisaggSettings,
    uncached: u64,
    needs_prefill: bool,
) -> Result<(), String> {
    match settings.mode {
        Disaggregation::Off => Err("disaggregation is off".into()),
        Disaggregation::Enforce => Ok(()),
        Disaggregation::Auto if needs_prefill => Ok(()),
        Disaggregation::Auto if uncached < settings.min_uncached_tokens => Err(format!(
            "{uncached} uncached prompt tokens on the decode worker, below the threshold of {}",
            settings.min_uncached_tokens
        )),
        Disaggregation::Auto => Ok(()),
    }
}

/// Saturation applies to `auto` only: `enforce` queues behind a busy prefill worker, and so
/// does a decode worker that cannot serve without one (`needs_prefill`).
fn saturated(
    settings: &DisaggSettings,
    decision: &Decision,
    needs_prefill: bool,
) -> Option<String> {
    let queued = decision.chosen().map_or(0, |c| c.queued_prefill_tokens);
    (settings.mode == Disaggregation::Auto
        && !needs_prefill
        && queued > settings.max_prefill_queue_tokens)
        .then(
        || {
            format!(
                "prefill pool saturated: the best prefill worker {} has {queued} prefill tokens queued (limit {})",
                decision.worker, settings.max_prefill_queue_tokens
            )
        },
    )
}

fn no_prefill_worker(model: &str, engine: EngineKind) -> ApiError {
    ApiError::Unavailable(format!(
        "disaggregation is enforced but no prefill worker is available for model `{model}` \
         (engine {engine}, the decode worker's)"
    ))
}

/// What the admin explain shows for `tokens` when the decode worker would compute `uncached`
/// of them. Changes nothing.
pub fn explain(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    settings: &DisaggSettings,
    decode_worker: &WorkerId,
    tokens: &[TokenId],
    uncached: u64,
) -> ModeExplanation {
    let aggregated = |why| ModeExplanation {
        mode: "aggregated",
        why,
        prefill: None,
    };
    let info = pool.worker(decode_worker).map(|w| w.info());
    let engine = info.as_ref().map_or(EngineKind::Sim, |i| i.engine);
    let needs = info.as_ref().is_some_and(routing::needs_prefill);
    if let Err(why) = wants_prefill(settings, uncached, needs) {
        return aggregated(why);
    }
    let forced = needs && settings.mode == Disaggregation::Auto;
    match routing::explain_prefill(pool, routes, engine, tokens) {
        Err(RouteError::NoCandidates) if settings.mode == Disaggregation::Enforce => {
            aggregated(no_prefill_worker(&routes.model, engine).to_string())
        }
        Err(err) if forced => ModeExplanation {
            mode: "rerouted",
            why: format!(
                "{}, and no prefill worker: {err}; the request goes to a worker that serves without one, or fails with 503",
                serves_only_with_prefill(decode_worker)
            ),
            prefill: None,
        },
        Err(err) => aggregated(format!("no prefill worker: {err}")),
        Ok(decision) => match saturated(settings, &decision, needs) {
            Some(why) => ModeExplanation {
                mode: "aggregated",
                why,
                prefill: Some(decision),
            },
            None => ModeExplanation {
                mode: "disaggregated",
                why: if forced {
                    format!(
                        "{}, so through the prefill pool whatever the threshold; prefill on {}",
                        serves_only_with_prefill(decode_worker),
                        decision.worker
                    )
                } else {
                    format!(
                        "{uncached} uncached prompt tokens on the decode worker; prefill on {}",
                        decision.worker
                    )
                },
                prefill: Some(decision),
            },
        },
    }
}

/// Why a worker that [`routing::needs_prefill`] is treated apart, for explanations and errors.
pub fn serves_only_with_prefill(worker: &WorkerId) -> String {
    format!(
        "decode worker {worker} (sglang, role decode) serves only requests whose KV comes from a prefill worker"
    )
}

/// The outcome of the prefill stage of one attempt.
#[derive(Debug)]
pub enum Prefilled {
    /// Prefill on the decode worker; the reason is logged.
    Aggregated(String),
    /// Generate with this source; the prefill ran on the named worker.
    Source {
        source: v1::KvSource,
        worker: WorkerId,
        /// A pipelined prefill still running on `worker`: its place in that worker's prefill
        /// queue stays booked until the decode worker's first token says it finished.
        running: Option<Box<RoutedRequest>>,
    },
    /// The request cannot be served (`enforce` without a working prefill worker).
    Fail(ApiError),
    /// The decode worker serves only with a prefill worker's KV ([`routing::needs_prefill`]) and
    /// no prefill worker could provide it (`auto`): route the request again among workers that
    /// serve aggregated. The reason says what the prefill pool lacked.
    Reroute(String),
}

/// Closes the attempt's `route` span with the serving mode it chose, the first time only: later
/// prefill retries (and a fall back after them) show on their own spans and on `decode`.
fn decided(route_span: &mut Option<Span>, mode: &str, why: &str, prefill_worker: Option<&str>) {
    if let Some(span) = route_span.take() {
        span.record("mode", mode);
        span.record("mode_reason", why);
        if let Some(worker) = prefill_worker {
            span.record("prefill_worker", worker);
        }
    }
}

/// The prefill stage of one attempt: chooses a prefill worker KV-aware among those of the
/// decode worker's engine kind, runs Prefill there with a timeout, and on failure tries another
/// (`excluded` collects the failed ones across the request's attempts). `route_span` is the
/// attempt's routing span: it ends with the mode decision, before any Prefill call; each call
/// has its own `prefill` span. `needs_prefill` says the decode worker cannot serve without a
/// prefill worker ([`routing::needs_prefill`]): under `auto` it then never falls back to
/// aggregated but answers [`Prefilled::Reroute`].
#[allow(clippy::too_many_arguments)]
pub async fn prefill_stage(
    pool: &WorkerPool,
    routes: &Arc<ModelRoutes>,
    settings: &DisaggSettings,
    engine: EngineKind,
    needs_prefill: bool,
    request_id: &str,
    prompt: &[TokenId],
    uncached: u64,
    attempts: u32,
    excluded: &mut Vec<WorkerId>,
    route_span: Span,
) -> Prefilled {
    let request_span = Span::current();
    let mut route_span = Some(route_span);
    if let Err(why) = wants_prefill(settings, uncached, needs_prefill) {
        decided(&mut route_span, "aggregated", &why, None);
        return Prefilled::Aggregated(why);
    }
    // Where `auto` would fall back to aggregated, a decode worker that cannot serve that way
    // sends the request elsewhere instead.
    let fall_back = |route_span: &mut Option<Span>, why: String| {
        if needs_prefill {
            decided(route_span, "rerouted", &why, None);
            Prefilled::Reroute(why)
        } else {
            decided(route_span, "aggregated", &why, None);
            Prefilled::Aggregated(why)
        }
    };
    let mut last_failure = None;
    for attempt in 1..=attempts.max(1) {
        let routed = match &route_span {
            Some(span) => span.in_scope(|| {
                routing::route_prefill(pool, routes, engine, prompt, excluded, request_id, attempt)
            }),
            None => {
                routing::route_prefill(pool, routes, engine, prompt, excluded, request_id, attempt)
            }
        };
        let mut routed = match routed {
            Ok(routed) => routed,
            Err(err) => {
                if settings.mode == Disaggregation::Enforce {
                    let err = match last_failure {
                        None => no_prefill_worker(&routes.model, engine),
                        Some(last) => ApiError::Unavailable(format!(
                            "disaggregation is enforced and every prefill worker failed; last: {last}"
                        )),
                    };
                    if let Some(span) = &route_span {
                        record_error(span, err.to_string());
                    }
                    return Prefilled::Fail(err);
                }
                let why = match last_failure {
                    None => format!("no prefill worker: {err}"),
                    Some(last) => format!("prefill failed everywhere, last: {last}"),
                };
                return fall_back(&mut route_span, why);
            }
        };
        if let Some(why) = saturated(settings, &routed.decision, needs_prefill) {
            decided(&mut route_span, "aggregated", &why, None);
            return Prefilled::Aggregated(why);
        }
        let worker = routed.worker_id.clone();
        decided(
            &mut route_span,
            "disaggregated",
            &format!("{uncached} uncached prompt tokens on the decode worker"),
            Some(worker.as_str()),
        );
        let prefill_span = tracing::info_span!(
            target: GATEWAY_SPANS,
            parent: &request_span,
            "prefill",
            otel.kind = "client",
            prefill_attempt = i64::from(attempt),
            worker = worker.as_str(),
            prompt_tokens = prompt.len() as i64,
            overlap_blocks = i64::from(routed.cached_blocks),
            cached_prompt_tokens = Empty,
        );
        let address = routed.worker.info().address;
        let mut client = routed.worker.client.clone();
        let mut request = tonic::Request::new(PrefillRequest {
            request_id: request_id.to_owned(),
            prompt_token_ids: prompt.to_vec(),
            hold_ms: 0,
            // A worker that cannot pipeline answers when done (response.pipelined = false).
            pipelined: settings.kv_transfer == KvTransfer::Pipelined,
        });
        switchyard_telemetry::inject_context(&prefill_span, request.metadata_mut());
        let call = client.prefill(request);
        let answer = tokio::time::timeout(settings.prefill_timeout, call)
            .instrument(prefill_span.clone())
            .await;
        let failure = match answer {
            Ok(Ok(response)) => {
                let response = response.into_inner();
                prefill_span.record(
                    "cached_prompt_tokens",
                    i64::from(response.cached_prompt_tokens),
                );
                let kv_transfer = if response.pipelined {
                    "pipelined"
                } else {
                    "after-prefill"
                };
                pool.metrics
                    .disagg_prefills
                    .get_or_create(&crate::metrics::KvTransferLabels { kv_transfer })
                    .inc();
                let source = v1::KvSource {
                    address,
                    handle: response.handle,
                    first_token_id: response.first_token_id,
                    cached_prompt_tokens: response.cached_prompt_tokens,
                    engine_transfer_params: response.engine_transfer_params,
                    pipelined: response.pipelined,
                };
                let running = if response.pipelined {
                    Some(Box::new(routed))
                } else {
                    routed.prefill_done();
                    None
                };
                return Prefilled::Source {
                    source,
                    worker,
                    running,
                };
            }
            Ok(Err(status)) if status.code() == Code::InvalidArgument => {
                // The prompt does not fit this prefill worker (e.g. a shorter context); the
                // decode worker already accepted it, so serve it there.
                record_error(&prefill_span, status.message());
                return fall_back(
                    &mut route_span,
                    format!(
                        "prefill worker {worker} refused the prompt: {}",
                        status.message()
                    ),
                );
            }
            Ok(Err(status)) => format!("{worker}: {:?}: {}", status.code(), status.message()),
            Err(_) => format!("{worker}: no answer within {:?}", settings.prefill_timeout),
        };
        record_error(&prefill_span, failure.as_str());
        drop(prefill_span);
        tracing::warn!(request = %request_id, %failure, "prefill failed; trying another prefill worker");
        pool.metrics.retries.inc();
        excluded.push(worker);
        last_failure = Some(failure);
    }
    let last = last_failure.unwrap_or_default();
    if settings.mode == Disaggregation::Enforce {
        return Prefilled::Fail(ApiError::Upstream(format!(
            "disaggregation is enforced and {} prefill attempts failed; last: {last}",
            attempts.max(1)
        )));
    }
    if needs_prefill {
        return Prefilled::Reroute(format!(
            "{} prefill attempts failed; last: {last}",
            attempts.max(1)
        ));
    }
    Prefilled::Aggregated(format!(
        "prefill failed, falling back to aggregated; last: {last}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_thresholds_decide() {
        assert_eq!("AUTO".parse::<Disaggregation>(), Ok(Disaggregation::Auto));
        assert!("sometimes".parse::<Disaggregation>().is_err());
        let auto = DisaggSettings {
            mode: Disaggregation::Auto,
            min_uncached_tokens: 1000,
            ..DisaggSettings::default()
        };
        assert!(wants_prefill(&auto, 999, false).is_err());
        assert!(wants_prefill(&auto, 1000, false).is_ok());
        // A decode worker that cannot serve aggregated goes through the pool below it too.
        assert!(wants_prefill(&auto, 0, true).is_ok());
        let enforce = DisaggSettings {
            mode: Disaggregation::Enforce,
            ..auto
        };
        assert!(wants_prefill(&enforce, 0, false).is_ok());
        assert!(wants_prefill(&DisaggSettings::default(), u64::MAX, false).is_err());
        assert_eq!(
            "after-prefill".parse::<KvTransfer>(),
            Ok(KvTransfer::AfterPrefill)
        );
        assert!("eventually".parse::<KvTransfer>().is_err());
        assert_eq!(DisaggSettings::default().kv_transfer, KvTransfer::Pipelined);
    }
}
