//! Gateway replicas that serve as one: a session's turns are served by the replica that owns
//! the session, whichever replica the client (or the Service in front) reached.
//!
//! Each replica announces itself in the registry under a lease ([`Replicas`]) and lists the
//! live replicas every `refresh_ms`. [`owner`] picks a session's owner by rendezvous hashing
//! over that list, so every replica agrees and a replica joining or leaving moves only its
//! share of the sessions. [`crate::api::forward`] is the `/v1` middleware that sends a turn whose owner is
//! another replica there (once: the forwarded request carries [`FORWARDED_HEADER`], with the
//! cluster secret's credential when the cluster has one, and is served where it lands), and
//! serves it here when the owner cannot be reached. Serving a session in one place keeps its
//! incremental tokenization and its worker affinity, both of which live in the replica.
//! [`config`] is `[fleet]`.

pub mod config;
pub mod owner;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;
use switchyard_registry::{ReplicaInfo, Replicas};
use switchyard_security::{ClusterSecret, Identity, PeerRole};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{FleetArgs, FleetConfig};

use crate::gateway_error::GatewayError;
pub use crate::observe::fleet_metrics::{FleetMetrics, ForwardLabels};

/// The header a forwarded turn carries: the cluster credential of the forwarding gateway
/// (or `open` in a cluster without a secret). A request that has it is never forwarded again.
pub const FORWARDED_HEADER: &str = "x-switchyard-forwarded";

/// This replica's view of the fleet.
#[derive(Debug)]
pub struct Fleet {
    me: ReplicaInfo,
    live: RwLock<Arc<Vec<ReplicaInfo>>>,
    pub(crate) client: reqwest::Client,
    /// Proves forwarded turns come from a member, and checks those that arrive.
    secret: Option<ClusterSecret>,
    identity: Identity,
    pub(crate) metrics: Arc<crate::observe::metrics::Metrics>,
    pub(crate) body_limit: usize,
}

impl Fleet {
    /// Announces `me` in `replicas`, lists the live replicas, and keeps both up to date on
    /// `tasks` until `shutdown`, when the announcement is withdrawn.
    #[allow(clippy::too_many_arguments)]
    pub async fn join(
        config: &FleetConfig,
        me: ReplicaInfo,
        replicas: Arc<dyn Replicas>,
        secret: Option<ClusterSecret>,
        cluster: &str,
        metrics: Arc<crate::observe::metrics::Metrics>,
        body_limit: usize,
        tasks: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, GatewayError> {
        let fleet_error = |e: String| GatewayError::Fleet(e);
        let announcement = replicas
            .announce(me.clone(), Duration::from_secs(config.lease_ttl_secs))
            .await
            .map_err(|e| fleet_error(format!("cannot announce replica {}: {e}", me.id)))?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .build()
            .map_err(|e| fleet_error(format!("cannot build the forwarding client: {e}")))?;
        let fleet = Arc::new(Self {
            live: RwLock::new(Arc::new(vec![me.clone()])),
            me,
            client,
            secret,
            identity: Identity::new(cluster, PeerRole::Gateway),
            metrics,
            body_limit,
        });
        fleet.refresh(replicas.as_ref()).await;
        let every = Duration::from_millis(config.refresh_ms);
        let task_fleet = Arc::clone(&fleet);
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(every) => task_fleet.refresh(replicas.as_ref()).await,
                }
            }
            // Leave first thing on shutdown, so the others stop forwarding here.
            announcement.leave().await;
        });
        tracing::info!(replica = %fleet.me.id, address = %fleet.me.address, "sharing sessions with the gateway replicas");
        Ok(fleet)
    }

    /// Replaces the view with the registry's list (this replica always in it: it serves even
    /// while its entry is being announced again). A registry that cannot be read leaves the
    /// view as it was.
    async fn refresh(&self, replicas: &dyn Replicas) {
        match replicas.list_replicas().await {
            Ok(mut listed) => {
                if !listed.iter().any(|r| r.id == self.me.id) {
                    listed.push(self.me.clone());
                }
                self.metrics.fleet.replicas.set(listed.len() as i64);
                *self.live.write() = Arc::new(listed);
            }
            Err(error) => {
                tracing::warn!(%error, "cannot list the gateway replicas; keeping the last list")
            }
        }
    }

    /// The replica that owns `session`, unless it is this one.
    pub fn other_owner(&self, session: &str) -> Option<ReplicaInfo> {
        let live = Arc::clone(&self.live.read());
        owner::owner(session, &live)
            .filter(|owner| owner.id != self.me.id)
            .cloned()
    }

    /// Drops `replica` from the view until the next refresh lists it again, so turns stop
    /// waiting on an owner that does not answer.
    pub(crate) fn set_aside(&self, replica: &ReplicaInfo) {
        let mut live = self.live.write();
        let kept: Vec<ReplicaInfo> = live
            .iter()
            .filter(|r| r.id != replica.id)
            .cloned()
            .collect();
        *live = Arc::new(kept);
    }

    /// The value of [`FORWARDED_HEADER`] on a turn this replica forwards.
    pub(crate) fn credential(&self) -> String {
        match &self.secret {
            Some(secret) => secret.credential(&self.identity, SystemTime::now()),
            None => "open".to_owned(),
        }
    }

    /// Whether a forwarded turn comes from a member of the cluster.
    pub(crate) fn accepts(&self, credential: &str) -> bool {
        match &self.secret {
            Some(secret) => matches!(
                secret.check_credential(&self.identity.cluster, credential, SystemTime::now()),
                Ok(PeerRole::Gateway)
            ),
            None => true,
        }
    }

    pub fn me(&self) -> &ReplicaInfo {
        &self.me
    }
}
