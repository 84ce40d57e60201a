//! Starting and stopping the follower tasks of the pool's workers as the registry reports them:
//! a worker that joins is connected ([`super::connections`]), added to the [`WorkerPool`] and
//! gets its KV-event follower (a gRPC
//! stream, [`super::subscriber`], or the event plane, [`super::plane`], fed by its model's one
//! consumer, [`super::plane_feed`]) and its load follower;
//! one that leaves is taken out, its tasks cancelled, its connection dropped and its blocks and
//! load dropped at once.
//! What changes is counted in the metrics and written to the recorder of the
//! [`FollowContext`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};

use switchyard_core::{WorkerId, WorkerInfo};

use super::follow::FollowContext;
use super::plane;
use super::plane_feed::PlaneHandle;
use super::subscriptions::{SubscriptionProgress, WorkerSubscription};
use super::{ModelRoutes, WorkerHandle, WorkerPool, kv_checks, subscriber};
use crate::cluster::health::Health;
use crate::observe::audit::KvAudit;
use crate::observe::recorder::Record;

/// The pool with what follows its workers.
#[derive(Debug)]
pub struct Followers {
    pool: Arc<WorkerPool>,
    context: Arc<FollowContext>,
    /// KV events are read from this event plane instead of a gRPC stream per worker.
    event_plane: Option<Arc<PlaneHandle>>,
}

impl Followers {
    pub fn new(pool: Arc<WorkerPool>, context: Arc<FollowContext>) -> Self {
        Self {
            pool,
            context,
            event_plane: None,
        }
    }

    /// The same followers, reading KV events from the event plane (`plane`) instead of a gRPC
    /// stream per worker.
    pub fn with_event_plane(mut self, plane: Option<Arc<PlaneHandle>>) -> Self {
        self.event_plane = plane;
        self
    }

    pub fn pool(&self) -> &Arc<WorkerPool> {
        &self.pool
    }

    pub fn context(&self) -> &Arc<FollowContext> {
        &self.context
    }

    /// Starts the periodic check for workers whose KV events stopped
    /// ([`kv_checks::watch_silence`]).
    pub fn watch_kv_silence(&self) {
        self.context.tasks.spawn(kv_checks::watch_silence(
            Arc::clone(&self.pool),
            Arc::clone(&self.context),
        ));
    }

    /// How far the gateway has come in following every worker it knows.
    pub fn subscription_progress(&self) -> SubscriptionProgress {
        self.context
            .subscriptions
            .progress(self.pool.worker_count())
    }

    fn set_refused(&self, id: &WorkerId, reason: Option<String>) {
        let refused = self.pool.set_refused(id, reason);
        self.context
            .metrics
            .audit
            .workers_refused
            .set(refused as i64);
    }

    /// A worker joined (or changed): start following it.
    pub fn upsert_worker(&self, info: WorkerInfo) {
        let (pool, cx) = (&self.pool, &self.context);
        if let Some(existing) = pool.worker(&info.id) {
            let old = existing.info();
            if old.incarnation == info.incarnation && old.address == info.address {
                pool.update_worker(&existing, info);
                return;
            }
            // Restarted or moved: follow the new incarnation from scratch.
            self.remove_worker(&info.id);
        }
        let routes = match pool.routes_for(&info) {
            Ok(routes) => routes,
            Err(message) => {
                tracing::warn!(worker = %info.id, "{message}; refusing to route to the worker");
                self.set_refused(&info.id, Some(message));
                return;
            }
        };
        self.set_refused(&info.id, None);
        if let Err(err) = cx.connections.connect(&info) {
            tracing::warn!(worker = %info.id, address = %info.address, error = %err, "invalid worker address; ignoring the worker");
            return;
        }
        let handle = Arc::new(WorkerHandle {
            draining: AtomicBool::new(false),
            routing_epoch: pool.routing_epoch_counter(),
            health: Health::new(),
            cancel: cx.cancel.child_token(),
            info: RwLock::new(info.clone()),
            kv: KvAudit::default(),
            subscription: WorkerSubscription::default(),
        });
        pool.insert_worker(Arc::clone(&handle));
        cx.recorder.record(|| Record::WorkerJoined {
            tick: pool.now_tick(),
            worker: info.clone(),
        });
        cx.metrics.workers.set(pool.worker_count() as i64);
        cx.metrics
            .audit
            .worker_joined(info.id.as_str(), &info.model);
        tracing::info!(worker = %info.id, address = %info.address, model = %info.model, role = %info.role, "worker joined");
        self.spawn(handle, routes);
    }

    /// A worker left: stop following it and forget its blocks and load at once.
    pub fn remove_worker(&self, id: &WorkerId) {
        let (pool, cx) = (&self.pool, &self.context);
        self.set_refused(id, None);
        let Some(handle) = pool.take_worker(id) else {
            return;
        };
        handle.cancel.cancel();
        cx.connections.disconnect(id);
        cx.subscriptions.left(&handle.subscription);
        let model = handle.info().model;
        if let Some(routes) = pool.model(&model) {
            let mut core = routes.lock();
            core.serving.remove_worker(id);
            cx.recorder.record(|| Record::WorkerLeft {
                tick: pool.now_tick(),
                model,
                worker: id.clone(),
            });
        }
        cx.metrics.remove_worker(id.as_str());
        cx.metrics.audit.remove_worker(id.as_str());
        cx.metrics.workers.set(pool.worker_count() as i64);
        tracing::info!(worker = %id, "worker left; its blocks are dropped from the index");
    }

    /// Starts the two follower tasks of `worker`; they stop when the worker's token is
    /// cancelled. With an event plane, the KV events come from it instead of a gRPC stream.
    fn spawn(&self, worker: Arc<WorkerHandle>, routes: Arc<ModelRoutes>) {
        let (pool, cx) = (&self.pool, &self.context);
        let events: Pin<Box<dyn Future<Output = ()> + Send>> = match &self.event_plane {
            Some(handle) => {
                // Joined now, in the registry's order: the model's consumer hands over what
                // it kept of the worker's subject and every message after.
                let info = worker.info();
                let feed = handle.subscribe(cx, &routes.model, &info.id, info.incarnation);
                Box::pin(plane::follow_plane(
                    Arc::clone(pool),
                    Arc::clone(cx),
                    Arc::clone(&worker),
                    Arc::clone(&routes),
                    feed,
                ))
            }
            None => Box::pin(subscriber::follow_events(
                Arc::clone(pool),
                Arc::clone(cx),
                Arc::clone(&worker),
                Arc::clone(&routes),
            )),
        };
        let load = subscriber::follow_load(
            Arc::clone(pool),
            Arc::clone(cx),
            Arc::clone(&worker),
            routes,
        );
        let cancel = worker.cancel.clone();
        cx.tasks.spawn({
            let cancel = cancel.clone();
            async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = events => {}
                }
            }
        });
        cx.tasks.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = load => {}
            }
        });
    }

    /// Stops every follower (and every other task on the context's tracker) and ends a
    /// recording under way.
    pub async fn shutdown(&self) {
        self.context.recorder.close();
        self.context.cancel.cancel();
        self.context.tasks.close();
        self.context.tasks.wait().await;
    }
}
