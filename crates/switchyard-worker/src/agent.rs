//! The worker agent's lifecycle: bind, serve, register, follow role changes, and shut down in
//! phases (stop accepting, let in-flight requests finish, deregister, stop serving).

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use switchyard_core::{EngineKind, WorkerId, WorkerInfo};
use switchyard_registry::{Registration, Registry, RegistryError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::engine::Engine;
use crate::engine::sim::SimEngine;
use crate::engine::vllm::VllmEngine;
use crate::metrics::WorkerMetrics;
use crate::peers::PeerDirectory;
use crate::service::{Access, ServiceLimits, WorkerService};
use crate::state::WorkerState;
use switchyard_security::{Dialer, PeerRole};

/// HTTP/2 keep-alive ping interval and timeout of the worker's gRPC server.
const WORKER_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(10);
/// Concurrent gRPC streams per connection (a gateway multiplexes its requests on one).
const WORKER_MAX_STREAMS: u32 = 4096;

/// How long a restarted worker waits for the process registered under its id to answer.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Registers `info`, taking over a registration of the same id whose process no longer answers
/// as that registration (this worker restarted before its old lease expired). A process that
/// does answer keeps its id, and this one is refused.
async fn register_or_take_over(
    registry: &dyn Registry,
    info: WorkerInfo,
    ttl: std::time::Duration,
    dialer: &Dialer,
) -> Result<Registration, RegistryError> {
    match registry.register(info.clone(), ttl).await {
        Err(RegistryError::AlreadyRegistered(id)) => {
            let holder = registry
                .list_workers()
                .await?
                .into_iter()
                .find(|w| w.id == id);
            let Some(stale) = holder else {
                // Its lease ran out meanwhile: the id is free.
                return registry.register(info, ttl).await;
            };
            if answers_as(&stale, dialer).await {
                return Err(RegistryError::AlreadyRegistered(id));
            }
            tracing::warn!(
                worker = %id,
                address = %stale.address,
                incarnation = stale.incarnation,
                "this id is registered by a process that no longer answers (restarted before its lease expired); taking its registration over"
            );
            registry.take_over(info, ttl, &stale).await
        }
        other => other,
    }
}

/// Whether a worker answers at `registered.address` as `registered` (same id, same
/// incarnation). A new process at the same address answers with its own incarnation.
async fn answers_as(registered: &WorkerInfo, dialer: &Dialer) -> bool {
    use switchyard_proto::v1::InfoRequest;
    use switchyard_proto::v1::worker_client::WorkerClient;
    let Ok(endpoint) = dialer.endpoint(&registered.address) else {
        return false;
    };
    let endpoint = endpoint
        .connect_timeout(PROBE_TIMEOUT)
        .timeout(PROBE_TIMEOUT);
    let probe = async {
        let channel = dialer.connect(endpoint).await.ok()?;
        let reply = WorkerClient::new(channel)
            .info(InfoRequest {})
            .await
            .ok()?
            .into_inner();
        Some(reply.id == registered.id.as_str() && reply.incarnation == registered.incarnation)
    };
    tokio::time::timeout(PROBE_TIMEOUT * 2, probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Why the agent could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid worker description: {0}")]
    Describe(String),
    #[error("cannot start the {kind} engine: {message}")]
    Engine { kind: EngineKind, message: String },
    #[error("cannot register in the registry: {0}")]
    Register(#[from] RegistryError),
    #[error("grpc server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("security: {0}")]
    Security(#[from] switchyard_security::SecurityError),
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), AgentError> {
    let bind_error = |source| AgentError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local_addr))
}

/// A started worker: what it is and where it listens.
#[derive(Debug)]
pub struct RunningWorker {
    pub info: WorkerInfo,
    pub local_addr: SocketAddr,
    /// Where `GET /metrics` is served, when it is.
    pub metrics_addr: Option<SocketAddr>,
}

/// A random 64-bit value from the standard library's per-process hasher keys.
fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish()
}

/// Runs a worker until `shutdown` is cancelled, then drains and deregisters.
///
/// `on_ready` is called once the server listens and the worker is registered.
pub async fn run(
    config: WorkerConfig,
    registry: Option<Arc<dyn Registry>>,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(&RunningWorker),
) -> Result<(), AgentError> {
    // Certificates and the secret are read first: a bad file fails before anything listens.
    let security = config.security.build(&config.cluster, PeerRole::Worker)?;
    let metrics_tls = config.metrics_tls()?;
    let (listener, local_addr) = bind(config.listen).await?;
    // Bound before the engine starts, so a port already taken fails at once.
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let address = config
        .advertise_address
        .clone()
        .unwrap_or_else(|| local_addr.to_string());
    let incarnation = random_u64();
    let id = match &config.id {
        Some(id) => WorkerId::new(id.clone()),
        None => WorkerId::new(format!(
            "worker-{}-{:04x}",
            local_addr.port(),
            incarnation & 0xffff
        )),
    }
    .map_err(|e| AgentError::Describe(e.to_string()))?;

    let kind = config.engine.kind;
    let engine_error = |message: String| AgentError::Engine { kind, message };
    let engine: Arc<dyn Engine> = match kind {
        EngineKind::Sim => Arc::new(
            SimEngine::start(
                id.clone(),
                incarnation,
                config.sim.clone(),
                config.speedup,
                config.kv_bytes_per_token,
                config.event_buffer,
                config.transfer_setup(),
            )
            .map_err(|e| engine_error(e.to_string()))?,
        ),
        EngineKind::Vllm | EngineKind::Sglang => Arc::new(
            VllmEngine::start(
                id.clone(),
                incarnation,
                &config.model,
                &config.lora_adapters,
                &config.engine,
                config.kv_bytes_per_token,
                config.event_buffer,
            )
            .await
            .map_err(|e| engine_error(e.to_string()))?,
        ),
        EngineKind::Trtllm => Arc::new(
            VllmEngine::start_trtllm(
                id.clone(),
                incarnation,
                &config.model,
                &config.engine,
                config.kv_bytes_per_token,
                config.event_buffer,
            )
            .await
            .map_err(|e| engine_error(e.to_string()))?,
        ),
    };
    let spec = engine.spec().clone();
    // The adapters the engine says it serves (vLLM, followed while it runs), else the
    // configured ones; the sender of a fixed list lives as long as the worker.
    let (_fixed_adapters, adapters_rx) = match engine.adapters() {
        Some(rx) => (None, rx),
        None => {
            let (tx, rx) = tokio::sync::watch::channel(config.lora_adapters.clone());
            (Some(tx), rx)
        }
    };
    let info = WorkerInfo {
        id: id.clone(),
        address,
        model: config.model.clone(),
        role: config.role,
        block_size: spec.block_size,
        kv_capacity_blocks: spec.kv_capacity_blocks,
        max_context_tokens: spec.max_context_tokens,
        engine: spec.kind,
        incarnation,
        adapters: adapters_rx.borrow().clone(),
        engine_endpoint: config.engine.http_endpoint(),
        kv_peer: config.kv_tiers.peer_link(),
        kv_tiers: Some(config.kv_tiers.announce(
            spec.kind,
            config.kv_bytes_per_token * u64::from(spec.block_size.get()),
            &config.sim.timing,
        )),
    };
    info.validate()
        .map_err(|e| AgentError::Describe(e.to_string()))?;

    let state = WorkerState::new(config.role);
    let metrics = Arc::new(WorkerMetrics::new(
        id.as_str(),
        Arc::clone(&engine),
        state.clone(),
    ));
    // Serves until the very end, so a scrape still sees the drain.
    let metrics_stop = CancellationToken::new();
    let metrics_addr = metrics_listener.as_ref().map(|(_, addr)| *addr);
    let metrics_server = metrics_listener.map(|(listener, addr)| {
        let scheme = if metrics_tls.is_some() {
            "https"
        } else {
            "http"
        };
        tracing::info!(
            worker = %id,
            url = %format!("{scheme}://{addr}/metrics"),
            token = config.metrics_token.is_some(),
            "serving metrics"
        );
        tokio::spawn(crate::metrics::serve(
            listener,
            crate::metrics::MetricsAccess {
                token: config.metrics_token.clone(),
                tls: metrics_tls,
            },
            Arc::clone(&metrics),
            state.clone(),
            metrics_stop.clone(),
        ))
    });
    // The cluster's workers, so a Generate's KV source can be checked (asked on demand).
    let peers = registry.as_ref().map(|r| PeerDirectory::new(Arc::clone(r)));
    if security.authorizer.is_open() {
        if !local_addr.ip().is_loopback() {
            tracing::warn!(worker = %id, address = %local_addr, "the worker's gRPC port is open to anyone who reaches it: set a cluster secret or mTLS (see docs/security.md)");
        }
    } else {
        tracing::info!(worker = %id, mtls = security.server_tls.is_some(), "gRPC calls are authenticated");
    }
    let dialer = security.dialer.clone();
    // The event plane publisher: each KV event message once to NATS JetStream, beside the gRPC
    // streams (which stay, for gateways without the plane and for snapshots).
    let plane_stop = CancellationToken::new();
    let plane_publisher = config.event_plane.enabled().then(|| {
        tokio::spawn(crate::service::plane::connect_and_publish(
            config.event_plane.clone(),
            config.cluster.clone(),
            info.model.clone(),
            info.block_size,
            Arc::clone(engine.events()),
            Arc::clone(&metrics),
            plane_stop.clone(),
        ))
    });
    let service = WorkerService::new(
        info.clone(),
        adapters_rx.clone(),
        Arc::clone(&engine),
        state.clone(),
        Arc::clone(&metrics),
        ServiceLimits {
            kv_pull_timeout: std::time::Duration::from_millis(config.kv_pull_timeout_ms),
            ..ServiceLimits::default()
        },
        Access::new(security.authorizer.clone(), security.dialer.clone(), peers),
    );
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<switchyard_proto::v1::worker_server::WorkerServer<WorkerService>>()
        .await;

    let server_stop = CancellationToken::new();
    let server = {
        let stop = server_stop.clone();
        let router = tonic::transport::Server::builder()
            // A gateway that stops answering pings is dropped (its streams cancelled) within
            // 20 s; streams per connection are bounded, and resets of not-yet-accepted streams
            // stay at hyper's bound (rapid-reset safe).
            .http2_keepalive_interval(Some(WORKER_KEEPALIVE))
            .http2_keepalive_timeout(Some(WORKER_KEEPALIVE))
            .max_concurrent_streams(Some(WORKER_MAX_STREAMS))
            .add_service(health_service)
            .add_service(service.into_server());
        match &security.server_tls {
            // Handshakes run beside the accept loop with a deadline; the certificate is re-read
            // when its files change.
            Some(tls) => tokio::spawn(router.serve_with_incoming_shutdown(
                switchyard_security::incoming::TlsIncoming::new(
                    listener,
                    Arc::clone(tls),
                    stop.clone(),
                ),
                stop.cancelled_owned(),
            )),
            None => tokio::spawn(router.serve_with_incoming_shutdown(
                // Tonic sets TCP_NODELAY only on sockets it binds itself: without it a reply
                // split into small frames waits ~40 ms for the gateway's delayed ACK.
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                stop.cancelled_owned(),
            )),
        }
    };

    // etcd may be down when the worker starts: it waits for it (saying so) rather than exit.
    // `None` here with a registry means a shutdown came while waiting.
    let registration = match &registry {
        Some(registry) => {
            let ttl = config.lease_ttl();
            switchyard_registry::retry::until_available("register the worker", &shutdown, || {
                register_or_take_over(registry.as_ref(), info.clone(), ttl, &dialer)
            })
            .await?
        }
        None => None,
    };
    let role_follower = registration.as_ref().map(|_| Follower {
        role: state.watch_role(),
        adapters: adapters_rx.clone(),
        info: info.clone(),
    });

    if !shutdown.is_cancelled() {
        tracing::info!(worker = %id, address = %info.address, role = %info.role, model = %info.model, "worker ready");
        on_ready(&RunningWorker {
            info: info.clone(),
            local_addr,
            metrics_addr,
        });
    }

    let registration = follow_until_shutdown(registration, role_follower, &shutdown).await;

    // Phase 1: stop taking work; tell health checkers and the router.
    tracing::info!(worker = %id, in_flight = state.in_flight(), "shutting down: draining");
    state.set_draining(true);
    health_reporter
        .set_not_serving::<switchyard_proto::v1::worker_server::WorkerServer<WorkerService>>()
        .await;
    // Phase 2: let in-flight requests finish within the grace period.
    if !state.wait_idle(config.drain_timeout()).await {
        tracing::warn!(worker = %id, in_flight = state.in_flight(), "drain timeout; aborting the rest");
    }
    // Phase 3: leave the registry so no gateway picks this worker again.
    if let Some(registration) = registration
        && let Err(err) = registration.deregister().await
    {
        tracing::warn!(worker = %id, error = %err, "deregistration failed; the lease will expire");
    }
    // Phase 4: stop serving and the engine.
    engine.shutdown();
    plane_stop.cancel();
    if let Some(publisher) = plane_publisher
        && let Err(join) = publisher.await
    {
        tracing::error!(error = %join, "event plane publisher task failed");
    }
    server_stop.cancel();
    metrics_stop.cancel();
    match server.await {
        Ok(result) => result?,
        Err(join) => tracing::error!(error = %join, "grpc server task failed"),
    }
    if let Some(server) = metrics_server
        && let Err(join) = server.await
    {
        tracing::error!(error = %join, "metrics server task failed");
    }
    tracing::info!(worker = %id, "worker stopped");
    Ok(())
}

/// What the registry entry follows: the worker's role and the LoRA adapters its engine serves.
struct Follower {
    role: tokio::sync::watch::Receiver<switchyard_core::Role>,
    adapters: tokio::sync::watch::Receiver<Vec<String>>,
    info: WorkerInfo,
}

/// Keeps the registry entry's role and adapters in step with the worker's until shutdown.
async fn follow_until_shutdown(
    registration: Option<Registration>,
    follower: Option<Follower>,
    shutdown: &CancellationToken,
) -> Option<Registration> {
    let (Some(registration), Some(mut f)) = (registration, follower) else {
        shutdown.cancelled().await;
        return None;
    };
    loop {
        let what = tokio::select! {
            _ = shutdown.cancelled() => return Some(registration),
            changed = f.role.changed() => {
                if changed.is_err() {
                    shutdown.cancelled().await;
                    return Some(registration);
                }
                f.info.role = *f.role.borrow_and_update();
                "role"
            }
            changed = f.adapters.changed() => {
                if changed.is_err() {
                    shutdown.cancelled().await;
                    return Some(registration);
                }
                let adapters = f.adapters.borrow_and_update().clone();
                if let Err(err) = switchyard_core::worker::validate_adapters(&f.info.model, &adapters) {
                    tracing::warn!(worker = %f.info.id, error = %err, "the engine's LoRA adapters cannot be registered; keeping the last list");
                    continue;
                }
                f.info.adapters = adapters;
                "LoRA adapters"
            }
        };
        if let Err(err) = registration.update(f.info.clone()).await {
            tracing::warn!(worker = %f.info.id, error = %err, "could not record the new {what} in the registry");
        }
    }
}
