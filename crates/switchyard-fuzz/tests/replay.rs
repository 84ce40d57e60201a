//! Replays every committed fuzz input — the seed corpus (`fuzz/corpus/<target>/`) and each crash
//! the fuzzer ever found (`fuzz/regressions/<target>/`) — through its target, so the ordinary
//! test run catches a regression without a fuzzer.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_fuzz::corpus::{fuzz_dir, inputs};
use switchyard_fuzz::{TARGETS, target};

/// Runs every input of `name` under `kind`; returns how many ran.
fn replay(name: &str, kind: &str) -> usize {
    let target = target(name).unwrap();
    let files = inputs(&fuzz_dir().join(kind).join(name)).unwrap();
    for (path, data) in &files {
        let outcome = std::panic::catch_unwind(|| (target.run)(data));
        assert!(
            outcome.is_ok(),
            "{name} panicked on {} (see the panic message above)",
            path.display()
        );
    }
    files.len()
}

fn replay_all(name: &str) {
    let seeds = replay(name, "corpus");
    assert!(
        seeds >= 5,
        "fuzz/corpus/{name} holds {seeds} seeds; the corpus is committed and must not be lost"
    );
    replay(name, "regressions");
}

#[test]
fn http_chat_body_corpus_and_regressions() {
    replay_all("http_chat_body");
}

#[test]
fn zmq_event_corpus_and_regressions() {
    replay_all("zmq_event");
}

#[test]
fn trtllm_events_corpus_and_regressions() {
    replay_all("trtllm_events");
}

#[test]
fn proto_conversions_corpus_and_regressions() {
    replay_all("proto_conversions");
}

#[test]
fn chat_template_corpus_and_regressions() {
    replay_all("chat_template");
}

#[test]
fn every_target_has_a_corpus_directory() {
    for target in TARGETS {
        assert!(
            fuzz_dir().join("corpus").join(target.name).is_dir(),
            "fuzz/corpus/{} is missing",
            target.name
        );
    }
}
