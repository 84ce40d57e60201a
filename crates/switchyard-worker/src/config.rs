//! The worker's one configuration struct, and the command-line/environment layer over it.
//!
//! Precedence: built-in defaults < config file (`--config`, TOML) < environment variables
//! (`SWITCHYARD_*`) < flags. Everything is validated once, at start; a bad value is a
//! [`ConfigError`] whose message is one sentence (the binary exits with code 64).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use switchyard_core::{BlockSize, EngineKind, Role, WorkerId};
use switchyard_engine_sim::{KvLayout, SimConfig};

pub use crate::engine::config::EngineConfig;
use crate::engine::openai_http::TokenIdSource;
use crate::engine::sim::TransferSetup;
pub use crate::kv_tiers::{KvTierArgs, KvTierConfig};
pub use crate::transfer_config::KvTransferConfig;

pub use switchyard_config::ConfigError;
use switchyard_security::{SecurityArgs, SecurityConfig};

/// Everything a worker agent needs to run.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Stable worker name; generated from the host and process when absent.
    pub id: Option<String>,
    /// Address the gRPC server binds (`host:port`; port 0 picks a free one).
    #[serde(deserialize_with = "switchyard_config::listen_addr::deserialize")]
    pub listen: SocketAddr,
    /// Address others dial, when it differs from `listen` (required with a wildcard listen).
    pub advertise_address: Option<String>,
    /// Where `GET /metrics` (Prometheus) is served (`host:port`; port 0 picks a free one);
    /// none serves no metrics.
    #[serde(deserialize_with = "switchyard_config::listen_addr::deserialize_opt")]
    pub metrics_listen: Option<SocketAddr>,
    /// Bearer token `GET /metrics` requires; none: open to whoever reaches the port.
    pub metrics_token: Option<String>,
    /// HTTPS on the metrics port: its certificate chain (PEM), re-read when it changes.
    pub metrics_tls_cert: Option<PathBuf>,
    /// HTTPS on the metrics port: the certificate's private key (PEM).
    pub metrics_tls_key: Option<PathBuf>,
    /// Model name clients ask for.
    pub model: String,
    /// LoRA adapters the engine serves besides the base model, by the names clients ask for
    /// them as `model` (vLLM's `--lora-modules` names or SGLang's `--lora-paths` names, checked
    /// against the engine's `/v1/models`; any name for the simulator). Registered with the worker, so the
    /// gateway routes a request naming one here, with the adapter's KV.
    pub lora_adapters: Vec<String>,
    pub role: Role,
    /// Cluster name: the registry namespace (`/switchyard/v1/<cluster>/`).
    pub cluster: String,
    /// etcd endpoints; empty runs the worker without a registry.
    pub etcd_endpoints: Vec<String>,
    /// Lease time-to-live in seconds: how long a dead worker stays listed.
    pub lease_ttl_secs: u64,
    /// How long a shutdown waits for in-flight requests.
    pub drain_timeout_secs: u64,
    /// KV events kept for consumers that resume.
    pub event_buffer: usize,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// KV cache bytes per token (all layers, K and V); 8B-class model in fp16 by default.
    pub kv_bytes_per_token: u64,
    /// The simulated engine.
    pub sim: SimConfig,
    /// How this worker's KV cache is laid out (model shape and tensor-parallel split); its
    /// bytes per token must equal `kv_bytes_per_token`.
    pub kv_layout: KvLayout,
    /// How a decode worker moves KV pulled from prefill workers.
    pub kv_transfer: KvTransferConfig,
    /// What loading KV from host, disk and remote tiers costs, announced to routers.
    pub kv_tiers: KvTierConfig,
    /// Longest a decode worker waits for the prefill worker's next KV chunk before failing the
    /// request as unavailable (so a dead or hung prefill worker cannot hang it).
    pub kv_pull_timeout_ms: u64,
    /// Which engine the worker fronts, and how to reach a real one.
    pub engine: EngineConfig,
    /// OpenTelemetry collector (OTLP/gRPC, `http://host:4317`) the worker's traces go to; none
    /// exports nothing.
    pub otlp_endpoint: Option<String>,
    /// Who may call this worker and how it proves itself to other workers (mTLS or the cluster
    /// secret); empty: an open cluster (see docs/security.md).
    pub security: SecurityConfig,
    /// `[event_plane]`: also publish each KV event message once to this NATS JetStream stream,
    /// which gateways started with the same plane read instead of a gRPC stream each (see
    /// `docs/scaling.md`). Unset: gRPC streams only.
    pub event_plane: switchyard_event_plane::EventPlaneConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_address: None,
            metrics_listen: None,
            metrics_token: None,
            metrics_tls_cert: None,
            metrics_tls_key: None,
            model: "sim-8b".to_owned(),
            lora_adapters: Vec::new(),
            role: Role::Both,
            cluster: "default".to_owned(),
            etcd_endpoints: Vec::new(),
            lease_ttl_secs: 10,
            drain_timeout_secs: 30,
            event_buffer: 4096,
            speedup: 1.0,
            // 32 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 bytes.
            kv_bytes_per_token: 131_072,
            sim: SimConfig::default(),
            kv_layout: KvLayout::default(),
            kv_transfer: KvTransferConfig::default(),
            kv_tiers: KvTierConfig::default(),
            kv_pull_timeout_ms: 30_000,
            engine: EngineConfig::default(),
            otlp_endpoint: None,
            security: SecurityConfig::default(),
            event_plane: switchyard_event_plane::EventPlaneConfig::default(),
        }
    }
}

impl WorkerConfig {
    /// The layouts on both sides of a pull into this worker, and how fragments are coalesced.
    pub fn transfer_setup(&self) -> TransferSetup {
        self.kv_transfer.setup(self.kv_layout)
    }

    /// Reads a TOML config file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        switchyard_config::load_toml(path)
    }

    /// Checks every value once, before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if let Some(id) = &self.id {
            WorkerId::new(id.clone()).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.model.trim().is_empty() {
            return invalid("model must not be empty".into());
        }
        switchyard_core::worker::validate_adapters(&self.model, &self.lora_adapters)
            .map_err(|e| ConfigError::Invalid(format!("lora_adapters: {e}")))?;
        if self.cluster.is_empty()
            || !self
                .cluster
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return invalid(format!(
                "cluster {:?} must be non-empty ASCII letters, digits, '.', '_' or '-'",
                self.cluster
            ));
        }
        if self.lease_ttl_secs < 2 {
            return invalid("lease_ttl_secs must be at least 2 (etcd's minimum lease)".into());
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return invalid(format!("speedup must be > 0, got {}", self.speedup));
        }
        if self.event_buffer == 0 {
            return invalid("event_buffer must be at least 1".into());
        }
        if self.kv_bytes_per_token == 0 {
            return invalid("kv_bytes_per_token must be at least 1".into());
        }
        if self.listen.ip().is_unspecified() && self.advertise_address.is_none() {
            return invalid(format!(
                "listening on {} needs --advertise-address (the address others dial)",
                self.listen
            ));
        }
        if self.metrics_listen == Some(self.listen) && self.listen.port() != 0 {
            return invalid(format!(
                "metrics_listen {} is the gRPC listen address; give metrics their own port",
                self.listen
            ));
        }
        self.validate_metrics_access()?;
        if let Some(endpoint) = &self.otlp_endpoint {
            switchyard_telemetry::validate_endpoint(endpoint)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        self.sim
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("sim: {e}")))?;
        let transfer = self.transfer_setup();
        for layout in [transfer.source, transfer.dest] {
            layout
                .validate()
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.kv_layout.bytes_per_token() != self.kv_bytes_per_token {
            return invalid(format!(
                "kv_layout describes {} KV bytes per token but kv_bytes_per_token is {}; make them agree",
                self.kv_layout.bytes_per_token(),
                self.kv_bytes_per_token
            ));
        }
        self.kv_tiers.validate()?;
        self.kv_tiers.check_peer_engine(self.engine.kind)?;
        if self.kv_pull_timeout_ms == 0 {
            return invalid("kv_pull_timeout_ms must be at least 1".into());
        }
        self.security
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.event_plane.validate().map_err(ConfigError::Invalid)?;
        if self.kv_transfer.staging_bytes == 0 {
            return invalid("kv_transfer.staging_bytes must be at least 1".into());
        }
        if self.engine.kind == EngineKind::Trtllm && !self.lora_adapters.is_empty() {
            // Not wired for TensorRT-LLM yet (docs/engines.md, "Not yet supported").
            return invalid(
                "--lora-adapter with --engine trtllm: LoRA adapters on TensorRT-LLM workers are not supported yet".into(),
            );
        }
        self.engine.validate()
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }
}

/// Command-line flags and `SWITCHYARD_*` environment variables of `switchyard worker`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct WorkerArgs {
    /// TOML config file; flags and environment variables override it.
    #[arg(long, env = "SWITCHYARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Worker id (default: generated).
    #[arg(long, env = "SWITCHYARD_WORKER_ID")]
    pub id: Option<String>,
    /// gRPC listen address, host:port (port 0 = any free port).
    #[arg(long, env = "SWITCHYARD_LISTEN", value_parser = switchyard_config::parse_listen_addr)]
    pub listen: Option<SocketAddr>,
    /// Address other processes dial, when it differs from --listen.
    #[arg(long, env = "SWITCHYARD_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (default: not served).
    #[arg(long, env = "SWITCHYARD_METRICS_LISTEN", value_parser = switchyard_config::parse_listen_addr)]
    pub metrics_listen: Option<SocketAddr>,
    /// Bearer token GET /metrics requires (default: open).
    #[arg(long, env = "SWITCHYARD_METRICS_TOKEN")]
    pub metrics_token: Option<String>,
    /// Serve /metrics over HTTPS with this certificate chain (PEM; re-read when it changes).
    #[arg(long, env = "SWITCHYARD_METRICS_TLS_CERT")]
    pub metrics_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --metrics-tls-cert.
    #[arg(long, env = "SWITCHYARD_METRICS_TLS_KEY")]
    pub metrics_tls_key: Option<PathBuf>,
    /// Model name served.
    #[arg(long, env = "SWITCHYARD_MODEL")]
    pub model: Option<String>,
    /// LoRA adapters the engine serves, by name (repeat, or comma-separated).
    #[arg(
        long = "lora-adapter",
        env = "SWITCHYARD_LORA_ADAPTERS",
        value_delimiter = ','
    )]
    pub lora_adapters: Option<Vec<String>>,
    /// prefill, decode or both.
    #[arg(long, env = "SWITCHYARD_ROLE")]
    pub role: Option<Role>,
    /// Cluster name (registry namespace).
    #[arg(long, env = "SWITCHYARD_CLUSTER")]
    pub cluster: Option<String>,
    /// etcd endpoints, comma-separated (none = run without a registry).
    #[arg(long, env = "SWITCHYARD_ETCD", value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// Registry lease TTL in seconds.
    #[arg(long, env = "SWITCHYARD_LEASE_TTL_SECS")]
    pub lease_ttl_secs: Option<u64>,
    /// Seconds a shutdown waits for in-flight requests.
    #[arg(long, env = "SWITCHYARD_DRAIN_TIMEOUT_SECS")]
    pub drain_timeout_secs: Option<u64>,
    /// KV events kept for consumers that resume.
    #[arg(long, env = "SWITCHYARD_EVENT_BUFFER")]
    pub event_buffer: Option<usize>,
    /// Simulated-time speed-up factor.
    #[arg(long, env = "SWITCHYARD_SPEEDUP")]
    pub speedup: Option<f64>,
    /// Simulator: tokens per KV block.
    #[arg(long, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Simulator: device KV cache size in blocks.
    #[arg(long, env = "SWITCHYARD_KV_BLOCKS")]
    pub kv_blocks: Option<u64>,
    /// Simulator: host-tier KV cache size in blocks (0 = none).
    #[arg(long, env = "SWITCHYARD_HOST_KV_BLOCKS")]
    pub host_kv_blocks: Option<u64>,
    /// Simulator: longest prompt + output in tokens.
    #[arg(long, env = "SWITCHYARD_MAX_CONTEXT")]
    pub max_context: Option<u64>,
    /// Simulator: answers end with the end-of-sequence token after this many tokens on average
    /// (0, the default: every answer runs to its `max_tokens`).
    #[arg(long, env = "SWITCHYARD_MEAN_OUTPUT_TOKENS")]
    pub mean_output_tokens: Option<u32>,
    /// Simulator: random seed.
    #[arg(long, env = "SWITCHYARD_SEED")]
    pub seed: Option<u64>,
    /// Tensor-parallel degree of this worker's KV layout.
    #[arg(long, env = "SWITCHYARD_TENSOR_PARALLEL")]
    pub tensor_parallel: Option<u32>,
    /// Decode side: tensor-parallel degree of prefill workers that announce no KV layout.
    #[arg(long, env = "SWITCHYARD_PREFILL_TENSOR_PARALLEL")]
    pub prefill_tensor_parallel: Option<u32>,
    /// Decode side: coalesce KV fragments through the staging area (true or false).
    #[arg(long, env = "SWITCHYARD_KV_COALESCE")]
    pub kv_coalesce: Option<bool>,
    #[command(flatten)]
    pub kv_tiers: KvTierArgs,
    /// Engine behind the worker: sim, vllm, sglang or trtllm.
    #[arg(long, env = "SWITCHYARD_ENGINE", value_parser = parse_engine_kind)]
    pub engine: Option<EngineKind>,
    /// vLLM/SGLang: the engine's HTTP base URL (http://host:port).
    #[arg(long, env = "SWITCHYARD_ENGINE_URL")]
    pub engine_url: Option<String>,
    /// vLLM/SGLang: host:port a proxy reaches the engine's HTTP API on, registered for
    /// `switchyard epp` (default: host:port of --engine-url).
    #[arg(long, env = "SWITCHYARD_ENGINE_ADVERTISE")]
    pub engine_advertise: Option<String>,
    /// vLLM/SGLang: the engine's KV event publisher (tcp://host:5557).
    #[arg(long, env = "SWITCHYARD_KV_EVENTS")]
    pub kv_events: Option<String>,
    /// vLLM/SGLang: the engine's KV event replay socket (tcp://host:5558).
    #[arg(long, env = "SWITCHYARD_KV_REPLAY")]
    pub kv_replay: Option<String>,
    /// vLLM/SGLang: KV event topic prefix to subscribe to.
    #[arg(long, env = "SWITCHYARD_KV_EVENTS_TOPIC")]
    pub kv_events_topic: Option<String>,
    /// vLLM/SGLang: data-parallel ranks (one publisher each, ports offset by rank);
    /// TensorRT-LLM: attention-DP ranks (one event stream each).
    #[arg(long, env = "SWITCHYARD_DP_RANKS")]
    pub dp_ranks: Option<u32>,
    /// TensorRT-LLM: milliseconds between polls of `/kv_cache_events` while events flow (backs
    /// off to 25x when none come or the engine does not answer); default 20.
    #[arg(long, env = "SWITCHYARD_ENGINE_KV_POLL_MS")]
    pub engine_kv_poll_ms: Option<u64>,
    /// vLLM/SGLang: model name sent to the engine (default: --model).
    #[arg(long, env = "SWITCHYARD_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// vLLM/SGLang: tokens per KV block (default: from the engine's metrics).
    #[arg(long, env = "SWITCHYARD_ENGINE_BLOCK_SIZE")]
    pub engine_block_size: Option<u32>,
    /// vLLM/SGLang: device KV blocks (default: from the engine's metrics).
    #[arg(long, env = "SWITCHYARD_ENGINE_KV_BLOCKS")]
    pub engine_kv_blocks: Option<u64>,
    /// vLLM/SGLang: longest context (default: from the engine's /v1/models).
    #[arg(long, env = "SWITCHYARD_ENGINE_MAX_CONTEXT")]
    pub engine_max_context: Option<u64>,
    /// vLLM: how generated token ids are requested: return_token_ids (vLLM >= 0.10.2) or logprobs.
    #[arg(long, env = "SWITCHYARD_VLLM_TOKEN_IDS")]
    pub vllm_token_ids: Option<TokenIdSource>,
    /// SGLang prefill: host decode engines reach the engine's bootstrap server on (default: the
    /// --engine-url host).
    #[arg(long, env = "SWITCHYARD_ENGINE_BOOTSTRAP_HOST")]
    pub engine_bootstrap_host: Option<String>,
    /// SGLang prefill: the engine's --disaggregation-bootstrap-port (default 8998).
    #[arg(long, env = "SWITCHYARD_ENGINE_BOOTSTRAP_PORT")]
    pub engine_bootstrap_port: Option<u16>,
    /// vLLM/SGLang: seconds start-up waits for the engine to answer.
    #[arg(long, env = "SWITCHYARD_ENGINE_STARTUP_TIMEOUT_SECS")]
    pub engine_startup_timeout_secs: Option<u64>,
    /// vLLM/SGLang: milliseconds between reads of `/v1/models` for the LoRA adapters the engine
    /// serves (loaded or unloaded while it runs); default 5000.
    #[arg(long, env = "SWITCHYARD_ENGINE_ADAPTERS_INTERVAL_MS")]
    pub engine_adapters_interval_ms: Option<u64>,
    /// vLLM/SGLang: the engine schedules by request priority (vLLM `--scheduling-policy
    /// priority`, SGLang `--enable-priority-scheduling`): send each request's `priority`.
    #[arg(long, env = "SWITCHYARD_ENGINE_PRIORITY_SCHEDULING")]
    pub engine_priority_scheduling: bool,
    /// SGLang: the engine evicts by request priority (`--radix-eviction-policy priority`):
    /// send retention hints as eviction priorities (docs/engines.md, "Retention hints").
    #[arg(long, env = "SWITCHYARD_ENGINE_RETENTION_PRIORITY")]
    pub engine_retention_priority: bool,
    /// Export traces to this OpenTelemetry collector (OTLP/gRPC), e.g. http://otel-collector:4317.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub event_plane: switchyard_event_plane::EventPlaneArgs,
}

fn parse_engine_kind(s: &str) -> Result<EngineKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "sim" => Ok(EngineKind::Sim),
        "vllm" => Ok(EngineKind::Vllm),
        "sglang" => Ok(EngineKind::Sglang),
        "trtllm" | "tensorrt-llm" => Ok(EngineKind::Trtllm),
        _ => Err(format!(
            "unknown engine {s:?} (sim, vllm, sglang or trtllm)"
        )),
    }
}

impl WorkerArgs {
    /// Merges defaults, the config file, environment and flags, and validates the result.
    pub fn resolve(&self) -> Result<WorkerConfig, ConfigError> {
        let mut config = match &self.config {
            Some(path) => WorkerConfig::from_file(path)?,
            None => WorkerConfig::default(),
        };
        macro_rules! set {
            ($field:ident => $target:expr) => {
                if let Some(value) = &self.$field {
                    $target = value.clone();
                }
            };
        }
        if let Some(id) = &self.id {
            config.id = Some(id.clone());
        }
        set!(listen => config.listen);
        if let Some(addr) = &self.advertise_address {
            config.advertise_address = Some(addr.clone());
        }
        if self.metrics_listen.is_some() {
            config.metrics_listen = self.metrics_listen;
        }
        for (flag, target) in [
            (&self.metrics_tls_cert, &mut config.metrics_tls_cert),
            (&self.metrics_tls_key, &mut config.metrics_tls_key),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        if self.metrics_token.is_some() {
            config.metrics_token.clone_from(&self.metrics_token);
        }
        set!(model => config.model);
        set!(lora_adapters => config.lora_adapters);
        set!(role => config.role);
        set!(cluster => config.cluster);
        set!(etcd => config.etcd_endpoints);
        set!(lease_ttl_secs => config.lease_ttl_secs);
        set!(drain_timeout_secs => config.drain_timeout_secs);
        set!(event_buffer => config.event_buffer);
        set!(speedup => config.speedup);
        if let Some(size) = self.block_size {
            config.sim.block_size =
                BlockSize::new(size).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        set!(kv_blocks => config.sim.num_device_blocks);
        set!(host_kv_blocks => config.sim.num_host_blocks);
        set!(max_context => config.sim.max_context_tokens);
        set!(mean_output_tokens => config.sim.mean_output_tokens);
        set!(seed => config.sim.seed);
        set!(tensor_parallel => config.kv_layout.tensor_parallel);
        if self.prefill_tensor_parallel.is_some() {
            config.kv_transfer.prefill_tensor_parallel = self.prefill_tensor_parallel;
        }
        set!(kv_coalesce => config.kv_transfer.coalesce);
        self.kv_tiers.apply(&mut config.kv_tiers);
        set!(engine => config.engine.kind);
        let engine = &mut config.engine;
        for (flag, target) in [
            (&self.engine_url, &mut engine.url),
            (&self.engine_advertise, &mut engine.advertise),
            (&self.kv_events, &mut engine.kv_events),
            (&self.kv_replay, &mut engine.kv_replay),
            (&self.served_model_name, &mut engine.served_model_name),
            (&self.engine_bootstrap_host, &mut engine.bootstrap_host),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        set!(kv_events_topic => engine.kv_events_topic);
        set!(dp_ranks => engine.dp_ranks);
        set!(engine_kv_poll_ms => engine.kv_poll_ms);
        set!(vllm_token_ids => engine.vllm_token_ids);
        set!(engine_startup_timeout_secs => engine.startup_timeout_secs);
        set!(engine_adapters_interval_ms => engine.adapters_interval_ms);
        set!(engine_bootstrap_port => engine.bootstrap_port);
        if self.engine_priority_scheduling {
            engine.priority_scheduling = true;
        }
        if self.engine_retention_priority {
            engine.retention_priority = true;
        }
        if self.engine_block_size.is_some() {
            engine.block_size = self.engine_block_size;
        }
        if self.engine_kv_blocks.is_some() {
            engine.kv_blocks = self.engine_kv_blocks;
        }
        if self.engine_max_context.is_some() {
            engine.max_context = self.engine_max_context;
        }
        if let Some(v) = &self.otlp_endpoint {
            // Empty (an `OTEL_EXPORTER_OTLP_ENDPOINT=` left in a manifest) turns traces off.
            config.otlp_endpoint = Some(v.clone()).filter(|v| !v.trim().is_empty());
        }
        self.security.apply(&mut config.security);
        self.event_plane.apply(&mut config.event_plane);
        config.etcd_endpoints.retain(|e| !e.trim().is_empty());
        config.validate()?;
        // Read the secret and certificates now, so a bad file is a configuration error.
        config
            .security
            .build(&config.cluster, switchyard_security::PeerRole::Worker)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        config
            .metrics_tls()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        WorkerConfig::default().validate().unwrap();
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "model = \"from-file\"\nrole = \"prefill\"\n[sim]\nblock_size = 32\n",
        )
        .unwrap();
        let args = WorkerArgs {
            config: Some(path),
            role: Some(Role::Decode),
            ..Default::default()
        };
        let config = args.resolve().unwrap();
        assert_eq!(config.model, "from-file");
        assert_eq!(config.metrics_listen, None);
        assert_eq!(config.role, Role::Decode);
        assert_eq!(config.sim.block_size.get(), 32);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_a_sentence() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(&path, "modle = \"typo\"\n").unwrap();
        let err = WorkerArgs {
            config: Some(path),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("modle"), "{err}");

        let err = WorkerArgs {
            block_size: Some(0),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("block size"), "{err}");

        let err = WorkerArgs {
            listen: Some("0.0.0.0:7000".parse().unwrap()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("advertise"), "{err}");

        let err = WorkerArgs {
            listen: Some("127.0.0.1:7000".parse().unwrap()),
            metrics_listen: Some("127.0.0.1:7000".parse().unwrap()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("own port"), "{err}");

        let err = WorkerArgs {
            otlp_endpoint: Some("https://collector:4317".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("OTLP endpoint"), "{err}");
        let config = WorkerArgs {
            otlp_endpoint: Some(" ".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(config.otlp_endpoint, None);

        let err = WorkerArgs {
            tensor_parallel: Some(3),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("tensor_parallel 3"), "{err}");
        let config = WorkerConfig {
            kv_bytes_per_token: 65_536,
            ..WorkerConfig::default()
        };
        assert!(config.validate().unwrap_err().to_string().contains("agree"));
    }

    #[test]
    fn the_prefill_split_defaults_to_this_workers_own() {
        let config = WorkerArgs {
            tensor_parallel: Some(2),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let setup = config.transfer_setup();
        assert_eq!(setup.source, setup.dest);
        let config = WorkerArgs {
            tensor_parallel: Some(2),
            prefill_tensor_parallel: Some(1),
            kv_coalesce: Some(false),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let setup = config.transfer_setup();
        assert_eq!(
            (setup.source.tensor_parallel, setup.dest.tensor_parallel),
            (1, 2)
        );
        assert!(!setup.coalesce);
    }

    #[test]
    fn engine_flags_select_and_check_a_real_engine() {
        let args = WorkerArgs {
            engine: Some(EngineKind::Vllm),
            engine_url: Some("http://127.0.0.1:8000".into()),
            kv_events: Some("tcp://127.0.0.1:5557".into()),
            kv_replay: Some("tcp://127.0.0.1:5558".into()),
            dp_ranks: Some(2),
            ..Default::default()
        };
        let config = args.resolve().unwrap();
        assert_eq!(config.engine.kind, EngineKind::Vllm);
        assert_eq!(config.engine.dp_ranks, 2);

        let err = WorkerArgs {
            engine: Some(EngineKind::Sglang),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("--engine-url"), "{err}");
        let err = WorkerArgs {
            kv_events: Some("tcp://*:5557".into()),
            ..args.clone()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("wildcard"), "{err}");
        assert!(parse_engine_kind("tgi").is_err());
        // A prefill worker in front of SGLang announces its engine's bootstrap server.
        let config = WorkerArgs {
            role: Some(Role::Prefill),
            engine: Some(EngineKind::Sglang),
            engine_bootstrap_port: Some(9000),
            ..args.clone()
        }
        .resolve()
        .unwrap();
        assert_eq!(config.role, Role::Prefill);
        assert_eq!(
            (config.engine.bootstrap_host, config.engine.bootstrap_port),
            (None, 9000)
        );
        let err = WorkerArgs {
            engine_bootstrap_port: Some(0),
            ..args
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("bootstrap_port"), "{err}");
    }

    #[test]
    fn a_peer_link_is_taken_for_vllm_and_refused_for_sglang() {
        let peer = crate::kv_tiers::KvTierArgs {
            kv_peer_gbytes_per_s: Some(10.0),
            ..Default::default()
        };
        let vllm = WorkerArgs {
            engine: Some(EngineKind::Vllm),
            engine_url: Some("http://127.0.0.1:8000".into()),
            kv_tiers: peer.clone(),
            ..Default::default()
        };
        let config = vllm.clone().resolve().unwrap();
        assert_eq!(
            config.kv_tiers.peer_link().map(|l| l.bytes_per_s),
            Some(10_000_000_000)
        );
        let err = WorkerArgs {
            engine: Some(EngineKind::Sglang),
            ..vllm
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("peer_gbytes_per_s"), "{err}");
    }

    #[test]
    fn a_trtllm_worker_is_polled_over_http_and_refuses_what_it_cannot_do_yet() {
        let args = WorkerArgs {
            engine: Some(parse_engine_kind("trtllm").unwrap()),
            engine_url: Some("http://127.0.0.1:8000".into()),
            engine_kv_poll_ms: Some(5),
            ..Default::default()
        };
        let config = args.resolve().unwrap();
        assert_eq!(
            (config.engine.kind, config.engine.kv_poll_ms),
            (EngineKind::Trtllm, 5)
        );
        let refused = |args: WorkerArgs, needle: &str| {
            let err = args.resolve().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        };
        let zmq = WorkerArgs {
            kv_events: Some("tcp://127.0.0.1:5557".into()),
            ..args.clone()
        };
        refused(zmq, "/kv_cache_events");
        // Prefill and decode roles split requests through disaggregated_params.
        for role in [Role::Prefill, Role::Decode] {
            let split = WorkerArgs {
                role: Some(role),
                ..args.clone()
            };
            assert_eq!(split.resolve().unwrap().role, role);
        }
        let lora = WorkerArgs {
            lora_adapters: Some(vec!["sql".into()]),
            ..args
        };
        refused(lora, "LoRA");
    }
}
