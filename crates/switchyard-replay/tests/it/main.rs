//! The integration tests of `switchyard-replay` as one test binary: each module is a file of
//! `tests/` (once a binary of its own), sharing one build of their support code and one link of
//! the dependency tree. Run one file's tests with `cargo nextest run -p switchyard-replay --test
//! it <module>::`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../support/mod.rs"]
mod support;

#[path = "../disagg.rs"]
mod disagg;

#[path = "../golden.rs"]
mod golden;

#[path = "../knobs.rs"]
mod knobs;

#[path = "../placement.rs"]
mod placement;

#[path = "../retention.rs"]
mod retention;

#[path = "../sessions.rs"]
mod sessions;

#[path = "../sweep.rs"]
mod sweep;

#[path = "../traces.rs"]
mod traces;
