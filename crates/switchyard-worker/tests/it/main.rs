//! The integration tests of `switchyard-worker` as one test binary: each module is a file of
//! `tests/` (once a binary of its own), sharing one build of their support code and one link of
//! the dependency tree. Run one file's tests with `cargo nextest run -p switchyard-worker --test
//! it <module>::`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../support/mod.rs"]
mod support;

#[path = "../disagg_ttft.rs"]
mod disagg_ttft;

#[path = "../engine_publishers.rs"]
mod engine_publishers;

#[path = "../grpc_service.rs"]
mod grpc_service;

#[path = "../kv_layout.rs"]
mod kv_layout;

#[path = "../kv_pipeline.rs"]
mod kv_pipeline;

#[path = "../kv_transfer.rs"]
mod kv_transfer;

#[path = "../metrics.rs"]
mod metrics;

#[path = "../request_priority.rs"]
mod request_priority;

#[path = "../retention_hints.rs"]
mod retention_hints;

#[path = "../trtllm_adapter.rs"]
mod trtllm_adapter;

#[path = "../vllm_adapter.rs"]
mod vllm_adapter;
