//! What the pool's follower tasks are given besides the pool itself: the observers they write
//! to (metrics, the recorder), the intervals they keep, the workers' connections, the bound on
//! stream opens, and the token and tracker that own them. The KV-event and load
//! followers ([`super::subscriber`], [`super::plane`]) and the KV checks
//! ([`super::kv_checks`]) take (`&WorkerPool`, `&FollowContext`); [`super::followers`] starts
//! and stops them.

use std::sync::Arc;
use std::time::Duration;

use switchyard_security::{Dialer, Identity, PeerRole};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::connections::WorkerConnections;
use super::subscriptions::{self, Subscriptions};
use crate::observe::Observers;
use crate::observe::metrics::Metrics;
use crate::observe::recorder::Recorder;

/// A worker reports its load at least every `load_interval_ms`; four heartbeats missed (and
/// at least 2 s, well above a busy runtime's hiccup) make it unresponsive. A worker that
/// crashes or drops its connection is out at once (its stream breaks); this bound is for one
/// that hangs with its connection open.
pub fn default_unresponsive_after(load_interval_ms: u32) -> Duration {
    Duration::from_millis(u64::from(load_interval_ms) * 4).max(Duration::from_secs(2))
}

/// The context of the pool's follower tasks.
#[derive(Debug)]
pub struct FollowContext {
    pub metrics: Arc<Metrics>,
    /// Records the router's inputs (KV events, load reports, workers joining and leaving)
    /// while a recording runs; a new recording asks every follower for a fresh snapshot.
    pub recorder: Arc<Recorder>,
    /// How often each worker sends a digest of its blocks (the KV audit; 0: never).
    pub digest_interval_ms: u32,
    /// A worker owing KV events this long is reported silent (the KV audit).
    pub kv_silence_after: Duration,
    pub load_interval_ms: u32,
    /// Asks workers to push a report this long after their load changes (0: interval only).
    pub load_push_min_ms: u32,
    /// A worker whose load reports stop for this long is unresponsive ([`crate::cluster::health`]).
    pub unresponsive_after: Duration,
    /// The workers' gRPC clients by id, dialed plain or with mTLS and the gateway's credential;
    /// the request path's transport calls through the same clients.
    pub connections: Arc<WorkerConnections>,
    /// Bounds the worker streams opening at once; counts the workers followed in full.
    pub subscriptions: Subscriptions,
    /// Cancels every follower (each worker's own token is a child of it); the gateway's other
    /// tasks stop with it.
    pub cancel: CancellationToken,
    /// Owns every follower task, and the gateway's other tasks (dispatches, recordings).
    pub tasks: TaskTracker,
}

impl FollowContext {
    /// Followers writing to `observers`, asking for load reports every `load_interval_ms`;
    /// the other settings at their defaults (the `with_` methods change them).
    pub fn new(observers: &Observers, load_interval_ms: u32) -> Self {
        let metrics = Arc::clone(&observers.metrics);
        Self {
            recorder: Arc::clone(&observers.recorder),
            digest_interval_ms: observers.audit.digest_interval_ms,
            kv_silence_after: observers.audit.kv_silence_after(),
            load_interval_ms,
            load_push_min_ms: 0,
            unresponsive_after: default_unresponsive_after(load_interval_ms),
            connections: Arc::new(WorkerConnections::new(Dialer::open(Identity::new(
                "default",
                PeerRole::Gateway,
            )))),
            subscriptions: Subscriptions::new(
                subscriptions::DEFAULT_CONCURRENCY,
                metrics.subscriptions_opening.clone(),
                metrics.workers_subscribed.clone(),
            ),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            metrics,
        }
    }

    /// The same context, dialing workers with `dialer` (before any worker is connected).
    pub fn with_dialer(mut self, dialer: Dialer) -> Self {
        self.connections = Arc::new(WorkerConnections::new(dialer));
        self
    }

    /// The same context, calling a worker unresponsive after `after` without a load report.
    pub fn with_unresponsive_after(mut self, after: Duration) -> Self {
        self.unresponsive_after = after;
        self
    }

    /// The same context, asking workers to push a load report `ms` after their load changes,
    /// at most one per `ms` (0: reports on the interval only).
    pub fn with_load_push(mut self, ms: u32) -> Self {
        self.load_push_min_ms = ms;
        self
    }

    /// The same context, opening at most `concurrency` worker streams at once (at least 1).
    pub fn with_subscribe_concurrency(mut self, concurrency: usize) -> Self {
        self.subscriptions = Subscriptions::new(
            concurrency,
            self.metrics.subscriptions_opening.clone(),
            self.metrics.workers_subscribed.clone(),
        );
        self
    }
}
