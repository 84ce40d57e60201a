//! The engine behind a worker (`[engine]`): the simulator, or a vLLM/SGLang server, and how to
//! reach it. Part of [`WorkerConfig`](crate::config::WorkerConfig), validated with it.

use serde::Deserialize;
use switchyard_core::{BlockSize, EngineKind};

use crate::config::ConfigError;
use crate::engine::openai_http::TokenIdSource;
use crate::engine::zmq_events::rank_endpoint;

/// The engine behind the worker: the simulator, or a vLLM/SGLang server reached over HTTP and
/// ZMQ (see `docs/engines.md`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// The engine's HTTP base URL (`http://host:port`).
    pub url: Option<String>,
    /// The engine's KV event publisher (`tcp://host:5557`); rank r publishes on port + r.
    pub kv_events: Option<String>,
    /// The engine's KV event replay socket (`tcp://host:5558`); rank r on port + r.
    pub kv_replay: Option<String>,
    /// Topic prefix to subscribe to (the engine's `topic`; empty = everything).
    pub kv_events_topic: String,
    /// Data-parallel ranks of the engine (one publisher each).
    pub dp_ranks: u32,
    /// Model name sent to the engine (default: `model`).
    pub served_model_name: Option<String>,
    /// Tokens per KV block; read from the engine's metrics when absent.
    pub block_size: Option<u32>,
    /// Device KV blocks; read from the engine's metrics when absent.
    pub kv_blocks: Option<u64>,
    /// Longest context; read from the engine's `/v1/models` when absent.
    pub max_context: Option<u64>,
    /// How often `/metrics` is scraped for load.
    pub metrics_interval_ms: u64,
    /// How long start-up waits for the engine to answer.
    pub startup_timeout_secs: u64,
    /// How vLLM is asked for generated token ids.
    pub vllm_token_ids: TokenIdSource,
    /// SGLang prefill: the host decode engines reach this engine's bootstrap server on
    /// (default: the host of `url`).
    pub bootstrap_host: Option<String>,
    /// SGLang prefill: the engine's `--disaggregation-bootstrap-port`.
    pub bootstrap_port: u16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kind: EngineKind::Sim,
            url: None,
            kv_events: None,
            kv_replay: None,
            kv_events_topic: String::new(),
            dp_ranks: 1,
            served_model_name: None,
            block_size: None,
            kv_blocks: None,
            max_context: None,
            metrics_interval_ms: 500,
            startup_timeout_secs: 600,
            vllm_token_ids: TokenIdSource::default(),
            bootstrap_host: None,
            bootstrap_port: crate::engine::pd::SGLANG_DEFAULT_BOOTSTRAP_PORT,
        }
    }
}

impl EngineConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.kind == EngineKind::Sim {
            return Ok(());
        }
        match &self.url {
            None => return invalid(format!("--engine {} needs --engine-url", self.kind)),
            Some(url) if !(url.starts_with("http://") || url.starts_with("https://")) => {
                return invalid(format!("--engine-url {url:?} must start with http://"));
            }
            Some(_) => {}
        }
        if self.dp_ranks == 0 {
            return invalid("dp_ranks must be at least 1".into());
        }
        for endpoint in [&self.kv_events, &self.kv_replay].into_iter().flatten() {
            rank_endpoint(endpoint, self.dp_ranks - 1)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.kv_replay.is_some() && self.kv_events.is_none() {
            return invalid("--kv-replay needs --kv-events".into());
        }
        if let Some(size) = self.block_size {
            BlockSize::new(size).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.kv_blocks == Some(0) || self.max_context == Some(0) {
            return invalid("engine kv_blocks and max_context must be at least 1".into());
        }
        if self.metrics_interval_ms == 0 {
            return invalid("metrics_interval_ms must be at least 1".into());
        }
        if self.bootstrap_port == 0 {
            return invalid(
                "bootstrap_port must be a port number (SGLang's default is 8998)".into(),
            );
        }
        Ok(())
    }
}
