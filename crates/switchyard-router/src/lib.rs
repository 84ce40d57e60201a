//! KV-aware router: which worker should run a request, and why.
//!
//! Synchronous and free of I/O, so the live gateway and offline replay run the same code:
//!
//! - [`index`]: the [`PrefixIndex`], built from workers' KV events (sequence tracking, gaps,
//!   snapshots, bounded memory), each worker's blocks kept as runs (chains stored together), and
//!   its exact overlap query along those runs.
//! - [`engine_map`]: maps an engine's own block hashes to Switchyard's chained hashes.
//! - [`load`]: the [`LoadView`], workers' reported load plus the router's in-flight bookkeeping.
//! - [`policy`]: the [`Policy`] trait, the routing policies and the [`Explanation`] every
//!   decision carries.
//! - [`recording`]: the KV recording format a gateway writes and offline replay reads.
//! - [`serve`]: the serving core — candidates, aggregated or disaggregated, the prefill and
//!   decode choices and what is booked for them — written once for the gateway, the replay
//!   lab and the planner's bench.
//! - [`error`]: [`IndexError`] and [`RouteError`].

pub mod engine_map;
pub mod error;
mod hasher;
pub mod index;
pub mod load;
pub mod policy;
pub mod recording;
pub mod serve;

pub use engine_map::EngineHashMap;
pub use error::{IndexError, RouteError};
pub use index::{
    ApplyOutcome, IndexConfig, IndexStats, OverlapScores, PrefixIndex, StatsDraft, TierOverlap,
    WorkerKey,
};
pub use load::{BookedRequest, LoadConfig, LoadView, RequestId, Tick, WorkerLoad};
pub use policy::{
    Candidate, Decision, Explanation, Policy, PolicyConfig, PolicyKind, RouteRequest, WorkerScore,
};
