//! Errors of the router crate.

use switchyard_core::{BlockSize, CoreError};

/// Why the prefix index refused an input. Every variant is the publisher's or the caller's
/// fault; retrying the same input cannot help, and the index is left unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A `Stored` event whose blocks are partial or whose hashes do not match their tokens.
    #[error("invalid kv event: {0}")]
    InvalidEvent(#[source] CoreError),
    /// The index cannot intern more workers.
    #[error("too many workers in the prefix index (at most {max})")]
    TooManyWorkers { max: usize },
    /// An engine event names a parent block the engine-hash map does not know (it was never
    /// stored, or the map evicted it); the consumer must resync the worker from a snapshot.
    #[error("engine block {0:#x} is unknown to the engine-hash map; resync the worker")]
    UnknownEngineParent(u64),
    /// An engine `Stored` event gave a different number of engine hashes and token blocks.
    #[error("engine stored event has {hashes} block hashes but {blocks} token blocks")]
    EngineBlockCountMismatch { hashes: usize, blocks: usize },
}

/// Why a routing decision could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// Nothing to choose from: every worker is gone, draining or of the wrong role. A retry
    /// can help once a worker registers.
    #[error("no candidate workers")]
    NoCandidates,
    /// The request was hashed with another block size than the index was built with (the
    /// caller's fault).
    #[error("request block size {request} does not match the index block size {index}")]
    BlockSizeMismatch {
        request: BlockSize,
        index: BlockSize,
    },
    /// A policy setting is out of range (the operator's fault).
    #[error("invalid policy configuration: {0}")]
    InvalidConfig(String),
    /// The policy name is not one of the known policies.
    #[error(
        "unknown routing policy {0:?} (expected kv, round-robin, random, least-loaded, session, approx-kv, dynamo-kv or sglang-ca)"
    )]
    UnknownPolicy(String),
}
