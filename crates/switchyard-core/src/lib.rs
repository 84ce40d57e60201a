//! Shared vocabulary of Switchyard.
//!
//! Every other crate speaks in these types, so they carry no I/O and no async:
//!
//! - [`tokens`]: token ids and the block size that cuts a prompt into blocks.
//! - [`hash`]: the chained 64-bit [`BlockHash`], Switchyard's own stable name for a prefix.
//! - [`identity`]: what besides its tokens names a request's KV ([`KvIdentity`]: a LoRA
//!   adapter, a cache salt) and the one rule that keys blocks by it.
//! - [`digest`]: an order-independent digest of a set of cached blocks, to check a consumer's
//!   view of a worker's cache against the worker's own.
//! - [`worker`]: who a worker is ([`WorkerId`], [`WorkerInfo`]) and what it does ([`Role`]).
//! - [`event`]: the KV event model (`Stored`, `Removed`, `Cleared`) with per-incarnation
//!   sequence numbers.
//! - [`load`]: the load figures a worker reports.
//! - [`retention`]: a request's hint to keep its prefix cached across a session's pause.
//! - [`sampling`]: a request's sampling settings ([`Sampling`]), validated once.
//! - [`logprobs`]: log probabilities of generated tokens ([`TokenLogprob`]).
//! - [`rng`], [`promtext`], [`sse`]: the workspace's one seeded generator, one Prometheus text
//!   reader and one server-sent-events decoder (pure functions every crate shares).
//! - [`error`]: the validation errors of this crate.

pub mod digest;
pub mod error;
pub mod event;
pub mod guided;
pub mod hash;
pub mod identity;
pub mod load;
pub mod logprobs;
pub mod promtext;
pub mod retention;
pub mod rng;
pub mod sampling;
pub mod sse;
pub mod tier_cost;
pub mod time;
pub mod tokens;
pub mod worker;

pub use digest::{BlockSetDigest, HASH_SCHEME, hash_probe};
pub use error::CoreError;
pub use event::{
    EventSeq, Incarnation, KvEvent, KvEventEnvelope, SnapshotBlock, StorageTier, StoredBlock,
};
pub use guided::Guided;
pub use hash::{BlockHash, block_hashes, block_key, chain_hash, chain_hash_keyed};
pub use identity::{KvIdentity, MAX_IDENTITY_PART_BYTES, identity_block_key};
pub use load::LoadStats;
pub use logprobs::{MAX_TOP_LOGPROBS, TokenLogprob, TopLogprob};
pub use retention::Retention;
pub use sampling::{Sampling, SamplingError};
pub use tier_cost::{KvTierCosts, TierLink};
pub use tokens::{BlockSize, TokenId};
pub use worker::{EngineKind, Role, WorkerId, WorkerInfo};
