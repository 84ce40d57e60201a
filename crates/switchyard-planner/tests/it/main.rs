//! The integration tests of `switchyard-planner` as one test binary: each module is a file of
//! `tests/` (once a binary of its own), sharing one build of their support code and one link of
//! the dependency tree. Run one file's tests with `cargo nextest run -p switchyard-planner --test
//! it <module>::`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../kubernetes_connector.rs"]
mod kubernetes_connector;

#[path = "../local_connector.rs"]
mod local_connector;

#[path = "../measure.rs"]
mod measure;

#[path = "../observe.rs"]
mod observe;

#[path = "../planner_correction.rs"]
mod planner_correction;

#[path = "../planner_loop.rs"]
mod planner_loop;
