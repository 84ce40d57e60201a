//! Gateway replicas that serve as one (issue 17): a session's turns sent alternately to two
//! replicas, real processes over a real etcd, keep their worker and are tokenized
//! incrementally, because each turn is served by the replica that owns the session; and
//! `switchyard up --gateways N` starts N replicas that find each other.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, eventually, refused_at_start};
use switchyard_testkit::EtcdServer;

/// The growing conversation of a session: turn `n` resends the whole history.
fn turn(history: &[Value], n: usize) -> (Vec<Value>, Value) {
    let mut messages = history.to_vec();
    let words: String = (0..60).map(|i| format!("turn{n}word{i} ")).collect();
    messages.push(json!({"role": "user", "content": words}));
    let body =
        json!({"model": "sim-8b", "messages": messages, "max_tokens": 4, "ignore_eos": true});
    (messages, body)
}

#[tokio::test]
async fn a_sessions_turns_alternating_over_two_replicas_keep_their_worker_and_tokenize_incrementally()
 {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = "fleet";
    // Replica a runs with the workers; replica b is a gateway of its own, in another process.
    let a = Launch::up(3)
        .arg("--etcd", &endpoint)
        .arg("--cluster", cluster)
        .args(["--fleet-sessions"])
        .arg("--replica-id", "a")
        .start()
        .await;
    let b = Launch::gateway(&endpoint, cluster)
        .args(["--fleet-sessions"])
        .arg("--replica-id", "b")
        .start()
        .await;
    let (api_a, api_b) = (Api::new(&a), Api::new(&b));
    assert!(api_b.lists_workers(3).await);
    assert!(
        eventually(Duration::from_secs(20), || async {
            api_a.metric("switchyard_fleet_replicas").await == 2.0
                && api_b.metric("switchyard_fleet_replicas").await == 2.0
        })
        .await,
        "the replicas did not find each other"
    );

    let session = "agent-session-1";
    let mut history = Vec::new();
    let turns = 6;
    for n in 0..turns {
        let (messages, body) = turn(&history, n);
        let api = if n % 2 == 0 { &api_a } else { &api_b };
        let request = api
            .http
            .post(format!("{}/v1/chat/completions", api.base))
            .header("x-session-id", session)
            .json(&body);
        let (status, answer) = api.send(request).await;
        assert_eq!(status, 200, "turn {n}: {answer}");
        history = messages;
        history.push(
            json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}),
        );
    }

    // One replica owns the session: it served every turn, half of them forwarded to it.
    let forwarded = [
        api_a
            .metric("switchyard_fleet_forwarded_requests{outcome=\"forwarded\"}")
            .await,
        api_b
            .metric("switchyard_fleet_forwarded_requests{outcome=\"forwarded\"}")
            .await,
    ];
    let received = [
        api_a.metric("switchyard_fleet_received_requests").await,
        api_b.metric("switchyard_fleet_received_requests").await,
    ];
    let (owner, other) = if received[0] > 0.0 {
        (&api_a, &api_b)
    } else {
        (&api_b, &api_a)
    };
    assert_eq!(
        forwarded.iter().sum::<f64>(),
        (turns / 2) as f64,
        "{forwarded:?}"
    );
    assert_eq!(
        received.iter().sum::<f64>(),
        (turns / 2) as f64,
        "{received:?}"
    );
    assert!(
        forwarded[0] == 0.0 || forwarded[1] == 0.0,
        "only the replica that does not own the session forwards: {forwarded:?}"
    );
    for api in [&api_a, &api_b] {
        assert_eq!(
            api.metric("switchyard_fleet_forwarded_requests{outcome=\"owner_unreachable\"}")
                .await,
            0.0
        );
    }
    // Tokenized incrementally after the first turn, all at the owner.
    assert_eq!(
        owner
            .metric("switchyard_tokenizer_turns{tokenization=\"full\"}")
            .await,
        1.0
    );
    assert_eq!(
        owner
            .metric("switchyard_tokenizer_turns{tokenization=\"incremental\"}")
            .await,
        (turns - 1) as f64
    );
    assert_eq!(other.metric("switchyard_tokenizer_turns").await, 0.0);
    // And routed to one worker: every decision at the owner chose the same one.
    let (_, decisions) = owner.get(&format!("/admin/decisions?limit={turns}")).await;
    let chosen: Vec<&str> = decisions
        .as_array()
        .expect("decisions")
        .iter()
        .map(|d| d["explanation"]["chosen"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(chosen.len(), turns, "{decisions}");
    assert!(
        chosen.iter().all(|w| *w == chosen[0] && !w.is_empty()),
        "{chosen:?}"
    );
}

#[tokio::test]
async fn up_starts_gateway_replicas_that_share_the_workers_and_each_other() {
    let up = Launch::up(2).arg("--gateways", "2").start().await;
    let urls = up.ready["gateways"]
        .as_array()
        .expect("gateways in the ready line");
    assert_eq!(urls.len(), 2, "{}", up.ready);
    for url in urls {
        let base = url
            .as_str()
            .expect("url")
            .trim_end_matches("/v1")
            .to_owned();
        let api = Api::at(&base);
        assert!(api.lists_workers(2).await, "{base} lists the workers");
        assert!(
            eventually(Duration::from_secs(20), || async {
                api.metric("switchyard_fleet_replicas").await == 2.0
            })
            .await,
            "{base} sees both replicas"
        );
        let body = json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        let request = api
            .http
            .post(format!("{base}/v1/chat/completions"))
            .header("x-session-id", "s")
            .json(&body);
        let (status, answer) = api.send(request).await;
        assert_eq!(status, 200, "{answer}");
    }
}

#[tokio::test]
async fn a_live_replay_spreads_over_the_replicas_as_a_service_would() {
    let up = Launch::up(2)
        .arg("--gateways", "2")
        .arg("--speedup", "20")
        .start()
        .await;
    let urls: Vec<String> = up.ready["gateways"]
        .as_array()
        .expect("gateways")
        .iter()
        .map(|u| u.as_str().expect("url").to_owned())
        .collect();
    let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/agentx/fixtures/weka-two-plays.jsonl");
    let dir = tempfile::tempdir().unwrap();
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "agentx", "--trace", fixture.to_str().unwrap()])
        .args([
            "--concurrency",
            "2",
            "--endpoint",
            &urls[0],
            "--spread-over",
            &urls[1],
        ])
        .args(["--out", dir.path().to_str().unwrap(), "--name", "spread"])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("replay finishes within 120 s")
        .expect("run switchyard replay");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("spread.json")).unwrap())
            .unwrap();
    assert_eq!(report["runs"][0]["requests_completed"], 3, "{report}");
    assert_eq!(report["runs"][0]["requests_failed"], 0);
    // Each replica took requests from the client: served them, or forwarded them to the
    // session's owner.
    for url in &urls {
        let api = Api::at(url.trim_end_matches("/v1"));
        let reached = api.metric("switchyard_requests").await
            + api.metric("switchyard_fleet_forwarded_requests").await
            - api.metric("switchyard_fleet_received_requests").await;
        assert!(reached >= 1.0, "{url} got no request from the client");
    }
}

#[tokio::test]
async fn fleet_settings_that_cannot_work_are_refused_at_start() {
    refused_at_start(&["up", "--gateways", "0"], "--gateways").await;
    refused_at_start(
        &["epp", "--etcd", "127.0.0.1:1", "--fleet-sessions"],
        "share_sessions",
    )
    .await;
    refused_at_start(
        &[
            "gateway",
            "--etcd",
            "127.0.0.1:1",
            "--fleet-sessions",
            "--replica-id",
            "a/b",
        ],
        "fleet.replica_id",
    )
    .await;
}
