//! Retention hints end to end through the real binary (`switchyard up`, one simulated worker
//! with a 64-block cache, half of it the retention budget): a session's prefix survives a
//! burst of other traffic across its pause when the gateway sends hints, and is gone when it
//! does not; a new session is admitted at once while the retention budget is full.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, eventually, tokens};

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// One completion of `prompt`; a turn of `session` when given (`x-session-id`), else
/// anonymous traffic. Returns the answer's body.
async fn complete(api: &Api, session: Option<&str>, prompt: &[u32]) -> Value {
    let body = json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true});
    let mut request = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&body);
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let (status, body) = api.send(request).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Session `a`'s first turn (20 blocks), a burst of 8 other requests of 20 blocks each (2.5
/// times the cache), then `a`'s next turn on top of its first: the cached tokens it reports.
async fn second_turn_cached_tokens(retention: bool) -> (u64, Api, support::SwitchyardProcess) {
    let mut launch = Launch::up(1)
        .arg("--speedup", "50")
        .arg("--kv-blocks", "64")
        .arg("--max-context", "1024")
        .arg("--admin-token", "s3cret");
    if retention {
        launch = launch.args(["--session-retention"]);
    }
    let up = launch.start().await;
    let api = Api::new(&up);
    let first = tokens(1, 320);
    complete(&api, Some("a"), &first).await;
    for i in 0..8 {
        complete(&api, None, &tokens(100 + i, 320)).await;
    }
    let mut next = first.clone();
    next.extend(tokens(2, 32));
    let body = complete(&api, Some("a"), &next).await;
    (cached(&body), api, up)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_prefix_outlives_a_burst_only_with_retention_hints() {
    let (without, _, up) = second_turn_cached_tokens(false).await;
    drop(up);
    assert_eq!(without, 0, "LRU alone evicts the paused session's prefix");

    let (with, api, up) = second_turn_cached_tokens(true).await;
    assert_eq!(with, 320, "the hint kept the whole prefix");
    // The decision log shows the hint sent with the session's turn (its first turn: the
    // initial 60 s), and none with anonymous traffic.
    let admin = Api::new(&up).with_token("s3cret");
    let shown = eventually(Duration::from_secs(10), || async {
        let (_, log) = admin.get("/admin/decisions?session=a&limit=5").await;
        log.as_array().is_some_and(|entries| {
            entries.len() == 2
                && entries
                    .iter()
                    .all(|e| e["outcome"]["retention"]["ttl_ms"].as_u64().is_some())
        })
    })
    .await;
    let (_, log) = admin.get("/admin/decisions?session=a&limit=5").await;
    assert!(shown, "{log:#}");
    let (_, all) = admin.get("/admin/decisions?limit=20").await;
    let hinted = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !e["outcome"]["retention"].is_null())
        .count();
    assert_eq!(hinted, 2, "only the session's turns carry hints: {all:#}");

    // Two more pinned sessions fill the budget (32 blocks) past its end; a new session whose
    // prompt needs 60 of the 64 blocks is still admitted and served, evicting pinned blocks.
    complete(&api, Some("b"), &tokens(3, 320)).await;
    complete(&api, Some("c"), &tokens(4, 320)).await;
    let body = complete(&api, Some("d"), &tokens(5, 960)).await;
    assert_eq!(body["usage"]["prompt_tokens"], 960, "{body}");
}
