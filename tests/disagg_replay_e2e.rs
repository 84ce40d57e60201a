//! `switchyard replay events` on a live recording of a disaggregating gateway, through the real
//! binaries: etcd, two prefill and two decode `switchyard worker` processes, and a
//! `switchyard gateway` recording under `--disaggregation enforce`, then `auto`. The replayed
//! live policy (`kv`) serves every recorded request through the serving core as the gateway
//! did: the same decode worker, the same serving mode and the same prefill worker, every time.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, eventually, tokens};
use switchyard_testkit::EtcdServer;

const PROMPT_BLOCKS: u64 = 36; // 512 shared + 64 own tokens, 16-token blocks

/// Whether some worker of `decision` (a decision as explain shows it) holds the whole prompt.
fn holds_prompt(decision: &Value) -> bool {
    decision["explanation"]["workers"]
        .as_array()
        .is_some_and(|ws| ws.iter().any(|w| w["overlap"]["device"] == PROMPT_BLOCKS))
}

/// Records a shared-prefix workload (prompts from `seed`: a new one leaves the workers' caches
/// of earlier prompts out of play) on a gateway in `mode` and returns the recording.
async fn record(endpoint: &str, cluster: &str, mode: &str, seed: u32, dir: &Path) -> PathBuf {
    let gateway = Launch::gateway(endpoint, cluster)
        .arg("--disaggregation", mode)
        .arg("--disagg-min-uncached-tokens", "256")
        .arg("--admin-token", "s3cret")
        .arg("--recording-dir", dir.to_str().unwrap())
        .start()
        .await;
    let api = Api::new(&gateway);
    let admin = Api::new(&gateway).with_token("s3cret");
    assert!(
        admin.lists_workers(4).await,
        "gateway sees all four workers"
    );
    let (status, started) = admin
        .post(
            "/admin/recording/start",
            &json!({"path": format!("{mode}.jsonl")}),
        )
        .await;
    assert_eq!(status, 200, "{started}");
    // 3 groups of 4 requests sharing a 512-token prefix, interleaved: a group's first request
    // computes its prompt, later ones find the prefix cached.
    for round in 0..4u32 {
        for group in 0..3u32 {
            let mut prompt = tokens(seed + group, 512);
            prompt.extend(tokens(seed * 100 + round * 10 + group, 64));
            let body =
                json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true});
            let (status, body) = api.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{mode}: {body}");
            // Let the request's KV events (prefill and decode worker) reach the index before
            // the next request, so the recording's order is the order of the decisions.
            let indexed = eventually(Duration::from_secs(10), || async {
                let (_, explain) = admin
                    .post(
                        "/admin/explain",
                        &json!({"model": "sim-8b", "prompt": prompt}),
                    )
                    .await;
                let prefill = &explain["disaggregation"]["prefill"];
                holds_prompt(&explain["decision"]) && (prefill.is_null() || holds_prompt(prefill))
            })
            .await;
            assert!(indexed, "{mode}: the request's blocks reached the index");
        }
    }
    let (code, stopped) = admin.post("/admin/recording/stop", &json!({})).await;
    assert_eq!(code, 200, "{stopped}");
    assert_eq!(stopped["complete"], true, "{stopped}");
    PathBuf::from(stopped["path"].as_str().unwrap())
}

/// Replays `recording` with the real binary: the report's policies by name.
fn replay(recording: &Path, out: &Path) -> Value {
    let replay = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "events", "--recording"])
        .arg(recording)
        .args(["--policies", "kv,round-robin", "--out"])
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert!(
        replay.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    eprintln!("{stdout}");
    serde_json::from_str(&std::fs::read_to_string(out.join("events.json")).unwrap()).unwrap()
}

fn policy(report: &Value, name: &str) -> Value {
    report["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == name)
        .unwrap_or_else(|| panic!("{name} in {report}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_live_policy_agrees_with_disaggregated_live_decisions() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("disagg-replay-{}", std::process::id());
    let start = |id: &str, role: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--speedup", "20")
            .arg("--max-context", "8192")
            .role(role)
            .id(id)
            .start()
    };
    let _workers = [
        start("prefill-a", "prefill").await,
        start("prefill-b", "prefill").await,
        start("decode-a", "decode").await,
        start("decode-b", "decode").await,
    ];
    let dir = tempfile::tempdir().unwrap();

    for (mode, seed) in [("enforce", 70), ("auto", 80)] {
        let path = record(&endpoint, &cluster, mode, seed, dir.path()).await;
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["version"], 2);
        assert_eq!(lines[0]["serve"]["disaggregation"], mode);
        let routes: Vec<&Value> = lines.iter().filter(|l| l["type"] == "route").collect();
        assert_eq!(routes.len(), 12, "{mode}");
        let disaggregated = routes
            .iter()
            .filter(|r| r["served"] == "disaggregated")
            .count();
        match mode {
            // Every request through the prefill pool.
            "enforce" => assert_eq!(disaggregated, 12),
            // Each group's first request computes 576 tokens (prefilled elsewhere); the
            // others find 512 cached on their decode worker: 64 uncached, below 256.
            _ => assert_eq!(disaggregated, 3, "{routes:?}"),
        }
        for r in &routes {
            assert_eq!(r["prefill_pool"], true, "{r}");
            if r["served"] == "disaggregated" {
                let prefill = &r["prefill"];
                assert!(prefill["chosen"].as_str().unwrap().starts_with("prefill-"));
                assert_eq!(prefill["candidates"].as_array().unwrap().len(), 2, "{r}");
            }
        }

        let report = replay(&path, &dir.path().join(format!("{mode}-report")));
        assert_eq!(report["disaggregation"], mode);
        assert_eq!(report["live_policy"], "kv");
        let kv = policy(&report, "kv");
        assert_eq!(kv["decisions"], 12, "{mode}: {kv}");
        assert_eq!(kv["failures"], 0, "{mode}: {kv}");
        // The same inputs in the same order through the same serving core: the decode worker,
        // the serving mode and the prefill worker are the live ones, every time.
        assert_eq!(kv["agreement"], 1.0, "{mode}: {kv}");
        assert_eq!(kv["stage_agreement"], 1.0, "{mode}: {kv}");
        assert_eq!(kv["disaggregated"], disaggregated, "{mode}: {kv}");
        assert_eq!(kv["prefill_decisions"], disaggregated, "{mode}: {kv}");
        assert_eq!(kv["prefill_agreement"], 1.0, "{mode}: {kv}");
        let live = policy(&report, "live (kv)");
        assert_eq!(kv["cached_tokens"], live["cached_tokens"], "{kv} vs {live}");
        assert_eq!(policy(&report, "round-robin")["decisions"], 12);
    }
}
