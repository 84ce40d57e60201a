//! Validation errors for the core vocabulary.

/// Why a core value was refused. Every variant is the caller's fault (bad input) and retrying
/// the same value cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("block size must be between 1 and {max} tokens, got {got}")]
    InvalidBlockSize { got: u64, max: u32 },
    #[error("invalid worker id {id:?}: {reason}")]
    InvalidWorkerId { id: String, reason: &'static str },
    #[error("unknown role {0:?} (expected prefill, decode or both)")]
    UnknownRole(String),
    #[error("unknown storage tier {0:?} (expected device, host or disk)")]
    UnknownTier(String),
    #[error("stored block has {got} tokens but the block size is {block_size}")]
    PartialBlock { got: usize, block_size: u32 },
    #[error("stored block {hash} does not hash to its tokens (expected {expected})")]
    HashMismatch { hash: String, expected: String },
    #[error("worker info is invalid: {0}")]
    InvalidWorkerInfo(String),
    #[error("invalid KV identity: {0}")]
    InvalidIdentity(String),
}
