//! The protocol-faithful vLLM/SGLang stand-in (`tests/python/fake_vllm.py`: OpenAI HTTP, ZMQ
//! PUB + ROUTER replay, its own block hashes) and an adapter started against it.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_core::{BlockHash, BlockSize, EngineKind, WorkerId, block_hashes};
use switchyard_worker::config::EngineConfig;
use switchyard_worker::engine::Engine;
use switchyard_worker::engine::vllm::VllmEngine;
use switchyard_worker::event_log::SubscriptionStart;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/fake_vllm.py"
);

/// Starts a Python stand-in engine (`script`) with `extra` flags; the process (killed when
/// dropped) and the ports its READY line names.
pub async fn spawn_stand_in(script: &str, extra: &[&str], what: &str) -> (Child, Value) {
    let mut child = Command::new("python3")
        .arg(script)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("python3 runs {what}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("stand-in starts")
        .unwrap()
        .expect("stand-in prints READY");
    let ports = serde_json::from_str(line.strip_prefix("READY ").unwrap()).unwrap();
    (child, ports)
}

/// A stand-in's test-only admin endpoint (`/admin/<what>`): its JSON answer.
pub async fn stand_in_admin(
    client: &reqwest::Client,
    http: &str,
    what: &str,
    body: Value,
) -> Value {
    client
        .post(format!("{http}/admin/{what}"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub struct Fake {
    _child: Child,
    pub http: String,
    pub zmq: u16,
    pub replay: u16,
    pub bootstrap: u16,
    pub client: reqwest::Client,
}

impl Fake {
    pub async fn start(extra: &[&str]) -> Fake {
        let (child, ports) =
            spawn_stand_in(SCRIPT, extra, "the stand-in (pip install pyzmq msgpack)").await;
        Fake {
            _child: child,
            http: format!("http://127.0.0.1:{}", ports["http"]),
            zmq: ports["zmq"].as_u64().unwrap() as u16,
            replay: ports["replay"].as_u64().unwrap() as u16,
            bootstrap: ports["bootstrap"].as_u64().unwrap() as u16,
            client: reqwest::Client::new(),
        }
    }

    pub async fn admin(&self, what: &str, body: Value) -> Value {
        stand_in_admin(&self.client, &self.http, what, body).await
    }

    pub async fn store(&self, tokens: Vec<u32>, rank: u32) {
        self.admin("store", json!({"tokens": tokens, "rank": rank}))
            .await;
    }

    /// Switchyard's hashes of every block the stand-in holds, over all ranks.
    pub async fn held(&self, bs: BlockSize) -> BTreeSet<BlockHash> {
        let state = self.admin("state", json!({})).await;
        let mut held = BTreeSet::new();
        for rank in state["ranks"].as_array().unwrap() {
            for prefix in rank.as_array().unwrap() {
                let tokens: Vec<u32> = serde_json::from_value(prefix.clone()).unwrap();
                held.insert(*block_hashes(&tokens, bs).last().unwrap());
            }
        }
        held
    }

    pub fn config(&self, kind: EngineKind, ranks: u32, replay: bool) -> EngineConfig {
        EngineConfig {
            kind,
            url: Some(self.http.clone()),
            kv_events: Some(format!("tcp://127.0.0.1:{}", self.zmq)),
            kv_replay: replay.then(|| format!("tcp://127.0.0.1:{}", self.replay)),
            dp_ranks: ranks,
            metrics_interval_ms: 50,
            startup_timeout_secs: 20,
            ..EngineConfig::default()
        }
    }
}

pub async fn start(config: EngineConfig) -> VllmEngine {
    let engine = VllmEngine::start(
        WorkerId::new("w").unwrap(),
        1,
        "fake-model",
        &[],
        &config,
        1,
        4096,
    )
    .await
    .unwrap();
    // Let the SUB sockets connect before the stand-in publishes (PUB drops unsent messages).
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine
}

pub fn logged(engine: &VllmEngine) -> BTreeSet<BlockHash> {
    match engine.events().subscribe(None, 0).start {
        SubscriptionStart::Snapshot { blocks, .. } => blocks.iter().map(|b| b.hash).collect(),
        SubscriptionStart::Replay(_) => unreachable!("no resume point was given"),
    }
}

/// Waits until the adapter's view equals what the stand-in holds.
pub async fn assert_mirrors(fake: &Fake, engine: &VllmEngine) {
    let bs = engine.spec().block_size;
    let want = fake.held(bs).await;
    for _ in 0..100 {
        if logged(engine) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "adapter view {:?} != engine {:?} (stats {:?})",
        logged(engine),
        want,
        engine.stats()
    );
}

pub fn seq(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}
