//! Switchyard's prefix index measured against the indexers of Dynamo's `dynamo-kv-router`
//! crate: the same event streams and queries, on one thread, in one run.
//!
//! This is its own cargo workspace so that the main workspace's CI never builds Dynamo's crate.
//! `cargo bench` here runs `benches/peers.rs`, which prints the side-by-side table and writes it
//! to `results/peers.md` and `results/peers.json`; `cargo test --release` runs
//! `tests/same_streams.rs`, which checks that every contender, fed the same small workloads,
//! gives the reference's answers (so the bench compares like with like).
//!
//! - [`workload`]: the block/event/query model, the synthetic streams.
//! - [`traces`]: the Mooncake and Weka agent traces turned into one fixed replay stream.
//! - [`contenders`]: each index behind the [`contenders::Contender`] interface.
//! - [`measure`]: heap accounting (a counting global allocator), percentiles, machine facts.
//! - [`report`]: rows, Switchyard's advantage per row, markdown and JSON.

pub mod contenders;
pub mod measure;
pub mod report;
pub mod traces;
pub mod workload;
