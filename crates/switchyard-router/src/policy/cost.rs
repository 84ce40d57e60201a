//! The cost model every load-aware policy scores with: the `kv` policy's settings and the
//! per-worker breakdown (`prefill_weight × (uncached + queued prefill) + decode_weight ×
//! active blocks × block size`) that the explanation shows. Its own file so that the `kv`
//! policy and the explanation both build on it without using each other.

use serde::{Deserialize, Serialize};
use switchyard_core::WorkerId;

use super::explain::WorkerScore;
use super::{Candidate, RouteRequest};
use crate::error::RouteError;
use crate::index::TierOverlap;
use crate::load::LoadView;

/// Settings of the `kv` policy (also the load terms of the other policies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    pub prefill_weight: f64,
    pub decode_weight: f64,
    /// Fraction of a device hit's saving a host-tier hit is worth, in `[0, 1]`.
    pub host_hit_factor: f64,
    /// Fraction of a device hit's saving a disk-tier hit is worth, in `[0, 1]`.
    pub disk_hit_factor: f64,
    /// 0 picks the lowest cost; above 0 samples (softmax over normalised costs).
    pub temperature: f64,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            prefill_weight: 1.0,
            decode_weight: 0.1,
            host_hit_factor: 0.75,
            disk_hit_factor: 0.25,
            temperature: 0.0,
        }
    }
}

impl KvConfig {
    pub fn validate(&self) -> Result<(), RouteError> {
        let finite_non_neg = |v: f64| v.is_finite() && v >= 0.0;
        if !finite_non_neg(self.prefill_weight) || !finite_non_neg(self.decode_weight) {
            return Err(RouteError::InvalidConfig(
                "kv weights must be finite and non-negative".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.host_hit_factor)
            || !(0.0..=1.0).contains(&self.disk_hit_factor)
        {
            return Err(RouteError::InvalidConfig(
                "host and disk hit factors must be between 0 and 1".into(),
            ));
        }
        if !finite_non_neg(self.temperature) {
            return Err(RouteError::InvalidConfig(
                "temperature must be finite and non-negative".into(),
            ));
        }
        Ok(())
    }
}

/// Fills the breakdown of every candidate; `score` is set to the kv cost
/// (`prefill_term + decode_term`), which policies may overwrite.
pub(crate) fn breakdown(
    request: &RouteRequest,
    candidates: &[Candidate],
    load: &LoadView,
    cfg: &KvConfig,
    overlap_of: impl Fn(&WorkerId) -> TierOverlap,
) -> Vec<WorkerScore> {
    let bs = f64::from(request.block_size.get());
    let prompt = request.prompt_tokens as f64;
    candidates
        .iter()
        .map(|c| {
            let overlap = overlap_of(&c.worker);
            let device = f64::from(overlap.device);
            let host_only = f64::from(overlap.device_or_host - overlap.device);
            let disk_only = f64::from(overlap.any_tier - overlap.device_or_host);
            let cached =
                bs * (device + cfg.host_hit_factor * host_only + cfg.disk_hit_factor * disk_only);
            let uncached = (prompt - cached).max(0.0).round() as u64;
            let l = load.get(&c.worker);
            let prefill_term = cfg.prefill_weight * (uncached + l.queued_prefill_tokens) as f64;
            let decode_term = cfg.decode_weight * l.active_blocks as f64 * bs;
            WorkerScore {
                worker: c.worker.clone(),
                overlap,
                uncached_prompt_tokens: uncached,
                queued_prefill_tokens: l.queued_prefill_tokens,
                running_requests: l.running_requests,
                active_decode_sequences: l.active_decode_sequences,
                active_blocks: l.active_blocks,
                kv_utilisation: l.kv_utilisation(),
                prefill_term,
                decode_term,
                score: prefill_term + decode_term,
                probability: None,
            }
        })
        .collect()
}
