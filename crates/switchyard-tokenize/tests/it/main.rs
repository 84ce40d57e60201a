//! Integration tests of switchyard-tokenize, in one binary to keep link time down.
//!
//! The Qwen3 tests need the files `fetch-test-models.sh` puts in
//! `$SWITCHYARD_TEST_MODELS/qwen3` (default `~/.cache/switchyard/test-models/qwen3`); they
//! fail, not skip, when those are missing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod builtin;
mod decode;
mod errors;
mod fast;
mod prefix;
mod qwen3;
mod session;
mod session_replay;
mod support;
mod synth;
mod within;
