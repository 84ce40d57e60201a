//! Retention hints on SGLang through the real gateway and `switchyard worker --engine sglang
//! --engine-retention-priority`, in front of the SGLang stand-in started with
//! `--radix-eviction-policy priority` (`tests/python/fake_vllm.py`: a block's priority is the
//! max of the priorities of the requests that cached it, the smallest (priority, last use) leaf
//! is evicted first, as SGLang's radix cache). Every request carries its keep-until time as
//! `priority`, a session's turn its send time plus the hint's TTL: the turn's prefix outlives
//! pressure that evicts an older anonymous prefix, and once the hint has expired later traffic
//! outranks it and evicts it (the take-back, docs/engines.md "Retention hints").

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use support::fake_engine::{Fake, indexed};
use support::{eventually, tokens};
use switchyard_testkit::EtcdServer;
use switchyard_worker::metrics::sample;

/// Tokens per block (the stand-in's `--block-size`) and blocks per prompt.
const BLOCK: usize = 4;
const PROMPT_BLOCKS: usize = 4;

/// One completion of `prompt` (one output token, so only the prompt's 4 full blocks are
/// cached); a turn of `session` when given.
async fn complete(api: &str, session: Option<&str>, prompt: &[u32]) {
    let body =
        json!({"model": "fake-model", "prompt": prompt, "max_tokens": 1, "ignore_eos": true});
    let mut request = reqwest::Client::new()
        .post(format!("{api}/v1/completions"))
        .json(&body);
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
}

fn prompt(seed: u32) -> Vec<u32> {
    tokens(seed, (BLOCK * PROMPT_BLOCKS) as u32)
}

/// How many of `prompt`'s blocks the stand-in holds.
async fn held(fake: &Fake, prompt: &[u32]) -> usize {
    let state = fake.admin("state", json!({})).await;
    let blocks = state["ranks"][0].as_array().unwrap();
    (1..=PROMPT_BLOCKS)
        .filter(|&n| blocks.contains(&json!(prompt[..n * BLOCK])))
        .count()
}

/// The eviction priority of `prompt`'s last block in the stand-in's radix cache.
async fn priority(fake: &Fake, prompt: &[u32]) -> u64 {
    let answer = fake.admin("priorities", json!({})).await;
    answer["ranks"][0]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["prefix"] == json!(prompt))
        .and_then(|b| b["priority"].as_u64())
        .unwrap_or_else(|| panic!("the prompt is held: {answer}"))
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

async fn metrics(worker: &support::SwitchyardProcess) -> String {
    let url = worker.ready["metrics"].as_str().expect("metrics url");
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_retention_hint_holds_a_prefix_until_it_expires_and_is_then_taken_back() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("sglang-ret-{}", std::process::id());
    // 16 blocks: four prompts of four blocks fill it.
    let fake = Fake::start(&[
        "--flavor",
        "sglang",
        "--radix-eviction-policy",
        "priority",
        "--num-blocks",
        "16",
    ])
    .await;
    let worker = fake
        .worker("sglang", "ret-sglang", &endpoint, &cluster)
        .args(["--engine-retention-priority"])
        .arg("--metrics-listen", "127.0.0.1:0")
        .start()
        .await;
    let gateway = support::Launch::gateway(&endpoint, &cluster)
        .args(["--session-retention"])
        .arg("--retention-max-seconds", "5")
        .start()
        .await;
    let api = format!("http://{}", gateway.address);
    let ready = eventually(Duration::from_secs(15), || async {
        indexed(&api, "ret-sglang").await.is_some()
    })
    .await;
    assert!(ready, "the gateway sees its worker");

    // A session's turn (a 5 s hint), then an anonymous request.
    let (session, anonymous) = (prompt(1), prompt(2));
    complete(&api, Some("s"), &session).await;
    complete(&api, None, &anonymous).await;
    let (hinted, unhinted) = (
        priority(&fake, &session).await,
        priority(&fake, &anonymous).await,
    );
    assert!(
        hinted >= unhinted + 4_000 && hinted <= unhinted + 5_000,
        "the turn carries its send time plus the 5 s hint, the anonymous request its send time: {hinted} vs {unhinted}"
    );
    let sent = fake.admin("requests", json!({})).await;
    let sent = sent["requests"].as_array().unwrap();
    assert!(
        sent.iter().all(|r| r["priority"].is_u64()),
        "every request carries its keep-until time: {sent:?}"
    );

    // Pressure within the hint: three more prompts, the last of which needs room. The
    // anonymous prefix (the oldest unhinted) goes; the session's stays.
    for seed in 10..13 {
        complete(&api, None, &prompt(seed)).await;
    }
    assert!(
        now_ms() < hinted,
        "the pressure came within the hint (a slow machine would need a longer one)"
    );
    assert_eq!(
        held(&fake, &anonymous).await,
        0,
        "the anonymous prefix was evicted"
    );
    assert_eq!(
        held(&fake, &session).await,
        PROMPT_BLOCKS,
        "the hinted prefix survived"
    );
    let text = metrics(&worker).await;
    assert_eq!(
        sample(
            &text,
            "switchyard_worker_retention_hints_total",
            &[("outcome", "passed")]
        ),
        Some(1.0),
        "{text}"
    );

    // The hint expires with no later turn of the session. Every request sent from then on
    // carries a larger priority than the prefix's (which no request can lower): four more
    // prompts evict the three sent within the hint (their use was older than its expiry), then
    // the session's prefix.
    let expired = eventually(Duration::from_secs(10), || async { now_ms() > hinted }).await;
    assert!(expired);
    for seed in 20..24 {
        complete(&api, None, &prompt(seed)).await;
    }
    assert_eq!(
        held(&fake, &session).await,
        0,
        "the expired hint was taken back: the departed session's prefix was evicted"
    );
    for seed in 20..24 {
        assert_eq!(held(&fake, &prompt(seed)).await, PROMPT_BLOCKS, "{seed}");
    }
    let listed: Value = fake.admin("priorities", json!({})).await;
    assert!(
        listed["ranks"][0]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["priority"].as_u64().unwrap() > hinted),
        "only traffic sent after the expiry is held: {listed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_priority_is_refused_for_engines_without_priority_eviction() {
    for engine in ["vllm", "trtllm", "sim"] {
        support::refused_at_start(
            &[
                "worker",
                "--engine",
                engine,
                "--engine-url",
                "http://127.0.0.1:9",
                "--engine-retention-priority",
            ],
            "--engine-retention-priority",
        )
        .await;
    }
    support::refused_at_start(
        &[
            "worker",
            "--engine",
            "sglang",
            "--engine-url",
            "http://127.0.0.1:9",
            "--engine-retention-priority",
            "--engine-priority-scheduling",
        ],
        "--engine-priority-scheduling",
    )
    .await;
}
