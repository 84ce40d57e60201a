//! The planner sizes the prefill and decode pools to meet a TTFT and an ITL target.
//!
//! Every interval [`planner::Planner`] runs one round:
//!
//! - [`observe`]: the gateways' traffic (request rate, prompt and output lengths, cache hit
//!   rate, queue depth, TTFT/ITL percentiles, parsed by [`promtext`] from their `/metrics`) and
//!   every worker's load (its `LoadStats` stream);
//! - [`predict`]: the next interval's load (constant or Holt's trend-following);
//! - [`correction`]: the profile's error, learnt from the observed TTFT/ITL against what the
//!   profile predicts for the served load (smoothed, bounded factors);
//! - [`sizing`]: the workers each pool needs, from a [`profile`] of the engine's speed (the
//!   simulator's timing model, or a file measured by [`measure`]) scaled by those factors;
//! - [`stability`]: hysteresis, cooldown, minimums, maximum, never both pools empty;
//! - [`connector`]: acting ([`connector::local::LocalConnector`] re-roles running workers over
//!   gRPC; the Kubernetes connector scales two Deployments).
//!
//! Decisions and their reasons go to the registry (`plan`, `roles/<id>`), the admin API
//! ([`admin`]) and Prometheus ([`metrics`]). [`config`] is the one configuration struct.
//! [`shift`] is the benchmark: the same predictor, sizing and stabiliser against a cluster of
//! simulators in virtual time, compared with fixed splits.

pub mod admin;
pub mod config;
pub mod connector;
pub mod correction;
pub mod measure;
pub mod metrics;
pub mod observe;
pub mod planner;
pub mod predict;
pub mod profile;
pub mod promtext;
pub mod shift;
pub mod sizing;
pub mod stability;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_engine_sim::TimingModel;
use switchyard_registry::Registry;

pub use config::{ConfigError, ConnectorKind, PlannerArgs, PlannerConfig};
pub use connector::{Connector, ConnectorError, PoolSizes};
pub use correction::{CorrectionFactors, CorrectionSettings};
pub use metrics::PlannerMetrics;
pub use planner::{Decision, PlanSettings, Planner, PlannerState};
pub use predict::{Load, Predictor, PredictorKind};
pub use profile::{PerformanceProfile, ProfileError};

/// Why the planner could not start.
#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("cannot start the {connector} connector: {source}")]
    Connector {
        connector: &'static str,
        source: ConnectorError,
    },
    #[error(transparent)]
    Admin(#[from] admin::AdminError),
}

impl PlannerError {
    /// Whether the operator's configuration is at fault (exit code 64) rather than the
    /// environment.
    pub fn is_config(&self) -> bool {
        match self {
            Self::Config(_) | Self::Profile(_) => true,
            Self::Connector { source, .. } => !source.retryable(),
            Self::Admin(_) => false,
        }
    }
}

/// The performance profile the configuration names: its file, or the simulator's timing model.
pub fn load_profile(config: &PlannerConfig) -> Result<PerformanceProfile, ProfileError> {
    match &config.profile {
        Some(path) => PerformanceProfile::load(path),
        None => Ok(PerformanceProfile::from_timing(
            &TimingModel::default(),
            config.sim_speedup,
            config.sim_max_batched_tokens,
        )),
    }
}

/// The connector the configuration names.
pub async fn build_connector(
    config: &PlannerConfig,
    registry: Arc<dyn Registry>,
    board: observe::WorkerBoard,
    dialer: switchyard_security::Dialer,
) -> Result<Arc<dyn Connector>, PlannerError> {
    match config.connector {
        ConnectorKind::Local => Ok(Arc::new(
            connector::local::LocalConnector::new(
                registry,
                board,
                Duration::from_secs(config.drain_timeout_secs),
            )
            .with_dialer(dialer),
        )),
        ConnectorKind::Kubernetes => {
            let k = &config.kubernetes;
            let settings = connector::kubernetes::KubernetesSettings {
                namespace: k.namespace.clone(),
                prefill_deployment: k.prefill_deployment.clone(),
                decode_deployment: k.decode_deployment.clone(),
                api_url: k.api_url.clone(),
            };
            let connector = connector::kubernetes::KubernetesConnector::new(settings)
                .await
                .map_err(|source| PlannerError::Connector {
                    connector: "kubernetes",
                    source,
                })?;
            Ok(Arc::new(connector))
        }
    }
}

/// Builds a planner from a validated configuration over `registry`.
pub async fn build(
    config: &PlannerConfig,
    registry: Arc<dyn Registry>,
) -> Result<Planner, PlannerError> {
    let profile = load_profile(config)?;
    let dialer = config
        .security
        .build(&config.cluster, switchyard_security::PeerRole::Planner)
        .map_err(|e| ConfigError::Invalid(e.to_string()))?
        .dialer;
    let board: observe::WorkerBoard = Arc::new(Mutex::new(BTreeMap::new()));
    let connector = build_connector(
        config,
        Arc::clone(&registry),
        Arc::clone(&board),
        dialer.clone(),
    )
    .await?;
    let predictor = Predictor::new(config.predictor, &config.predictor_settings);
    let state = Arc::new(PlannerState::new(PlanSettings {
        connector: connector.name(),
        predictor: config.predictor.as_str(),
        interval_seconds: config.interval_secs,
        targets: config.targets(),
        limits: config.limits(),
        profile_source: profile.source.clone(),
        disagg_min_uncached_tokens: config.disagg_min_uncached_tokens,
        correction: config.correction,
        decision_log_size: config.decision_log_size,
    }));
    let mut observer =
        observe::Observer::new(config.gateways.clone(), Arc::clone(&registry), board)
            .with_dialer(dialer)
            .with_metrics_token(config.gateway_metrics_token.clone());
    if let Some(ca) = &config.gateway_ca {
        let tls = switchyard_security::tls::https_client_config(ca)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        observer = observer.with_gateway_tls(tls);
    }
    Ok(Planner::new(
        state,
        Arc::new(PlannerMetrics::new()),
        observer,
        predictor,
        stability::Stabilizer::new(config.stability()),
        connector,
        registry,
        profile,
        config.interval(),
    ))
}
