//! Shared helpers of the cross-process tests: start the real `switchyard` binary and read the
//! JSON line it prints when ready.

#![allow(dead_code)]

pub mod envoy_proxy;
pub mod fake_engine;
pub mod fake_kube;
pub mod fake_trtllm;
pub mod fault_proxy;
pub mod kv_tamper;
mod launch;
pub mod load;

pub use launch::Launch;

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A `switchyard` child process (worker, gateway or up), killed when dropped.
#[derive(Debug)]
pub struct WorkerProcess {
    pub child: Child,
    pub id: String,
    pub address: String,
    pub ready: serde_json::Value,
}

/// Any `switchyard` subcommand that prints a ready line.
pub type SwitchyardProcess = WorkerProcess;

impl WorkerProcess {
    /// Starts `switchyard worker <args>` and waits (bounded) for its ready line.
    pub async fn start(args: &[&str]) -> WorkerProcess {
        Self::spawn("worker", args).await
    }

    /// Starts `switchyard <subcommand> <args>` and waits (bounded) for its ready line.
    pub async fn spawn(subcommand: &str, args: &[&str]) -> WorkerProcess {
        Self::spawn_with_env(subcommand, args, &[]).await
    }

    /// [`spawn`](Self::spawn) with extra environment variables.
    pub async fn spawn_with_env(
        subcommand: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> WorkerProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .arg(subcommand)
            .args(args)
            .env("SWITCHYARD_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn switchyard worker");
        let stdout = child.stdout.take().expect("stdout piped");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("worker ready within 60 s")
            .expect("read worker stdout")
            .expect("worker printed a ready line");
        let ready: serde_json::Value = serde_json::from_str(&line).expect("ready line is JSON");
        assert_eq!(ready["event"], "ready", "unexpected first line: {line}");
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        WorkerProcess {
            id: ready["id"].as_str().unwrap_or_default().to_owned(),
            address: ready["address"].as_str().expect("address").to_owned(),
            ready,
            child,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Sends SIGKILL: the process dies without deregistering.
    pub async fn kill_hard(&mut self) {
        self.child.kill().await.expect("kill worker");
    }

    /// Sends SIGTERM and waits for the exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("worker still running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("worker exits within 60 s of SIGTERM")
            .expect("wait for worker")
    }
}

/// Whether the chaos tests run their full variants (longer faults, more load):
/// `SWITCHYARD_CHAOS_FULL=1`.
pub fn chaos_full() -> bool {
    std::env::var("SWITCHYARD_CHAOS_FULL").is_ok_and(|v| v == "1")
}

/// Sends `sig` (`-STOP`, `-CONT`, `-KILL`, `-TERM`) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// Polls `check` until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Registers in etcd a `sim-8b` worker that nobody answers at, as if its process were gone
/// and its lease not yet expired; it stays listed while the registration is held.
pub async fn register_ghost(
    etcd: &str,
    cluster: &str,
    id: &str,
    role: switchyard_core::Role,
    ttl: Duration,
) -> switchyard_registry::Registration {
    use switchyard_registry::Registry as _;
    let registry = switchyard_registry::EtcdRegistry::connect(&[etcd.to_owned()], cluster)
        .await
        .expect("connect to etcd");
    let ghost = switchyard_core::WorkerInfo {
        id: switchyard_core::WorkerId::new(id).expect("worker id"),
        address: format!("127.0.0.1:{}", switchyard_testkit::free_port()),
        model: "sim-8b".into(),
        role,
        block_size: switchyard_core::BlockSize::new(16).expect("block size"),
        kv_capacity_blocks: 8192,
        max_context_tokens: 8192,
        engine: switchyard_core::EngineKind::Sim,
        incarnation: 1,
        adapters: Vec::new(),
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    };
    registry.register(ghost, ttl).await.expect("register ghost")
}

/// An HTTP client of one gateway, for the end-to-end tests.
#[derive(Debug)]
pub struct Api {
    pub base: String,
    pub http: reqwest::Client,
    /// Sent as `Authorization: Bearer` by [`get`](Self::get), [`post`](Self::post) and
    /// [`put`](Self::put).
    token: Option<String>,
}

impl Api {
    pub fn new(process: &SwitchyardProcess) -> Self {
        Self::at(&format!("http://{}", process.address))
    }

    /// A client of the HTTP API at `base` (`http://host:port`).
    pub fn at(base: &str) -> Self {
        Self {
            base: base.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .expect("http client"),
            token: None,
        }
    }

    /// The same client, authenticated with an admin token.
    pub fn with_token(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// Sends a request and returns the status and the body (JSON, or the text as a string).
    pub async fn send(&self, request: reqwest::RequestBuilder) -> (u16, Value) {
        let response = request.send().await.expect("send");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.request(reqwest::Method::POST, path).json(body))
            .await
    }

    pub async fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.request(reqwest::Method::PUT, path).json(body))
            .await
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        self.send(request).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    /// Whether `/admin/workers` comes to list exactly `count` workers within 10 s.
    pub async fn lists_workers(&self, count: usize) -> bool {
        eventually(Duration::from_secs(10), || async {
            let (_, workers) = self.get("/admin/workers").await;
            workers.as_array().map_or(0, Vec::len) == count
        })
        .await
    }

    /// Streams and returns every `data:` payload, `[DONE]` included.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        let text = response.text().await.expect("sse body");
        switchyard_core::sse::events(&text)
    }

    pub async fn metric(&self, name: &str) -> f64 {
        self.try_metric(name).await.expect("metrics")
    }

    /// [`Self::metric`], or `None` when the scrape fails (a gateway at its connection cap
    /// refuses the scrape's connection until it notices closed ones).
    pub async fn try_metric(&self, name: &str) -> Option<f64> {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        // `name` is a series selector, `metric` or `metric{label="value",...}`: the sum of every
        // series whose name starts with the metric's (a counter's `_total` included) and whose
        // labels include the selector's.
        let selector = switchyard_core::promtext::parse(&format!("{name} 0"))
            .pop()
            .expect("a series selector");
        switchyard_core::promtext::parse(&text)
            .iter()
            .filter(|s| {
                s.name.starts_with(&selector.name)
                    && selector.labels.iter().all(|(k, v)| s.label(k) == Some(v))
            })
            .map(|s| s.value)
            .sum::<f64>()
            .into()
    }
}

/// A chat completion request of one user message that decodes exactly `max_tokens`.
/// Runs `switchyard` with `args` until it exits (within `limit`): its output and its stderr.
pub async fn run_to_exit<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    args: &[S],
    limit: Duration,
) -> (std::process::Output, String) {
    let run = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{args:?} exits within {limit:?}"))
        .expect("run switchyard");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output, stderr)
}

pub fn chat(content: &str, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": "sim-8b",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

/// Deterministic token ids: same seed, same prompt.
pub fn tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

/// Runs `switchyard <args>` that must refuse its configuration before starting anything: exit
/// code 64 (EX_USAGE) and one line on stderr naming `needle`.
pub async fn refused_at_start<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    args: &[S],
    needle: &str,
) {
    let (output, stderr) = run_to_exit(args, Duration::from_secs(30)).await;
    assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
    assert!(
        stderr.contains(needle),
        "{args:?} should name {needle:?}: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
}

/// The Qwen3 test tokenizer's directory (`crates/switchyard-tokenize/fetch-test-models.sh`, which
/// the README test command runs; `SWITCHYARD_TEST_MODELS` overrides the cache).
pub fn qwen3_dir() -> String {
    let dir = std::env::var("SWITCHYARD_TEST_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::PathBuf::from(std::env::var("HOME").expect("HOME"))
                .join(".cache/switchyard/test-models")
        })
        .join("qwen3");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "Qwen3 tokenizer missing in {}: run crates/switchyard-tokenize/fetch-test-models.sh (the README test command does)",
        dir.display()
    );
    dir.to_string_lossy().into_owned()
}
