//! The gateway's one configuration struct and its flag/environment layer.
//!
//! Precedence: defaults < config file (`--config`, TOML) < `SWITCHYARD_*` environment < flags.
//! Validated once at start; a bad value is a one-sentence [`ConfigError`] (exit code 64).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use switchyard_router::{PolicyConfig, PolicyKind};

use switchyard_router::serve::{
    DEFAULT_MAX_PREFILL_QUEUE_TOKENS, DEFAULT_MIN_UNCACHED_TOKENS, ServeSettings,
};

use crate::api::chat_output::OutputConfig;
use crate::serving::disagg::{DEFAULT_PREFILL_TIMEOUT, DisaggSettings, Disaggregation, KvTransfer};

pub use switchyard_config::ConfigError;
use switchyard_security::{PeerRole, SecurityArgs, SecurityConfig};

use crate::access::listener::{AccessArgs, AccessConfig};

/// Default load-report interval when workers push on change: only the heartbeat that keeps an
/// idle worker in routing (`unresponsive_after`), so it can be long.
pub const DEFAULT_HEARTBEAT_MS: u32 = 1_000;
/// Default load-report interval without pushes: every load change waits for it.
pub const DEFAULT_POLL_MS: u32 = 100;

/// Everything the gateway needs to run.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// HTTP listen address (`IP:PORT` or `HOST:PORT`).
    #[serde(deserialize_with = "switchyard_config::listen_addr::deserialize")]
    pub listen: SocketAddr,
    /// etcd endpoints; empty means the caller provides a registry (`switchyard up`).
    pub etcd_endpoints: Vec<String>,
    pub cluster: String,
    /// Bearer token the admin API requires; none leaves it open (bind to loopback then).
    pub admin_token: Option<String>,
    /// Tokenizer for every model without its own entry in `models`: `builtin:cl100k`,
    /// `builtin:o200k`, or a Hugging Face model directory.
    pub tokenizer: String,
    /// Per-model tokenizer (model name → `builtin:…` or a model directory).
    pub models: BTreeMap<String, String>,
    /// Routing policy at start (switchable at runtime through the admin API).
    pub policy: PolicyKind,
    pub policy_settings: PolicyConfig,
    /// Incremental tokenization of sessions (one cache per tokenizer).
    pub session_cache: SessionCacheConfig,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Whole-request deadline in seconds (streaming included).
    pub request_timeout_secs: u64,
    /// `max_tokens` when a request does not say (at most what the context leaves). Agent
    /// clients such as Codex leave it out and expect the model to finish its turn; vLLM gives
    /// such a request all the context left, this bounds a model that never ends.
    pub default_max_tokens: u32,
    /// Requests served at once; more wait in the queue.
    pub max_concurrent_requests: usize,
    /// Requests waiting for a slot; more get 429.
    pub max_queued_requests: usize,
    /// Requests one flow (a session, or a tenant's requests without a session) may have
    /// waiting; more get 429, so one flow cannot fill the whole queue.
    pub max_queued_per_session: usize,
    /// Requests one client address may have in flight (waiting or running); more get 429 at
    /// once. 0: no limit (the default, since clients behind one proxy share its address).
    pub max_requests_per_client: usize,
    /// Limits of the HTTP listener (`[http]`): connections, timeouts, HTTP/2, shutdown.
    pub http: HttpConfig,
    /// `[output]`: per-model tool-call and reasoning parsers.
    pub output: OutputConfig,
    /// Other workers tried when a worker fails before the first token.
    pub max_retries: u32,
    /// Times a stream moves to another worker after its worker fails mid-stream.
    pub max_migrations: u32,
    /// Routing decisions kept for the admin decision log.
    pub decision_log_size: usize,
    /// Load-report interval asked of workers, in milliseconds. Unset, it follows
    /// `load_push_min_ms`: with pushes on, changes travel as pushes and the interval is only
    /// the idle heartbeat ([`DEFAULT_HEARTBEAT_MS`]); with pushes off, it is how fresh the load
    /// view is ([`DEFAULT_POLL_MS`]). See [`Self::load_interval_ms`].
    pub load_interval_ms: Option<u32>,
    /// Workers push a load report this many milliseconds after their load changes, at most
    /// one per this many (0: reports every `load_interval_ms` only). See `docs/fleet.md`.
    pub load_push_min_ms: u32,
    /// Worker streams (KV events with their snapshot, load reports) the gateway opens at once,
    /// so one that starts in front of a large fleet does not ask every worker at the same time
    /// (`docs/scaling.md`). At least 1.
    pub subscribe_concurrency: usize,
    /// A worker whose load reports stop for this many milliseconds (or whose connection
    /// fails) is out of routing until it answers again, whatever its lease says. Default:
    /// twenty report intervals, at least 2000.
    pub unresponsive_after_ms: Option<u64>,
    /// Directory KV recordings (admin API) are confined to; unset, recordings are off. See
    /// `docs/kv-recording.md`.
    pub recording_dir: Option<PathBuf>,
    /// Disaggregated prefill/decode serving: `off`, `auto` (per request, when it pays) or
    /// `enforce` (every request through a prefill worker, 503 without one).
    pub disaggregation: Disaggregation,
    /// `auto` sends a request through a prefill worker only when at least this many of its
    /// prompt tokens are uncached on the chosen decode worker; shorter prefills are cheaper to
    /// run in place than to transfer.
    pub disagg_min_uncached_tokens: u64,
    /// A prefill worker with more prefill tokens queued than this is saturated: `auto` stays
    /// aggregated rather than queue behind it.
    pub disagg_max_prefill_queue_tokens: u64,
    /// Longest a Prefill call may take before the gateway tries another prefill worker.
    pub prefill_timeout_secs: u64,
    /// OpenTelemetry collector (OTLP/gRPC, `http://host:4317`) the gateway's traces go to;
    /// none exports nothing.
    pub otlp_endpoint: Option<String>,
    /// When the decode worker pulls the KV: `pipelined` (while the prefill runs, chunk by
    /// chunk) or `after-prefill`.
    pub kv_transfer: KvTransfer,
    /// The decision log and the KV audit (`[audit]`, see `docs/admin-api.md`).
    pub audit: crate::observe::audit::AuditConfig,
    /// How the gateway proves itself to workers (mTLS or the cluster secret); empty: an open
    /// cluster. See `docs/security.md`.
    pub security: SecurityConfig,
    /// Who may use the HTTP listener: API keys, the metrics token, HTTPS (`[access]`).
    pub access: AccessConfig,
    /// Largest KV recording, in bytes: a recording stops there whatever its request asked.
    pub recording_max_bytes: u64,
    /// Where the workers are found (`[discovery]`): etcd, Kubernetes, or both.
    pub discovery: crate::cluster::discovery::DiscoveryConfig,
    /// Sessions shared with the other gateway replicas (`[fleet]`).
    pub fleet: crate::cluster::fleet::FleetConfig,
    /// Fleet-wide per-tenant quotas and the Redis they are counted in (`[quota]`).
    pub quota: crate::access::quota::QuotaConfig,
    /// Retention hints on sessions' turns (`[retention]`).
    pub retention: crate::serving::retention::RetentionSettings,
    /// Sessions' turns scheduled by their working sets (`[sessions]`).
    pub sessions: crate::serving::sessions::SessionSettings,
    /// The request field policy (`[api]`, see `http::fields`).
    pub api: crate::api::http::fields::ApiConfig,
    /// Stored responses and sealed reasoning of `/v1/responses` (`[responses]`).
    pub responses: crate::api::http::responses::ResponsesConfig,
    /// `[event_plane]`: read KV events from this NATS JetStream stream instead of a gRPC
    /// stream per worker (`docs/scaling.md`); unset: gRPC streams.
    pub event_plane: switchyard_event_plane::EventPlaneConfig,
}

/// Limits of the HTTP listener (`[http]`); see `http::server` and `docs/operations.md`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Connections open at once; one more is answered 503 and closed. Lowered at start to
    /// what the open-files limit allows.
    pub max_connections: usize,
    /// Seconds an HTTP/1.1 request's headers may take to arrive, counted from when the
    /// connection starts waiting for them (also how long a kept-alive connection waits for
    /// its next request).
    pub header_timeout_secs: u64,
    /// Seconds a request's body may take to arrive after its headers; later is 408.
    pub body_timeout_secs: u64,
    /// Seconds a connection may stay open with no request in flight.
    pub idle_timeout_secs: u64,
    /// Concurrent streams per HTTP/2 connection.
    pub http2_max_streams: u32,
    /// Seconds open connections get to finish after a shutdown signal before they are cut.
    pub shutdown_grace_secs: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            header_timeout_secs: 30,
            body_timeout_secs: 60,
            idle_timeout_secs: 60,
            http2_max_streams: 256,
            shutdown_grace_secs: 30,
        }
    }
}

impl HttpConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self.max_connections == 0 {
            return invalid("http.max_connections must be at least 1");
        }
        for (name, secs) in [
            ("header_timeout_secs", self.header_timeout_secs),
            ("body_timeout_secs", self.body_timeout_secs),
            ("idle_timeout_secs", self.idle_timeout_secs),
        ] {
            if secs == 0 {
                return invalid(&format!("http.{name} must be at least 1"));
            }
        }
        if self.http2_max_streams == 0 {
            return invalid("http.http2_max_streams must be at least 1");
        }
        Ok(())
    }

    /// The listener's limits, with the connection cap the process can actually hold.
    pub fn limits(&self, max_connections: usize) -> crate::api::http::server::HttpLimits {
        crate::api::http::server::HttpLimits {
            max_connections,
            header_timeout: Duration::from_secs(self.header_timeout_secs),
            body_timeout: Duration::from_secs(self.body_timeout_secs),
            idle_timeout: Duration::from_secs(self.idle_timeout_secs),
            http2_max_streams: self.http2_max_streams,
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
        }
    }
}

/// Bounds and checking of the incremental session tokenization cache (`[session_cache]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionCacheConfig {
    /// Sessions kept per tokenizer; the least recently used goes first.
    pub max_sessions: usize,
    /// Bytes kept per tokenizer (text, token ids, offsets).
    pub max_bytes: usize,
    /// Fraction of incremental turns also tokenized in full and compared (0 to 1); a mismatch
    /// is counted and the full result used.
    pub verify_sample_rate: f64,
    /// Bytes per tokenizer of the cross-request prefix cache: prompt openings (system
    /// prompts, tool definitions) tokenized once for every session; 0 turns it off.
    pub prefix_cache_bytes: usize,
}

impl Default for SessionCacheConfig {
    fn default() -> Self {
        let defaults = switchyard_tokenize::SessionConfig::default();
        Self {
            max_sessions: defaults.max_sessions,
            max_bytes: defaults.max_bytes,
            verify_sample_rate: defaults.verify_sample_rate,
            prefix_cache_bytes: defaults.prefix_cache_bytes,
        }
    }
}

impl SessionCacheConfig {
    pub fn to_session_config(&self) -> switchyard_tokenize::SessionConfig {
        switchyard_tokenize::SessionConfig {
            max_sessions: self.max_sessions,
            max_bytes: self.max_bytes,
            verify_sample_rate: self.verify_sample_rate,
            prefix_cache_bytes: self.prefix_cache_bytes,
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            etcd_endpoints: Vec::new(),
            cluster: "default".to_owned(),
            admin_token: None,
            tokenizer: "builtin:cl100k".to_owned(),
            models: BTreeMap::new(),
            policy: PolicyKind::Kv,
            policy_settings: PolicyConfig::default(),
            session_cache: SessionCacheConfig::default(),
            max_body_bytes: 32 << 20,
            request_timeout_secs: 600,
            default_max_tokens: 16_384,
            max_concurrent_requests: 1024,
            max_queued_requests: 4096,
            max_queued_per_session: 256,
            max_requests_per_client: 0,
            http: HttpConfig::default(),
            output: OutputConfig::default(),
            max_retries: 2,
            max_migrations: 2,
            decision_log_size: 256,
            load_interval_ms: None,
            load_push_min_ms: 5,
            subscribe_concurrency: crate::cluster::pool::subscriptions::DEFAULT_CONCURRENCY,
            unresponsive_after_ms: None,
            recording_dir: None,
            disaggregation: Disaggregation::Off,
            disagg_min_uncached_tokens: DEFAULT_MIN_UNCACHED_TOKENS,
            disagg_max_prefill_queue_tokens: DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
            prefill_timeout_secs: DEFAULT_PREFILL_TIMEOUT.as_secs(),
            otlp_endpoint: None,
            kv_transfer: KvTransfer::Pipelined,
            audit: crate::observe::audit::AuditConfig::default(),
            security: SecurityConfig::default(),
            access: AccessConfig::default(),
            recording_max_bytes: 1 << 30,
            discovery: crate::cluster::discovery::DiscoveryConfig::default(),
            fleet: crate::cluster::fleet::FleetConfig::default(),
            quota: crate::access::quota::QuotaConfig::default(),
            retention: crate::serving::retention::RetentionSettings::default(),
            sessions: crate::serving::sessions::SessionSettings::default(),
            api: crate::api::http::fields::ApiConfig::default(),
            responses: crate::api::http::responses::ResponsesConfig::default(),
            event_plane: switchyard_event_plane::EventPlaneConfig::default(),
        }
    }
}

impl GatewayConfig {
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        switchyard_config::load_toml(path)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        self.event_plane.validate().map_err(ConfigError::Invalid)?;
        if self.max_body_bytes < 1024 {
            return invalid("max_body_bytes must be at least 1024");
        }
        if self.request_timeout_secs == 0 {
            return invalid("request_timeout_secs must be at least 1");
        }
        if self.default_max_tokens == 0 {
            return invalid("default_max_tokens must be at least 1");
        }
        if self.max_concurrent_requests == 0 {
            return invalid("max_concurrent_requests must be at least 1");
        }
        let rate = self.session_cache.verify_sample_rate;
        if !(0.0..=1.0).contains(&rate) {
            return invalid("session_cache.verify_sample_rate must be between 0 and 1");
        }
        if self.max_queued_per_session == 0 {
            return invalid("max_queued_per_session must be at least 1");
        }
        self.http.validate()?;
        self.output.validate().map_err(ConfigError::Invalid)?;
        if self.load_push_min_ms >= self.load_interval_ms().max(1) {
            return invalid(
                "load_push_min_ms must be below load_interval_ms (or 0 to turn pushing off), or pushes would come no sooner than the interval",
            );
        }
        if self.subscribe_concurrency == 0 {
            return invalid("subscribe_concurrency must be at least 1");
        }
        if let Some(after) = self.unresponsive_after_ms
            && after < 2 * u64::from(self.load_interval_ms().max(1))
        {
            return invalid(
                "unresponsive_after_ms must be at least twice load_interval_ms, or workers flap out of routing",
            );
        }
        self.audit.validate().map_err(ConfigError::Invalid)?;
        if self.decision_log_size == 0 {
            return invalid("decision_log_size must be at least 1");
        }
        if self.prefill_timeout_secs == 0 {
            return invalid("prefill_timeout_secs must be at least 1");
        }
        if self.admin_token.as_deref().is_some_and(str::is_empty) {
            return invalid("admin_token must not be empty when set");
        }
        self.security
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.access.validate().map_err(ConfigError::Invalid)?;
        self.discovery.validate().map_err(ConfigError::Invalid)?;
        self.validate_fleet()?;
        self.quota.validate().map_err(ConfigError::Invalid)?;
        self.responses.validate().map_err(ConfigError::Invalid)?;
        self.retention.estimator().map_err(ConfigError::Invalid)?;
        self.sessions.validate().map_err(ConfigError::Invalid)?;
        // The admin API drains workers and switches the policy: open only on loopback.
        if self.admin_token.is_none() && !self.listen.ip().is_loopback() {
            return invalid(
                "the admin API needs an admin_token (--admin-token or SWITCHYARD_ADMIN_TOKEN) when the gateway listens beyond loopback",
            );
        }
        if self.recording_max_bytes == 0 {
            return invalid("recording_max_bytes must be at least 1");
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            switchyard_telemetry::validate_endpoint(endpoint)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        self.policy
            .build(&self.policy_settings)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(())
    }

    /// `[fleet]` on its own, and what the forwarding hop supports: plain HTTP between the
    /// replicas, authenticated by the cluster secret when the cluster is secured.
    fn validate_fleet(&self) -> Result<(), ConfigError> {
        self.fleet.validate().map_err(ConfigError::Invalid)?;
        if !self.fleet.share_sessions {
            return Ok(());
        }
        if self.access.tls_cert.is_some() {
            return Err(ConfigError::Invalid(
                "fleet.share_sessions forwards turns over plain HTTP and this listener serves HTTPS ([access] tls_cert): terminate TLS in front of the replicas, or turn session sharing off".into(),
            ));
        }
        if self.security.tls_cert.is_some() && self.security.cluster_secret_file.is_none() {
            return Err(ConfigError::Invalid(
                "fleet.share_sessions authenticates the forwarding hop with the cluster secret: give --cluster-secret-file too (mTLS alone does not cover it)".into(),
            ));
        }
        Ok(())
    }

    /// Reads the security files once (the secret, the certificates, their identity for this
    /// cluster), so a bad one is a configuration error at start rather than a failure later.
    pub fn check_security_files(&self) -> Result<(), ConfigError> {
        let invalid = |e: switchyard_security::SecurityError| ConfigError::Invalid(e.to_string());
        self.security
            .build(&self.cluster, PeerRole::Gateway)
            .map_err(invalid)?;
        self.access.build().map(drop).map_err(invalid)
    }

    /// How long a worker may go without a load report before it is out of routing.
    pub fn unresponsive_after(&self) -> Duration {
        match self.unresponsive_after_ms {
            Some(ms) => Duration::from_millis(ms),
            None => {
                crate::cluster::pool::follow::default_unresponsive_after(self.load_interval_ms())
            }
        }
    }

    /// The load-report interval asked of workers: the configured one, else the idle heartbeat
    /// when workers push on change (every report an idle worker sends is a stream message
    /// each gateway handles: 1,000 idle workers on a 100 ms interval cost a gateway ≈ 10,000
    /// reports a second), else the polling interval.
    pub fn load_interval_ms(&self) -> u32 {
        match (self.load_interval_ms, self.load_push_min_ms) {
            (Some(ms), _) => ms,
            (None, 0) => DEFAULT_POLL_MS,
            (None, _) => DEFAULT_HEARTBEAT_MS,
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_secs)
    }

    /// The disaggregation settings each request carries.
    pub fn disagg(&self) -> DisaggSettings {
        DisaggSettings {
            serve: ServeSettings {
                disaggregation: self.disaggregation,
                min_uncached_tokens: self.disagg_min_uncached_tokens,
                max_prefill_queue_tokens: self.disagg_max_prefill_queue_tokens,
            },
            prefill_timeout: Duration::from_secs(self.prefill_timeout_secs),
            kv_transfer: self.kv_transfer,
        }
    }
}

/// Flags and `SWITCHYARD_*` environment variables of the gateway.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct GatewayArgs {
    /// TOML config file; environment variables and flags override it.
    #[arg(long = "gateway-config", env = "SWITCHYARD_GATEWAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long = "http", env = "SWITCHYARD_HTTP", value_parser = switchyard_config::parse_listen_addr)]
    pub listen: Option<SocketAddr>,
    /// Bearer token for /admin.
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// Default tokenizer: builtin:cl100k, builtin:o200k or a Hugging Face model directory.
    #[arg(long, env = "SWITCHYARD_TOKENIZER")]
    pub tokenizer: Option<String>,
    /// Per-model tokenizer, MODEL=builtin:cl100k, MODEL=builtin:o200k or MODEL=/path/to/model-dir
    /// (repeatable).
    #[arg(long = "model-tokenizer", value_parser = parse_model_tokenizer)]
    pub model_tokenizers: Vec<(String, String)>,
    /// Per-model tool-call parser, MODEL=NAME (hermes, llama3_json, mistral, deepseek_v3,
    /// qwen3_coder, none; repeatable). Default: what the model's chat template implies.
    #[arg(long = "tool-call-parser", value_parser = parse_model_tokenizer)]
    pub tool_call_parsers: Vec<(String, String)>,
    /// Per-model reasoning parser, MODEL=NAME (qwen3, deepseek_r1, none; repeatable).
    #[arg(long = "reasoning-parser", value_parser = parse_model_tokenizer)]
    pub reasoning_parsers: Vec<(String, String)>,
    /// Routing policy: kv, round-robin, random, least-loaded, session, approx-kv, dynamo-kv, sglang-ca.
    #[arg(long, env = "SWITCHYARD_POLICY")]
    pub policy: Option<PolicyKind>,
    /// Whole-request deadline in seconds.
    #[arg(long, env = "SWITCHYARD_REQUEST_TIMEOUT_SECS")]
    pub request_timeout_secs: Option<u64>,
    /// max_tokens when a request does not say.
    #[arg(long, env = "SWITCHYARD_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<u32>,
    /// Requests served at once.
    #[arg(long, env = "SWITCHYARD_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<usize>,
    /// Requests waiting for a slot before 429.
    #[arg(long, env = "SWITCHYARD_MAX_QUEUED_REQUESTS")]
    pub max_queued_requests: Option<usize>,
    /// Fraction (0-1) of incremental session tokenizations checked against a full one.
    #[arg(long, env = "SWITCHYARD_SESSION_VERIFY_SAMPLE_RATE")]
    pub session_verify_sample_rate: Option<f64>,
    /// Bytes per tokenizer of the cross-request prefix cache (prompt openings shared by
    /// sessions); 0 turns it off.
    #[arg(long, env = "SWITCHYARD_PREFIX_CACHE_BYTES")]
    pub prefix_cache_bytes: Option<usize>,
    /// Requests one session (or one tenant's requests without a session) may have waiting.
    #[arg(long, env = "SWITCHYARD_MAX_QUEUED_PER_SESSION")]
    pub max_queued_per_session: Option<usize>,
    /// Requests one client address may have in flight; 0 for no limit.
    #[arg(long, env = "SWITCHYARD_MAX_REQUESTS_PER_CLIENT")]
    pub max_requests_per_client: Option<usize>,
    /// Milliseconds without a load report after which a worker is out of routing.
    #[arg(long, env = "SWITCHYARD_UNRESPONSIVE_AFTER_MS")]
    pub unresponsive_after_ms: Option<u64>,
    /// Milliseconds after a load change that workers push a report (0: every interval only).
    #[arg(long, env = "SWITCHYARD_LOAD_PUSH_MIN_MS")]
    pub load_push_min_ms: Option<u32>,
    /// Load-report interval asked of workers, in ms (default: 1000 with pushes, the idle
    /// heartbeat; 100 without).
    #[arg(long, env = "SWITCHYARD_LOAD_INTERVAL_MS")]
    pub load_interval_ms: Option<u32>,
    /// Worker streams opened at once while following the workers (at least 1).
    #[arg(long, env = "SWITCHYARD_SUBSCRIBE_CONCURRENCY")]
    pub subscribe_concurrency: Option<usize>,
    /// HTTP connections open at once; one more is answered 503.
    #[arg(long, env = "SWITCHYARD_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Seconds an HTTP/1.1 request's headers may take (also the keep-alive wait).
    #[arg(long, env = "SWITCHYARD_HEADER_TIMEOUT_SECS")]
    pub header_timeout_secs: Option<u64>,
    /// Seconds a request body may take after its headers (408 after).
    #[arg(long, env = "SWITCHYARD_BODY_TIMEOUT_SECS")]
    pub body_timeout_secs: Option<u64>,
    /// Seconds a connection may stay open with no request in flight.
    #[arg(long, env = "SWITCHYARD_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// Concurrent streams per HTTP/2 connection.
    #[arg(long, env = "SWITCHYARD_HTTP2_MAX_STREAMS")]
    pub http2_max_streams: Option<u32>,
    /// Seconds connections get to finish after SIGTERM before they are cut.
    #[arg(long, env = "SWITCHYARD_SHUTDOWN_GRACE_SECS")]
    pub shutdown_grace_secs: Option<u64>,
    /// Directory KV recordings started through the admin API are confined to.
    #[arg(long, env = "SWITCHYARD_RECORDING_DIR")]
    pub recording_dir: Option<PathBuf>,
    /// Request fields the gateway does not know: accept (counted, logged once; the default)
    /// or refuse (a 400 naming the field).
    #[arg(long, env = "SWITCHYARD_UNKNOWN_FIELDS")]
    pub unknown_fields: Option<crate::api::http::fields::UnknownFields>,
    /// Disaggregated serving: off, auto or enforce.
    #[arg(long, env = "SWITCHYARD_DISAGGREGATION")]
    pub disaggregation: Option<Disaggregation>,
    /// Uncached prompt tokens from which `auto` uses a prefill worker.
    #[arg(long, env = "SWITCHYARD_DISAGG_MIN_UNCACHED_TOKENS")]
    pub disagg_min_uncached_tokens: Option<u64>,
    /// Seconds a Prefill may take before another prefill worker is tried.
    #[arg(long, env = "SWITCHYARD_PREFILL_TIMEOUT_SECS")]
    pub prefill_timeout_secs: Option<u64>,
    /// Export traces to this OpenTelemetry collector (OTLP/gRPC), e.g. http://otel-collector:4317.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub access: AccessArgs,
    #[command(flatten)]
    pub discovery: crate::cluster::discovery::DiscoveryArgs,
    #[command(flatten)]
    pub fleet: crate::cluster::fleet::FleetArgs,
    #[command(flatten)]
    pub quota: crate::access::quota::QuotaArgs,
    #[command(flatten)]
    pub retention: crate::serving::retention::RetentionArgs,
    #[command(flatten)]
    pub sessions: crate::serving::sessions::SessionArgs,
    #[command(flatten)]
    pub responses: crate::api::http::responses::ResponsesArgs,
    #[command(flatten)]
    pub event_plane: switchyard_event_plane::EventPlaneArgs,
    /// Largest KV recording in bytes (default 1 GiB).
    #[arg(long, env = "SWITCHYARD_RECORDING_MAX_BYTES")]
    pub recording_max_bytes: Option<u64>,
    /// KV transfer of disaggregated requests: pipelined (default) or after-prefill.
    #[arg(long, env = "SWITCHYARD_KV_TRANSFER")]
    pub kv_transfer: Option<KvTransfer>,
    /// Also write finished routing decisions to this JSON Lines file (rotated, size-capped).
    #[arg(long, env = "SWITCHYARD_DECISION_LOG_PATH")]
    pub decision_log_path: Option<PathBuf>,
    /// Bytes the decision log may take on disk (with its one rotation).
    #[arg(long, env = "SWITCHYARD_DECISION_LOG_MAX_BYTES")]
    pub decision_log_max_bytes: Option<u64>,
    /// Milliseconds between digests of each worker's blocks, checked against the index (0: off).
    #[arg(long, env = "SWITCHYARD_DIGEST_INTERVAL_MS")]
    pub digest_interval_ms: Option<u32>,
    /// Milliseconds a worker may owe KV events before it is reported silent.
    #[arg(long, env = "SWITCHYARD_KV_SILENCE_AFTER_MS")]
    pub kv_silence_after_ms: Option<u64>,
}

fn parse_model_tokenizer(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((model, tok)) if !model.is_empty() && !tok.is_empty() => {
            Ok((model.to_owned(), tok.to_owned()))
        }
        _ => Err(format!("expected MODEL=VALUE, got {s:?}")),
    }
}

impl GatewayArgs {
    /// Merges the layers over `base` (the defaults, or what a caller prepared).
    pub fn resolve_onto(&self, base: GatewayConfig) -> Result<GatewayConfig, ConfigError> {
        let mut config = match &self.config {
            Some(path) => GatewayConfig::from_file(path)?,
            None => base,
        };
        if let Some(v) = self.listen {
            config.listen = v;
        }
        if let Some(v) = &self.admin_token {
            config.admin_token = Some(v.clone());
        }
        if let Some(v) = &self.tokenizer {
            config.tokenizer = v.clone();
        }
        for (model, tok) in &self.model_tokenizers {
            config.models.insert(model.clone(), tok.clone());
        }
        for (model, name) in &self.tool_call_parsers {
            config
                .output
                .tool_call_parsers
                .insert(model.clone(), name.clone());
        }
        for (model, name) in &self.reasoning_parsers {
            config
                .output
                .reasoning_parsers
                .insert(model.clone(), name.clone());
        }
        if let Some(v) = self.policy {
            config.policy = v;
        }
        if let Some(v) = self.request_timeout_secs {
            config.request_timeout_secs = v;
        }
        if let Some(v) = self.default_max_tokens {
            config.default_max_tokens = v;
        }
        if let Some(v) = self.max_concurrent_requests {
            config.max_concurrent_requests = v;
        }
        if let Some(v) = self.max_queued_requests {
            config.max_queued_requests = v;
        }
        if let Some(v) = self.session_verify_sample_rate {
            config.session_cache.verify_sample_rate = v;
        }
        if let Some(v) = self.prefix_cache_bytes {
            config.session_cache.prefix_cache_bytes = v;
        }
        if let Some(v) = self.max_queued_per_session {
            config.max_queued_per_session = v;
        }
        if let Some(v) = self.max_requests_per_client {
            config.max_requests_per_client = v;
        }
        if let Some(v) = self.unresponsive_after_ms {
            config.unresponsive_after_ms = Some(v);
        }
        if let Some(v) = self.load_push_min_ms {
            config.load_push_min_ms = v;
        }
        if let Some(v) = self.load_interval_ms {
            config.load_interval_ms = Some(v);
        }
        if let Some(v) = self.subscribe_concurrency {
            config.subscribe_concurrency = v;
        }
        if let Some(v) = self.max_connections {
            config.http.max_connections = v;
        }
        if let Some(v) = self.header_timeout_secs {
            config.http.header_timeout_secs = v;
        }
        if let Some(v) = self.body_timeout_secs {
            config.http.body_timeout_secs = v;
        }
        if let Some(v) = self.idle_timeout_secs {
            config.http.idle_timeout_secs = v;
        }
        if let Some(v) = self.http2_max_streams {
            config.http.http2_max_streams = v;
        }
        if let Some(v) = self.shutdown_grace_secs {
            config.http.shutdown_grace_secs = v;
        }
        if let Some(v) = &self.recording_dir {
            config.recording_dir = Some(v.clone());
        }
        if let Some(v) = &self.decision_log_path {
            config.audit.decision_log_path = Some(v.clone());
        }
        if let Some(v) = self.decision_log_max_bytes {
            config.audit.decision_log_max_bytes = v;
        }
        if let Some(v) = self.digest_interval_ms {
            config.audit.digest_interval_ms = v;
        }
        if let Some(v) = self.kv_silence_after_ms {
            config.audit.kv_silence_after_ms = v;
        }
        if let Some(v) = self.disaggregation {
            config.disaggregation = v;
        }
        if let Some(v) = self.unknown_fields {
            config.api.unknown_fields = v;
        }
        if let Some(v) = self.disagg_min_uncached_tokens {
            config.disagg_min_uncached_tokens = v;
        }
        if let Some(v) = self.kv_transfer {
            config.kv_transfer = v;
        }
        if let Some(v) = self.prefill_timeout_secs {
            config.prefill_timeout_secs = v;
        }
        if let Some(v) = &self.otlp_endpoint {
            // Empty (an `OTEL_EXPORTER_OTLP_ENDPOINT=` left in a manifest) turns traces off.
            config.otlp_endpoint = Some(v.clone()).filter(|v| !v.trim().is_empty());
        }
        self.security.apply(&mut config.security);
        self.access.apply(&mut config.access);
        self.responses.apply(&mut config.responses);
        self.discovery.apply(&mut config.discovery);
        self.fleet.apply(&mut config.fleet);
        self.quota.apply(&mut config.quota);
        self.retention.apply(&mut config.retention);
        self.sessions.apply(&mut config.sessions);
        self.event_plane.apply(&mut config.event_plane);
        self.quota
            .check(&config.quota)
            .map_err(ConfigError::Invalid)?;
        if let Some(v) = self.recording_max_bytes {
            config.recording_max_bytes = v;
        }
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
