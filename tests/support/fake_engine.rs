//! The stand-in vLLM/SGLang engine (`tests/python/fake_vllm.py`) as the end-to-end tests drive
//! it, and the `switchyard worker` flags that put a worker in front of one.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::Launch;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/fake_vllm.py"
);

/// Starts a Python stand-in engine (`script`) with block size 4 and 128 blocks plus `extra`
/// flags; the process (killed when dropped) and the ports its READY line names.
pub async fn spawn_stand_in(script: &str, extra: &[&str]) -> (Child, Value) {
    let mut child = Command::new("python3")
        .arg(script)
        .args(["--block-size", "4", "--num-blocks", "128"])
        .args(extra)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs the stand-in");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("stand-in starts")
        .expect("read stand-in stdout")
        .expect("stand-in prints READY");
    let ports =
        serde_json::from_str(line.strip_prefix("READY ").expect("READY line")).expect("READY json");
    (child, ports)
}

/// A stand-in's test-only admin endpoint (`/admin/<what>`): its JSON answer.
pub async fn stand_in_admin(
    client: &reqwest::Client,
    http: &str,
    what: &str,
    body: Value,
) -> Value {
    let response = client
        .post(format!("{http}/admin/{what}"))
        .json(&body)
        .send()
        .await
        .expect("admin");
    response.json().await.expect("admin json")
}

/// One stand-in engine process, killed when dropped.
pub struct Fake {
    _child: Child,
    pub http: String,
    pub zmq: u64,
    pub replay: u64,
    /// SGLang bootstrap server / vLLM side channel port.
    pub bootstrap: u64,
    /// Plays SGLang (`--flavor sglang`), not vLLM.
    sglang: bool,
    client: reqwest::Client,
}

impl Fake {
    /// Starts a stand-in with block size 4 and 128 blocks, plus `extra` flags.
    pub async fn start(extra: &[&str]) -> Fake {
        let (child, ports) = spawn_stand_in(SCRIPT, extra).await;
        let port = |name: &str| ports[name].as_u64().expect("port");
        Fake {
            _child: child,
            http: format!("http://127.0.0.1:{}", port("http")),
            zmq: port("zmq"),
            replay: port("replay"),
            bootstrap: port("bootstrap"),
            sglang: extra.windows(2).any(|w| w == ["--flavor", "sglang"]),
            client: reqwest::Client::new(),
        }
    }

    /// Loads the LoRA adapter `name` (with a `path`) or unloads it (`None`) at run time, through
    /// the engine's own endpoint (vLLM's `/v1/load_lora_adapter`, SGLang's
    /// `/load_lora_adapter`, and their unload twins); the status and the body.
    pub async fn lora(&self, name: &str, path: Option<&str>) -> (u16, String) {
        let prefix = if self.sglang { "" } else { "/v1" };
        let verb = if path.is_some() { "load" } else { "unload" };
        let mut body = json!({"lora_name": name});
        if let Some(path) = path {
            body["lora_path"] = json!(path);
        }
        let response = self
            .client
            .post(format!("{}{prefix}/{verb}_lora_adapter", self.http))
            .json(&body)
            .send()
            .await
            .expect("lora endpoint");
        let status = response.status().as_u16();
        (status, response.text().await.unwrap_or_default())
    }

    pub async fn admin(&self, what: &str, body: Value) -> Value {
        stand_in_admin(&self.client, &self.http, what, body).await
    }

    /// Blocks the stand-in holds (rank 0).
    pub async fn held(&self) -> u64 {
        let state = self.admin("state", json!({})).await;
        state["ranks"][0].as_array().map_or(0, |r| r.len() as u64)
    }

    /// `switchyard worker` with id `id` in front of this stand-in.
    pub fn worker(&self, engine: &str, id: &str, etcd: &str, cluster: &str) -> Launch {
        Launch::worker(etcd, cluster)
            .arg("--engine", engine)
            .arg("--engine-url", &self.http)
            .arg("--kv-events", &format!("tcp://127.0.0.1:{}", self.zmq))
            .arg("--kv-replay", &format!("tcp://127.0.0.1:{}", self.replay))
            .arg("--model", "fake-model")
            .id(id)
    }
}

/// Blocks the gateway at `api` indexes for `worker`, when it lists the worker.
pub async fn indexed(api: &str, worker: &str) -> Option<u64> {
    let workers: Value = reqwest::get(format!("{api}/admin/workers"))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    workers
        .as_array()?
        .iter()
        .find(|w| w["id"] == worker)
        .and_then(|w| w["indexed_blocks"].as_u64())
}

/// Waits until the gateway indexes exactly as many blocks for `worker` as `fake` holds.
pub async fn assert_mirrored(api: &str, worker: &str, fake: &Fake) {
    let ok = super::eventually(Duration::from_secs(15), || async {
        indexed(api, worker).await == Some(fake.held().await)
    })
    .await;
    let (want, got) = (fake.held().await, indexed(api, worker).await);
    assert!(
        ok,
        "{worker}: engine holds {want} blocks, index has {got:?}"
    );
}

/// The gateway's explain for `prompt` (model `fake-model`).
pub async fn explain(api: &str, prompt: &[u32]) -> Value {
    explain_as(api, "fake-model", prompt).await
}

/// The gateway's explain for `prompt` asked as `model` (a base model or a LoRA adapter).
pub async fn explain_as(api: &str, model: &str, prompt: &[u32]) -> Value {
    reqwest::Client::new()
        .post(format!("{api}/admin/explain"))
        .json(&json!({"model": model, "prompt": prompt}))
        .send()
        .await
        .expect("explain")
        .json()
        .await
        .expect("explain json")
}

/// The prompt's overlap (device blocks) on `worker`, per the gateway's explain.
pub async fn overlap(api: &str, worker: &str, prompt: &[u32]) -> u64 {
    overlap_as(api, "fake-model", worker, prompt).await
}

/// [`overlap`] for `prompt` asked as `model`.
pub async fn overlap_as(api: &str, model: &str, worker: &str, prompt: &[u32]) -> u64 {
    let explain = explain_as(api, model, prompt).await;
    explain["decision"]["explanation"]["workers"]
        .as_array()
        .unwrap_or_else(|| panic!("explain answered {explain}"))
        .iter()
        .find(|w| w["worker"] == worker)
        .map_or(0, |w| w["overlap"]["device"].as_u64().unwrap_or(0))
}
