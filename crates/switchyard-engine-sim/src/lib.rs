//! Simulated LLM engine: behaves like vLLM wherever a router or a planner could tell the
//! difference, synchronously and deterministically, so the same code runs inside a live worker
//! (which sleeps each step's simulated duration) and inside offline replay (virtual time).
//!
//! How the modules fit:
//!
//! - [`config`] holds [`SimConfig`], the engine's shape (cache sizes, batching limits, seed).
//! - [`timing`] holds [`TimingModel`], the cost of a step from what it computes; public so a
//!   planner can derive a performance profile without running the simulator.
//! - `kv_cache` is the paged device block pool with reference counts, prefix caching keyed by
//!   the chained [`switchyard_core::BlockHash`], LRU eviction, and the optional host tier;
//!   `retained` keeps the idle blocks retention hints pin, within a budget; `lru` is the
//!   eviction order of the others.
//! - `events` merges one step's KV events into the fewest ordered `Stored`/`Removed` events.
//! - `sequence` is a request's state inside the engine and its deterministic sampler.
//! - `scheduler` is [`Simulator::step`]: continuous batching with chunked prefill and
//!   recompute preemption.
//! - [`engine`] is the rest of [`Simulator`]'s API: intake and validation, aborts, holds for
//!   disaggregated prefill, load figures and cache snapshots.
//! - [`request`] holds what goes in ([`SimRequest`]) and what comes out ([`StepOutcome`]).
//! - [`import`] admits KV blocks computed elsewhere (the decode side of disaggregation).
//! - [`transfer_plan`] plans a KV transfer between two layouts (tensor-parallel splits) and
//!   coalesces strided fragments into few descriptors through a bounded [`StagingArea`].
//! - [`error`] holds [`SimError`].

// Tests may unwrap: a panic there is a failed test, which is the point.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
pub mod engine;
pub mod error;
mod events;
pub mod import;
mod kv_cache;
mod lru;
pub mod request;
mod retained;
mod scheduler;
mod sequence;
pub mod timing;
pub mod transfer_plan;

pub use config::SimConfig;
pub use engine::Simulator;
pub use error::SimError;
pub use import::ImportOutcome;
pub use request::{BlockExport, FinishReason, SimRequest, StepOutcome, TokenOutput};
pub use timing::{StepWork, TimingModel, attention_pairs};
pub use transfer_plan::{KvLayout, PlanStats, StagingArea};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod retention_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod testutil;
