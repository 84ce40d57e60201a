//! What every handler is given: the gateway's shared state, the tenant an API key names, and
//! what other roles embedded in the same process add to the listener.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use tokio_util::task::TaskTracker;

use crate::access::admission::Admission;
use crate::access::listener::ClientAccess;
use crate::cluster::pool::WorkerPool;
use crate::cluster::pool::followers::Followers;
use crate::config::GatewayConfig;
use crate::observe::Observers;
use crate::serving::preprocess::Tokenizers;

/// Everything a handler needs.
#[derive(Debug)]
pub struct AppState {
    pub config: GatewayConfig,
    /// The workers and each model's routing state.
    pub pool: Arc<WorkerPool>,
    /// What follows the pool's workers; [`Followers::shutdown`] stops the gateway's tasks.
    pub followers: Arc<Followers>,
    /// The metrics, the decision log, the recorder and the audit's settings.
    pub observers: Arc<Observers>,
    /// Owns the gateway's tasks (dispatches, recordings, the followers): shut down with the
    /// followers.
    pub tasks: TaskTracker,
    /// How dispatch calls the workers (gRPC; tests script it).
    pub transport: Arc<dyn crate::serving::transport::WorkerTransport>,
    pub tokenizers: Tokenizers,
    pub admission: Admission,
    /// Fleet-wide per-tenant quotas, checked before admission.
    pub quota: Arc<crate::access::quota::Quotas>,
    pub extensions: Extensions,
    /// API keys, the metrics token, HTTPS.
    pub access: ClientAccess,
    /// Sessions' think times, for the retention hints of their turns.
    pub retention: Arc<crate::serving::retention::SessionRetention>,
    /// Session scheduling: holds a session's turn while its working set does not fit.
    pub sessions: Arc<crate::serving::sessions::SessionSchedule>,
    /// Stored responses and the reasoning sealer (`/v1/responses`).
    pub responses: Arc<super::responses::store::ResponsesState>,
}

/// The tenant of the API key a `/v1` request was let in with.
#[derive(Debug, Clone)]
pub struct ApiTenant(pub String);

/// A text exposition of metrics another role exports (OpenMetrics, ending in `# EOF`).
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// What other roles embedded in the same process serve on the gateway's listener.
#[derive(Clone, Default)]
pub struct Extensions {
    /// Routers mounted under `/admin/<path>`, behind the admin token like the gateway's own.
    pub admin: Vec<(&'static str, Router)>,
    /// Metrics appended to `/metrics`.
    pub metrics: Vec<MetricsSource>,
    /// Where this gateway announces itself and finds the other replicas, to share sessions
    /// (`[fleet]`): the registry its workers are in.
    pub replicas: Option<Arc<dyn switchyard_registry::Replicas>>,
}

impl std::fmt::Debug for Extensions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extensions")
            .field(
                "admin",
                &self.admin.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("metrics", &self.metrics.len())
            .field("replicas", &self.replicas.is_some())
            .finish()
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
