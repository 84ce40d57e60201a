//! `dynamo-kv`: NVIDIA Dynamo's KV router cost, for comparison in the same simulator and on the
//! same traces as `kv` (issue 45). Dynamo scores a worker, in blocks, as
//!
//! ```text
//! logit = overlap_score_weight × prefill_blocks + decode_blocks
//! prefill_blocks = (the worker's queued prefill tokens + the prompt past its cached prefix)
//!                  / block_size
//! decode_blocks  = the worker's active blocks + the request's own blocks
//! ```
//!
//! and takes the lowest (`router_temperature` 0, its default) or samples by a softmax of the
//! normalised logits (`--router-temperature`); `--kv-overlap-score-weight` defaults to 1. The
//! cached prefix is the device's, as Dynamo's event-fed indexer sees it. Unlike `kv` it counts
//! blocks, not seconds: a prefill token weighs as much as a decoded block's token, whatever the
//! engine's speeds, and nothing prices what a worker's queue costs the request behind it.
//! Ties at temperature 0 go as `kv`'s do (fewer running requests, then a stable per-request
//! hash), where Dynamo draws among them at random.

use serde::{Deserialize, Serialize};
use switchyard_core::rng::SplitMix64;

use super::cost;
use super::explain::{self, thousands};
use super::kv::{KvConfig, check_inputs, finish, index_overlap};
use super::{Candidate, Decision, Policy, RouteRequest};
use crate::error::RouteError;
use crate::index::PrefixIndex;
use crate::load::LoadView;

/// `[policy_settings.dynamo]`: Dynamo's two knobs, under its names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamoConfig {
    /// `--kv-overlap-score-weight`: the weight of the prefill blocks against the decode blocks.
    pub overlap_score_weight: f64,
    /// `--router-temperature`: 0 takes the lowest logit; above 0 samples.
    pub router_temperature: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_score_weight: 1.0,
            router_temperature: 0.0,
        }
    }
}

impl DynamoConfig {
    pub fn validate(&self) -> Result<(), RouteError> {
        let finite_non_neg = |v: f64| v.is_finite() && v >= 0.0;
        if !finite_non_neg(self.overlap_score_weight) || !finite_non_neg(self.router_temperature) {
            return Err(RouteError::InvalidConfig(
                "dynamo.overlap_score_weight and dynamo.router_temperature must be finite and non-negative".into(),
            ));
        }
        Ok(())
    }
}

/// Dynamo's KV router cost (see the module note).
#[derive(Debug, Clone)]
pub struct DynamoKvPolicy {
    config: DynamoConfig,
    /// Fills the common breakdown (overlap, queues, active blocks) the logit is read from.
    breakdown: KvConfig,
    rng: SplitMix64,
}

impl DynamoKvPolicy {
    pub fn new(config: DynamoConfig, seed: u64) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self {
            config,
            breakdown: KvConfig::default(),
            rng: SplitMix64::new(seed),
        })
    }

    /// The logit of a worker holding `cached_blocks` of the prompt on its device, with
    /// `queued_prefill_tokens` and `active_blocks` already there.
    pub fn logit(
        &self,
        request: &RouteRequest,
        cached_blocks: u32,
        queued_prefill_tokens: u64,
        active_blocks: u64,
    ) -> f64 {
        let block = f64::from(request.block_size.get());
        let cached_tokens = u64::from(cached_blocks) * u64::from(request.block_size.get());
        let new_tokens = request.prompt_tokens.saturating_sub(cached_tokens);
        let prefill_blocks = (queued_prefill_tokens + new_tokens) as f64 / block;
        let request_blocks = (request.prompt_tokens as f64 / block).ceil();
        let decode_blocks = active_blocks as f64 + request_blocks;
        self.config.overlap_score_weight * prefill_blocks + decode_blocks
    }
}

impl Policy for DynamoKvPolicy {
    fn name(&self) -> &'static str {
        "dynamo-kv"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        check_inputs(request, candidates, index)?;
        let mut scores = cost::breakdown(
            request,
            candidates,
            load,
            &self.breakdown,
            index_overlap(request, index),
            cost::Pending::Ignored,
        );
        for s in &mut scores {
            s.score = self.logit(
                request,
                s.overlap.device,
                s.queued_prefill_tokens,
                s.active_blocks,
            );
        }
        let sampled = self.config.router_temperature > 0.0 && scores.len() > 1;
        let chosen = if sampled {
            explain::sample(&mut scores, self.config.router_temperature, &mut self.rng)
        } else {
            explain::best(request, &scores)
        };
        let w = &scores[chosen];
        let why = format!(
            "{}: {} logit {:.1} = {} × prefill blocks + decode blocks ({} of {} prompt blocks cached on device, {} queued prefill tokens, {} active blocks)",
            w.worker,
            if sampled { "sampled for its" } else { "lowest" },
            w.score,
            self.config.overlap_score_weight,
            w.overlap.device,
            request.block_hashes.len(),
            thousands(w.queued_prefill_tokens),
            thousands(w.active_blocks),
        );
        Ok(finish(self.name(), request, scores, chosen, sampled, why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::BlockSize;

    fn request(prompt_tokens: u64) -> RouteRequest {
        RouteRequest {
            block_hashes: vec![],
            prompt_tokens,
            block_size: BlockSize::new(16).unwrap(),
            session: None,
            now: 0,
            adapter: None,
        }
    }

    /// Dynamo's formula, figure by figure: a 160-token prompt (10 blocks), 4 of them cached,
    /// 32 tokens queued, 20 blocks active: (32 + 96) / 16 = 8 prefill blocks, 20 + 10 = 30
    /// decode blocks.
    #[test]
    fn the_logit_is_dynamos_blocks_formula() {
        let policy = DynamoKvPolicy::new(DynamoConfig::default(), 0).unwrap();
        assert_eq!(policy.logit(&request(160), 4, 32, 20), 8.0 + 30.0);
        let weighted = DynamoKvPolicy::new(
            DynamoConfig {
                overlap_score_weight: 2.0,
                ..DynamoConfig::default()
            },
            0,
        )
        .unwrap();
        assert_eq!(weighted.logit(&request(160), 4, 32, 20), 16.0 + 30.0);
        // A prefix cached past the prompt leaves nothing to prefill.
        assert_eq!(policy.logit(&request(160), 20, 0, 0), 10.0);
        assert!(
            DynamoKvPolicy::new(
                DynamoConfig {
                    router_temperature: f64::NAN,
                    ..DynamoConfig::default()
                },
                0
            )
            .is_err()
        );
    }
}
