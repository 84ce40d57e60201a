//! What goes into the simulator and what comes out of a step.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use switchyard_core::{BlockHash, KvEvent, Retention, TokenId, TokenLogprob};

/// One generation request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SimRequest {
    /// The caller's id; unique among requests that are queued, running or holding blocks.
    pub id: u64,
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate (including a final EOS or stop token).
    pub max_tokens: u32,
    /// Keep generating past the EOS token (stop tokens still stop).
    pub ignore_eos: bool,
    /// Sampling any of these ends the sequence with [`FinishReason::Stop`].
    pub stop_token_ids: Vec<TokenId>,
    /// Per-request sampling seed: the same seed and prompt give the same tokens, on any
    /// simulator. Without one the engine's seed and the request id seed the stream.
    pub seed: Option<u64>,
    /// Greedy decoding (temperature 0): the prompt alone decides the tokens, on any simulator.
    #[serde(default)]
    pub greedy: bool,
    /// End-of-sequence and stop tokens do not end the sequence before this many tokens.
    #[serde(default)]
    pub min_tokens: u32,
    /// Never sampled (a logit bias of -100).
    #[serde(default)]
    pub banned: Vec<TokenId>,
    /// When not empty, only these are sampled (a logit bias of +100).
    #[serde(default)]
    pub forced: Vec<TokenId>,
    /// Prefill-only (the prefill side of disaggregated serving): generate exactly one token,
    /// finish with [`FinishReason::Length`], and keep the prompt's full blocks referenced until
    /// [`crate::Simulator::release_hold`] so a decode worker can pull them.
    pub hold_blocks: bool,
    /// With `hold_blocks`: report the prompt's full blocks as each prefill chunk computes them
    /// ([`StepOutcome::exports`]), so a decode worker can pull them while the prefill runs.
    #[serde(default)]
    pub pipeline: bool,
    /// Report each token's log probability with this many alternatives
    /// ([`TokenOutput::logprobs`]).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// When not empty, the tokens to generate, in order (a guided answer the caller wrote,
    /// since the simulator has no model to constrain): the sequence ends with
    /// [`FinishReason::Stop`] after the last, or with [`FinishReason::Length`] at `max_tokens`.
    #[serde(default)]
    pub script: Vec<TokenId>,
    /// Keep the request's blocks for a while after it ends (within the engine's retention
    /// budget, see [`crate::SimConfig::retention_budget_fraction`]).
    #[serde(default)]
    pub retention: Retention,
    /// The adapter and cache salt the prompt's KV is named by: its blocks are cached (and
    /// announced) under that identity, shared only with requests of the same identity.
    #[serde(default)]
    pub identity: switchyard_core::KvIdentity,
    /// The chained hashes of the prompt's full blocks under `identity`, when the caller has
    /// them already (a router hashed the prompt to route it): the simulator then does not hash
    /// the prompt again. They must be exactly what hashing the prompt gives (only their number
    /// is checked); `None`: the simulator hashes the prompt itself. Never on the wire.
    #[serde(skip)]
    pub prompt_hashes: Option<Vec<BlockHash>>,
}

impl SimRequest {
    /// A plain request; set the other fields with struct update syntax.
    pub fn new(id: u64, prompt: Vec<TokenId>, max_tokens: u32) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            ..Self::default()
        }
    }
}

/// Why a sequence stopped generating. Preemption is not a finish: a preempted sequence resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// `max_tokens` reached (or the one token of a `hold_blocks` prefill).
    Length,
    /// The EOS token (unless ignored) or one of the request's stop tokens was sampled.
    Stop,
}

/// One token sampled by one sequence in a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenOutput {
    pub id: u64,
    /// The sampled token. Always present: like vLLM, a final EOS or stop token is part of the
    /// output and counted in `completion_tokens`; dropping it from text is the detokenizer's job.
    pub token: TokenId,
    /// Set on the sequence's last token.
    pub finish: Option<FinishReason>,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (either tier) at the request's first
    /// admission; a recompute after preemption does not change it (as in vLLM).
    pub cached_prompt_tokens: u32,
    /// Tokens generated so far, this one included.
    pub completion_tokens: u32,
    /// The token's log probability, when the request asked for them.
    #[serde(default)]
    pub logprobs: Option<TokenLogprob>,
}

/// What one engine iteration did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutcome {
    /// Simulated model time of the step (before any speed-up); zero when nothing ran.
    pub duration: Duration,
    /// At most one token per sequence that sampled in this step, in batch order.
    pub outputs: Vec<TokenOutput>,
    /// KV events the step produced, in the order a consumer must apply them.
    pub events: Vec<KvEvent>,
    /// Prompt tokens computed in this step (cache misses, including recompute after preemption).
    pub prefill_tokens: usize,
    /// Sequences that decoded one token in this step.
    pub decode_sequences: usize,
    /// Sequences preempted in this step.
    pub preempted: usize,
    /// Host-tier blocks copied back to the device for prefix hits in this step.
    pub host_hit_blocks: usize,
    /// Prompt blocks of `pipeline` prefills that became available in this step.
    pub exports: Vec<BlockExport>,
}

/// Prompt blocks of a `pipeline` prefill that became available in one step (computed, or found
/// cached at admission), each block exported exactly once per request even across preemptions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockExport {
    pub id: u64,
    /// Index of the first exported block in the prompt.
    pub first_block: usize,
    /// Hash and tokens of each block, in prompt order.
    pub blocks: Vec<(BlockHash, Vec<TokenId>)>,
}

impl StepOutcome {
    /// Nothing was scheduled: there was no work, or everything waiting is blocked on KV
    /// blocks that only an abort or [`crate::Simulator::release_hold`] can free. Stepping again
    /// without such a call changes nothing.
    pub fn is_idle(&self) -> bool {
        self.duration.is_zero() && self.outputs.is_empty() && self.preempted == 0
    }
}
