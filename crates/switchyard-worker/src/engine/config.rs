//! The engine behind a worker (`[engine]`): the simulator, or a vLLM/SGLang/TensorRT-LLM server, and how to
//! reach it. Part of the worker's configuration (`WorkerConfig`), validated with it.

use serde::Deserialize;
use switchyard_core::{BlockSize, EngineKind};

use switchyard_config::ConfigError;

use super::openai_http::TokenIdSource;
use super::zmq_events::rank_endpoint;

/// The engine behind the worker: the simulator, or a vLLM/SGLang server reached over HTTP and
/// ZMQ (see `docs/engines.md`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// The engine's HTTP base URL (`http://host:port`).
    pub url: Option<String>,
    /// `host:port` a proxy reaches the engine's HTTP API on, registered for the endpoint picker
    /// (`switchyard epp`). Default: the host and port of `url`, which is right when the worker
    /// dials the engine the way the proxy does (a pod IP or Service), and wrong when the engine
    /// is a sidecar on 127.0.0.1 (then set the pod's IP here).
    pub advertise: Option<String>,
    /// The engine's KV event publisher (`tcp://host:5557`); rank r publishes on port + r.
    pub kv_events: Option<String>,
    /// The engine's KV event replay socket (`tcp://host:5558`); rank r on port + r.
    pub kv_replay: Option<String>,
    /// Topic prefix to subscribe to (the engine's `topic`; empty = everything).
    pub kv_events_topic: String,
    /// Data-parallel ranks of the engine (one publisher each; TensorRT-LLM: attention-DP ranks,
    /// whose events arrive on one endpoint, each tagged with its rank).
    pub dp_ranks: u32,
    /// TensorRT-LLM: milliseconds between polls of `/kv_cache_events` while events flow; an
    /// empty or failed poll backs off up to 25 times that.
    pub kv_poll_ms: u64,
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
    /// vLLM/SGLang: how often `/v1/models` is read for the LoRA adapters the engine serves
    /// (loaded or unloaded at run time through vLLM's `/v1/load_lora_adapter` or SGLang's
    /// `/load_lora_adapter`), which the worker registers.
    pub adapters_interval_ms: u64,
    /// How long start-up waits for the engine to answer.
    pub startup_timeout_secs: u64,
    /// How vLLM is asked for generated token ids.
    pub vllm_token_ids: TokenIdSource,
    /// SGLang prefill: the host decode engines reach this engine's bootstrap server on
    /// (default: the host of `url`).
    pub bootstrap_host: Option<String>,
    /// SGLang prefill: the engine's `--disaggregation-bootstrap-port`.
    pub bootstrap_port: u16,
    /// vLLM/SGLang: the engine schedules by request priority (vLLM `--scheduling-policy
    /// priority`, SGLang `--enable-priority-scheduling`), so a request's `priority` is sent to
    /// it. Off: priorities are counted as unhonoured and not sent (vLLM refuses a non-zero one
    /// unless it schedules by priority).
    pub priority_scheduling: bool,
    /// SGLang: the engine evicts by request priority (`--radix-eviction-policy priority`), so
    /// every request carries its keep-until time as `priority` and a retention hint extends
    /// it (see `sglang_retention`). Off: hints are counted as unhonoured.
    pub retention_priority: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kind: EngineKind::Sim,
            url: None,
            advertise: None,
            kv_events: None,
            kv_replay: None,
            kv_events_topic: String::new(),
            dp_ranks: 1,
            kv_poll_ms: 20,
            served_model_name: None,
            block_size: None,
            kv_blocks: None,
            max_context: None,
            metrics_interval_ms: 500,
            adapters_interval_ms: 5000,
            startup_timeout_secs: 600,
            vllm_token_ids: TokenIdSource::default(),
            priority_scheduling: false,
            retention_priority: false,
            bootstrap_host: None,
            bootstrap_port: super::pd::SGLANG_DEFAULT_BOOTSTRAP_PORT,
        }
    }
}

impl EngineConfig {
    /// The `host:port` the worker registers as its engine's HTTP endpoint: `advertise`, else
    /// the authority of `url` (port 80 or 443 by scheme when it names none). None for the
    /// simulator.
    pub fn http_endpoint(&self) -> Option<String> {
        if self.kind == EngineKind::Sim {
            return None;
        }
        if let Some(endpoint) = &self.advertise {
            return Some(endpoint.clone());
        }
        let url = self.url.as_deref()?;
        let (scheme, rest) = url.split_once("://")?;
        let authority = rest.split(['/', '?', '#']).next()?;
        let authority = authority.rsplit('@').next()?;
        if authority.is_empty() {
            return None;
        }
        let has_port = match authority.rfind(']') {
            Some(close) => authority[close..].contains(':'),
            None => authority.contains(':'),
        };
        Some(if has_port {
            authority.to_owned()
        } else {
            let port = if scheme == "https" { 443 } else { 80 };
            format!("{authority}:{port}")
        })
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.priority_scheduling && !matches!(self.kind, EngineKind::Vllm | EngineKind::Sglang) {
            return invalid(format!(
                "--engine-priority-scheduling is for vLLM and SGLang; --engine {} does not schedule by a request priority the worker can send",
                self.kind
            ));
        }
        if self.retention_priority && self.kind != EngineKind::Sglang {
            return invalid(format!(
                "--engine-retention-priority is for SGLang (--radix-eviction-policy priority); --engine {} has no eviction priority the worker can send",
                self.kind
            ));
        }
        if self.retention_priority && self.priority_scheduling {
            return invalid(
                "--engine-retention-priority and --engine-priority-scheduling cannot both be set: SGLang reads one `priority` for both eviction and scheduling".into(),
            );
        }
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
        if let Some(endpoint) = &self.advertise {
            switchyard_core::worker::validate_endpoint(endpoint)
                .map_err(|e| ConfigError::Invalid(format!("--engine-advertise: {e}")))?;
        }
        if self.dp_ranks == 0 {
            return invalid("dp_ranks must be at least 1".into());
        }
        for endpoint in [&self.kv_events, &self.kv_replay].into_iter().flatten() {
            rank_endpoint(endpoint, self.dp_ranks - 1)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.kind == EngineKind::Trtllm && (self.kv_events.is_some() || self.kv_replay.is_some())
        {
            return invalid(
                "--kv-events and --kv-replay are vLLM/SGLang ZMQ sockets; TensorRT-LLM's KV events are polled from --engine-url's /kv_cache_events".into(),
            );
        }
        if self.kv_poll_ms == 0 {
            return invalid("kv_poll_ms must be at least 1".into());
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
        if self.adapters_interval_ms == 0 {
            return invalid("adapters_interval_ms must be at least 1".into());
        }
        if self.bootstrap_port == 0 {
            return invalid(
                "bootstrap_port must be a port number (SGLang's default is 8998)".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(url: &str, advertise: Option<&str>) -> EngineConfig {
        EngineConfig {
            kind: EngineKind::Vllm,
            url: Some(url.into()),
            advertise: advertise.map(str::to_owned),
            ..EngineConfig::default()
        }
    }

    #[test]
    fn priority_scheduling_is_refused_for_engines_the_worker_cannot_send_a_priority_to() {
        for kind in [EngineKind::Sim, EngineKind::Trtllm] {
            let config = EngineConfig {
                kind,
                url: Some("http://127.0.0.1:8000".into()),
                priority_scheduling: true,
                ..EngineConfig::default()
            };
            let err = config.validate().unwrap_err().to_string();
            assert!(
                err.contains("--engine-priority-scheduling"),
                "{kind}: {err}"
            );
        }
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            let config = EngineConfig {
                kind,
                priority_scheduling: true,
                ..vllm("http://127.0.0.1:8000", None)
            };
            config.validate().unwrap();
        }
    }

    #[test]
    fn retention_priority_is_for_sglang_alone_and_never_with_priority_scheduling() {
        for kind in [EngineKind::Sim, EngineKind::Vllm, EngineKind::Trtllm] {
            let config = EngineConfig {
                kind,
                retention_priority: true,
                ..vllm("http://127.0.0.1:8000", None)
            };
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains("--engine-retention-priority"), "{kind}: {err}");
        }
        let sglang = EngineConfig {
            kind: EngineKind::Sglang,
            retention_priority: true,
            ..vllm("http://127.0.0.1:30000", None)
        };
        sglang.validate().unwrap();
        let both = EngineConfig {
            priority_scheduling: true,
            ..sglang
        };
        let err = both.validate().unwrap_err().to_string();
        assert!(err.contains("--engine-priority-scheduling"), "{err}");
    }

    #[test]
    fn the_http_endpoint_is_the_advertised_one_or_the_urls_authority() {
        assert_eq!(
            vllm("http://10.0.0.7:8000/", None)
                .http_endpoint()
                .as_deref(),
            Some("10.0.0.7:8000")
        );
        assert_eq!(
            vllm("http://vllm.ns.svc", None).http_endpoint().as_deref(),
            Some("vllm.ns.svc:80")
        );
        assert_eq!(
            vllm("http://[::1]:9000/v1", None)
                .http_endpoint()
                .as_deref(),
            Some("[::1]:9000")
        );
        assert_eq!(
            vllm("http://127.0.0.1:8000", Some("10.1.2.3:8000"))
                .http_endpoint()
                .as_deref(),
            Some("10.1.2.3:8000")
        );
        assert_eq!(EngineConfig::default().http_endpoint(), None);
    }

    #[test]
    fn a_bad_advertised_endpoint_is_refused() {
        let err = vllm("http://127.0.0.1:8000", Some("10.1.2.3"))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--engine-advertise"), "{err}");
        assert!(
            vllm("http://127.0.0.1:8000", Some("pod:8000"))
                .validate()
                .is_ok()
        );
    }
}
