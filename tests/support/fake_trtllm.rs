//! The `trtllm-serve` stand-in (`tests/python/fake_trtllm.py`) as the end-to-end tests drive it,
//! and the `switchyard worker --engine trtllm` flags that put a worker in front of one.

use serde_json::{Value, json};
use tokio::process::Child;

use super::Launch;
use super::fake_engine::{spawn_stand_in, stand_in_admin};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/fake_trtllm.py"
);

/// One stand-in engine process, killed when dropped.
pub struct FakeTrtllm {
    _child: Child,
    pub http: String,
    client: reqwest::Client,
}

impl FakeTrtllm {
    /// Starts a stand-in with block size 4 and 128 blocks, plus `extra` flags.
    pub async fn start(extra: &[&str]) -> FakeTrtllm {
        let (child, ports) = spawn_stand_in(SCRIPT, extra).await;
        FakeTrtllm {
            _child: child,
            http: format!("http://127.0.0.1:{}", ports["http"]),
            client: reqwest::Client::new(),
        }
    }

    pub async fn admin(&self, what: &str, body: Value) -> Value {
        stand_in_admin(&self.client, &self.http, what, body).await
    }

    /// What its cache transceiver did (`/admin/transfers`): context requests held and handed
    /// over, what generation requests were handed and whether the KV arrived, blocks received
    /// instead of computed, prompt tokens computed.
    pub async fn transfers(&self) -> Value {
        self.admin("transfers", json!({})).await
    }

    /// Full blocks the stand-in holds.
    pub async fn held(&self) -> u64 {
        let state = self.admin("state", json!({})).await;
        state["blocks"].as_array().map_or(0, |b| b.len() as u64)
    }

    /// `switchyard worker --engine trtllm` with id `id` in front of this stand-in, with the facts
    /// an idle trtllm-serve does not announce, and its `/metrics` served.
    pub fn worker(&self, id: &str, etcd: &str, cluster: &str) -> Launch {
        Launch::worker(etcd, cluster)
            .arg("--engine", "trtllm")
            .arg("--engine-url", &self.http)
            .arg("--engine-block-size", "4")
            .arg("--engine-kv-blocks", "128")
            .arg("--engine-max-context", "4096")
            .arg("--engine-kv-poll-ms", "10")
            .arg("--model", "fake-model")
            .arg("--metrics-listen", "127.0.0.1:0")
            .id(id)
    }
}
