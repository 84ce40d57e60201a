//! The protocol-faithful `trtllm-serve` stand-in (`tests/python/fake_trtllm.py`: OpenAI
//! completions with `detokenize: false`, iteration stats at `/metrics`, the KV event queue at
//! `/kv_cache_events`, its own block hashes) and a TensorRT-LLM adapter started against it.

use std::collections::BTreeSet;

use serde_json::{Value, json};
use switchyard_core::{BlockHash, BlockSize, EngineKind, WorkerId, block_hashes};
use switchyard_worker::config::EngineConfig;
use switchyard_worker::engine::vllm::{AdapterError, VllmEngine};
use tokio::process::Child;

use super::fake_vllm::{spawn_stand_in, stand_in_admin};

pub const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/fake_trtllm.py"
);

pub struct FakeTrtllm {
    child: Child,
    pub http: String,
    pub client: reqwest::Client,
}

impl FakeTrtllm {
    pub async fn start(extra: &[&str]) -> FakeTrtllm {
        let (child, ports) = spawn_stand_in(SCRIPT, extra, "the trtllm-serve stand-in").await;
        FakeTrtllm {
            child,
            http: format!("http://127.0.0.1:{}", ports["http"]),
            client: reqwest::Client::new(),
        }
    }

    /// Stops the engine: its HTTP API no longer answers.
    pub async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    pub async fn admin(&self, what: &str, body: Value) -> Value {
        stand_in_admin(&self.client, &self.http, what, body).await
    }

    pub async fn store(&self, tokens: Vec<u32>) {
        self.admin("store", json!({"tokens": tokens})).await;
    }

    /// Switchyard's hashes of every full block the stand-in holds.
    pub async fn held(&self, bs: BlockSize) -> BTreeSet<BlockHash> {
        let state = self.admin("state", json!({})).await;
        state["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|prefix| {
                let tokens: Vec<u32> = serde_json::from_value(prefix.clone()).unwrap();
                *block_hashes(&tokens, bs).last().unwrap()
            })
            .collect()
    }

    /// The adapter's configuration: the facts an idle trtllm-serve does not tell given as flags.
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            kind: EngineKind::Trtllm,
            url: Some(self.http.clone()),
            block_size: Some(4),
            kv_blocks: Some(64),
            max_context: Some(4096),
            metrics_interval_ms: 50,
            kv_poll_ms: 10,
            startup_timeout_secs: 20,
            ..EngineConfig::default()
        }
    }
}

pub async fn start_trtllm(config: &EngineConfig) -> Result<VllmEngine, AdapterError> {
    VllmEngine::start_trtllm(
        WorkerId::new("w").unwrap(),
        1,
        "fake-model",
        config,
        1,
        4096,
    )
    .await
}
