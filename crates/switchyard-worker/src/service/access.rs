//! Who may make which call on a worker, and which KV sources a `Generate` may name.
//!
//! | call | allowed callers |
//! |---|---|
//! | `Control` | the planner |
//! | `Generate`, `Prefill` | gateways |
//! | `PullKv` | workers |
//! | `KvEvents` | gateways (events carry prompt tokens) |
//! | `LoadStats` | gateways and the planner |
//! | `Info` | any member of the cluster |
//! | `grpc.health.v1` | anyone (probes) |
//!
//! In an open cluster (no secret, no mTLS) everyone may make every call; see
//! `switchyard_security`.

use std::sync::Arc;

use switchyard_core::WorkerId;
use switchyard_proto::ErrorCode;
use switchyard_security::{Authorizer, Dialer, Identity, PeerRole};
use tonic::{Request, Status};

use crate::peers::PeerDirectory;

/// The calls and who may make them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    Control,
    Generate,
    Prefill,
    PullKv,
    KvEvents,
    LoadStats,
    Info,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Control => "Control",
            Call::Generate => "Generate",
            Call::Prefill => "Prefill",
            Call::PullKv => "PullKv",
            Call::KvEvents => "KvEvents",
            Call::LoadStats => "LoadStats",
            Call::Info => "Info",
        }
    }

    fn allowed(self) -> &'static [PeerRole] {
        match self {
            Call::Control => &[PeerRole::Planner],
            Call::Generate | Call::Prefill | Call::KvEvents => &[PeerRole::Gateway],
            Call::PullKv => &[PeerRole::Worker],
            Call::LoadStats => &[PeerRole::Gateway, PeerRole::Planner],
            Call::Info => &PeerRole::ALL,
        }
    }
}

/// The worker's side of the cluster's security.
#[derive(Debug, Clone)]
pub struct Access {
    authorizer: Authorizer,
    /// How this worker dials prefill workers to pull KV.
    pub(crate) dialer: Dialer,
    /// The cluster's workers, when the worker has a registry.
    peers: Option<Arc<PeerDirectory>>,
}

impl Access {
    pub fn new(authorizer: Authorizer, dialer: Dialer, peers: Option<Arc<PeerDirectory>>) -> Self {
        Self {
            authorizer,
            dialer,
            peers,
        }
    }

    /// Everyone may do everything, and KV comes from wherever a `Generate` says.
    pub fn open(cluster: &str) -> Self {
        Self::new(
            Authorizer::open(cluster),
            Dialer::open(Identity::new(cluster, PeerRole::Worker)),
            None,
        )
    }

    pub(crate) fn check<T>(&self, request: &Request<T>, call: Call) -> Result<(), Status> {
        self.authorizer
            .require(request, call.name(), call.allowed())
    }

    /// A `Generate` may pull KV only from a live worker of this cluster. Without a registry
    /// there is no way to tell, so a secured worker refuses every source and an open one
    /// (the local mode) takes any. `worker_id` (empty from older gateways) names the worker
    /// that must be registered at `address`.
    pub(crate) async fn check_kv_source(
        &self,
        address: &str,
        worker_id: &str,
    ) -> Result<(), Status> {
        let worker = match worker_id {
            "" => None,
            id => Some(WorkerId::new(id).map_err(|e| {
                ErrorCode::InvalidRequest.status(format!("kv_source.worker_id: {e}"))
            })?),
        };
        let allowed = match &self.peers {
            Some(peers) => peers.is_worker(worker.as_ref(), address).await,
            None => self.authorizer.is_open(),
        };
        if allowed {
            Ok(())
        } else {
            tracing::warn!(
                address,
                "refused a kv_source that is not a registered worker of this cluster"
            );
            Err(ErrorCode::PermissionDenied
                .status("kv_source.address is not a registered worker of this cluster"))
        }
    }
}
