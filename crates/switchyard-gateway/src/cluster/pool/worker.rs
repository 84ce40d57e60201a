//! A worker as the gateway sees it: its registration and what the gateway learned of it
//! (draining, answering, its KV audit, how far its subscription came). Its gRPC client is
//! kept apart, by worker id ([`super::connections`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use switchyard_core::{WorkerId, WorkerInfo};
use tokio_util::sync::CancellationToken;

use super::subscriptions;
use crate::cluster::health::Health;
use crate::observe::audit::KvAudit;
use crate::observe::metrics::{Metrics, WorkerLabels};

/// A worker as the gateway sees it.
#[derive(Debug)]
pub struct WorkerHandle {
    pub info: RwLock<WorkerInfo>,
    /// Set from the worker's load reports ([`WorkerHandle::set_draining`]); a draining worker
    /// gets no new requests.
    pub(super) draining: AtomicBool,
    /// The pool's count of changes to whether a worker takes requests (draining, answering),
    /// bumped by this worker's ([`super::WorkerPool::routing_epoch`]).
    pub(super) routing_epoch: Arc<AtomicU64>,
    /// Whether it answers, whatever its lease says ([`crate::cluster::health`]).
    pub health: Health,
    /// Cancels this worker's subscriber tasks.
    pub cancel: CancellationToken,
    /// Whether its KV events arrive and agree with its own view ([`crate::observe::audit::kv`]).
    pub kv: KvAudit,
    /// Whether its snapshot and first load report are in ([`subscriptions`]).
    pub subscription: subscriptions::WorkerSubscription,
}

impl WorkerHandle {
    pub fn info(&self) -> WorkerInfo {
        self.info.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn id(&self) -> WorkerId {
        self.info
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .id
            .clone()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The worker drains (takes no new requests) or no longer does.
    pub fn set_draining(&self, draining: bool) {
        if self.draining.swap(draining, Ordering::Relaxed) != draining {
            self.routable_changed();
        }
    }

    /// Whether it takes requests changed: member lists that found every member open look again.
    fn routable_changed(&self) {
        self.routing_epoch.fetch_add(1, Ordering::Release);
    }

    /// The worker stopped answering (a transport failure, its load stream broke or went
    /// silent): out of routing until it answers again; counted in `metrics`.
    pub fn mark_failed(&self, metrics: &Metrics, reason: impl Into<String>) {
        let id = self.id();
        if self.health.failed(&id, reason) {
            self.routable_changed();
            metrics.unresponsive_transitions.inc();
            metrics
                .worker_unresponsive
                .get_or_create(&WorkerLabels {
                    worker: id.to_string(),
                })
                .set(1);
        }
    }

    /// The worker answered (a load report arrived): back in routing if it was out.
    pub fn mark_answered(&self, metrics: &Metrics) {
        // Every load report lands here: the usual case (it was answering) costs one read.
        if self.health.is_answering() {
            return;
        }
        let id = self.id();
        if self.health.answered(&id) {
            self.routable_changed();
            metrics
                .worker_unresponsive
                .get_or_create(&WorkerLabels {
                    worker: id.to_string(),
                })
                .set(0);
        }
    }
}
