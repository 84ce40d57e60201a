//! A request's KV identity end to end through the real binary: a cache-salted request is routed
//! to, and served from, only the KV of requests with the same salt; a plain request never
//! matches salted blocks; a bad salt is refused by name.

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

/// The device overlap `explain` finds on `worker` for `prompt` under `salt`.
async fn overlap_on(admin: &Api, worker: &str, prompt: &[u32], salt: Option<&str>) -> u64 {
    let mut ask = json!({"model": "sim-8b", "prompt": prompt});
    if let Some(salt) = salt {
        ask["cache_salt"] = json!(salt);
    }
    let (status, explain) = admin.post("/admin/explain", &ask).await;
    assert_eq!(status, 200, "{explain}");
    explain["decision"]["explanation"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == worker)
        .map_or(0, |w| w["overlap"]["device"].as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_request_reuses_only_its_own_salts_kv() {
    let up = Launch::up(2)
        .arg("--speedup", "50")
        .arg("--admin-token", "s3cret")
        .start()
        .await;
    let api = Api::new(&up);
    let admin = Api::new(&up).with_token("s3cret");
    let prompt = tokens(11, 1024);
    let salted = |salt: &str| {
        json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 2, "ignore_eos": true,
               "cache_salt": salt})
    };

    let (status, body) = api.post("/v1/completions", &salted("tenant-a")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(cached(&body), 0, "{body}");
    let (_, decisions) = admin.get("/admin/decisions?limit=1").await;
    let holder = decisions[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    let indexed = eventually(Duration::from_secs(10), || async {
        overlap_on(&admin, &holder, &prompt, Some("tenant-a")).await >= 64
    })
    .await;
    assert!(
        indexed,
        "the salted blocks reached the index under the salt"
    );
    // The same tokens without the salt, or under another, match nothing.
    assert_eq!(overlap_on(&admin, &holder, &prompt, None).await, 0);
    assert_eq!(
        overlap_on(&admin, &holder, &prompt, Some("tenant-b")).await,
        0
    );

    // Served: another salt computes the whole prompt (whichever worker it lands on), the same
    // salt is routed back to its blocks and reuses them.
    let (status, body) = api.post("/v1/completions", &salted("tenant-b")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(cached(&body), 0, "another salt reused salted KV: {body}");
    let (status, body) = api.post("/v1/completions", &salted("tenant-a")).await;
    assert_eq!(status, 200, "{body}");
    assert!(cached(&body) >= 1008, "{body}");
    let (_, decisions) = admin.get("/admin/decisions?limit=1").await;
    assert_eq!(decisions[0]["explanation"]["chosen"], holder.as_str());

    // Chat takes it too; a salt that names nothing is refused by name.
    let chat = json!({"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2, "cache_salt": "tenant-a"});
    let (status, body) = api.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api.post("/v1/completions", &salted("")).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "cache_salt", "{body}");
}
