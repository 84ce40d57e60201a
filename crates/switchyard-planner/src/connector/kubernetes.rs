//! The Kubernetes connector: the prefill pool and the decode pool are two Deployments, and a
//! plan becomes their replica counts.
//!
//! It reads and writes only the `scale` subresource (`deployments/scale`, autoscaling/v1
//! `Scale`), the same door `kubectl scale` and the HorizontalPodAutoscaler use, so the planner's
//! Role needs `get` and `patch` on `deployments/scale` and nothing on the Deployments themselves.
//! Draining is the workers' business: a pod the Deployment removes gets SIGTERM and drains
//! within its termination grace period.

use async_trait::async_trait;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v1::Scale;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Config};
use std::time::Duration;

use super::{Connector, ConnectorError, PoolSizes};

/// Where the two Deployments live and how to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesSettings {
    pub namespace: String,
    pub prefill_deployment: String,
    pub decode_deployment: String,
    /// The API server's URL, with no credentials (a `kubectl proxy`, or a test's fake server).
    /// `None`: the kubeconfig (`KUBECONFIG` or `~/.kube/config`) when there is one, else the
    /// pod's service account (token and CA under /var/run/secrets/kubernetes.io/serviceaccount,
    /// API server from KUBERNETES_SERVICE_HOST/PORT).
    pub api_url: Option<String>,
}

/// A request the API server does not answer within this long fails as retryable; without it
/// a hung API server would stall the planner loop forever (kube-rs sets no read timeout).
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// Scales the prefill and decode Deployments through their `scale` subresource.
pub struct KubernetesConnector {
    deployments: Api<Deployment>,
    settings: KubernetesSettings,
}

impl std::fmt::Debug for KubernetesConnector {
    // kube's Api and Client have no Debug; the settings say everything worth logging.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesConnector")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    fn size(self, sizes: PoolSizes) -> u32 {
        match self {
            Self::Prefill => sizes.prefill,
            Self::Decode => sizes.decode,
        }
    }
}

/// What a request was doing, for the error message (and the RBAC verb it needs).
#[derive(Debug, Clone, Copy)]
enum Verb {
    Get,
    Patch,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Patch => "patch",
        }
    }
}

impl KubernetesConnector {
    /// Builds the client. Sends no request: an API server that is down at start is a retryable
    /// failure of the first `current()`, not a reason for the planner not to start.
    pub async fn new(settings: KubernetesSettings) -> Result<Self, ConnectorError> {
        for (what, value) in [
            ("namespace", &settings.namespace),
            ("prefill deployment", &settings.prefill_deployment),
            ("decode deployment", &settings.decode_deployment),
        ] {
            if !is_object_name(value) {
                return Err(config_error(format!(
                    "kubernetes connector: the {what} name {value:?} is not a Kubernetes object \
                     name (lowercase letters, digits, '-' and '.', starting and ending with a \
                     letter or digit)"
                )));
            }
        }
        if settings.prefill_deployment == settings.decode_deployment {
            return Err(config_error(format!(
                "kubernetes connector: the prefill and decode pools are both deployment {:?}; \
                 they must be two different Deployments",
                settings.prefill_deployment
            )));
        }

        let mut config = match &settings.api_url {
            Some(url) => {
                let uri = url.parse::<http::Uri>().map_err(|e| {
                    config_error(format!(
                        "kubernetes connector: api url {url:?} is not a URL: {e}"
                    ))
                })?;
                // Without a scheme and host every request would fail to build, at every interval.
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                    return Err(config_error(format!(
                        "kubernetes connector: api url {url:?} must be http://host[:port] or \
                         https://host[:port]"
                    )));
                }
                Config::new(uri)
            }
            None => Config::infer().await.map_err(|e| {
                config_error(format!(
                    "kubernetes connector: no kubeconfig and no in-cluster service account \
                     to reach the Kubernetes API: {e}"
                ))
            })?,
        };
        config.read_timeout = Some(API_TIMEOUT);
        // The timeout counts from the request, not from when a pooled connection went idle.
        config.reset_reader_on_write = true;
        // The planner loop is the retry: the next interval re-reads the pools and decides
        // again, instead of a request from an older decision being replayed later.
        config.default_retry = false;
        let client = Client::try_from(config).map_err(|e| {
            config_error(format!(
                "kubernetes connector: cannot build the API client: {e}"
            ))
        })?;
        Ok(Self {
            deployments: Api::namespaced(client, &settings.namespace),
            settings,
        })
    }

    fn deployment(&self, pool: Pool) -> &str {
        match pool {
            Pool::Prefill => &self.settings.prefill_deployment,
            Pool::Decode => &self.settings.decode_deployment,
        }
    }

    async fn replicas(&self, pool: Pool) -> Result<u32, ConnectorError> {
        let name = self.deployment(pool);
        let scale = self
            .deployments
            .get_scale(name)
            .await
            .map_err(|e| self.api_error(Verb::Get, name, e))?;
        spec_replicas(&scale).map_err(|what| ConnectorError::Failed {
            what: format!(
                "deployment {name} in namespace {}: {what}",
                self.settings.namespace
            ),
            retryable: false,
        })
    }

    async fn set_replicas(&self, pool: Pool, replicas: u32) -> Result<(), ConnectorError> {
        let name = self.deployment(pool);
        let replicas = i32::try_from(replicas).map_err(|_| ConnectorError::Failed {
            what: format!("cannot scale deployment {name} to {replicas} replicas (above i32)"),
            retryable: false,
        })?;
        // A JSON merge patch of spec.replicas alone: it leaves every other field of the Scale
        // to the API server and needs no resourceVersion, so it cannot conflict with a
        // concurrent change of the Deployment's template.
        let patch = Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } }));
        self.deployments
            .patch_scale(name, &PatchParams::default(), &patch)
            .await
            .map_err(|e| self.api_error(Verb::Patch, name, e))?;
        tracing::info!(
            deployment = name,
            namespace = %self.settings.namespace,
            replicas,
            "scaled deployment"
        );
        Ok(())
    }

    /// Says whose fault a failed request is and whether the next interval can do better.
    fn api_error(&self, verb: Verb, name: &str, error: kube::Error) -> ConnectorError {
        let namespace = &self.settings.namespace;
        let (what, retryable) = match error {
            kube::Error::Api(status) => match status.code {
                404 => (
                    format!(
                        "deployment {name} not found in namespace {namespace} (the planner's \
                         --prefill-deployment/--decode-deployment must name an existing \
                         Deployment): {}",
                        status.message
                    ),
                    false,
                ),
                403 => (
                    format!(
                        "forbidden to {verb} deployments/scale of {name} in namespace \
                         {namespace}: the planner's service account needs a Role granting \
                         verb \"{verb}\" on resource \"deployments/scale\" (API group apps): {}",
                        status.message,
                        verb = verb.as_str()
                    ),
                    false,
                ),
                401 => (
                    format!(
                        "the Kubernetes API rejected the planner's credentials ({verb} \
                         deployments/scale of {name} in namespace {namespace}): {}",
                        status.message,
                        verb = verb.as_str()
                    ),
                    false,
                ),
                // 409: someone else changed the Scale meanwhile; 429: the API server sheds load.
                code @ (409 | 429 | 500..=599) => (
                    format!(
                        "{verb} deployments/scale of {name} in namespace {namespace}: the API \
                         server answered {code}; retrying next interval: {}",
                        status.message,
                        verb = verb.as_str()
                    ),
                    true,
                ),
                code => (
                    format!(
                        "{verb} deployments/scale of {name} in namespace {namespace}: the API \
                         server refused the request with {code}: {}",
                        status.message,
                        verb = verb.as_str()
                    ),
                    false,
                ),
            },
            // Connection refused or reset, timeouts: the network or the API server, not us.
            e @ (kube::Error::HyperError(_) | kube::Error::Service(_)) => (
                format!(
                    "{verb} deployments/scale of {name} in namespace {namespace}: cannot reach \
                     the Kubernetes API: {}",
                    error_chain(&e),
                    verb = verb.as_str()
                ),
                true,
            ),
            e => (
                format!(
                    "{verb} deployments/scale of {name} in namespace {namespace}: {}",
                    error_chain(&e),
                    verb = verb.as_str()
                ),
                false,
            ),
        };
        ConnectorError::Failed { what, retryable }
    }
}

#[async_trait]
impl Connector for KubernetesConnector {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    async fn current(&self) -> Result<PoolSizes, ConnectorError> {
        Ok(PoolSizes {
            prefill: self.replicas(Pool::Prefill).await?,
            decode: self.replicas(Pool::Decode).await?,
        })
    }

    async fn scale_to(&self, target: PoolSizes) -> Result<(), ConnectorError> {
        let now = self.current().await?;
        for pool in scale_order(now, target) {
            self.set_replicas(pool, pool.size(target)).await?;
        }
        Ok(())
    }
}

/// The pools to patch, in order: only those whose count changes; the shrinking pool first, so
/// the total never exceeds the larger of the two totals (the freed node or GPU is what the
/// growing pool's new pod needs), unless shrinking first would leave both pools empty.
fn scale_order(now: PoolSizes, target: PoolSizes) -> Vec<Pool> {
    let mut changes: Vec<Pool> = [Pool::Prefill, Pool::Decode]
        .into_iter()
        .filter(|pool| pool.size(now) != pool.size(target))
        .collect();
    // Shrinking pools before growing ones; sort is stable, so prefill stays first on a tie.
    changes.sort_by_key(|pool| pool.size(target) > pool.size(now));
    if let [first, second] = changes[..] {
        let after_first = |pool: Pool| {
            if pool == first {
                pool.size(target)
            } else {
                pool.size(now)
            }
        };
        if after_first(first) + after_first(second) == 0 {
            changes.swap(0, 1);
        }
    }
    changes
}

/// spec.replicas of a Scale; absent means 0 (the API omits a zero count).
fn spec_replicas(scale: &Scale) -> Result<u32, String> {
    let replicas = scale
        .spec
        .as_ref()
        .and_then(|spec| spec.replicas)
        .unwrap_or(0);
    u32::try_from(replicas)
        .map_err(|_| format!("the scale subresource reports {replicas} replicas"))
}

/// An RFC 1123 subdomain, what Kubernetes accepts as a namespace or Deployment name; checked
/// at start so a typo is a clear error there, not a 404 (or a different URL) at every interval.
fn is_object_name(name: &str) -> bool {
    let alphanumeric = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| alphanumeric(c) || c == '-' || c == '.')
        && name.starts_with(alphanumeric)
        && name.ends_with(alphanumeric)
}

fn config_error(what: String) -> ConnectorError {
    ConnectorError::Failed {
        what,
        retryable: false,
    }
}

/// kube's errors keep the useful part (the connect error, the timeout) in their sources.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(prefill: u32, decode: u32) -> PoolSizes {
        PoolSizes { prefill, decode }
    }

    #[test]
    fn unchanged_pools_are_not_in_the_order() {
        assert_eq!(scale_order(sizes(2, 3), sizes(2, 3)), vec![]);
        assert_eq!(scale_order(sizes(2, 3), sizes(2, 5)), vec![Pool::Decode]);
        assert_eq!(scale_order(sizes(2, 3), sizes(1, 3)), vec![Pool::Prefill]);
    }

    #[test]
    fn the_shrinking_pool_goes_first() {
        assert_eq!(
            scale_order(sizes(2, 3), sizes(3, 2)),
            vec![Pool::Decode, Pool::Prefill]
        );
        assert_eq!(
            scale_order(sizes(3, 2), sizes(2, 3)),
            vec![Pool::Prefill, Pool::Decode]
        );
        assert_eq!(
            scale_order(sizes(1, 1), sizes(4, 4)),
            vec![Pool::Prefill, Pool::Decode]
        );
    }

    #[test]
    fn both_pools_are_never_empty_in_between() {
        assert_eq!(
            scale_order(sizes(1, 0), sizes(0, 1)),
            vec![Pool::Decode, Pool::Prefill]
        );
        assert_eq!(
            scale_order(sizes(0, 2), sizes(3, 0)),
            vec![Pool::Prefill, Pool::Decode]
        );
    }

    #[test]
    fn object_names_are_rfc_1123_subdomains() {
        for good in ["sy-switchyard-worker-prefill", "a", "team.a-1"] {
            assert!(is_object_name(good), "{good}");
        }
        for bad in [
            "",
            " ",
            "Decode",
            "-decode",
            "decode-",
            "pools/decode",
            "a b",
        ] {
            assert!(!is_object_name(bad), "{bad:?}");
        }
        assert!(!is_object_name(&"a".repeat(254)));
    }

    #[test]
    fn a_missing_replica_count_is_zero_and_a_negative_one_is_refused() {
        let mut scale = Scale::default();
        assert_eq!(spec_replicas(&scale), Ok(0));
        scale.spec = Some(k8s_openapi::api::autoscaling::v1::ScaleSpec { replicas: Some(4) });
        assert_eq!(spec_replicas(&scale), Ok(4));
        scale.spec = Some(k8s_openapi::api::autoscaling::v1::ScaleSpec { replicas: Some(-1) });
        assert!(spec_replicas(&scale).is_err());
    }
}
