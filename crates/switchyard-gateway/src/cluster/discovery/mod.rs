//! Where the gateway (and the endpoint picker) find their workers: etcd (the workers'
//! leased registry entries), the Kubernetes API ([`kubernetes`]: the ready pods of a
//! selector or an InferencePool, each with a worker sidecar), or both. Every source is a
//! [`Discovery`]; the pool follows whichever [`build`] returns, the same way.
//!
//! `[discovery]` in the gateway's configuration, or the `--discovery` and `--k8s-*` flags.

pub mod kubernetes;
pub mod pods;

use std::sync::Arc;

use serde::Deserialize;
use switchyard_registry::{Discovery, Merged, Registry};

pub use kubernetes::{KubernetesDiscovery, KubernetesSettings, PodSelector};
pub use pods::PortRef;

use switchyard_security::SecurityConfig;

use crate::gateway_error::GatewayError;

/// Which sources say who the workers are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DiscoverySource {
    /// The workers' entries in etcd (they register with a lease).
    #[default]
    Etcd,
    /// The Kubernetes API: ready pods with a Switchyard worker sidecar; no etcd needed.
    Kubernetes,
    /// Both: a worker is live while either lists it.
    Both,
}

impl DiscoverySource {
    pub fn uses_etcd(self) -> bool {
        matches!(self, Self::Etcd | Self::Both)
    }

    pub fn uses_kubernetes(self) -> bool {
        matches!(self, Self::Kubernetes | Self::Both)
    }
}

/// `[discovery]`: the source, and where the pods are when it is Kubernetes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    pub source: DiscoverySource,
    /// `[discovery.kubernetes]`.
    pub kubernetes: KubernetesConfig,
}

/// `[discovery.kubernetes]` (see `docs/deploy-kubernetes.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// The namespace of the pods (and the pool); unset: the pod's own namespace in a
    /// cluster, else the kubeconfig context's.
    pub namespace: Option<String>,
    /// A label selector of the worker pods (`app=vllm`); or set `pool`.
    pub selector: Option<String>,
    /// An InferencePool whose selector and target port say which pods and which engine port.
    pub pool: Option<String>,
    /// The worker sidecar's gRPC port in each pod: a number or a container port name.
    pub worker_port: Option<String>,
    /// The engine's HTTP port in each pod (what the endpoint picker answers with): a number
    /// or a container port name; unset: the pool's target port, else what the sidecar reports.
    pub engine_port: Option<String>,
    /// The API server's URL with no credentials (a `kubectl proxy`); unset: the kubeconfig,
    /// else the pod's service account.
    pub api_url: Option<String>,
    /// How often each pod's sidecar is asked again who it is, in milliseconds (its LoRA
    /// adapters change while the engine runs); unset: 10,000.
    pub info_refresh_ms: Option<u64>,
}

impl DiscoveryConfig {
    /// Checks the settings the source needs; one sentence when they are wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.source.uses_kubernetes() {
            self.kubernetes_settings()?;
        }
        Ok(())
    }

    /// The Kubernetes settings, checked.
    pub fn kubernetes_settings(&self) -> Result<KubernetesSettings, String> {
        let k = &self.kubernetes;
        let selector = match (&k.selector, &k.pool) {
            (Some(labels), None) if !labels.trim().is_empty() => {
                PodSelector::Labels(labels.trim().to_owned())
            }
            (None, Some(pool)) if is_object_name(pool) => PodSelector::Pool(pool.clone()),
            (None, Some(pool)) => {
                return Err(format!(
                    "discovery.kubernetes.pool {pool:?} is not a Kubernetes object name"
                ));
            }
            (Some(_), Some(_)) => {
                return Err(
                    "discovery.kubernetes: set either selector (--k8s-selector) or pool (--k8s-pool), not both".into(),
                );
            }
            _ => {
                return Err(
                    "kubernetes discovery needs the worker pods' label selector (--k8s-selector) or their InferencePool (--k8s-pool)".into(),
                );
            }
        };
        if let Some(namespace) = &k.namespace
            && !is_object_name(namespace)
        {
            return Err(format!(
                "discovery.kubernetes.namespace {namespace:?} is not a Kubernetes namespace name"
            ));
        }
        let worker_port = k
            .worker_port
            .as_deref()
            .ok_or("kubernetes discovery needs the worker sidecar's gRPC port (--k8s-worker-port)")
            .map_err(str::to_owned)
            .and_then(|p| PortRef::parse(p).map_err(|e| format!("--k8s-worker-port: {e}")))?;
        let engine_port = k
            .engine_port
            .as_deref()
            .map(|p| PortRef::parse(p).map_err(|e| format!("--k8s-engine-port: {e}")))
            .transpose()?;
        let info_refresh = match k.info_refresh_ms {
            None => kubernetes::INFO_REFRESH,
            Some(0) => {
                return Err(
                    "discovery.kubernetes.info_refresh_ms (--k8s-info-refresh-ms) must be at least 1"
                        .into(),
                );
            }
            Some(ms) => std::time::Duration::from_millis(ms),
        };
        Ok(KubernetesSettings {
            namespace: k.namespace.clone(),
            selector,
            worker_port,
            engine_port,
            api_url: k.api_url.clone(),
            info_refresh,
        })
    }
}

/// Flags and `SWITCHYARD_*` variables of `[discovery]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DiscoveryArgs {
    /// Where the workers are found: etcd, kubernetes or both.
    #[arg(long = "discovery", env = "SWITCHYARD_DISCOVERY")]
    pub source: Option<DiscoverySource>,
    /// Namespace of the worker pods (default: this pod's own).
    #[arg(long = "k8s-namespace", env = "SWITCHYARD_K8S_NAMESPACE")]
    pub namespace: Option<String>,
    /// Label selector of the worker pods.
    #[arg(long = "k8s-selector", env = "SWITCHYARD_K8S_SELECTOR")]
    pub selector: Option<String>,
    /// InferencePool naming the worker pods (its selector and target port).
    #[arg(long = "k8s-pool", env = "SWITCHYARD_K8S_POOL")]
    pub pool: Option<String>,
    /// The worker sidecar's gRPC port in each pod (number or container port name).
    #[arg(long = "k8s-worker-port", env = "SWITCHYARD_K8S_WORKER_PORT")]
    pub worker_port: Option<String>,
    /// The engine's HTTP port in each pod (number or container port name).
    #[arg(long = "k8s-engine-port", env = "SWITCHYARD_K8S_ENGINE_PORT")]
    pub engine_port: Option<String>,
    /// Kubernetes API server URL without credentials (default: kubeconfig or service account).
    #[arg(long = "k8s-api-url", env = "SWITCHYARD_K8S_API_URL")]
    pub api_url: Option<String>,
    /// Milliseconds between asking each pod's sidecar again who it is (default 10000).
    #[arg(long = "k8s-info-refresh-ms", env = "SWITCHYARD_K8S_INFO_REFRESH_MS")]
    pub info_refresh_ms: Option<u64>,
}

impl DiscoveryArgs {
    pub fn apply(&self, config: &mut DiscoveryConfig) {
        if let Some(source) = self.source {
            config.source = source;
        }
        let k = &mut config.kubernetes;
        for (flag, target) in [
            (&self.namespace, &mut k.namespace),
            (&self.worker_port, &mut k.worker_port),
            (&self.engine_port, &mut k.engine_port),
            (&self.api_url, &mut k.api_url),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        if self.info_refresh_ms.is_some() {
            k.info_refresh_ms = self.info_refresh_ms;
        }
        // A selector given by flag replaces a pool from the file and the other way round.
        if self.selector.is_some() {
            k.selector.clone_from(&self.selector);
            k.pool = None;
        }
        if self.pool.is_some() {
            k.pool.clone_from(&self.pool);
            k.selector = None;
        }
    }
}

/// The discovery `config` (the gateway's `[discovery]`) asks for: `registry` (etcd, which the
/// caller connected when [`DiscoverySource::uses_etcd`]), the Kubernetes API (its workers
/// dialed with the gateway's `security` in `cluster`), or both merged.
pub async fn build(
    config: &DiscoveryConfig,
    security: &SecurityConfig,
    cluster: &str,
    registry: Option<Arc<dyn Registry>>,
) -> Result<Arc<dyn Discovery>, GatewayError> {
    let source = config.source;
    let kubernetes = if source.uses_kubernetes() {
        let settings = config
            .kubernetes_settings()
            .map_err(GatewayError::Discovery)?;
        let security = security.build(cluster, switchyard_security::PeerRole::Gateway)?;
        let found = KubernetesDiscovery::new(settings, security.dialer)
            .await
            .map_err(GatewayError::Discovery)?;
        Some(Arc::new(found) as Arc<dyn Discovery>)
    } else {
        None
    };
    let etcd = match (source.uses_etcd(), registry) {
        (true, Some(registry)) => Some(registry as Arc<dyn Discovery>),
        (true, None) => {
            return Err(GatewayError::Discovery(
                "etcd discovery needs etcd endpoints (--etcd)".into(),
            ));
        }
        (false, _) => None,
    };
    match (etcd, kubernetes) {
        (Some(etcd), Some(kubernetes)) => Ok(Arc::new(Merged::new(vec![etcd, kubernetes]))),
        (Some(one), None) | (None, Some(one)) => Ok(one),
        (None, None) => Err(GatewayError::Discovery("no discovery source".into())),
    }
}

/// An RFC 1123 name: what namespaces and pools are called.
fn is_object_name(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubernetes(f: impl FnOnce(&mut KubernetesConfig)) -> DiscoveryConfig {
        let mut config = DiscoveryConfig {
            source: DiscoverySource::Kubernetes,
            kubernetes: KubernetesConfig {
                selector: Some("app=vllm".into()),
                worker_port: Some("worker".into()),
                ..KubernetesConfig::default()
            },
        };
        f(&mut config.kubernetes);
        config
    }

    #[test]
    fn kubernetes_discovery_needs_a_selector_or_a_pool_and_the_sidecar_port() {
        assert!(kubernetes(|_| {}).validate().is_ok());
        let none = kubernetes(|k| k.selector = None).validate().unwrap_err();
        assert!(none.contains("--k8s-selector"), "{none}");
        let both = kubernetes(|k| k.pool = Some("pool".into()))
            .validate()
            .unwrap_err();
        assert!(both.contains("not both"), "{both}");
        let port = kubernetes(|k| k.worker_port = None).validate().unwrap_err();
        assert!(port.contains("--k8s-worker-port"), "{port}");
        let bad = kubernetes(|k| k.engine_port = Some("0".into()))
            .validate()
            .unwrap_err();
        assert!(bad.contains("--k8s-engine-port"), "{bad}");
        let ns = kubernetes(|k| k.namespace = Some("Prod".into()))
            .validate()
            .unwrap_err();
        assert!(ns.contains("namespace"), "{ns}");
        let never = kubernetes(|k| k.info_refresh_ms = Some(0))
            .validate()
            .unwrap_err();
        assert!(never.contains("--k8s-info-refresh-ms"), "{never}");
        assert_eq!(
            kubernetes(|_| {})
                .kubernetes_settings()
                .unwrap()
                .info_refresh,
            kubernetes::INFO_REFRESH
        );
        let mut quick = kubernetes(|_| {});
        DiscoveryArgs {
            info_refresh_ms: Some(250),
            ..DiscoveryArgs::default()
        }
        .apply(&mut quick);
        assert_eq!(
            quick.kubernetes_settings().unwrap().info_refresh,
            std::time::Duration::from_millis(250)
        );
        // etcd alone needs none of it.
        assert!(DiscoveryConfig::default().validate().is_ok());
    }

    #[test]
    fn a_pool_flag_replaces_a_selector_from_the_file() {
        let mut config = kubernetes(|_| {});
        DiscoveryArgs {
            pool: Some("llama".into()),
            ..DiscoveryArgs::default()
        }
        .apply(&mut config);
        assert_eq!(
            config.kubernetes_settings().unwrap().selector,
            PodSelector::Pool("llama".into())
        );
    }
}
