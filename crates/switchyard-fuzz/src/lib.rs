//! Switchyard's fuzz targets, as plain functions over bytes.
//!
//! Each target feeds outside input to the product's own public parsing code and checks that it
//! answers with a value or an error, never a panic (or an error of the wrong kind):
//!
//! - [`http_body`]: the gateway's parsing and validation of `/v1/chat/completions`,
//!   `/v1/completions` and `/v1/messages` bodies, and the error object it answers with.
//! - [`zmq_event`]: vLLM/SGLang KV-event messages off ZeroMQ: frame splitting (live and replay
//!   framings), MessagePack batch decoding and the relay into the worker's event log.
//! - [`trtllm_events`]: TensorRT-LLM's KV events as `trtllm-serve` hands them out (JSON polls),
//!   through the converter that finds lost events and the relay into the worker's event log.
//! - [`proto`]: `switchyard.v1` protobuf messages decoded by prost, their conversions to core
//!   types, and KV-event streams applied to the router's prefix index as the gateway does.
//! - [`chat_template`]: chat-template rendering of arbitrary conversations with the built-in and
//!   Qwen3 templates, and of arbitrary templates under the render's fuel budget.
//!
//! The libFuzzer drivers in `fuzz/` (a workspace of their own) call these functions; so does
//! [`mutate`], the coverage-less mutational fuzzer of the test command's bounded run (binary
//! `fuzz-mutate`). The `replay` test runs every file of [`corpus`] (`fuzz/corpus/<target>/`
//! and `fuzz/regressions/<target>/`) through them in the ordinary test run, so a crash once
//! found stays fixed without a fuzzer. `fuzz/README.md` explains how they are built and run.

pub mod chat_template;
pub mod corpus;
pub mod http_body;
pub mod mutate;
pub mod proto;
pub mod trtllm_events;
pub mod zmq_event;

/// One fuzz target: its name (the directory name under `fuzz/corpus` and `fuzz/regressions`,
/// and the libFuzzer binary's name) and the function that runs one input.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: [Target; 5] = [
    Target {
        name: "http_chat_body",
        run: http_body::run,
    },
    Target {
        name: "zmq_event",
        run: zmq_event::run,
    },
    Target {
        name: "trtllm_events",
        run: trtllm_events::run,
    },
    Target {
        name: "proto_conversions",
        run: proto::run,
    },
    Target {
        name: "chat_template",
        run: chat_template::run,
    },
];

/// The target named `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
