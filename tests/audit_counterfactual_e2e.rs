//! Asking the router after the fact, end to end through the real binary: a logged decision
//! re-scored under another policy gives what that policy chooses (checked against the policy
//! itself, switched in live), over the index as it was; `switchyard replay events` counts only
//! one session's or tenant's decisions; and the Grafana dashboard the chart ships queries only
//! metrics a live gateway exports.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, eventually, tokens};

/// Sends a completion with `x-request-id` (and `x-session-id` when given); returns the body.
async fn complete(api: &Api, request_id: &str, session: Option<&str>, body: &Value) -> Value {
    let mut request = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .header("x-request-id", request_id);
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let response = request.json(body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn prompt_body(prompt: &[u32], user: &str) -> Value {
    json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true, "user": user})
}

/// Waits until some worker's indexed overlap with `prompt` reaches `blocks` device blocks.
async fn indexed(api: &Api, prompt: &[u32], blocks: u64) -> bool {
    eventually(Duration::from_secs(10), || async {
        let (_, explain) = api
            .post(
                "/admin/explain",
                &json!({"model": "sim-8b", "prompt": prompt}),
            )
            .await;
        explain["decision"]["explanation"]["workers"]
            .as_array()
            .is_some_and(|ws| ws.iter().any(|w| w["overlap"]["device"] == blocks))
    })
    .await
}

async fn decision(api: &Api, request_id: &str) -> Value {
    let (status, found) = api
        .get(&format!("/admin/decisions?request_id={request_id}"))
        .await;
    assert_eq!(status, 200, "{found}");
    found[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logged_decision_rescored_under_another_policy_gives_that_policys_choice() {
    let up = Launch::up(3).arg("--speedup", "50").start().await;
    let api = Api::new(&up);

    // cf-1 is cold; once its blocks are indexed, cf-2 (same 512-token prefix) goes where they
    // are under the live kv policy.
    let prefix = tokens(21, 512);
    complete(&api, "cf-1", None, &prompt_body(&prefix, "alice")).await;
    assert!(
        indexed(&api, &prefix, 32).await,
        "cf-1's blocks reached the index"
    );
    let mut longer = prefix.clone();
    longer.extend(tokens(22, 64));
    complete(&api, "cf-2", None, &prompt_body(&longer, "alice")).await;
    let live = decision(&api, "cf-2").await;
    let hot = live["worker"].as_str().unwrap().to_owned();

    // Re-scored under the live policy: the same choice and the same per-worker breakdown.
    let (status, same) = api.get("/admin/explain?request_id=cf-2&policy=kv").await;
    assert_eq!(status, 200, "{same}");
    assert_eq!(same["policy"], "kv");
    assert_eq!(same["index"], "recorded");
    let only = &same["decisions"][0];
    assert_eq!(same["decisions"].as_array().unwrap().len(), 1, "{same}");
    assert_eq!(only["id"], live["id"]);
    assert_eq!(only["live"], json!({"policy": "kv", "worker": hot}));
    assert_eq!(only["counterfactual"]["worker"], hot.as_str());
    assert_eq!(only["differs"], false);
    assert_eq!(
        only["counterfactual"]["explanation"]["workers"], live["explanation"]["workers"],
        "the recorded load and overlap, scored again"
    );

    // The index as recorded: cf-1 was cold when it was decided, though its worker holds the
    // prompt now.
    let (_, cold) = api.get("/admin/explain?request_id=cf-1&policy=kv").await;
    let workers = cold["decisions"][0]["counterfactual"]["explanation"]["workers"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(workers.len(), 3, "{cold}");
    assert!(
        workers.iter().all(|w| w["overlap"]["device"] == 0),
        "{cold}"
    );

    // Under round-robin (a fresh one: its first turn), asked by POST as explain is.
    let (status, rr) = api
        .post(
            "/admin/explain",
            &json!({"request_id": "cf-2", "policy": "round-robin"}),
        )
        .await;
    assert_eq!(status, 200, "{rr}");
    let rr = &rr["decisions"][0];
    let rr_choice = rr["counterfactual"]["worker"].as_str().unwrap().to_owned();
    assert_eq!(rr["counterfactual"]["explanation"]["policy"], "round-robin");
    assert_eq!(rr["differs"], rr_choice != hot, "{rr}");
    // Round-robin switched in live (it starts fresh) decides the same request the same way.
    let (status, _) = api
        .put("/admin/policy", &json!({"policy": "round-robin"}))
        .await;
    assert_eq!(status, 200);
    complete(&api, "cf-3", None, &prompt_body(&longer, "alice")).await;
    let switched = decision(&api, "cf-3").await;
    assert_eq!(switched["explanation"]["policy"], "round-robin");
    assert_eq!(switched["worker"], rr_choice.as_str(), "{switched}");

    // By decision id, under least-loaded: it decides by the recorded load alone.
    let id = live["id"].as_u64().unwrap();
    let (status, ll) = api
        .get(&format!(
            "/admin/explain?decision_id={id}&policy=least-loaded"
        ))
        .await;
    assert_eq!(status, 200, "{ll}");
    let why = ll["decisions"][0]["counterfactual"]["explanation"]["why"]
        .as_str()
        .unwrap();
    assert!(why.contains("least loaded"), "{why}");

    // An unknown request is 404, an unknown or missing policy 400, each with a sentence.
    let (status, err) = api
        .get("/admin/explain?request_id=no-such-request&policy=kv")
        .await;
    assert_eq!(status, 404, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-request"),
        "{err}"
    );
    let (status, err) = api.get("/admin/explain?request_id=cf-2&policy=fifo").await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "policy", "{err}");
    let (status, err) = api
        .post("/admin/explain", &json!({"request_id": "cf-2"}))
        .await;
    assert_eq!(status, 400, "{err}");
    // The prompt form of explain is unchanged.
    let (status, prompt) = api
        .post(
            "/admin/explain",
            &json!({"model": "sim-8b", "prompt": longer}),
        )
        .await;
    assert_eq!(status, 200, "{prompt}");
    assert!(prompt["decision"]["worker"].is_string());
}

/// Runs `switchyard replay events` on `recording` with `extra` flags; returns the exit code,
/// the JSON report (when it succeeded) and stderr.
fn replay_events(recording: &Path, out: &Path, extra: &[&str]) -> (i32, Value, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "events", "--recording"])
        .arg(recording)
        .args(["--policies", "kv,round-robin", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    let code = output.status.code().unwrap_or(-1);
    let report = std::fs::read_to_string(out.join("events.json"))
        .ok()
        .filter(|_| code == 0)
        .map_or(Value::Null, |text| serde_json::from_str(&text).unwrap());
    (
        code,
        report,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn decisions_of(report: &Value, policy: &str) -> u64 {
    report["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == policy)
        .unwrap_or_else(|| panic!("{policy} in {report}"))["decisions"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_events_counts_only_one_sessions_or_tenants_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let recordings = dir.path().join("recordings");
    std::fs::create_dir(&recordings).unwrap();
    let up = Launch::up(2)
        .arg("--speedup", "50")
        .arg("--recording-dir", recordings.to_str().unwrap())
        .start()
        .await;
    let api = Api::new(&up);
    let (status, started) = api
        .post("/admin/recording/start", &json!({"path": "run.jsonl"}))
        .await;
    assert_eq!(status, 200, "{started}");
    // alice: 3 requests in session s-a; bob: 2 in s-b and 1 without a session.
    let sends = [
        ("s-a", "alice"),
        ("s-b", "bob"),
        ("s-a", "alice"),
        ("s-b", "bob"),
        ("s-a", "alice"),
        ("", "bob"),
    ];
    for (i, (session, user)) in sends.iter().enumerate() {
        let session = (!session.is_empty()).then_some(*session);
        let body = prompt_body(&tokens(60 + i as u32, 96), user);
        complete(&api, &format!("rp-{i}"), session, &body).await;
    }
    let (status, stopped) = api.post("/admin/recording/stop", &json!({})).await;
    assert_eq!(status, 200, "{stopped}");
    let path = std::path::PathBuf::from(stopped["path"].as_str().unwrap());
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["version"], 2, "{}", lines[0]);
    let tenants: BTreeSet<&str> = lines
        .iter()
        .filter(|l| l["type"] == "route")
        .map(|l| l["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(tenants, BTreeSet::from(["user:alice", "user:bob"]));

    let out = dir.path().join("all");
    let (code, all, stderr) = replay_events(&path, &out, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(decisions_of(&all, "live (kv)"), 6);
    assert!(all.get("filter").is_none(), "{all}");

    let out = dir.path().join("session");
    let (code, session, stderr) = replay_events(&path, &out, &["--session", "s-a"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(session["filter"], "session s-a");
    for policy in ["live (kv)", "kv", "round-robin"] {
        assert_eq!(decisions_of(&session, policy), 3, "{policy}: {session}");
    }
    let out = dir.path().join("tenant");
    let (code, tenant, stderr) = replay_events(&path, &out, &["--tenant", "user:bob"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(decisions_of(&tenant, "kv"), 3, "{tenant}");
    let out = dir.path().join("both");
    let (code, both, stderr) =
        replay_events(&path, &out, &["--tenant", "user:bob", "--session", "s-b"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(decisions_of(&both, "kv"), 2, "{both}");

    // A version 1 file (no tenants) still replays and filters by session; by tenant it is
    // refused with a sentence rather than matching nothing.
    let v1: String = lines
        .iter()
        .map(|l| {
            let mut l = l.clone();
            if l["type"] == "header" {
                l["version"] = json!(1);
            }
            if let Some(map) = l.as_object_mut() {
                map.remove("tenant");
            }
            format!("{l}\n")
        })
        .collect();
    let old = dir.path().join("v1.jsonl");
    std::fs::write(&old, v1).unwrap();
    let out = dir.path().join("v1-session");
    let (code, session, stderr) = replay_events(&old, &out, &["--session", "s-a"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(decisions_of(&session, "kv"), 3, "{session}");
    let out = dir.path().join("v1-tenant");
    let (code, _, stderr) = replay_events(&old, &out, &["--tenant", "user:bob"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("version 1"), "{stderr}");
}

/// The chart's dashboard file.
fn dashboard() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/helm/switchyard/dashboards/switchyard-routing.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Every series name `/metrics` can show: each family's name with the suffixes of its type.
fn exported_names(metrics: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in metrics.lines() {
        let mut words = line.split_whitespace();
        if (words.next(), words.next()) != (Some("#"), Some("TYPE")) {
            continue;
        }
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        names.insert(name.to_owned());
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            "summary" => &["_sum", "_count", "_created"],
            "info" => &["_info"],
            _ => &[],
        };
        for suffix in suffixes {
            names.insert(format!("{name}{suffix}"));
        }
    }
    names
}

/// The metric names a PromQL expression uses: every `switchyard_…` identifier (labels and
/// functions of ours have no such prefix).
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("switchyard_") {
        let boundary = rest[..at]
            .chars()
            .last()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'));
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        if boundary {
            out.push(tail[..len].to_owned());
        }
        rest = &tail[len..];
    }
    out
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = stack.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            stack.extend(nested);
        }
        out.push(panel);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routing_dashboard_queries_only_metrics_a_live_gateway_exports() {
    let board = dashboard();
    assert!(
        board["schemaVersion"].as_u64().unwrap() >= 36,
        "schemaVersion"
    );
    assert!(board["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(board["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let datasource = &board["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a datasource variable")["query"];
    assert_eq!(datasource, "prometheus");

    let up = Launch::up(2).arg("--speedup", "50").start().await;
    let api = Api::new(&up);
    complete(&api, "dash-1", None, &prompt_body(&tokens(90, 64), "alice")).await;
    let scrape = || async {
        api.http
            .get(format!("{}/metrics", api.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // A decision's outcome is counted when its request's dispatch ends, which can come just
    // after the client has its answer.
    let outcome_counted = eventually(Duration::from_secs(10), || async {
        exported_names(&scrape().await).contains("switchyard_routing_decision_outcomes_total")
    })
    .await;
    assert!(outcome_counted, "the decision's outcome was never counted");
    let metrics = scrape().await;
    let exported = exported_names(&metrics);
    assert!(
        exported.contains("switchyard_route_accuracy_ratio"),
        "{metrics}"
    );

    let mut ids = BTreeSet::new();
    let mut used = BTreeSet::new();
    let mut graphs = 0;
    for panel in panels(&board) {
        let kind = panel["type"].as_str().unwrap();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "panel ids are unique"
        );
        assert!(panel["gridPos"]["w"].as_u64().is_some(), "{panel}");
        if kind == "row" {
            continue;
        }
        graphs += 1;
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{panel}"));
        assert!(!targets.is_empty(), "{} has no target", panel["title"]);
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{expr} queries none of our metrics");
            for name in names {
                assert!(
                    exported.contains(&name),
                    "panel {:?} queries {name}, which the gateway does not export",
                    panel["title"]
                );
                used.insert(name);
            }
        }
    }
    assert!(graphs >= 8, "{graphs} panels");
    // The template variables' queries too.
    for variable in board["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"]["query"].as_str() {
            for name in metric_names(query) {
                assert!(
                    exported.contains(&name),
                    "variable {} queries {name}",
                    variable["name"]
                );
            }
        }
    }
    // What the dashboard is for.
    for wanted in [
        "switchyard_route_accuracy_ratio",
        "switchyard_route_predicted_cached_tokens_total",
        "switchyard_route_realized_cached_tokens_total",
        "switchyard_worker_index_divergence_blocks",
        "switchyard_routing_decisions_total",
        "switchyard_time_to_first_token_seconds_bucket",
    ] {
        assert!(used.contains(wanted), "the dashboard shows {wanted}");
    }
    // The checker itself: a renamed metric is caught.
    assert!(!exported.contains("switchyard_route_accuracy"));
    assert_eq!(
        metric_names(
            "sum(rate(switchyard_requests_total{model=~\"$model\"}[5m])) / x_switchyard_y"
        ),
        ["switchyard_requests_total"]
    );
}
