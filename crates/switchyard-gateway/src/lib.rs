//! The Switchyard gateway: the OpenAI and Anthropic APIs in front of the workers.
//!
//! Its folders are its roles. A request comes in through [`api`] (the listener, the request
//! pipeline, one renderer per API), is let in by [`access`] (API keys, quotas, fair
//! admission), served by [`serving`] (template and tokenizer, routing through the model's
//! serving core, the serving state machine driven over gRPC to the workers), on the state
//! [`cluster`] keeps (the workers discovery reports, each model's prefix index and load view
//! fed by the workers' KV events and load reports, the other gateway replicas), while
//! [`observe`] records what operators may look at (metrics, the decision log and its audits,
//! recordings). [`config`] is the one configuration struct, [`gateway_error`] why the gateway
//! could not start or stopped; this file starts them in order ([`start`], [`run`]).

pub mod access;
pub mod api;
pub mod cluster;
pub mod config;
pub mod error;
pub mod gateway_error;
pub mod observe;
pub mod serving;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use std::ops::ControlFlow;

use switchyard_registry::{Discovery, WorkerChange, WorkerWatch};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use api::http::Extensions;
pub use config::{ConfigError, GatewayArgs, GatewayConfig};
pub use gateway_error::GatewayError;

use crate::access::quota;
use crate::api::http;
use crate::cluster::{fleet, pool};
use crate::observe::audit;
use crate::serving::retention;

use crate::access::admission::Admission;
use crate::api::http::AppState;
use crate::cluster::pool::WorkerPool;
use crate::cluster::pool::follow::FollowContext;
use crate::cluster::pool::followers::Followers;
use crate::observe::Observers;
use crate::observe::metrics::Metrics;
use crate::observe::recorder::Recorder;
use crate::serving::preprocess::Tokenizers;

/// Runs the gateway until `shutdown` is cancelled. `on_ready` gets the bound address once the
/// listener is open.
pub async fn run(
    config: GatewayConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), GatewayError> {
    run_with(config, discovery, shutdown, Extensions::default(), on_ready).await
}

/// [`run`] with parts of other roles served by the gateway's listener (the planner embedded in
/// `switchyard up --planner`).
pub async fn run_with(
    config: GatewayConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: CancellationToken,
    extensions: Extensions,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), GatewayError> {
    let Some(state) = start(
        config,
        discovery,
        &shutdown,
        extensions,
        pool::Delivery::WorkerGrpc,
    )
    .await?
    else {
        return Ok(());
    };
    let listener = TcpListener::bind(state.config.listen)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: state.config.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| GatewayError::Bind {
        addr: state.config.listen,
        source,
    })?;
    let limits = state.config.http.limits(http::server::connection_cap(
        state.config.http.max_connections,
    ));
    let metrics = Arc::clone(&state.observers.metrics);
    let followers = Arc::clone(&state.followers);
    let tls = state.access.tls.clone();
    let fleet = join_fleet(&state, local_addr, &shutdown).await?;
    let app = http::router(state, fleet);
    tracing::info!(
        address = %local_addr,
        max_connections = limits.max_connections,
        https = tls.is_some(),
        "gateway listening"
    );
    on_ready(local_addr);
    http::server::serve(listener, app, limits, tls, metrics, shutdown).await;
    followers.shutdown().await;
    Ok(())
}

/// With `[fleet] share_sessions`, announces this replica (listening at `local_addr`) among the
/// gateway replicas of the registry the caller handed over, and follows them.
async fn join_fleet(
    state: &Arc<AppState>,
    local_addr: SocketAddr,
    shutdown: &CancellationToken,
) -> Result<Option<Arc<fleet::Fleet>>, GatewayError> {
    let config = &state.config;
    if !config.fleet.share_sessions {
        return Ok(None);
    }
    let Some(replicas) = state.extensions.replicas.clone() else {
        return Err(GatewayError::Fleet(
            "sharing sessions needs the replicas' registry: give etcd endpoints (--etcd)".into(),
        ));
    };
    let address = match &config.fleet.advertise {
        Some(address) => address.clone(),
        None if local_addr.ip().is_unspecified() => {
            return Err(GatewayError::Fleet(format!(
                "the gateway listens on {local_addr}: say where the other replicas reach it (--advertise host:port)"
            )));
        }
        None => local_addr.to_string(),
    };
    let id = config
        .fleet
        .replica_id
        .clone()
        .unwrap_or_else(|| address.replace([':', '[', ']'], "-"));
    let me = switchyard_registry::ReplicaInfo { id, address };
    me.validate().map_err(GatewayError::Fleet)?;
    let secret = match &config.security.cluster_secret_file {
        Some(path) => Some(switchyard_security::ClusterSecret::from_file(path)?),
        None => None,
    };
    let fleet = fleet::Fleet::join(
        &config.fleet,
        me,
        replicas,
        secret,
        &config.cluster,
        Arc::clone(&state.observers.metrics),
        config.max_body_bytes,
        &state.tasks,
        shutdown.clone(),
    )
    .await?;
    Ok(Some(fleet))
}

/// The gateway's state, up and following the registry: tokenizers loaded, the worker pool
/// (routing for `delivery`) holding the registered workers, admission set up. None when
/// `shutdown` came first. The endpoint picker (`switchyard epp`) starts the same state and
/// answers a proxy instead of clients; [`pool::followers::Followers::shutdown`] ends it.
pub async fn start(
    config: GatewayConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: &CancellationToken,
    extensions: Extensions,
    delivery: pool::Delivery,
) -> Result<Option<Arc<AppState>>, GatewayError> {
    let tokenizer_spec = config.tokenizer.clone();
    let per_model = config.models.clone();
    let sessions = config.session_cache.to_session_config();
    let tokenizers = tokio::task::spawn_blocking(move || {
        Tokenizers::load(&tokenizer_spec, &per_model, &sessions)
    })
    .await
    .map_err(|e| GatewayError::Tokenizers(e.to_string()))?
    .map_err(GatewayError::Tokenizers)?;
    let security = config
        .security
        .build(&config.cluster, switchyard_security::PeerRole::Gateway)?;
    let access = config.access.build()?;
    if access.api_keys.is_none() && !config.listen.ip().is_loopback() {
        tracing::warn!(listen = %config.listen, "/v1 takes requests without an API key: set [access] api_keys_file (see docs/security.md)");
    }
    let metrics = Arc::new(Metrics::new());
    let quota = Arc::new(
        quota::Quotas::new(config.quota.clone(), metrics.quota.clone())
            .map_err(|e| GatewayError::Quota(e.to_string()))?,
    );
    let disk = match &config.audit.decision_log_path {
        Some(path) => Some(
            audit::disk::DiskLog::open(
                path.clone(),
                config.audit.decision_log_max_bytes,
                metrics.audit.decisions_logged.clone(),
                metrics.audit.decision_log_dropped.clone(),
            )
            .map_err(GatewayError::DecisionLog)?,
        ),
        None => None,
    };
    let decisions = audit::DecisionLog::new(config.decision_log_size, disk)
        .counting_outcomes(metrics.audit.decision_outcomes.clone());
    let pool = Arc::new(
        WorkerPool::new(config.policy, config.policy_settings.clone())
            .map_err(|e| GatewayError::Routing(e.to_string()))?
            .with_delivery(delivery),
    );
    let observers = Arc::new(Observers::new(
        Arc::clone(&metrics),
        decisions,
        Recorder::new(pool.epoch()),
        config.audit.clone(),
    ));
    let context = FollowContext::new(&observers, config.load_interval_ms())
        .with_unresponsive_after(config.unresponsive_after())
        .with_load_push(config.load_push_min_ms)
        .with_subscribe_concurrency(config.subscribe_concurrency)
        .with_dialer(security.dialer);
    // The followers' token and tracker are the gateway's: its other tasks stop and are
    // waited for with them.
    let (cancel, tasks) = (context.cancel.clone(), context.tasks.clone());
    let followers = Arc::new(
        Followers::new(Arc::clone(&pool), Arc::new(context)).with_event_plane(
            config.event_plane.enabled().then(|| {
                Arc::new(pool::plane_feed::PlaneHandle::new(
                    config.event_plane.clone(),
                    &config.cluster,
                    &format!("switchyard-gateway {}", config.listen),
                ))
            }),
        ),
    );
    followers.watch_kv_silence();
    // Know the registered workers before announcing readiness, so the first request finds them.
    // etcd may have gone away since the connection was made: wait for it, as at start.
    let watch = switchyard_registry::retry::until_available("watch the workers", shutdown, || {
        discovery.discover()
    })
    .await
    .map_err(|e| GatewayError::Registry(e.to_string()))?;
    let Some(mut watch) = watch else {
        followers.shutdown().await;
        return Ok(None);
    };
    // Applied here, not in the task, so the workers are in the pool when the ready line goes out.
    apply_initial(&followers, &mut watch);
    tasks.spawn(follow_registry(
        Arc::clone(&followers),
        discovery,
        Some(watch),
        cancel.clone(),
    ));
    tasks.spawn(Arc::clone(&quota).renew_leases(cancel));
    let retention =
        retention::SessionRetention::new(&config.retention).map_err(GatewayError::Routing)?;
    let cluster_secret = match &config.security.cluster_secret_file {
        Some(path) => Some(std::fs::read(path).map_err(|e| {
            GatewayError::Routing(format!(
                "cannot read the cluster secret {}: {e}",
                path.display()
            ))
        })?),
        None => None,
    };
    let responses = Arc::new(
        http::responses::ResponsesState::new(&config.responses, cluster_secret.as_deref())
            .map_err(GatewayError::Routing)?,
    );
    let sessions = Arc::new(serving::sessions::SessionSchedule::new(
        &config.sessions,
        Arc::clone(&pool),
        observers.metrics.sessions.clone(),
    ));
    Ok(Some(Arc::new(AppState {
        quota,
        retention,
        sessions,
        responses,
        admission: Admission::new(
            config.max_concurrent_requests,
            config.max_queued_requests,
            config.max_queued_per_session,
        )
        .with_client_limit(config.max_requests_per_client),
        config,
        pool,
        transport: Arc::new(serving::transport::GrpcTransport::new(Arc::clone(
            &followers.context().connections,
        ))),
        followers,
        observers,
        tasks,
        tokenizers,
        extensions,
        access,
    })))
}

/// Mirrors the discovered workers (etcd's registry, Kubernetes' pods) into the pool for as long as the gateway runs, starting from `first`
/// (a watch already opened) and watching again whenever a watch ends or cannot be opened.
async fn follow_registry(
    followers: Arc<Followers>,
    discovery: Arc<dyn Discovery>,
    mut applied: Option<WorkerWatch>,
    cancel: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let watch = match applied.take() {
            Some(watch) => Ok(watch),
            None => tokio::select! {
                _ = cancel.cancelled() => return,
                watch = discovery.discover() => watch.map(|mut watch| {
                    apply_initial(&followers, &mut watch);
                    watch
                }),
            },
        };
        match watch {
            Ok(watch) => {
                backoff = Duration::from_millis(100);
                if follow_changes(&followers, watch, &cancel).await.is_break() {
                    return;
                }
                tracing::warn!("worker watch ended; discovering the workers again");
            }
            Err(err) => tracing::warn!(error = %err, "cannot discover the workers; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Applies a watch's initial list to the pool, dropping workers that left meanwhile, with one
/// member-list rebuild per model ([`WorkerPool::batch_membership`]).
fn apply_initial(followers: &Followers, watch: &mut WorkerWatch) {
    let known: std::collections::HashSet<_> = watch.initial.iter().map(|w| w.id.clone()).collect();
    followers.pool().batch_membership(|| {
        for info in std::mem::take(&mut watch.initial) {
            followers.upsert_worker(info);
        }
        for worker in followers.pool().workers() {
            let id = worker.id();
            if !known.contains(&id) {
                followers.remove_worker(&id);
            }
        }
    });
}

/// Most watch changes applied under one member-list rebuild.
const MEMBERSHIP_BATCH: usize = 4_096;

/// Applies one change of the worker watch.
fn apply_change(followers: &Followers, change: WorkerChange) {
    match change {
        WorkerChange::Added(info) | WorkerChange::Updated(info) => followers.upsert_worker(info),
        WorkerChange::Removed(id) => followers.remove_worker(&id),
    }
}

/// Applies a watch's changes (its initial list already applied) until it ends (`Continue`) or
/// the gateway stops (`Break`).
async fn follow_changes(
    followers: &Followers,
    mut watch: WorkerWatch,
    cancel: &CancellationToken,
) -> ControlFlow<()> {
    loop {
        let change = tokio::select! {
            _ = cancel.cancelled() => return ControlFlow::Break(()),
            change = watch.next() => change,
        };
        let Some(change) = change else {
            return ControlFlow::Continue(());
        };
        // The change and those already waiting behind it (a fleet starting, a zone leaving),
        // under one member-list rebuild per model.
        followers.pool().batch_membership(|| {
            apply_change(followers, change);
            for _ in 1..MEMBERSHIP_BATCH {
                let Some(next) = watch.try_next() else { break };
                apply_change(followers, next);
            }
        });
    }
}
