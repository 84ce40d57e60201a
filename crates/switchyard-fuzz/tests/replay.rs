//! Replays every committed fuzz input — the seed corpus (`fuzz/corpus/<target>/`) and each crash
//! the fuzzer ever found (`fuzz/regressions/<target>/`) — through its target, so the ordinary
//! test run catches a regression without libFuzzer.

use std::path::{Path, PathBuf};

use switchyard_fuzz::{TARGETS, Target};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files of `dir`, sorted; none when it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"))
        .collect();
    files.sort();
    files
}

/// Runs every input of `target` under `kind`; returns how many ran.
fn replay(target: &Target, kind: &str) -> usize {
    let files = inputs(&fuzz_dir().join(kind).join(target.name));
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let outcome = std::panic::catch_unwind(|| (target.run)(&data));
        assert!(
            outcome.is_ok(),
            "{} panicked on {} (see the panic message above)",
            target.name,
            file.display()
        );
    }
    files.len()
}

fn target(name: &str) -> &'static Target {
    TARGETS.iter().find(|t| t.name == name).unwrap()
}

fn replay_all(name: &str) {
    let target = target(name);
    let seeds = replay(target, "corpus");
    assert!(
        seeds >= 5,
        "fuzz/corpus/{name} holds {seeds} seeds; the corpus is committed and must not be lost"
    );
    replay(target, "regressions");
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
