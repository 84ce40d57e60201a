//! The Switchyard worker agent.
//!
//! One agent fronts one inference engine. It serves the gRPC `switchyard.v1.Worker` service
//! ([`service`]) over a small [`engine::Engine`] trait, whose first implementation is the
//! built-in simulator ([`engine::sim`]); it publishes the engine's KV cache changes through an
//! [`event_log::EventLog`] that lets consumers resume or resynchronise; it registers itself in
//! the registry with a lease and keeps its role there up to date; and on shutdown it drains
//! before it deregisters ([`agent`]). [`config`] holds the one configuration struct and its
//! flag/environment layer (the engine's part in `engine::config`); [`state`] the role, drain flag and in-flight count shared by all;
//! [`metrics`] the Prometheus metrics and their `/metrics` listener. A decode worker pulls a
//! disaggregated prompt's KV in `kv_source`, planned against the layout the prefill worker
//! announces (`kv_layout`), only from a live worker of its cluster (`peers`); who may make which
//! call is `service::access`.

pub mod agent;
pub mod config;
pub mod engine;
mod engine_transfer;
pub mod event_log;
mod kv_layout;
mod kv_source;
pub mod kv_tiers;
pub mod metrics;
mod metrics_access;
pub mod peers;
pub mod service;
pub mod state;
mod transfer_config;

pub use agent::{AgentError, RunningWorker, run};
pub use config::{ConfigError, WorkerArgs, WorkerConfig};
