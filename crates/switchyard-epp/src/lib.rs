//! Switchyard as an endpoint picker (EPP) of the Kubernetes Gateway API Inference Extension:
//! an Envoy `ext_proc` server a gateway (Istio, kgateway, Envoy Gateway, GKE, NGINX Gateway
//! Fabric) consults for every request to an InferencePool, answering which model server pod
//! should take it.
//!
//! The picker runs the gateway's state without its OpenAI API ([`switchyard_gateway::start`]):
//! the worker discovery (etcd, or the Kubernetes pods of its InferencePool), each worker's KV-event and load subscriptions, the tokenizers,
//! admission, and the one serving core that decides. A request's path:
//!
//! - [`server`]: the tonic `ExternalProcessor` service; one owned task per stream drives an
//!   [`exchange::Exchange`], the state machine over the messages Envoy sends in its configured
//!   body modes;
//! - [`pick`]: body → prompt → tokens → admission → the gateway's routing, then the chosen
//!   worker's engine endpoint and its fallbacks;
//! - [`envoy`]: the protocol's reading and writing of ext_proc messages (destination header and
//!   `envoy.lb` metadata, subset hint, served endpoint, immediate responses);
//! - [`proto`]: the code generated from the vendored Envoy protos; [`config`] the picker's own
//!   settings.
//!
//! Only workers that registered their engine's HTTP endpoint (`WorkerInfo::engine_endpoint`:
//! vLLM and SGLang workers) are candidates: the proxy sends the request to the engine itself.
//! The admin API, `/metrics` and readiness are served on the gateway's HTTP listener.

pub mod config;
pub mod envoy;
pub mod exchange;
pub mod pick;
pub mod proto;
pub mod server;
pub mod usage;

use std::net::SocketAddr;
use std::sync::Arc;

use switchyard_gateway::api::http::AppState;
use switchyard_gateway::cluster::pool::Delivery;
use switchyard_gateway::{Extensions, GatewayConfig, GatewayError};
use switchyard_registry::Discovery;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Server;
use tonic_health::ServingStatus;

pub use config::{BodyMode, EppArgs, EppConfig, FailureMode};

use crate::proto::ext_proc::external_processor_server::ExternalProcessorServer;
use crate::server::{EndpointPicker, SERVICE_NAME};

/// Why the endpoint picker could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    #[error(transparent)]
    Gateway(#[from] GatewayError),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the ext_proc server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Where a running picker listens.
#[derive(Debug, Clone, Copy)]
pub struct Listening {
    /// The ext_proc gRPC server (and gRPC health).
    pub grpc: SocketAddr,
    /// The admin API, `/metrics`, `/health` and `/ready`.
    pub http: SocketAddr,
}

/// Runs the endpoint picker until `shutdown` is cancelled. `on_ready` gets the bound addresses.
pub async fn run(
    gateway: GatewayConfig,
    epp: EppConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(Listening),
) -> Result<(), EppError> {
    let Some(state) = switchyard_gateway::start(
        gateway,
        discovery,
        &shutdown,
        Extensions::default(),
        Delivery::EngineHttp,
    )
    .await?
    else {
        return Ok(());
    };
    serve(state, epp, shutdown, on_ready).await
}

/// Serves the picker over a gateway state already started with
/// [`Delivery::EngineHttp`] (what [`run`] does after starting it), until `shutdown` is
/// cancelled; the state's followers (and the gateway's tasks) are shut down at the end.
pub async fn serve(
    state: Arc<AppState>,
    epp: EppConfig,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(Listening),
) -> Result<(), EppError> {
    let bind = |addr: SocketAddr| async move {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EppError::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| EppError::Bind { addr, source })?;
        Ok::<_, EppError>((listener, local))
    };
    let (grpc_listener, grpc) = bind(epp.listen).await?;
    let (http_listener, http) = bind(state.config.listen).await?;

    let (health, health_service) = tonic_health::server::health_reporter();
    for service in ["", "liveness", "readiness", SERVICE_NAME] {
        health
            .set_service_status(service, ServingStatus::Serving)
            .await;
    }
    let tasks = TaskTracker::new();
    let picker = EndpointPicker::new(
        Arc::clone(&state),
        Arc::new(epp),
        tasks.clone(),
        shutdown.child_token(),
    );
    let limits = state
        .config
        .http
        .limits(switchyard_gateway::api::http::server::connection_cap(
            state.config.http.max_connections,
        ));
    let followers = Arc::clone(&state.followers);
    let metrics = Arc::clone(&state.observers.metrics);
    let tls = state.access.tls.clone();
    let admin = switchyard_gateway::api::http::operations_router(state);
    let http_task = tokio::spawn(switchyard_gateway::api::http::server::serve(
        http_listener,
        admin,
        limits,
        tls,
        metrics,
        shutdown.clone(),
    ));
    tracing::info!(grpc = %grpc, http = %http, "endpoint picker listening");
    on_ready(Listening { grpc, http });

    let stopping = shutdown.clone();
    let served = Server::builder()
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(picker))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
            async move {
                stopping.cancelled().await;
                for service in ["", "readiness", SERVICE_NAME] {
                    health
                        .set_service_status(service, ServingStatus::NotServing)
                        .await;
                }
            },
        )
        .await;
    tasks.close();
    tasks.wait().await;
    let _ = http_task.await;
    followers.shutdown().await;
    served?;
    Ok(())
}
