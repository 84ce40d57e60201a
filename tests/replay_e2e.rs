//! Live replay end to end: `switchyard replay ... --endpoint` (the real binary) drives a
//! Mooncake slice and the Weka fixture against `switchyard up` over HTTP, and its JSON report
//! accounts for every request.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::SwitchyardProcess;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/agentx/fixtures/weka-two-plays.jsonl")
}

/// Runs `switchyard replay <args>` to completion and returns its report.
async fn replay(args: &[&str], out: &Path, name: &str) -> Value {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("replay")
        .args(args)
        .args(["--out", out.to_str().unwrap(), "--name", name])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("replay finishes within 120 s")
        .expect("run switchyard replay");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "replay failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("live"), "no table printed: {stdout}");
    let json = std::fs::read_to_string(out.join(format!("{name}.json"))).unwrap();
    assert!(out.join(format!("{name}.csv")).exists());
    assert!(out.join(format!("{name}.svg")).exists());
    serde_json::from_str(&json).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_replay_against_switchyard_up() {
    let up = SwitchyardProcess::spawn(
        "up",
        &[
            "--http",
            "127.0.0.1:0",
            "--workers",
            "2",
            "--speedup",
            "20",
            "--max-context",
            "8192",
        ],
    )
    .await;
    let endpoint = format!("{}/v1", up.endpoint());
    let dir = tempfile::tempdir().unwrap();

    // A small Mooncake-format slice: three conversations of two turns, prompts of 600-1100
    // tokens (two or three 512-token ids), the second turn extending the first.
    let trace = dir.path().join("slice.jsonl");
    let mut lines = String::new();
    for conv in 0..3u32 {
        let base = conv * 10;
        lines += &format!(
            "{{\"timestamp\": {}, \"input_length\": 600, \"output_length\": 8, \"hash_ids\": [{}, {}]}}\n",
            conv * 50,
            base,
            base + 1
        );
        lines += &format!(
            "{{\"timestamp\": {}, \"input_length\": 1100, \"output_length\": 12, \"hash_ids\": [{}, {}, {}]}}\n",
            400 + conv * 50,
            base,
            base + 1,
            base + 2
        );
    }
    std::fs::write(&trace, lines).unwrap();
    let report = replay(
        &[
            "mooncake",
            "--trace",
            trace.to_str().unwrap(),
            "--speed",
            "2",
            "--endpoint",
            &endpoint,
        ],
        dir.path(),
        "mooncake-live",
    )
    .await;
    assert_eq!(report["mode"], "live");
    let run = &report["runs"][0];
    assert_eq!(run["requests_completed"], 6, "{report}");
    assert_eq!(run["requests_failed"], 0);
    assert_eq!(run["output_tokens"], 3 * 8 + 3 * 12);
    assert_eq!(run["prompt_tokens"], 3 * 600 + 3 * 1100);
    assert!(run["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(run["tpot_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(run["interactivity_tok_s"].as_f64().unwrap() > 0.0);

    // Closed-loop agent sessions: the parent, its subagent, then the second session.
    let report = replay(
        &[
            "agentx",
            "--trace",
            fixture().to_str().unwrap(),
            "--concurrency",
            "1,2",
            "--endpoint",
            &endpoint,
        ],
        dir.path(),
        "agentx-live",
    )
    .await;
    for run in report["runs"].as_array().unwrap() {
        assert_eq!(run["requests_completed"], 3, "{report}");
        assert_eq!(run["sessions_completed"], 2);
        assert_eq!(run["requests_failed"], 0);
    }
}
