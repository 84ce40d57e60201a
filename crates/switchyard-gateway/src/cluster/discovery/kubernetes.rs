//! Kubernetes-native discovery: the workers are the ready pods of one namespace that match a
//! label selector (given, or read from an InferencePool's `spec.selector`), each running a
//! Switchyard worker sidecar.
//!
//! [`KubernetesDiscovery::discover`] lists the pods, asks each serving pod's sidecar who it
//! is (the worker's `Info` call: model, role, block size, engine), and follows the pods with
//! a watch from the list's `resourceVersion`. A watch that the API server ends (its timeout)
//! is reopened from the last version seen; a `410 Gone` (the version is too old) or any other
//! failure ends the [`WorkerWatch`], and the gateway discovers again, which re-lists, with
//! backoff. A pod that turns unready, terminates or is deleted leaves routing at once; a pod
//! whose sidecar does not answer yet is asked again every [`RETRY_INFO`].
//!
//! Only `list` and `watch` on pods (and `get` on the InferencePool) are needed: the kube-rs
//! client's plain calls, no `runtime` feature.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client, Config};
use switchyard_core::WorkerInfo;
use switchyard_proto::v1;
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_registry::{Discovery, RegistryError, WorkerChange, WorkerWatch};
use switchyard_security::Dialer;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::pods::{self, PodTarget, PortRef};

/// A list or get the API server does not answer within this long fails (retryably).
const API_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the API server keeps one watch open before it ends it and we reopen it.
const WATCH_SECS: u32 = 240;
/// How long a sidecar gets to answer `Info`.
const INFO_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a serving pod whose sidecar did not answer is asked again.
pub const RETRY_INFO: Duration = Duration::from_secs(2);
/// How often, by default, every answered pod's sidecar is asked again (its LoRA adapters follow
/// the engine's, loaded and unloaded at run time).
pub const INFO_REFRESH: Duration = Duration::from_secs(10);

/// Which pods are the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodSelector {
    /// A label selector (`app=vllm,tier=serve`).
    Labels(String),
    /// The InferencePool of that name (`inference.networking.k8s.io/v1`): its
    /// `spec.selector.matchLabels`, and its first target port as the engine port.
    Pool(String),
}

/// Where to look and how to reach the pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesSettings {
    /// None: the client's default (in a pod, the pod's own namespace).
    pub namespace: Option<String>,
    pub selector: PodSelector,
    /// The sidecar's gRPC port.
    pub worker_port: PortRef,
    /// The engine's HTTP port, what the endpoint picker answers with. None: the pool's target
    /// port, else what the sidecar reports.
    pub engine_port: Option<PortRef>,
    /// The API server's URL with no credentials (a `kubectl proxy`, a test's fake server).
    /// None: the kubeconfig when there is one, else the pod's service account.
    pub api_url: Option<String>,
    /// How often each answered pod's sidecar is asked again who it is.
    pub info_refresh: Duration,
}

/// Discovery from the Kubernetes API (see the module header).
#[derive(Clone)]
pub struct KubernetesDiscovery {
    client: Client,
    namespace: String,
    settings: KubernetesSettings,
    dialer: Dialer,
}

impl std::fmt::Debug for KubernetesDiscovery {
    // kube's Client has no Debug; the settings say everything worth logging.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesDiscovery")
            .field("namespace", &self.namespace)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// What one (re)list looks for.
#[derive(Debug, Clone)]
struct Selection {
    labels: String,
    engine_port: Option<PortRef>,
}

impl KubernetesDiscovery {
    /// Builds the client; sends no request (an API server that is down at start is a
    /// retryable failure of the first `discover`). Fails when there is no way to reach one.
    pub async fn new(settings: KubernetesSettings, dialer: Dialer) -> Result<Self, String> {
        let config = match &settings.api_url {
            Some(url) => {
                let uri = url
                    .parse::<hyper::Uri>()
                    .map_err(|e| format!("api url {url:?} is not a URL: {e}"))?;
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                    return Err(format!(
                        "api url {url:?} must be http://host[:port] or https://host[:port]"
                    ));
                }
                Config::new(uri)
            }
            None => Config::infer().await.map_err(|e| {
                format!("no kubeconfig and no in-cluster service account to reach the Kubernetes API: {e}")
            })?,
        };
        let client = Client::try_from(config)
            .map_err(|e| format!("cannot build the Kubernetes API client: {e}"))?;
        let namespace = settings
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned());
        Ok(Self {
            client,
            namespace,
            settings,
            dialer,
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The label selector and engine port for this (re)list: the pool is read again each
    /// time, so a changed selector is followed at the next re-list.
    async fn selection(&self) -> Result<Selection, RegistryError> {
        let name = match &self.settings.selector {
            PodSelector::Labels(labels) => {
                return Ok(Selection {
                    labels: labels.clone(),
                    engine_port: self.settings.engine_port.clone(),
                });
            }
            PodSelector::Pool(name) => name,
        };
        let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "inferencepools");
        let pools: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
        let pool = bounded(pools.get(name), "get the InferencePool").await?;
        let spec = &pool.data["spec"];
        let labels = spec["selector"]["matchLabels"]
            .as_object()
            .filter(|m| !m.is_empty())
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .ok_or_else(|| RegistryError::DiscoveryUnavailable {
                backend: "kubernetes",
                reason: format!(
                    "InferencePool {}/{name} has no spec.selector.matchLabels",
                    self.namespace
                ),
            })?;
        let target_port = spec["targetPorts"][0]["number"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)
            .map(PortRef::Number);
        Ok(Selection {
            labels,
            engine_port: self.settings.engine_port.clone().or(target_port),
        })
    }

    /// Asks each pod's sidecar who it is, all at once; the pods that answered get their info.
    async fn resolve(&self, known: &mut PodSet) -> Vec<WorkerChange> {
        let mut changes = Vec::new();
        for (pod, target, answer) in self.ask_all(known.pending()).await {
            match answer {
                Ok(info) => changes.extend(known.resolved(&pod, &target, info)),
                Err(reason) => {
                    tracing::info!(pod, address = %target.worker_address, %reason, "pod's worker sidecar does not answer yet; asking again")
                }
            }
        }
        changes
    }

    /// Asks every answered pod's sidecar again who it is, all at once: a worker whose
    /// description changed (its LoRA adapters, a restart) is updated. A sidecar that does not
    /// answer keeps its last description (the pod's readiness says whether it serves).
    async fn refresh(&self, known: &mut PodSet) -> Vec<WorkerChange> {
        let mut changes = Vec::new();
        for (pod, target, answer) in self.ask_all(known.answered()).await {
            match answer {
                Ok(info) => changes.extend(known.refreshed(&pod, &target, info)),
                Err(reason) => {
                    tracing::debug!(pod, address = %target.worker_address, %reason, "pod's worker sidecar did not answer a refresh");
                }
            }
        }
        changes
    }

    /// Asks the sidecars of `pods` who they are, all at once; each pod with its answer.
    async fn ask_all(
        &self,
        pods: Vec<(String, PodTarget)>,
    ) -> Vec<(String, PodTarget, Result<WorkerInfo, String>)> {
        futures::future::join_all(pods.into_iter().map(|(pod, target)| async {
            let answer = self.info(&target).await;
            (pod, target, answer)
        }))
        .await
    }

    /// The sidecar's own description, at the address it was reached (and with the engine
    /// endpoint the pod exposes, when known).
    async fn info(&self, target: &PodTarget) -> Result<WorkerInfo, String> {
        let endpoint = self
            .dialer
            .endpoint(&target.worker_address)
            .map_err(|e| e.to_string())?
            .connect_timeout(INFO_TIMEOUT)
            .timeout(INFO_TIMEOUT);
        let channel = self
            .dialer
            .connect(endpoint)
            .await
            .map_err(|e| e.to_string())?;
        let wire = WorkerClient::new(channel)
            .info(v1::InfoRequest {})
            .await
            .map_err(|status| format!("Info: {}", status.message()))?
            .into_inner();
        let mut info = WorkerInfo::try_from(wire).map_err(|e| e.to_string())?;
        info.address.clone_from(&target.worker_address);
        if let Some(endpoint) = &target.engine_endpoint {
            info.engine_endpoint = Some(endpoint.clone());
        }
        Ok(info)
    }

    /// Follows the pods from `version` until the watch cannot go on (then `changes_tx` is
    /// dropped and the gateway discovers again) or `cancel` fires.
    async fn follow(
        self,
        mut known: PodSet,
        selection: Selection,
        mut version: String,
        changes_tx: mpsc::UnboundedSender<WorkerChange>,
        cancel: CancellationToken,
    ) {
        let params = WatchParams::default()
            .labels(&selection.labels)
            .timeout(WATCH_SECS);
        let mut retry = tokio::time::interval(RETRY_INFO);
        // The tick is awaited only while a pod waits for its sidecar; no burst after a pause.
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let every = self.settings.info_refresh;
        let mut refresh = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let pods = self.pods();
        loop {
            let stream = tokio::select! {
                () = cancel.cancelled() => return,
                stream = pods.watch(&params, &version) => stream,
            };
            let stream = match stream {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::warn!(error = %error, "cannot watch the pods; listing them again");
                    return;
                }
            };
            let mut stream = std::pin::pin!(stream);
            loop {
                let event = tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = retry.tick(), if known.has_pending() => {
                        let changes = self.resolve(&mut known).await;
                        if !send(&changes_tx, changes) {
                            return;
                        }
                        continue;
                    }
                    _ = refresh.tick() => {
                        let changes = self.refresh(&mut known).await;
                        if !send(&changes_tx, changes) {
                            return;
                        }
                        continue;
                    }
                    event = stream.next() => event,
                };
                let changes = match event {
                    Some(Ok(WatchEvent::Added(pod) | WatchEvent::Modified(pod))) => {
                        version = resource_version(&pod).unwrap_or(version);
                        let mut changes = known.observe(&pod, &selection);
                        if known.has_pending() {
                            changes.extend(self.resolve(&mut known).await);
                        }
                        changes
                    }
                    Some(Ok(WatchEvent::Deleted(pod))) => {
                        version = resource_version(&pod).unwrap_or(version);
                        pods::name(&pod)
                            .map(|name| known.forget(name))
                            .unwrap_or_default()
                    }
                    Some(Ok(WatchEvent::Bookmark(mark))) => {
                        version = mark.metadata.resource_version;
                        Vec::new()
                    }
                    Some(Ok(WatchEvent::Error(status))) => {
                        // 410 Gone: the version is older than the API server keeps.
                        tracing::info!(code = status.code, reason = %status.reason, message = %status.message, "pod watch ended by the API server; listing again");
                        return;
                    }
                    Some(Err(error)) => {
                        tracing::warn!(error = %error, "pod watch failed; listing again");
                        return;
                    }
                    // The API server's timeout: reopen from the last version seen.
                    None => break,
                };
                if !send(&changes_tx, changes) {
                    return;
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Discovery for KubernetesDiscovery {
    async fn discover(&self) -> Result<WorkerWatch, RegistryError> {
        let selection = self.selection().await?;
        let list = bounded(
            self.pods()
                .list(&ListParams::default().labels(&selection.labels)),
            "list the pods",
        )
        .await?;
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let mut known = PodSet::new(self.settings.worker_port.clone());
        for pod in &list.items {
            known.observe(pod, &selection);
        }
        // The initial list is the workers that answered; the rest come as changes.
        self.resolve(&mut known).await;
        let initial = known.workers();
        tracing::info!(namespace = %self.namespace, selector = %selection.labels, pods = list.items.len(), workers = initial.len(), "listed the worker pods");
        let (changes_tx, changes_rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        tokio::spawn(
            self.clone()
                .follow(known, selection, version, changes_tx, cancel.clone()),
        );
        Ok(WorkerWatch::from_channel(
            initial,
            changes_rx,
            cancel.drop_guard(),
        ))
    }
}

/// Sends `changes`; false when the watch's consumer is gone.
fn send(changes_tx: &mpsc::UnboundedSender<WorkerChange>, changes: Vec<WorkerChange>) -> bool {
    changes
        .into_iter()
        .all(|change| changes_tx.send(change).is_ok())
}

fn resource_version(pod: &Pod) -> Option<String> {
    pod.metadata.resource_version.clone()
}

/// `call` within [`API_TIMEOUT`], its failure a retryable discovery error.
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
    action: &str,
) -> Result<T, RegistryError> {
    let unavailable = |reason: String| RegistryError::DiscoveryUnavailable {
        backend: "kubernetes",
        reason: format!("cannot {action}: {reason}"),
    };
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(unavailable(error_chain(&error))),
        Err(_) => Err(unavailable(format!("no answer within {API_TIMEOUT:?}"))),
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

/// The pods the watch knows: where each serving one is reached and, once its sidecar
/// answered, the worker it is.
#[derive(Debug)]
struct PodSet {
    worker_port: PortRef,
    pods: BTreeMap<String, Known>,
}

#[derive(Debug)]
struct Known {
    target: PodTarget,
    worker: Option<WorkerInfo>,
}

impl PodSet {
    fn new(worker_port: PortRef) -> Self {
        Self {
            worker_port,
            pods: BTreeMap::new(),
        }
    }

    /// A pod as it now is: a serving pod whose address changed is a new worker; a pod that
    /// no longer serves leaves.
    fn observe(&mut self, pod: &Pod, selection: &Selection) -> Vec<WorkerChange> {
        let Some(name) = pods::name(pod) else {
            return Vec::new();
        };
        match pods::target(pod, &self.worker_port, selection.engine_port.as_ref()) {
            Ok(target) => {
                if self.pods.get(name).is_some_and(|k| k.target == target) {
                    return Vec::new();
                }
                let left = self.forget(name);
                self.pods.insert(
                    name.to_owned(),
                    Known {
                        target,
                        worker: None,
                    },
                );
                left
            }
            Err(reason) => {
                if self.pods.contains_key(name) {
                    tracing::info!(pod = name, reason, "pod no longer serves; out of routing");
                }
                self.forget(name)
            }
        }
    }

    fn forget(&mut self, name: &str) -> Vec<WorkerChange> {
        self.pods
            .remove(name)
            .and_then(|known| known.worker)
            .map(|info| WorkerChange::Removed(info.id))
            .into_iter()
            .collect()
    }

    fn has_pending(&self) -> bool {
        self.pods.values().any(|k| k.worker.is_none())
    }

    fn pending(&self) -> Vec<(String, PodTarget)> {
        self.pods
            .iter()
            .filter(|(_, k)| k.worker.is_none())
            .map(|(name, k)| (name.clone(), k.target.clone()))
            .collect()
    }

    /// The pods whose sidecars answered, where they are reached.
    fn answered(&self) -> Vec<(String, PodTarget)> {
        self.pods
            .iter()
            .filter(|(_, k)| k.worker.is_some())
            .map(|(name, k)| (name.clone(), k.target.clone()))
            .collect()
    }

    /// The sidecar of an answered `pod` at `target` answered again with `info`: an update when
    /// it describes itself differently; a worker of another id replaces the old one. Nothing
    /// when the pod moved on meanwhile.
    fn refreshed(&mut self, pod: &str, target: &PodTarget, info: WorkerInfo) -> Vec<WorkerChange> {
        let Some(old) = self
            .pods
            .get(pod)
            .filter(|k| &k.target == target)
            .and_then(|k| k.worker.clone())
        else {
            return Vec::new();
        };
        if old == info {
            return Vec::new();
        }
        if old.id == info.id {
            if let Some(known) = self.pods.get_mut(pod) {
                known.worker = Some(info.clone());
            }
            return vec![WorkerChange::Updated(info)];
        }
        let mut changes = self.forget(pod);
        self.pods.insert(
            pod.to_owned(),
            Known {
                target: target.clone(),
                worker: None,
            },
        );
        changes.extend(self.resolved(pod, target, info));
        changes
    }

    /// The sidecar of `pod` at `target` answered with `info`; None when the pod moved on
    /// meanwhile or another pod already serves that worker id.
    fn resolved(
        &mut self,
        pod: &str,
        target: &PodTarget,
        info: WorkerInfo,
    ) -> Option<WorkerChange> {
        if let Some((other, _)) = self
            .pods
            .iter()
            .find(|(name, k)| *name != pod && k.worker.as_ref().is_some_and(|w| w.id == info.id))
        {
            tracing::warn!(pod, other = %other, worker = %info.id, "two pods answer as the same worker id; the second is ignored (give each sidecar its own --id)");
            return None;
        }
        let known = self.pods.get_mut(pod).filter(|k| &k.target == target)?;
        known.worker = Some(info.clone());
        Some(WorkerChange::Added(info))
    }

    fn workers(&self) -> Vec<WorkerInfo> {
        let mut workers: Vec<_> = self
            .pods
            .values()
            .filter_map(|k| k.worker.clone())
            .collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        workers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{BlockSize, EngineKind, Role, WorkerId};

    fn pod(name: &str, ip: &str, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "grpc", "containerPort": 7000}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap()
    }

    fn info(id: &str) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: "0.0.0.0:7000".into(),
            model: "m".into(),
            role: Role::Both,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: EngineKind::Vllm,
            incarnation: 1,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    fn selection() -> Selection {
        Selection {
            labels: "app=engine".into(),
            engine_port: Some(PortRef::Number(8000)),
        }
    }

    #[test]
    fn a_pod_serves_once_its_sidecar_answered_and_leaves_when_unready() {
        let mut known = PodSet::new(PortRef::Named("grpc".into()));
        assert!(
            known
                .observe(&pod("p0", "10.0.0.1", true), &selection())
                .is_empty()
        );
        let pending = known.pending();
        assert_eq!(pending.len(), 1);
        let (name, target) = &pending[0];
        assert_eq!(target.worker_address, "10.0.0.1:7000");
        assert_eq!(target.engine_endpoint.as_deref(), Some("10.0.0.1:8000"));
        let added = known.resolved(name, target, info("w0"));
        assert_eq!(added, Some(WorkerChange::Added(info("w0"))));
        assert!(!known.has_pending());
        // The same pod again (a status update that changes nothing for routing): no change.
        assert!(
            known
                .observe(&pod("p0", "10.0.0.1", true), &selection())
                .is_empty()
        );
        let gone = known.observe(&pod("p0", "10.0.0.1", false), &selection());
        assert_eq!(gone, [WorkerChange::Removed(WorkerId::new("w0").unwrap())]);
        assert!(known.workers().is_empty());
    }

    #[test]
    fn a_new_address_is_a_new_worker_and_a_duplicate_id_is_ignored() {
        let mut known = PodSet::new(PortRef::Number(7000));
        known.observe(&pod("p0", "10.0.0.1", true), &selection());
        known.observe(&pod("p1", "10.0.0.2", true), &selection());
        let targets = known.pending();
        assert!(
            known
                .resolved(&targets[0].0, &targets[0].1, info("w0"))
                .is_some()
        );
        assert_eq!(
            known.resolved(&targets[1].0, &targets[1].1, info("w0")),
            None
        );
        // p0 moves (rescheduled with a new IP): its worker leaves until it answers again.
        let moved = known.observe(&pod("p0", "10.0.0.9", true), &selection());
        assert_eq!(moved, [WorkerChange::Removed(WorkerId::new("w0").unwrap())]);
        // An answer for the old address is stale.
        assert_eq!(
            known.resolved(&targets[0].0, &targets[0].1, info("w0")),
            None
        );
        assert!(known.forget("p1").is_empty());
    }

    #[test]
    fn a_sidecar_asked_again_updates_its_worker_only_when_it_changed() {
        let mut known = PodSet::new(PortRef::Number(7000));
        known.observe(&pod("p0", "10.0.0.1", true), &selection());
        let (name, target) = known.pending().remove(0);
        known.resolved(&name, &target, info("w0"));
        assert_eq!(known.answered(), [(name.clone(), target.clone())]);
        // The same answer: nothing to tell.
        assert!(known.refreshed(&name, &target, info("w0")).is_empty());
        // An adapter loaded on the engine: the worker is updated.
        let mut loaded = info("w0");
        loaded.adapters = vec!["sql-lora".into()];
        assert_eq!(
            known.refreshed(&name, &target, loaded.clone()),
            [WorkerChange::Updated(loaded.clone())]
        );
        assert_eq!(known.workers(), [loaded.clone()]);
        // Another worker answering at the pod's address (a sidecar started with another id)
        // replaces the old one.
        assert_eq!(
            known.refreshed(&name, &target, info("w1")),
            [
                WorkerChange::Removed(WorkerId::new("w0").unwrap()),
                WorkerChange::Added(info("w1"))
            ]
        );
        // An answer for an address the pod no longer has is stale.
        known.observe(&pod("p0", "10.0.0.9", true), &selection());
        assert!(known.refreshed(&name, &target, loaded).is_empty());
        assert!(known.answered().is_empty());
    }
}
