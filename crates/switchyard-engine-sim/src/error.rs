//! Why the simulator refused a configuration or a request.

/// Every variant is the caller's fault: the same configuration or request will be refused again,
/// so retrying cannot help (except [`SimError::DuplicateId`], which succeeds once the earlier
/// request with that id has finished or been aborted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("invalid simulator config: {0}")]
    InvalidConfig(String),
    #[error("request {id} has an empty prompt")]
    EmptyPrompt { id: u64 },
    #[error("request {id} asks for max_tokens = 0; at least one token must be generated")]
    ZeroMaxTokens { id: u64 },
    #[error(
        "request {id} needs {prompt_tokens} prompt + {max_tokens} output tokens, \
         more than the model's context of {max_context_tokens} tokens"
    )]
    ContextTooLong {
        id: u64,
        prompt_tokens: u64,
        max_tokens: u32,
        max_context_tokens: u64,
    },
    #[error(
        "request {id} needs {needed_blocks} kv blocks for its prompt and output, \
         more than the whole device cache of {capacity_blocks} blocks"
    )]
    ExceedsKvCapacity {
        id: u64,
        needed_blocks: u64,
        capacity_blocks: u64,
    },
    #[error("request id {id} is already in use by a queued, running or held request")]
    DuplicateId { id: u64 },
    #[error(
        "request {id} comes with {got} prompt block hashes, but its prompt has {expected} full blocks"
    )]
    PromptHashCount {
        id: u64,
        got: usize,
        expected: usize,
    },
}
