//! The command line as a new user meets it, with the real binary: `--version` names the build's
//! git revision, replays find their default traces from any directory and show progress when
//! nothing is a terminal, logs carry no colour codes when stderr is a pipe, and listen
//! addresses take host names (`--http localhost:PORT`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

/// The binary allocates with mimalloc (its global allocator, chosen for the gateway's CPU per
/// request, `docs/BENCHMARKS.md`): asked to, mimalloc announces its start on stderr, which the
/// system allocator never does.
#[tokio::test]
async fn the_binary_allocates_with_mimalloc() {
    let out = Command::new(BIN)
        .arg("--version")
        .env("MIMALLOC_VERBOSE", "1")
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mimalloc: process init"), "{stderr}");
}

#[tokio::test]
async fn version_names_the_git_revision() {
    let out = Command::new(BIN).arg("--version").output().await.unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let expected_rev = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8(o.stdout).unwrap().trim().to_owned());
    assert!(
        text.starts_with(&format!("switchyard {} (git ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    if let Some(rev) = expected_rev {
        assert!(text.contains(&rev), "{text} should name {rev}");
    }
}

#[tokio::test]
async fn replay_finds_its_default_trace_from_any_directory_and_shows_progress_in_a_pipe() {
    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["replay", "mooncake", "--limit", "40", "--policies", "kv"])
        .current_dir(elsewhere.path())
        .env_remove("SWITCHYARD_DATA")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("conversation_trace.jsonl"),
        "the default trace is named: {stdout}"
    );
    assert!(
        stderr.contains("/40 requests (") && stderr.contains("ETA"),
        "a progress line on stderr: {stderr}"
    );
    assert!(!stderr.contains('\u{1b}'), "no escape codes: {stderr:?}");
}

#[tokio::test]
async fn a_missing_trace_names_the_flag() {
    let out = Command::new(BIN)
        .args([
            "replay",
            "agentx",
            "--trace",
            "/nonexistent/sessions.jsonl.gz",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/sessions.jsonl.gz"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_listens_on_a_host_name_and_logs_plain_text_to_a_pipe() {
    let mut child = Command::new(BIN)
        .args(["up", "--http", "localhost:0", "--workers", "1"])
        .env("SWITCHYARD_LOG", "info")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("ready within 60 s")
        .unwrap()
        .expect("a ready line");
    let ready: serde_json::Value = serde_json::from_str(&line).unwrap();
    let address = ready["address"].as_str().unwrap();
    assert!(
        address.starts_with("127.0.0.1:"),
        "localhost resolves to IPv4 loopback: {ready}"
    );
    let models = reqwest::get(format!("http://{address}/v1/models"))
        .await
        .unwrap();
    assert_eq!(models.status(), 200);

    let pid = child.id().unwrap() as i32;
    // mimalloc is built without transparent huge pages (`docs/operations.md`): where the kernel
    // gives them only to memory that asks (`madvise`, this machine's default), the process holds
    // none (≈ 70 MiB of them here when mimalloc asked).
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[madvise]") {
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
        let huge = rollup
            .lines()
            .find_map(|l| l.strip_prefix("AnonHugePages:"))
            .expect("AnonHugePages in smaps_rollup");
        assert_eq!(huge.trim(), "0 kB", "{rollup}");
    }
    // SIGTERM: a clean shutdown, so every log line is written.
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(stderr.contains("INFO"), "some log lines: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in piped logs: {stderr:?}"
    );
}

/// Runs the real binary to completion and returns (success, stdout, stderr).
async fn run_switchyard(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn offline_runs_in_parallel_report_what_serial_runs_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let common = [
        "mooncake",
        "--limit",
        "60",
        "--policies",
        "kv,round-robin",
        "--speed",
        "1,4",
        "--sim-block-size",
        "64",
        "--kv-blocks",
        "2048",
        "--out",
        out,
    ];
    let serial: Vec<&str> = ["replay"]
        .into_iter()
        .chain(common)
        .chain(["--threads", "1", "--name", "serial"])
        .collect();
    let (ok, stdout, stderr) = run_switchyard(&serial).await;
    assert!(ok, "{stdout}\n{stderr}");
    let parallel: Vec<&str> = ["bench"]
        .into_iter()
        .chain(common)
        .chain(["--threads", "3", "--name", "parallel"])
        .collect();
    let (ok, stdout, stderr) = run_switchyard(&parallel).await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("3 threads"), "{stdout}");
    assert!(stdout.contains("all runs: "), "{stdout}");
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
    let report = read("serial.json");
    assert!(report.contains("round-robin"), "{report}");
    assert_eq!(report, read("parallel.json"));
    assert_eq!(read("serial.csv"), read("parallel.csv"));
}

#[tokio::test]
async fn threads_are_refused_for_a_live_replay() {
    let (ok, _, stderr) = run_switchyard(&[
        "replay",
        "mooncake",
        "--limit",
        "4",
        "--endpoint",
        "http://127.0.0.1:9/v1",
        "--threads",
        "2",
    ])
    .await;
    assert!(!ok);
    assert!(stderr.contains("--threads"), "{stderr}");
}

#[tokio::test]
async fn agentx_truncation_drops_long_calls_and_reports_the_ttft_floor() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/agentx/fixtures/weka-two-plays.jsonl");
    let dir = tempfile::tempdir().unwrap();
    // play-a's first call is 4 + 2 tokens: over 5, dropped; its sub-agent (4 + 1) and play-b
    // (4 + 0) stay.
    let out = Command::new(BIN)
        .args(["replay", "agentx", "--policies", "kv", "--concurrency", "1"])
        .args(["--truncate-tokens", "5", "--name", "cut"])
        .arg("--trace")
        .arg(&fixture)
        .arg("--out")
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json = std::fs::read_to_string(dir.path().join("cut.json")).unwrap();
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let workload = &report["settings"]["workload"];
    assert_eq!(workload["calls_kept"], 2, "{workload}");
    assert_eq!(workload["calls_dropped"], 1, "{workload}");
    let run = &report["runs"][0];
    assert_eq!(run["requests_completed"], 2, "{run}");
    assert!(run["ttft_floor_ms"]["p99"].as_f64().unwrap() > 0.0, "{run}");

    let crossed = Command::new(BIN)
        .args(["replay", "agentx", "--policies", "kv", "--concurrency", "1"])
        .args(["--truncate-tokens", "5", "--min-call-tokens", "6"])
        .arg("--trace")
        .arg(&fixture)
        .output()
        .await
        .unwrap();
    assert_eq!(crossed.status.code(), Some(64), "a configuration error");
    let stderr = String::from_utf8_lossy(&crossed.stderr);
    assert!(stderr.contains("--truncate-tokens"), "{stderr}");
}
