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
use switchyard_proto::ErrorCode;
use switchyard_proto::v1::{self, PrefillRequest};
use switchyard_router::serve::{ModeChoice, PrefillChoice, ServeSettings, serving_mode};
use switchyard_router::{Decision, RouteError, RouteRequest};
use switchyard_telemetry::{GATEWAY_SPANS, record_error};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::error::ApiError;
use crate::pool::{ModelRoutes, WorkerPool};
use crate::recorder::ServedAs;
use crate::routing::{self, PrefillRoute, RoutedRequest};

pub use switchyard_router::serve::Disaggregation;

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

/// The disaggregation settings a request runs under (from the gateway configuration): the
/// serving core's decision settings, and how the gateway carries a prefill out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggSettings {
    pub serve: ServeSettings,
    pub prefill_timeout: Duration,
    pub kv_transfer: KvTransfer,
}

/// Default [`DisaggSettings::prefill_timeout`].
pub const DEFAULT_PREFILL_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for DisaggSettings {
    fn default() -> Self {
        Self {
            serve: ServeSettings::default(),
            prefill_timeout: DEFAULT_PREFILL_TIMEOUT,
            kv_transfer: KvTransfer::default(),
        }
    }
}

impl DisaggSettings {
    pub fn mode(&self) -> Disaggregation {
        self.serve.disaggregation
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

fn no_prefill_worker(model: &str, engine: EngineKind) -> ApiError {
    ApiError::Unavailable(format!(
        "disaggregation is enforced but no prefill worker is available for model `{model}` \
         (engine {engine}, the decode worker's)"
    ))
}

/// What the admin explain shows for `request` when `decode_worker` would compute `uncached` of
/// its tokens. Changes nothing.
pub fn explain(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    settings: &DisaggSettings,
    decode_worker: &WorkerId,
    request: &RouteRequest,
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
    let forced = match serving_mode(&settings.serve, uncached, needs) {
        ModeChoice::Aggregated(why) => return aggregated(why),
        ModeChoice::TryPrefill { forced } => forced,
    };
    match routing::explain_prefill(pool, routes, &settings.serve, request, engine, needs) {
        PrefillChoice::Unavailable(RouteError::NoCandidates)
            if settings.mode() == Disaggregation::Enforce =>
        {
            aggregated(no_prefill_worker(&routes.model, engine).to_string())
        }
        PrefillChoice::Unavailable(err) if forced => ModeExplanation {
            mode: "rerouted",
            why: format!(
                "{}, and no prefill worker: {err}; the request goes to a worker that serves without one, or fails with 503",
                serves_only_with_prefill(decode_worker)
            ),
            prefill: None,
        },
        PrefillChoice::Unavailable(err) => aggregated(format!("no prefill worker: {err}")),
        PrefillChoice::Saturated { decision, why } => ModeExplanation {
            mode: "aggregated",
            why,
            prefill: Some(decision),
        },
        PrefillChoice::Chosen(decision) => ModeExplanation {
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

/// The prefill stage of one attempt, for `decode` (the attempt's routed decode worker): from
/// what that worker would compute, the serving core says whether to use the prefill pool; if
/// so a prefill worker is chosen KV-aware among those of the decode worker's engine kind and
/// booked (the decode worker's booking then counts no prefill), Prefill runs there with a
/// timeout, and on failure another is tried (`excluded` collects the failed ones across the
/// request's attempts) while the decode worker's booking is aggregated again. `route_span` is
/// the attempt's routing span: it ends with the mode decision, before any Prefill call; each
/// call has its own `prefill` span. A decode worker that [`routing::needs_prefill`] never falls
/// back to aggregated under `auto`: the stage answers [`Prefilled::Reroute`].
#[allow(clippy::too_many_arguments)]
pub async fn prefill_stage(
    pool: &WorkerPool,
    routes: &Arc<ModelRoutes>,
    settings: &DisaggSettings,
    request: &RouteRequest,
    ask: PrefillAsk<'_>,
    decode: &mut RoutedRequest,
    tags: &Arc<crate::audit::RequestTags>,
    attempts: u32,
    excluded: &mut Vec<WorkerId>,
    route_span: Span,
) -> Prefilled {
    let request_span = Span::current();
    let mut route_span = Some(route_span);
    let (engine, needs_prefill) = {
        let info = decode.worker.info.read().unwrap_or_else(|p| p.into_inner());
        (info.engine, routing::needs_prefill(&info))
    };
    let uncached = decode.uncached_prompt_tokens();
    if let ModeChoice::Aggregated(why) = serving_mode(&settings.serve, uncached, needs_prefill) {
        decode.record_served(ServedAs::Aggregated, None);
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
        let routed = {
            let mut route = || {
                routing::route_prefill(
                    pool,
                    routes,
                    &settings.serve,
                    request,
                    engine,
                    needs_prefill,
                    excluded,
                    decode,
                    tags,
                    attempt,
                )
            };
            match &route_span {
                Some(span) => span.in_scope(route),
                None => route(),
            }
        };
        let prefill = match routed {
            PrefillRoute::Routed(prefill) => prefill,
            PrefillRoute::Saturated(why) => {
                decided(&mut route_span, "aggregated", &why, None);
                return Prefilled::Aggregated(why);
            }
            PrefillRoute::Unavailable(err) => {
                if settings.mode() == Disaggregation::Enforce {
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
        let worker = prefill.worker_id.clone();
        decided(
            &mut route_span,
            "disaggregated",
            &format!("{uncached} uncached prompt tokens on the decode worker"),
            Some(worker.as_str()),
        );
        let failure = match run_prefill(
            pool,
            settings,
            &request_span,
            prefill,
            ask,
            &request.block_hashes,
            attempt,
        )
        .await
        {
            Ok(done) => return done,
            Err((prefill, failure)) => {
                prefill.prefill_failed(decode);
                failure
            }
        };
        match failure {
            PrefillFailure::Refused(message) => {
                // The prompt does not fit this prefill worker (e.g. a shorter context); the
                // decode worker already accepted it, so serve it there.
                return fall_back(
                    &mut route_span,
                    format!("prefill worker {worker} refused the prompt: {message}"),
                );
            }
            PrefillFailure::Failed(failure) => {
                tracing::warn!(request = %ask.request_id, %failure, "prefill failed; trying another prefill worker");
                pool.metrics.retries.inc();
                excluded.push(worker);
                last_failure = Some(failure);
            }
        }
    }
    let last = last_failure.unwrap_or_default();
    if settings.mode() == Disaggregation::Enforce {
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

/// Why one Prefill call did not give a KV source.
enum PrefillFailure {
    /// The worker refused the prompt (InvalidArgument): no other prefill worker is tried.
    Refused(String),
    /// It failed or did not answer in time; another may succeed.
    Failed(String),
}

/// Runs Prefill on the routed prefill worker through the pool's transport. On success, the
/// [`Prefilled::Source`] to generate with; on failure the route back (so the caller can undo its
/// booking) and what went wrong.
/// What a prefill worker is asked to compute: the request's prompt under its KV identity.
#[derive(Debug, Clone, Copy)]
pub struct PrefillAsk<'a> {
    pub request_id: &'a str,
    pub prompt: &'a [TokenId],
    pub identity: &'a switchyard_core::KvIdentity,
    /// The retention hint the prefill worker keeps the prompt's blocks by.
    pub retention: switchyard_core::Retention,
}

#[allow(clippy::too_many_arguments)]
async fn run_prefill(
    pool: &WorkerPool,
    settings: &DisaggSettings,
    request_span: &Span,
    mut prefill: RoutedRequest,
    ask: PrefillAsk<'_>,
    prompt_blocks: &[switchyard_core::BlockHash],
    attempt: u32,
) -> Result<Prefilled, (RoutedRequest, PrefillFailure)> {
    let PrefillAsk {
        request_id,
        prompt,
        identity,
        retention,
    } = ask;
    let worker = prefill.worker_id.clone();
    let prefill_span = tracing::info_span!(
        target: GATEWAY_SPANS,
        parent: request_span,
        "prefill",
        otel.kind = "client",
        prefill_attempt = i64::from(attempt),
        worker = worker.as_str(),
        prompt_tokens = prompt.len() as i64,
        overlap_blocks = i64::from(prefill.cached_blocks),
        cached_prompt_tokens = Empty,
    );
    let address = prefill.worker.info().address;
    let mut call = tonic::Request::new(PrefillRequest {
        request_id: request_id.to_owned(),
        prompt_token_ids: prompt.to_vec(),
        hold_ms: 0,
        // A worker that cannot pipeline answers when done (response.pipelined = false).
        pipelined: settings.kv_transfer == KvTransfer::Pipelined,
        identity: switchyard_proto::identity_to_proto(identity),
        retention: switchyard_proto::retention_to_proto(&retention),
    });
    switchyard_telemetry::inject_context(&prefill_span, call.metadata_mut());
    let answer = tokio::time::timeout(
        settings.prefill_timeout,
        pool.transport.prefill(&prefill.worker, call),
    )
    .instrument(prefill_span.clone())
    .await;
    let failure = match answer {
        Ok(Ok(response)) => {
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
                worker_id: prefill.worker_id.to_string(),
            };
            // A pipelined answer's counts are not final: only a finished prefill's hit is compared.
            if !response.pipelined {
                crate::audit::realized::realize(
                    pool,
                    crate::audit::realized::Realized {
                        entry: &prefill.audit,
                        worker: &prefill.worker,
                        routes: &prefill.routes,
                        prompt_blocks,
                        cached_prompt_tokens: u64::from(response.cached_prompt_tokens),
                        comparable: true,
                    },
                );
            }
            let running = if response.pipelined {
                Some(Box::new(prefill))
            } else {
                prefill.prefill_done();
                None
            };
            return Ok(Prefilled::Source {
                source,
                worker,
                running,
            });
        }
        Ok(Err(status)) if ErrorCode::of(&status) == ErrorCode::InvalidRequest => {
            record_error(&prefill_span, status.message());
            PrefillFailure::Refused(status.message().to_owned())
        }
        Ok(Err(status)) => {
            let failure = format!("{worker}: {:?}: {}", status.code(), status.message());
            record_error(&prefill_span, failure.as_str());
            PrefillFailure::Failed(failure)
        }
        Err(_) => {
            let failure = format!("{worker}: no answer within {:?}", settings.prefill_timeout);
            record_error(&prefill_span, failure.as_str());
            PrefillFailure::Failed(failure)
        }
    };
    let detail = match &failure {
        PrefillFailure::Refused(message) => format!("refused the prompt: {message}"),
        PrefillFailure::Failed(message) => message.clone(),
    };
    pool.decisions.end(
        &prefill.audit,
        crate::audit::OutcomeStatus::Failed,
        Some(detail),
    );
    Err((prefill, failure))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_settings_default_to_the_cores() {
        assert_eq!("AUTO".parse::<Disaggregation>(), Ok(Disaggregation::Auto));
        assert!("sometimes".parse::<Disaggregation>().is_err());
        assert_eq!(
            "after-prefill".parse::<KvTransfer>(),
            Ok(KvTransfer::AfterPrefill)
        );
        assert!("eventually".parse::<KvTransfer>().is_err());
        let defaults = DisaggSettings::default();
        assert_eq!(defaults.kv_transfer, KvTransfer::Pipelined);
        assert_eq!(defaults.serve, ServeSettings::default());
        assert_eq!(defaults.prefill_timeout, DEFAULT_PREFILL_TIMEOUT);
    }
}
