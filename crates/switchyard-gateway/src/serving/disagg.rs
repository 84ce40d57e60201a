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
//! pool's queue; when no prefill worker can serve one, the request is routed again among
//! workers that serve aggregated (or answered 503), rather than a bare prompt sent to a server
//! that would reject it.
//!
//! The sequence itself (mode, prefill tries, fall back, reroute) is the router's serving
//! machine ([`switchyard_router::serve::Serving`]), which dispatch drives; this module holds the
//! settings a deployment chooses and the admin explain of the mode.

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use switchyard_core::{EngineKind, WorkerId};
use switchyard_router::serve::{
    ModeChoice, PrefillChoice, ServeSettings, no_prefill_worker, serving_mode,
};
use switchyard_router::{Decision, RouteError, RouteRequest};

use crate::cluster::pool::{ModelRoutes, WorkerPool};
use crate::serving::routing;

pub use switchyard_router::serve::{Disaggregation, serves_only_with_prefill};

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
    /// `aggregated`, `disaggregated`, `placement` (the prefix pulled from the peer holding
    /// it), or `rerouted` (the decode worker serves only with a prefill worker and none is
    /// available).
    pub mode: &'static str,
    pub why: String,
    /// The prefill worker decision, when the prefill pool was consulted.
    pub prefill: Option<Decision>,
}

/// What the admin explain shows when the decision prices copying the prompt's prefix to
/// `decode_worker` from `peer` (sub-agent placement): the peer prefills, the decode worker pulls.
pub fn explain_placement(decode_worker: &WorkerId, peer: &WorkerId) -> ModeExplanation {
    ModeExplanation {
        mode: "placement",
        why: format!(
            "placement: {peer} holds the prompt's prefix and prefills it from its cache; {decode_worker} pulls the KV instead of recomputing it"
        ),
        prefill: None,
    }
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
