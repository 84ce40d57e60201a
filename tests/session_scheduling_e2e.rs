//! Session scheduling end to end (`switchyard gateway --session-scheduling` over a real etcd
//! and one simulated worker announcing 64 blocks of 16 tokens): two sessions whose working sets
//! (40 blocks each) do not both fit. The second session's turn waits until the first session
//! leaves, or until its aging bound when the first stays; a client that goes away while its
//! turn waits takes only that turn out of the queue.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::EtcdServer;

/// A worker announcing 64 blocks of 16 tokens and `prefill_tokens_per_s` (what a held turn's
/// aging bound is made of), and a gateway scheduling sessions that leave after
/// `idle_seconds`; the admin log keeps decisions.
async fn cluster(
    etcd: &EtcdServer,
    name: &str,
    prefill_tokens_per_s: u32,
    idle_seconds: u32,
) -> (SwitchyardProcess, SwitchyardProcess, Api) {
    let cluster = format!("{name}-{}", std::process::id());
    let worker = Launch::worker(&etcd.endpoint(), &cluster)
        .id("w0")
        .arg("--block-size", "16")
        .arg("--kv-blocks", "64")
        .arg("--mean-output-tokens", "0")
        .arg(
            "--kv-prefill-tokens-per-s",
            &prefill_tokens_per_s.to_string(),
        )
        .start()
        .await;
    let gateway = Launch::gateway(&etcd.endpoint(), &cluster)
        .args(["--session-scheduling"])
        .arg("--session-idle-seconds", &idle_seconds.to_string())
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(1).await, "the gateway sees the worker");
    (worker, gateway, api)
}

/// A completion of `prompt` as a turn of `session`.
fn turn(api: &Api, session: &str, prompt: &[u32], max_tokens: u32) -> reqwest::RequestBuilder {
    let body = json!({"model": "sim-8b", "prompt": prompt, "max_tokens": max_tokens,
                      "ignore_eos": true});
    api.http
        .post(format!("{}/v1/completions", api.base))
        .header("x-session-id", session)
        .json(&body)
}

async fn served(api: &Api, request: reqwest::RequestBuilder) -> Value {
    let (status, body) = api.send(request).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// The decode decisions of `session`'s turns.
async fn decisions(api: &Api, session: &str) -> Vec<Value> {
    let (status, log) = api
        .get(&format!("/admin/decisions?session={session}&limit=10"))
        .await;
    assert_eq!(status, 200, "{log}");
    log.as_array().unwrap().clone()
}

/// 40 blocks: two such prompts overflow the worker's 64 by 16.
const FORTY_BLOCKS: u32 = 640;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_waits_until_the_resident_session_leaves_then_is_served() {
    let etcd = EtcdServer::start().expect("etcd");
    // Prefill at 1 token/s: the aging bound of b's turn (16 blocks over) is 256 s, so only a
    // leaving (1 s after its turn ends) lets b go.
    let (_worker, _gateway, api) = cluster(&etcd, "sessions-room", 1, 1).await;
    let a = {
        let request = turn(&api, "a", &tokens(1, FORTY_BLOCKS), 300);
        let api = Api::at(&api.base);
        tokio::spawn(async move { served(&api, request).await })
    };
    let running = eventually(Duration::from_secs(10), || async {
        let (_, workers) = api.get("/admin/workers").await;
        workers[0]["load"]["running_requests"].as_u64() == Some(1)
    })
    .await;
    assert!(running, "a's turn runs");
    assert_eq!(api.metric("switchyard_sessions_resident").await, 1.0);
    let b = {
        let request = turn(&api, "b", &tokens(2, FORTY_BLOCKS), 2);
        let api = Api::at(&api.base);
        tokio::spawn(async move { served(&api, request).await })
    };
    let waiting = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_session_turns_waiting").await == 1.0
    })
    .await;
    assert!(waiting, "b's turn waits");
    // a's 300 tokens take seconds; b's 2 would take milliseconds were it let in.
    let a = a.await.unwrap();
    assert_eq!(a["usage"]["completion_tokens"], 300, "{a}");
    assert!(!b.is_finished(), "b was served before a's turn ended");
    let b = b.await.unwrap();
    assert_eq!(b["usage"]["completion_tokens"], 2, "{b}");
    assert_eq!(api.metric("switchyard_session_turns_held").await, 1.0);
    assert_eq!(api.metric("switchyard_session_turns_aged").await, 0.0);
    assert_eq!(api.metric("switchyard_session_turns_waiting").await, 0.0);
    // b's decision says how long it waited and what let it go; a's says nothing.
    let b_log = decisions(&api, "b").await;
    assert_eq!(b_log.len(), 1, "{b_log:#?}");
    assert_eq!(b_log[0]["session_hold"]["released"], "room", "{b_log:#?}");
    assert!(b_log[0]["session_hold"]["held_ms"].as_u64().is_some());
    let a_log = decisions(&api, "a").await;
    assert!(a_log[0].get("session_hold").is_none(), "{a_log:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_goes_in_at_its_aging_bound_when_room_never_appears() {
    let etcd = EtcdServer::start().expect("etcd");
    // Prefill at 640 tokens/s: b's bound is 256 tokens' recompute, 0.4 s; a stays resident
    // (idle for up to 600 s) and nothing else ends.
    let (_worker, _gateway, api) = cluster(&etcd, "sessions-aged", 640, 600).await;
    served(&api, turn(&api, "a", &tokens(1, FORTY_BLOCKS), 2)).await;
    let b = served(&api, turn(&api, "b", &tokens(2, FORTY_BLOCKS), 2)).await;
    assert_eq!(b["usage"]["completion_tokens"], 2, "{b}");
    assert_eq!(api.metric("switchyard_session_turns_held").await, 1.0);
    assert_eq!(api.metric("switchyard_session_turns_aged").await, 1.0);
    assert_eq!(
        api.metric("switchyard_session_demotions").await,
        1.0,
        "a, idle, gave up its residency"
    );
    assert_eq!(api.metric("switchyard_sessions_resident").await, 1.0);
    let b_log = decisions(&api, "b").await;
    assert_eq!(b_log[0]["session_hold"]["released"], "aged", "{b_log:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_while_held_leaves_the_schedule_as_it_was() {
    let etcd = EtcdServer::start().expect("etcd");
    // Bounds of minutes, a resident that stays: nothing lets b go while its client waits.
    let (_worker, _gateway, api) = cluster(&etcd, "sessions-gone", 1, 600).await;
    served(&api, turn(&api, "a", &tokens(1, FORTY_BLOCKS), 2)).await;
    let gone = turn(&api, "b", &tokens(2, FORTY_BLOCKS), 2)
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(gone.is_err_and(|e| e.is_timeout()), "b's turn was held");
    let withdrawn = eventually(Duration::from_secs(10), || async {
        api.metric("switchyard_session_turns_withdrawn").await == 1.0
            && api.metric("switchyard_session_turns_waiting").await == 0.0
    })
    .await;
    assert!(
        withdrawn,
        "b's turn left the queue when its client went away"
    );
    // c fits beside a (10 blocks): with b's turn gone from the queue, nothing is ahead of it.
    let c = served(&api, turn(&api, "c", &tokens(3, 160), 2)).await;
    assert_eq!(c["usage"]["completion_tokens"], 2, "{c}");
    assert_eq!(
        api.metric("switchyard_session_turns_held").await,
        1.0,
        "only b's turn was held"
    );
    assert_eq!(api.metric("switchyard_sessions_resident").await, 2.0);
    // a's next turn, on top of its first, goes on at once: it is still resident.
    let mut next = tokens(1, FORTY_BLOCKS);
    next.extend(tokens(4, 16));
    served(&api, turn(&api, "a", &next, 2)).await;
    assert_eq!(api.metric("switchyard_session_turns_held").await, 1.0);
}
