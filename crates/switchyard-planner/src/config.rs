//! The planner's one configuration struct and its flag/environment layer.
//!
//! Precedence: defaults < config file (`--planner-config`, TOML) < `SWITCHYARD_*` environment
//! < flags. Validated once at start; a bad value is a one-sentence [`ConfigError`] (exit 64).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::correction::CorrectionSettings;
use crate::predict::{PredictorKind, PredictorSettings};
use crate::sizing::{Limits, Targets};
use crate::stability::StabilitySettings;

pub use switchyard_config::ConfigError;

/// Which connector acts on the plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ConnectorKind {
    /// Re-role the running workers over gRPC.
    #[default]
    Local,
    /// Scale a prefill and a decode Deployment.
    Kubernetes,
}

/// Where the Kubernetes connector finds its Deployments.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    pub namespace: String,
    pub prefill_deployment: String,
    pub decode_deployment: String,
    /// API server URL; none uses the in-cluster or kubeconfig settings.
    pub api_url: Option<String>,
}

/// Everything the planner needs to run.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    pub etcd_endpoints: Vec<String>,
    pub cluster: String,
    /// Base URLs of the gateways whose `/metrics` the planner reads (`http://host:port`).
    pub gateways: Vec<String>,
    pub interval_secs: f64,
    pub ttft_target_ms: f64,
    pub itl_target_ms: f64,
    /// Most workers in both pools together.
    pub max_workers: u32,
    pub min_prefill: u32,
    pub min_decode: u32,
    pub predictor: PredictorKind,
    pub predictor_settings: PredictorSettings,
    /// Performance profile file (JSON, `docs/planner.md`); none: the simulator's timing model.
    pub profile: Option<PathBuf>,
    /// Without a profile file: the simulated workers' speedup (their figures divide by it).
    pub sim_speedup: f64,
    /// Without a profile file: the simulated workers' chunked-prefill step budget.
    pub sim_max_batched_tokens: u64,
    /// The gateways' `disagg_min_uncached_tokens`: prompts with fewer uncached tokens are
    /// prefilled by the decode workers, which the decode pool is sized for.
    pub disagg_min_uncached_tokens: u64,
    /// Least time between two changes.
    pub cooldown_secs: f64,
    /// Intervals a new size must be wanted in a row before it is applied.
    pub hysteresis_intervals: u32,
    /// Correcting the profile by the observed TTFT/ITL (`[correction]`).
    pub correction: CorrectionSettings,
    /// Longest a worker may take to finish its requests before a move is given up.
    pub drain_timeout_secs: u64,
    /// Decisions kept for the admin API.
    pub decision_log_size: usize,
    /// Listen address of the planner's own admin API and metrics; none: no listener.
    #[serde(deserialize_with = "switchyard_config::listen_addr::deserialize_opt")]
    pub admin_listen: Option<SocketAddr>,
    /// Bearer token the admin API requires; none leaves it open (bind to loopback then).
    pub admin_token: Option<String>,
    /// Bearer token the planner's own `/metrics` requires; none: open.
    pub metrics_token: Option<String>,
    /// HTTPS on the admin listener: its certificate chain (PEM), re-read when it changes.
    pub admin_tls_cert: Option<PathBuf>,
    /// HTTPS on the admin listener: the certificate's private key (PEM).
    pub admin_tls_key: Option<PathBuf>,
    /// Bearer token sent when reading the gateways' `/metrics` (their `[access] metrics_token`).
    pub gateway_metrics_token: Option<String>,
    /// CA (PEM) of the gateways' HTTPS certificates, for `https://` gateway URLs.
    pub gateway_ca: Option<PathBuf>,
    pub connector: ConnectorKind,
    pub kubernetes: KubernetesConfig,
    /// How the planner proves itself to workers (mTLS or the cluster secret); empty: an open
    /// cluster. See `docs/security.md`.
    pub security: switchyard_security::SecurityConfig,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            etcd_endpoints: Vec::new(),
            cluster: "default".into(),
            gateways: Vec::new(),
            interval_secs: 10.0,
            ttft_target_ms: 500.0,
            itl_target_ms: 30.0,
            max_workers: 16,
            min_prefill: 1,
            min_decode: 1,
            predictor: PredictorKind::Constant,
            predictor_settings: PredictorSettings::default(),
            profile: None,
            sim_speedup: 1.0,
            sim_max_batched_tokens: 8192,
            disagg_min_uncached_tokens: switchyard_router::serve::DEFAULT_MIN_UNCACHED_TOKENS,
            cooldown_secs: 30.0,
            hysteresis_intervals: 2,
            correction: CorrectionSettings::default(),
            drain_timeout_secs: 120,
            decision_log_size: 100,
            admin_listen: None,
            admin_token: None,
            metrics_token: None,
            admin_tls_cert: None,
            admin_tls_key: None,
            gateway_metrics_token: None,
            gateway_ca: None,
            connector: ConnectorKind::Local,
            kubernetes: KubernetesConfig::default(),
            security: switchyard_security::SecurityConfig::default(),
        }
    }
}

impl PlannerConfig {
    /// The admin listener's HTTPS configuration (certificate files read now), when it has one.
    pub fn admin_tls(
        &self,
    ) -> Result<Option<Arc<switchyard_security::listener::HttpsConfig>>, ConfigError> {
        switchyard_security::listener::https_files(
            self.admin_tls_cert.as_ref(),
            self.admin_tls_key.as_ref(),
            "admin_tls_cert and admin_tls_key",
        )
        .and_then(|files| {
            files
                .map(|f| switchyard_security::listener::https_config(&f))
                .transpose()
        })
        .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// The admin listener's token and TLS, and the gateways' scheme, fit together.
    fn validate_listener(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self
            .metrics_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return invalid("metrics_token must not be empty when set".into());
        }
        switchyard_security::listener::https_files(
            self.admin_tls_cert.as_ref(),
            self.admin_tls_key.as_ref(),
            "admin_tls_cert and admin_tls_key",
        )
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let protected = self.metrics_token.is_some() || self.admin_tls_cert.is_some();
        if protected && self.admin_listen.is_none() {
            return invalid(
                "metrics_token and admin_tls_cert protect the admin listener: set admin_listen too"
                    .into(),
            );
        }
        if let Some(gateway) = self
            .gateways
            .iter()
            .find(|g| g.starts_with("https://") && self.gateway_ca.is_none())
        {
            return invalid(format!(
                "gateway {gateway} is https: give the CA of its certificate (--gateway-ca)"
            ));
        }
        Ok(())
    }

    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        switchyard_config::load_toml(path)
    }

    /// Checks the values. `needs_etcd`: the stand-alone planner finds workers through etcd;
    /// embedded in `switchyard up` it is handed a registry.
    pub fn validate(&self, needs_etcd: bool) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        self.security
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if let Some(addr) = self.admin_listen
            && self.admin_token.is_none()
            && !addr.ip().is_loopback()
        {
            return invalid(format!(
                "the admin API on {addr} needs an admin_token (--admin-token or SWITCHYARD_ADMIN_TOKEN) beyond loopback"
            ));
        }
        self.validate_listener()?;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if needs_etcd && self.etcd_endpoints.is_empty() {
            return invalid("the planner needs --etcd to find the workers".into());
        }
        if needs_etcd && self.gateways.is_empty() {
            return invalid(
                "the planner needs at least one --gateway to read the traffic from".into(),
            );
        }
        if !positive(self.interval_secs) {
            return invalid("interval must be a positive number of seconds".into());
        }
        if !positive(self.ttft_target_ms) || !positive(self.itl_target_ms) {
            return invalid("ttft_target_ms and itl_target_ms must be positive".into());
        }
        if self.max_workers == 0 {
            return invalid("max_workers must be at least 1".into());
        }
        if u64::from(self.min_prefill) + u64::from(self.min_decode) > u64::from(self.max_workers) {
            return invalid(format!(
                "min_prefill {} plus min_decode {} exceed max_workers {}",
                self.min_prefill, self.min_decode, self.max_workers
            ));
        }
        if self.predictor_settings.window == 0 {
            return invalid("predictor_settings.window must be at least 1".into());
        }
        let unit = |v: f64| v > 0.0 && v <= 1.0;
        if !unit(self.predictor_settings.alpha) || !unit(self.predictor_settings.beta) {
            return invalid("predictor_settings.alpha and beta must lie in (0, 1]".into());
        }
        if !positive(self.sim_speedup) || self.sim_max_batched_tokens == 0 {
            return invalid(
                "sim_speedup must be positive and sim_max_batched_tokens at least 1".into(),
            );
        }
        if !(self.cooldown_secs.is_finite() && self.cooldown_secs >= 0.0) {
            return invalid("cooldown must be a non-negative number of seconds".into());
        }
        if self.hysteresis_intervals == 0 {
            return invalid("hysteresis_intervals must be at least 1".into());
        }
        if let Some(problem) = self.correction.problem() {
            return invalid(problem);
        }
        if self.decision_log_size == 0 {
            return invalid("decision_log_size must be at least 1".into());
        }
        for url in &self.gateways {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return invalid(format!(
                    "gateway {url:?} must be an http:// or https:// URL"
                ));
            }
        }
        if self.connector == ConnectorKind::Kubernetes {
            let k = &self.kubernetes;
            if k.namespace.is_empty()
                || k.prefill_deployment.is_empty()
                || k.decode_deployment.is_empty()
            {
                return invalid(
                    "the kubernetes connector needs --kube-namespace, --prefill-deployment and --decode-deployment".into(),
                );
            }
        }
        Ok(())
    }

    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.interval_secs)
    }

    pub fn targets(&self) -> Targets {
        Targets {
            ttft_seconds: self.ttft_target_ms / 1e3,
            itl_seconds: self.itl_target_ms / 1e3,
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            min_prefill: self.min_prefill,
            min_decode: self.min_decode,
            max_total: self.max_workers,
        }
    }

    pub fn stability(&self) -> StabilitySettings {
        StabilitySettings {
            cooldown: Duration::from_secs_f64(self.cooldown_secs),
            hysteresis_intervals: self.hysteresis_intervals,
        }
    }
}

/// The planning flags, shared by `switchyard planner` and `switchyard up --planner`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlannerArgs {
    /// TOML config file; environment variables and flags override it.
    #[arg(
        id = "planner_config",
        long = "planner-config",
        env = "SWITCHYARD_PLANNER_CONFIG"
    )]
    pub config: Option<PathBuf>,
    /// Seconds between two planning rounds.
    #[arg(long = "interval", env = "SWITCHYARD_PLANNER_INTERVAL")]
    pub interval_secs: Option<f64>,
    /// Time-to-first-token target, milliseconds.
    #[arg(long, env = "SWITCHYARD_TTFT_TARGET_MS")]
    pub ttft_target_ms: Option<f64>,
    /// Inter-token latency target, milliseconds.
    #[arg(long, env = "SWITCHYARD_ITL_TARGET_MS")]
    pub itl_target_ms: Option<f64>,
    /// Most workers in both pools together.
    #[arg(long, env = "SWITCHYARD_MAX_WORKERS")]
    pub max_workers: Option<u32>,
    /// Fewest prefill workers.
    #[arg(long, env = "SWITCHYARD_MIN_PREFILL")]
    pub min_prefill: Option<u32>,
    /// Fewest decode workers.
    #[arg(long, env = "SWITCHYARD_MIN_DECODE")]
    pub min_decode: Option<u32>,
    /// Load predictor: constant (moving average) or holt (trend-following).
    #[arg(long, env = "SWITCHYARD_PREDICTOR")]
    pub predictor: Option<PredictorKind>,
    /// Performance profile file (JSON); default: the simulator's timing model.
    #[arg(long, env = "SWITCHYARD_PROFILE")]
    pub profile: Option<PathBuf>,
    /// Least seconds between two changes.
    #[arg(long = "cooldown", env = "SWITCHYARD_PLANNER_COOLDOWN")]
    pub cooldown_secs: Option<f64>,
    /// Intervals a new size must be wanted in a row before it is applied.
    #[arg(long, env = "SWITCHYARD_HYSTERESIS_INTERVALS")]
    pub hysteresis_intervals: Option<u32>,
    /// Correct the profile by the observed TTFT/ITL: true (default) or false.
    #[arg(long, env = "SWITCHYARD_PLANNER_CORRECTION", value_name = "BOOL")]
    pub correction: Option<bool>,
    /// Connector: local (re-role running workers) or kubernetes (scale Deployments).
    #[arg(long, env = "SWITCHYARD_CONNECTOR")]
    pub connector: Option<ConnectorKind>,
    /// Kubernetes namespace of the Deployments.
    #[arg(long, env = "SWITCHYARD_KUBE_NAMESPACE")]
    pub kube_namespace: Option<String>,
    /// Deployment of the prefill workers.
    #[arg(long, env = "SWITCHYARD_PREFILL_DEPLOYMENT")]
    pub prefill_deployment: Option<String>,
    /// Deployment of the decode workers.
    #[arg(long, env = "SWITCHYARD_DECODE_DEPLOYMENT")]
    pub decode_deployment: Option<String>,
    /// Kubernetes API server URL (default: in-cluster or kubeconfig).
    #[arg(long, env = "SWITCHYARD_KUBE_API_URL")]
    pub kube_api_url: Option<String>,
    /// Bearer token for the gateways' /metrics (their --metrics-token).
    #[arg(long, env = "SWITCHYARD_GATEWAY_METRICS_TOKEN")]
    pub gateway_metrics_token: Option<String>,
}

impl PlannerArgs {
    /// Merges the layers over `base` (the defaults, or what a caller prepared).
    pub fn resolve_onto(&self, base: PlannerConfig) -> Result<PlannerConfig, ConfigError> {
        let mut c = match &self.config {
            Some(path) => PlannerConfig::from_file(path)?,
            None => base,
        };
        macro_rules! set {
            ($($field:ident => $target:expr),* $(,)?) => {
                $(if let Some(v) = &self.$field { $target = v.clone(); })*
            };
        }
        set!(
            interval_secs => c.interval_secs,
            ttft_target_ms => c.ttft_target_ms,
            itl_target_ms => c.itl_target_ms,
            max_workers => c.max_workers,
            min_prefill => c.min_prefill,
            min_decode => c.min_decode,
            predictor => c.predictor,
            cooldown_secs => c.cooldown_secs,
            hysteresis_intervals => c.hysteresis_intervals,
            connector => c.connector,
            kube_namespace => c.kubernetes.namespace,
            prefill_deployment => c.kubernetes.prefill_deployment,
            decode_deployment => c.kubernetes.decode_deployment,
        );
        if let Some(on) = self.correction {
            c.correction.enabled = on;
        }
        if let Some(p) = &self.profile {
            c.profile = Some(p.clone());
        }
        if let Some(url) = &self.kube_api_url {
            c.kubernetes.api_url = Some(url.clone());
        }
        if self.gateway_metrics_token.is_some() {
            c.gateway_metrics_token
                .clone_from(&self.gateway_metrics_token);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn flags_override_the_file_and_bad_values_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("planner.toml");
        std::fs::write(
            &path,
            "etcd_endpoints = [\"http://e:2379\"]\ngateways = [\"http://gw:8000\"]\nttft_target_ms = 200.0\nmin_prefill = 2\n[correction]\nmax_factor = 3.0\n[kubernetes]\nnamespace = \"ns\"\n",
        )
        .unwrap();
        let args = PlannerArgs {
            config: Some(path.clone()),
            ttft_target_ms: Some(300.0),
            predictor: Some(PredictorKind::Holt),
            correction: Some(false),
            ..PlannerArgs::default()
        };
        let c = args.resolve_onto(PlannerConfig::default()).unwrap();
        assert_eq!(c.ttft_target_ms, 300.0);
        assert_eq!(c.min_prefill, 2);
        assert_eq!(c.predictor, PredictorKind::Holt);
        assert_eq!(c.kubernetes.namespace, "ns");
        assert!(!c.correction.enabled, "--correction false turns it off");
        assert_eq!(
            c.correction.max_factor, 3.0,
            "the file's [correction] table is read"
        );
        c.validate(true).unwrap();

        let bad = |f: &dyn Fn(&mut PlannerConfig)| {
            let mut c = c.clone();
            f(&mut c);
            c.validate(true).unwrap_err().to_string()
        };
        assert!(bad(&|c| c.etcd_endpoints.clear()).contains("--etcd"));
        assert!(bad(&|c| c.gateways.clear()).contains("--gateway"));
        assert!(bad(&|c| c.interval_secs = 0.0).contains("interval"));
        assert!(bad(&|c| c.max_workers = 2).contains("exceed max_workers"));
        assert!(bad(&|c| c.gateways = vec!["localhost:8000".into()]).contains("http://"));
        assert!(bad(&|c| c.correction.smoothing = 2.0).contains("correction.smoothing"));
        assert!(bad(&|c| c.connector = ConnectorKind::Kubernetes).contains("--prefill-deployment"));

        std::fs::write(&path, "no_such_key = 1\n").unwrap();
        let err = args.resolve_onto(PlannerConfig::default()).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
    }
}
