//! The simulator's configuration, deserialisable from the worker's config file.

use serde::{Deserialize, Serialize};
use switchyard_core::BlockSize;

use crate::{SimError, TimingModel};

/// Shape of the simulated engine: cache sizes, batching limits, vocabulary and timing.
///
/// The defaults resemble vLLM serving an 8B model on one 80 GB H100 (see [`TimingModel`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Tokens per KV block; only full blocks are cached and announced.
    pub block_size: BlockSize,
    /// Device (GPU) KV cache capacity in blocks. 8192 × 16 ≈ 131k tokens, about what an 8B
    /// model leaves for KV on an 80 GB card.
    pub num_device_blocks: u64,
    /// Host (CPU) KV tier capacity in blocks; 0 disables the tier.
    pub num_host_blocks: u64,
    /// Share of the device blocks that retention hints may keep pinned while idle, in [0, 1];
    /// 0 ignores hints. Pinned blocks are still evicted when nothing else is left, so this
    /// bounds how far pins reorder eviction, and admission never waits on a pin.
    pub retention_budget_fraction: f64,
    /// Most sequences in the running batch at once.
    pub max_num_seqs: usize,
    /// Per-step token budget shared by decode tokens and prefill chunks.
    pub max_batched_tokens: usize,
    /// Longest prompt plus `max_tokens` accepted.
    pub max_context_tokens: u64,
    /// Sampled tokens are drawn from `0..vocab_size`.
    pub vocab_size: u32,
    /// Sampling this token ends a sequence with [`crate::FinishReason::Stop`] unless the
    /// request ignores EOS.
    pub eos_token_id: u32,
    /// Answers end the way a model's do: each sampled token is the end of sequence (the
    /// request's first stop token, else [`Self::eos_token_id`]) with probability
    /// 1/`mean_output_tokens`, so answers are this long on average and finish `stop`. 0: tokens
    /// are drawn uniformly and answers run to `max_tokens` (the replay lab sets lengths from
    /// its traces).
    pub mean_output_tokens: u32,
    /// Engine-wide sampling seed; the same seed and the same calls give the same run.
    pub seed: u64,
    pub timing: TimingModel,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            block_size: BlockSize::new(16).unwrap_or_else(|_| unreachable!("16 is a valid size")),
            num_device_blocks: 8192,
            num_host_blocks: 0,
            retention_budget_fraction: 0.5,
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            max_context_tokens: 131_072,
            vocab_size: 32_000,
            eos_token_id: 2,
            mean_output_tokens: 0,
            seed: 0,
            timing: TimingModel::default(),
        }
    }
}

impl SimConfig {
    /// Idle device blocks retention hints may keep pinned.
    pub fn retention_budget_blocks(&self) -> usize {
        (self.num_device_blocks as f64 * self.retention_budget_fraction).floor() as usize
    }

    /// Refuses configurations the scheduler cannot run: an empty cache, a zero budget, an EOS
    /// token that can never be sampled, or a timing model with negative or non-finite costs.
    pub fn validate(&self) -> Result<(), SimError> {
        let fail = |msg: String| Err(SimError::InvalidConfig(msg));
        if self.num_device_blocks == 0 {
            return fail("num_device_blocks must be at least 1".into());
        }
        if self.num_device_blocks > u64::from(u32::MAX) {
            return fail(format!(
                "num_device_blocks must be at most {}, got {}",
                u32::MAX,
                self.num_device_blocks
            ));
        }
        if !(0.0..=1.0).contains(&self.retention_budget_fraction) {
            return fail(format!(
                "retention_budget_fraction must be in [0, 1], got {}",
                self.retention_budget_fraction
            ));
        }
        if self.max_num_seqs == 0 {
            return fail("max_num_seqs must be at least 1".into());
        }
        if self.max_batched_tokens == 0 {
            return fail("max_batched_tokens must be at least 1".into());
        }
        if self.max_context_tokens == 0 {
            return fail("max_context_tokens must be at least 1".into());
        }
        if self.vocab_size == 0 {
            return fail("vocab_size must be at least 1".into());
        }
        if self.eos_token_id >= self.vocab_size {
            return fail(format!(
                "eos_token_id {} is outside the vocabulary of {} tokens",
                self.eos_token_id, self.vocab_size
            ));
        }
        self.timing.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_parse_from_an_empty_object() {
        assert!(SimConfig::default().validate().is_ok());
        let parsed: SimConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(parsed, SimConfig::default());
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        assert!(serde_json::from_str::<SimConfig>(r#"{"num_blocks": 3}"#).is_err());
        assert!(serde_json::from_str::<SimConfig>(r#"{"block_size": 0}"#).is_err());
        let cfg: SimConfig =
            serde_json::from_str(r#"{"num_device_blocks": 0, "timing": {"step_overhead_us": 1}}"#)
                .unwrap();
        assert!(matches!(cfg.validate(), Err(SimError::InvalidConfig(_))));
        let cfg = SimConfig {
            eos_token_id: 100,
            vocab_size: 100,
            ..SimConfig::default()
        };
        assert!(cfg.validate().is_err());
        let cfg = SimConfig {
            retention_budget_fraction: 1.5,
            ..SimConfig::default()
        };
        assert!(cfg.validate().is_err());
    }
}
