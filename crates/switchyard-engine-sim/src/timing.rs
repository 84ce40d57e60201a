//! How long one engine step takes.
//!
//! A step's time is a roofline-style sum of what the step does:
//!
//! ```text
//! step = overhead
//!      + prefill_tokens        × prefill_token_us           (weights × tokens: compute-bound)
//!      + prefill_attention_pairs × prefill_attention_pair_ns (each prefill token attends to its context)
//!      + decode_sequences      × decode_sequence_us         (per-sequence sampling and linear work)
//!      + decode_context_tokens × decode_context_token_ns    (reading the KV cache: memory-bound)
//!      + host_to_device_blocks × host_to_device_block_us    (PCIe copy of host-tier hits)
//! ```
//!
//! The defaults resemble Llama-3-8B in bf16 under vLLM on one H100 SXM:
//!
//! - **Overhead 8 ms.** Every step streams the 16 GB of weights (≈ 5.3 ms at ≈ 3 TB/s) plus
//!   the scheduler, sampler and launch gaps of a real engine (≈ 2–3 ms).
//! - **Prefill 60 µs/token.** 2 × 8 G = 16 GFLOP per token at ≈ 270 TFLOP/s achieved
//!   (≈ 27 % of the dense bf16 peak, what long prompts reach in practice), ≈ 16.7k tokens/s.
//! - **Prefill attention 1 ns per (token, context token) pair.** 4 × 32 layers × 4096
//!   hidden ≈ 0.5 MFLOP per pair at ≈ 500 TFLOP/s; an 8k-token prompt spends ≈ 34 ms on it
//!   beside ≈ 490 ms of linear work, the ~7 % share real attention kernels show at that length.
//! - **Decode 80 µs/sequence.** Per-sequence linear-layer, sampling and bookkeeping cost.
//! - **Decode 50 ns/context token.** The KV of one token is 2 × 32 layers × 8 KV heads × 128 ×
//!   2 bytes = 128 KiB; reading it at ≈ 2.6 TB/s takes ≈ 50 ns.
//! - **Host copy 40 µs/block.** A 16-token block is 2 MiB of KV; PCIe Gen5 moves ≈ 50 GB/s.
//!   That is ≈ 25× cheaper than recomputing the block (16 × 60 µs).
//!
//! Resulting figures: a 1k-token prompt alone takes ≈ 70 ms (≈ 14.6k tokens/s with the step
//! overhead), an 8k-token prompt ≈ 533 ms (≈ 15.4k tokens/s); a decode step is ≈ 8.2 ms for one
//! sequence with a 2k context and ≈ 19.7 ms for 64 sequences with 2k contexts each.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// Costs of the parts of one engine step. Every field is a non-negative, finite number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingModel {
    /// Fixed cost of any step that runs the model, in microseconds.
    pub step_overhead_us: f64,
    /// Cost of each computed (uncached) prompt token, in microseconds.
    pub prefill_token_us: f64,
    /// Cost of each (prefill token, earlier token it attends to) pair, in nanoseconds; makes
    /// long prompts super-linear and charges chunks that sit on a long cached prefix.
    pub prefill_attention_pair_ns: f64,
    /// Cost of each sequence that decodes one token in the step, in microseconds.
    pub decode_sequence_us: f64,
    /// Cost of each context token a decoding sequence attends to, in nanoseconds.
    pub decode_context_token_ns: f64,
    /// Cost of copying one block from the host tier back to the device, in microseconds.
    pub host_to_device_block_us: f64,
    /// Bandwidth of a KV transfer between workers (disaggregated serving), in gigabits per
    /// second; 400 is one RDMA NIC of an H100 node.
    pub kv_transfer_gbps: f64,
    /// Fixed cost of each copy descriptor of a KV transfer (one per contiguous block copied),
    /// in microseconds: the work request posting and completion of an RDMA transfer.
    pub kv_descriptor_overhead_us: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            step_overhead_us: 8_000.0,
            prefill_token_us: 60.0,
            prefill_attention_pair_ns: 1.0,
            decode_sequence_us: 80.0,
            decode_context_token_ns: 50.0,
            host_to_device_block_us: 40.0,
            kv_transfer_gbps: 400.0,
            kv_descriptor_overhead_us: 2.0,
        }
    }
}

/// What one step computes; the input of [`TimingModel::step_time`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepWork {
    /// Prompt tokens computed in the step (cache misses, including recompute after preemption).
    pub prefill_tokens: u64,
    /// Sum over the computed prompt tokens of the number of positions each attends to
    /// (itself and everything before it, cached or not). See [`attention_pairs`].
    pub prefill_attention_pairs: u64,
    /// Sequences that decode one token in the step.
    pub decode_sequences: u64,
    /// Sum of the context lengths of the decoding sequences.
    pub decode_context_tokens: u64,
    /// Host-tier blocks copied back to the device for prefix hits.
    pub host_to_device_blocks: u64,
}

impl StepWork {
    /// Whether the step runs the model at all; an empty step costs nothing.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_sequences == 0 && self.host_to_device_blocks == 0
    }
}

/// Attention pairs of computing the tokens at positions `start..end` (0-based): the token at
/// position `p` attends to `p + 1` positions.
pub fn attention_pairs(start: u64, end: u64) -> u64 {
    if end <= start {
        return 0;
    }
    let tri = |n: u64| n.saturating_mul(n.saturating_add(1)) / 2;
    tri(end).saturating_sub(tri(start))
}

impl TimingModel {
    /// Simulated model time of a step doing `work`; zero for an empty step.
    pub fn step_time(&self, work: &StepWork) -> Duration {
        if work.is_empty() {
            return Duration::ZERO;
        }
        let us = self.step_overhead_us
            + work.prefill_tokens as f64 * self.prefill_token_us
            + work.prefill_attention_pairs as f64 * self.prefill_attention_pair_ns / 1_000.0
            + work.decode_sequences as f64 * self.decode_sequence_us
            + work.decode_context_tokens as f64 * self.decode_context_token_ns / 1_000.0
            + work.host_to_device_blocks as f64 * self.host_to_device_block_us;
        // Whole nanoseconds keep durations exactly reproducible when summed.
        Duration::from_nanos((us * 1_000.0).round() as u64)
    }

    /// Time to prefill a prompt of `prompt_tokens` alone in one step when its first
    /// `cached_tokens` come from the device prefix cache (the step that samples the first
    /// token; chunking adds one overhead per extra step).
    pub fn prefill_time(&self, prompt_tokens: u64, cached_tokens: u64) -> Duration {
        let cached = cached_tokens.min(prompt_tokens.saturating_sub(1));
        self.step_time(&StepWork {
            prefill_tokens: prompt_tokens - cached,
            prefill_attention_pairs: attention_pairs(cached, prompt_tokens),
            ..StepWork::default()
        })
    }

    /// Time to prefill a prompt alone on an idle worker whose step budget is `chunk_tokens`:
    /// [`Self::prefill_time`] plus one step overhead per chunk past the first, the scheduler's
    /// chunked prefill. No placement of the request can give it a shorter time to first token.
    pub fn chunked_prefill_time(
        &self,
        prompt_tokens: u64,
        cached_tokens: u64,
        chunk_tokens: u64,
    ) -> Duration {
        let computed = prompt_tokens - cached_tokens.min(prompt_tokens.saturating_sub(1));
        let chunks = computed.div_ceil(chunk_tokens.max(1));
        let extra_us = chunks.saturating_sub(1) as f64 * self.step_overhead_us;
        self.prefill_time(prompt_tokens, cached_tokens)
            + Duration::from_nanos((extra_us * 1_000.0).round() as u64)
    }

    /// Time of a decode-only step of `batch` sequences that each attend to `context_tokens`.
    pub fn decode_step_time(&self, batch: u64, context_tokens: u64) -> Duration {
        self.step_time(&StepWork {
            decode_sequences: batch,
            decode_context_tokens: batch.saturating_mul(context_tokens),
            ..StepWork::default()
        })
    }

    /// Time to move `bytes` of KV between workers in `descriptors` copies:
    /// `bytes / bandwidth + descriptors × overhead`. Charged by the receiving side before its
    /// request can use the blocks, so it lands in a disaggregated request's TTFT.
    pub fn transfer_time(&self, bytes: u64, descriptors: u64) -> Duration {
        let bytes_per_us = self.kv_transfer_gbps * 1e9 / 8.0 / 1e6;
        let us = bytes as f64 / bytes_per_us + descriptors as f64 * self.kv_descriptor_overhead_us;
        Duration::from_nanos((us * 1_000.0).round() as u64)
    }

    /// The `host_to_device_block_us` of a host link of `gbps` gigabits per second moving
    /// blocks of `bytes_per_block` bytes.
    pub fn host_block_us(bytes_per_block: u64, gbps: f64) -> f64 {
        bytes_per_block as f64 * 8.0 / (gbps * 1e3)
    }

    pub(crate) fn validate(&self) -> Result<(), SimError> {
        if !(self.kv_transfer_gbps.is_finite() && self.kv_transfer_gbps > 0.0) {
            return Err(SimError::InvalidConfig(format!(
                "timing.kv_transfer_gbps must be a finite number > 0, got {}",
                self.kv_transfer_gbps
            )));
        }
        let fields = [
            ("step_overhead_us", self.step_overhead_us),
            ("prefill_token_us", self.prefill_token_us),
            ("prefill_attention_pair_ns", self.prefill_attention_pair_ns),
            ("decode_sequence_us", self.decode_sequence_us),
            ("decode_context_token_ns", self.decode_context_token_ns),
            ("host_to_device_block_us", self.host_to_device_block_us),
            ("kv_descriptor_overhead_us", self.kv_descriptor_overhead_us),
        ];
        for (name, value) in fields {
            if !value.is_finite() || value < 0.0 {
                return Err(SimError::InvalidConfig(format!(
                    "timing.{name} must be a finite non-negative number, got {value}"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1_000.0
    }

    #[test]
    fn defaults_land_in_the_h100_8b_ranges() {
        let t = TimingModel::default();
        let long = t.prefill_time(8192, 0);
        let tok_per_s = 8192.0 / long.as_secs_f64();
        assert!((10_000.0..20_000.0).contains(&tok_per_s), "{tok_per_s}");
        let one = ms(t.decode_step_time(1, 2048));
        let batch = ms(t.decode_step_time(64, 2048));
        assert!((7.0..12.0).contains(&one), "{one}");
        assert!((10.0..25.0).contains(&batch), "{batch}");
        assert!(batch > one);
    }

    #[test]
    fn cached_prefix_and_empty_steps_cost_less() {
        let t = TimingModel::default();
        assert!(t.prefill_time(4096, 2048) < t.prefill_time(4096, 0));
        // A fully cached prompt still computes its last token.
        assert!(t.prefill_time(4096, 4096) > Duration::ZERO);
        assert_eq!(t.step_time(&StepWork::default()), Duration::ZERO);
    }

    #[test]
    fn chunked_prefill_adds_one_overhead_per_extra_chunk() {
        let t = TimingModel::default();
        // 8192 uncached tokens fit one chunk of 8192: the single-step time.
        assert_eq!(
            t.chunked_prefill_time(8192, 0, 8192),
            t.prefill_time(8192, 0)
        );
        // 8193 take two steps: one more overhead, the same tokens and attention pairs.
        let two = t.chunked_prefill_time(8193, 0, 8192) - t.prefill_time(8193, 0);
        assert_eq!(two, Duration::from_micros(8_000));
        // Only the uncached part is chunked; a fully cached prompt computes its last token.
        assert_eq!(
            t.chunked_prefill_time(100_000, 100_000, 8192),
            t.prefill_time(100_000, 99_999)
        );
        let cold = t.chunked_prefill_time(100_000, 0, 8192);
        assert_eq!(
            cold - t.prefill_time(100_000, 0),
            Duration::from_micros(12 * 8_000)
        );
    }

    #[test]
    fn attention_pairs_sum_positions() {
        assert_eq!(attention_pairs(0, 3), 1 + 2 + 3);
        assert_eq!(attention_pairs(2, 4), 3 + 4);
        assert_eq!(attention_pairs(5, 5), 0);
        assert_eq!(
            attention_pairs(0, 10),
            attention_pairs(0, 4) + attention_pairs(4, 10)
        );
    }

    #[test]
    fn transfer_time_is_bandwidth_plus_descriptors() {
        let t = TimingModel {
            kv_transfer_gbps: 8.0, // 1 GB/s: 1000 bytes per microsecond
            kv_descriptor_overhead_us: 5.0,
            ..TimingModel::default()
        };
        assert_eq!(t.transfer_time(1_000_000, 0), Duration::from_millis(1));
        assert_eq!(t.transfer_time(1_000_000, 10), Duration::from_micros(1_050));
        // Defaults: an 8k-token prompt (1 GiB at 128 KiB/token, 512 blocks) moves in ~22 ms.
        let d = TimingModel::default().transfer_time(8192 * 131_072, 512);
        assert!((15.0..30.0).contains(&ms(d)), "{d:?}");
        let zero = TimingModel {
            kv_transfer_gbps: 0.0,
            ..TimingModel::default()
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn a_host_link_costs_blocks_by_their_bytes() {
        // A 16-token block of 2 MiB over 400 Gbit/s (50 GB/s): ≈ 42 µs.
        let us = TimingModel::host_block_us(16 * 131_072, 400.0);
        assert!((us - 41.943).abs() < 0.01, "{us}");
    }

    #[test]
    fn bad_costs_are_refused() {
        let t = TimingModel {
            prefill_token_us: f64::NAN,
            ..TimingModel::default()
        };
        assert!(t.validate().is_err());
        let t = TimingModel {
            step_overhead_us: -1.0,
            ..TimingModel::default()
        };
        assert!(t.validate().is_err());
    }
}
