//! The gateway's routing end to end through the real binary: the admin API, KV-aware routing
//! against round-robin, and a KV recording that replays offline to the live decisions.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, eventually, tokens};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_routing_follows_prefixes_and_beats_round_robin() {
    let up = Launch::up(4)
        .arg("--speedup", "50")
        .arg("--admin-token", "s3cret")
        .start()
        .await;
    let api = Api::new(&up);
    let admin = Api::new(&up).with_token("s3cret");
    // The admin API wants the token.
    let (status, err) = api.get("/admin/workers").await;
    assert_eq!(status, 401);
    assert_eq!(err["error"]["type"], "authentication_error");

    // A long prefix, then the same prefix with a new suffix: the second goes where the first
    // left its blocks, and explain says why.
    let prefix = tokens(3, 1024);
    let first = json!({"model": "sim-8b", "prompt": prefix, "max_tokens": 2, "ignore_eos": true});
    let (status, body) = api.post("/v1/completions", &first).await;
    assert_eq!(status, 200, "{body}");
    let (_, decisions) = admin.get("/admin/decisions?limit=1").await;
    let holder = decisions[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    // Wait until the holder's KV events reached the index.
    let indexed =
        eventually(Duration::from_secs(10), || async {
            let (_, workers) = admin.get("/admin/workers").await;
            workers.as_array().unwrap().iter().any(|w| {
                w["id"] == holder.as_str() && w["indexed_blocks"].as_u64().unwrap_or(0) >= 64
            })
        })
        .await;
    assert!(indexed, "the prompt's blocks reached the index");
    let mut second_prompt = prefix.clone();
    second_prompt.extend(tokens(4, 100));
    let (_, explain) = admin
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": second_prompt}),
        )
        .await;
    let decision = &explain["decision"];
    assert_eq!(decision["worker"], holder.as_str(), "{explain}");
    let holder_score = decision["explanation"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == holder.as_str())
        .unwrap();
    assert_eq!(holder_score["overlap"]["device"], 64, "{holder_score}");
    assert!(
        decision["explanation"]["why"]
            .as_str()
            .unwrap()
            .contains(&holder)
    );
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": second_prompt, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 1008,
        "{body}"
    );

    // Shared-prefix workload: 5 groups of 4 requests sharing a 512-token prefix, interleaved.
    // (5 groups over 4 workers: round-robin never sends a group back to the same worker.)
    async fn workload(api: &Api, admin: &Api, seed: u32) -> f64 {
        let mut cached = 0u64;
        let mut total = 0u64;
        for round in 0..4 {
            for group in 0..5 {
                let mut prompt = tokens(seed + group, 512);
                prompt.extend(tokens(seed * 100 + round * 10 + group, 64));
                let (status, body) = api
                    .post(
                        "/v1/completions",
                        &json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
                    )
                    .await;
                assert_eq!(status, 200, "{body}");
                cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                total += body["usage"]["prompt_tokens"].as_u64().unwrap();
                // Wait until this request's KV events reached the gateway: some worker's
                // indexed prefix covers the whole prompt (36 blocks of 16).
                let indexed = eventually(Duration::from_secs(10), || async {
                    let (_, explain) = admin
                        .post(
                            "/admin/explain",
                            &json!({"model": "sim-8b", "prompt": prompt}),
                        )
                        .await;
                    explain["decision"]["explanation"]["workers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|w| w["overlap"]["device"] == 36)
                })
                .await;
                assert!(indexed, "the request's blocks reached the index");
            }
        }
        cached as f64 / total as f64
    }
    let kv_hit = workload(&api, &admin, 10).await;
    let (status, _) = admin
        .put("/admin/policy", &json!({"policy": "round-robin"}))
        .await;
    assert_eq!(status, 200);
    let rr_hit = workload(&api, &admin, 20).await;
    eprintln!("cache hit rate: kv {kv_hit:.3}, round-robin {rr_hit:.3}");
    assert!(
        kv_hit > 0.5 && kv_hit > rr_hit + 0.3,
        "kv {kv_hit:.3} should clearly beat round-robin {rr_hit:.3}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_recording_replays_offline_and_kv_agrees_with_the_live_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let recordings = dir.path().join("recordings");
    std::fs::create_dir(&recordings).unwrap();
    let up = Launch::up(3)
        .arg("--speedup", "50")
        .arg("--admin-token", "s3cret")
        .arg("--recording-dir", recordings.to_str().unwrap())
        .start()
        .await;
    let api = Api::new(&up);
    let admin = Api::new(&up).with_token("s3cret");
    // The token is required, and paths outside the recording directory are refused.
    assert_eq!(api.post("/admin/recording/start", &json!({})).await.0, 401);
    let (status, err) = admin
        .post("/admin/recording/start", &json!({"path": "../x.jsonl"}))
        .await;
    assert_eq!(status, 400, "{err}");
    let (status, err) = admin
        .post("/admin/recording/start", &json!({"path": "/tmp/x.jsonl"}))
        .await;
    assert_eq!(status, 400, "{err}");
    let (status, started) = admin
        .post("/admin/recording/start", &json!({"path": "run.jsonl"}))
        .await;
    assert_eq!(status, 200, "{started}");
    assert_eq!(started["active"], true);
    let (status, again) = admin
        .post("/admin/recording/start", &json!({"path": "other.jsonl"}))
        .await;
    assert_eq!(status, 400, "one recording at a time: {again}");

    // Shared-prefix workload: 4 groups of 5 requests sharing a 512-token prefix, interleaved
    // (4 groups over 3 workers: round-robin rarely sends a group back where its prefix is).
    for round in 0..5u32 {
        for group in 0..4u32 {
            let mut prompt = tokens(40 + group, 512);
            prompt.extend(tokens(4000 + round * 10 + group, 64));
            let body =
                json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true});
            let (status, body) = api.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{body}");
            // Let the request's KV events reach the index before the next one.
            let indexed = eventually(Duration::from_secs(10), || async {
                let (_, explain) = admin
                    .post(
                        "/admin/explain",
                        &json!({"model": "sim-8b", "prompt": prompt}),
                    )
                    .await;
                explain["decision"]["explanation"]["workers"]
                    .as_array()
                    .is_some_and(|ws| ws.iter().any(|w| w["overlap"]["device"] == 36))
            })
            .await;
            assert!(indexed, "the request's blocks reached the index");
        }
    }
    let (_, status) = admin.get("/admin/recording").await;
    assert_eq!(status["active"], true, "{status}");
    let (code, stopped) = admin.post("/admin/recording/stop", &json!({})).await;
    assert_eq!(code, 200, "{stopped}");
    assert_eq!(stopped["dropped"], 0, "{stopped}");
    assert_eq!(stopped["complete"], true, "{stopped}");
    let path = std::path::PathBuf::from(stopped["path"].as_str().unwrap());
    assert!(path.starts_with(recordings.canonicalize().unwrap()));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        stopped["bytes"].as_u64().unwrap()
    );
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["type"], "header");
    assert_eq!(lines[0]["format"], "switchyard-kv-recording");
    assert_eq!(lines.last().unwrap()["type"], "trailer");
    let count = |kind: &str| lines.iter().filter(|l| l["type"] == kind).count();
    assert!(
        count("snapshot") >= 3,
        "starting a recording resyncs every worker"
    );
    assert_eq!(count("route"), 20);
    assert_eq!(count("finished"), 20);
    assert!(count("kv_event") > 0 && count("load") > 0);

    // Replay it offline with the real binary.
    let out = dir.path().join("report");
    let replay = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "events", "--recording"])
        .arg(&path)
        .args(["--policies", "kv,round-robin", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert!(
        replay.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    eprintln!("{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("events.json")).unwrap()).unwrap();
    assert_eq!(report["complete"], true);
    assert_eq!(report["index"]["gaps"], 0, "{report}");
    let policy = |name: &str| {
        report["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["policy"] == name)
            .unwrap_or_else(|| panic!("{name} in {report}"))
            .clone()
    };
    let (live, kv, rr) = (policy("live (kv)"), policy("kv"), policy("round-robin"));
    assert_eq!(kv["decisions"], 20);
    // The same inputs in the same order: the replayed kv policy decides exactly as live did.
    assert_eq!(kv["agreement"], 1.0, "{kv}");
    assert_eq!(kv["cached_tokens"], live["cached_tokens"], "{kv} vs {live}");
    let hit = |p: &Value| p["hit_rate"].as_f64().unwrap();
    assert!(hit(&kv) > hit(&rr), "kv {kv} should beat round-robin {rr}");
    assert!(out.join("events.csv").exists());
}
