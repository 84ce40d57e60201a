//! Load figures a worker reports.

use serde::{Deserialize, Serialize};

/// A worker's load at one instant, as its load-stats stream reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LoadStats {
    /// Prompt tokens admitted but not yet prefilled (queued and in-progress chunks).
    pub queued_prefill_tokens: u64,
    /// Requests waiting for admission.
    pub waiting_requests: u64,
    /// Sequences in the running batch (prefilling or decoding).
    pub running_requests: u64,
    /// Sequences currently decoding.
    pub active_decode_sequences: u64,
    /// Device blocks referenced by running sequences.
    pub active_blocks: u64,
    /// Device blocks in use, cached or referenced.
    pub used_blocks: u64,
    /// Device capacity in blocks.
    pub capacity_blocks: u64,
    /// Sequences preempted since the engine started.
    pub preemptions_total: u64,
    /// Prompt tokens served from the prefix cache since the engine started.
    pub cached_prompt_tokens_total: u64,
    /// Prompt tokens seen since the engine started.
    pub prompt_tokens_total: u64,
}

impl LoadStats {
    /// Fraction of device blocks referenced by running sequences, in `[0, 1]`.
    pub fn kv_utilisation(&self) -> f64 {
        if self.capacity_blocks == 0 {
            return 0.0;
        }
        (self.active_blocks as f64 / self.capacity_blocks as f64).clamp(0.0, 1.0)
    }
}
