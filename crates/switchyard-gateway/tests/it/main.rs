//! The integration tests of `switchyard-gateway` as one test binary: each module is a file of
//! `tests/` (once a binary of its own), sharing one build of their support code and one link of
//! the dependency tree. Run one file's tests with `cargo nextest run -p switchyard-gateway --test
//! it <module>::`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../support/mod.rs"]
mod support;

#[path = "../fidelity.rs"]
mod fidelity;

#[path = "../load_push.rs"]
mod load_push;

#[path = "../subscriptions.rs"]
mod subscriptions;
