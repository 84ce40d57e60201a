//! The agent's mutable state shared by the gRPC service and the lifecycle: role, draining, the
//! count of requests in flight and the prompt tokens they still have to prefill, and a signal
//! that the load changed (a request taken, its first token, its end, role or drain), which
//! load-report streams push on.
//!
//! The queued prefill tokens are the agent's own count, for engines that publish no such figure
//! (vLLM, SGLang and TensorRT-LLM report waiting and running requests, not tokens): each request
//! the engine takes adds the prompt tokens it has to compute (its prompt past the leading blocks
//! the worker's KV events say the engine holds), and its first token, or its end, takes them
//! off. The router's cost model prices a worker's queue in these tokens, and with several
//! gateways in front of one worker only the worker sees all of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use switchyard_core::{LoadStats, Role};
use tokio::sync::{Notify, watch};

use crate::engine::Engine;

/// Shared worker state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WorkerState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    role_tx: watch::Sender<Role>,
    draining: AtomicBool,
    in_flight: AtomicU64,
    /// Prompt tokens of requests in flight not yet prefilled ([`InFlightGuard::queue_prefill`]).
    queued_prefill_tokens: AtomicU64,
    idle: Notify,
    /// Bumped on every load change; load-report streams that push on change watch it.
    load_changes: watch::Sender<u64>,
}

impl WorkerState {
    pub fn new(role: Role) -> Self {
        let (role_tx, _) = watch::channel(role);
        Self {
            inner: Arc::new(Inner {
                role_tx,
                draining: AtomicBool::new(false),
                in_flight: AtomicU64::new(0),
                queued_prefill_tokens: AtomicU64::new(0),
                idle: Notify::new(),
                load_changes: watch::channel(0).0,
            }),
        }
    }

    pub fn role(&self) -> Role {
        *self.inner.role_tx.borrow()
    }

    /// Changes the role; watchers (the registry updater) see it.
    pub fn set_role(&self, role: Role) {
        self.inner.role_tx.send_replace(role);
        self.load_changed();
    }

    pub fn watch_role(&self) -> watch::Receiver<Role> {
        self.inner.role_tx.subscribe()
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    pub fn set_draining(&self, draining: bool) {
        self.inner.draining.store(draining, Ordering::SeqCst);
        self.load_changed();
    }

    /// Tells the load-report streams that push on change that the load moved.
    pub fn load_changed(&self) {
        self.inner
            .load_changes
            .send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Sees every [`Self::load_changed`] from now on.
    pub fn watch_load(&self) -> watch::Receiver<u64> {
        self.inner.load_changes.subscribe()
    }

    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Prompt tokens the requests in flight still have to prefill (see the module docs).
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.inner.queued_prefill_tokens.load(Ordering::SeqCst)
    }

    /// Counts a request as in flight until the returned guard drops.
    pub fn begin_request(&self) -> InFlightGuard {
        self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
        self.load_changed();
        InFlightGuard {
            state: self.clone(),
            queued: AtomicU64::new(0),
        }
    }

    /// Waits until no request is in flight, at most `timeout`. Returns whether it got there.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.idle.notified();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }
}

/// The load the worker reports: the engine's, with the worker's own count of queued prefill
/// tokens where the engine has none ([`Engine::reports_queued_prefill`]).
pub fn worker_load(engine: &dyn Engine, state: &WorkerState) -> LoadStats {
    let mut load = engine.load();
    if !engine.reports_queued_prefill() {
        load.queued_prefill_tokens = state.queued_prefill_tokens();
    }
    load
}

/// Marks one request in flight; dropping it ends the request.
#[derive(Debug)]
pub struct InFlightGuard {
    state: WorkerState,
    /// Its prompt tokens still counted in the worker's queued prefill tokens.
    queued: AtomicU64,
}

impl InFlightGuard {
    /// The request has `tokens` prompt tokens to prefill: they count in the worker's queue
    /// until its first token (or its end). Replaces what it counted before.
    pub fn queue_prefill(&self, tokens: u64) {
        let before = self.queued.swap(tokens, Ordering::SeqCst);
        self.state
            .inner
            .queued_prefill_tokens
            .fetch_add(tokens, Ordering::SeqCst);
        self.unqueue(before);
        self.state.load_changed();
    }

    /// The request's prefill is done (its first token came): its prompt left the queue.
    pub fn prefill_done(&self) {
        self.unqueue(self.queued.swap(0, Ordering::SeqCst));
        self.state.load_changed();
    }

    fn unqueue(&self, tokens: u64) {
        if tokens > 0 {
            self.state
                .inner
                .queued_prefill_tokens
                .fetch_sub(tokens, Ordering::SeqCst);
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.unqueue(self.queued.swap(0, Ordering::SeqCst));
        if self.state.inner.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.state.inner.idle.notify_waiters();
        }
        self.state.load_changed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn wait_idle_returns_when_the_last_request_ends() {
        let state = WorkerState::new(Role::Both);
        let guard = state.begin_request();
        let waiter = tokio::spawn({
            let state = state.clone();
            async move { state.wait_idle(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        drop(guard);
        assert!(waiter.await.unwrap());
    }

    #[test]
    fn every_load_change_is_signalled() {
        let state = WorkerState::new(Role::Both);
        let mut changes = state.watch_load();
        let mut expect_change = |what: &str| {
            assert!(changes.has_changed().unwrap(), "{what} was not signalled");
            changes.mark_unchanged();
        };
        let guard = state.begin_request();
        expect_change("a request taken");
        guard.prefill_done();
        expect_change("its first token");
        drop(guard);
        expect_change("its end");
        state.set_role(Role::Prefill);
        expect_change("a role change");
        state.set_draining(true);
        expect_change("draining");
        assert!(!changes.has_changed().unwrap());
    }

    #[test]
    fn queued_prefill_tokens_last_until_the_first_token_or_the_end() {
        let state = WorkerState::new(Role::Both);
        let a = state.begin_request();
        a.queue_prefill(1_000);
        let b = state.begin_request();
        b.queue_prefill(300);
        assert_eq!(state.queued_prefill_tokens(), 1_300);
        // Re-counted (the engine found more of the prompt cached): replaced, not added.
        b.queue_prefill(200);
        assert_eq!(state.queued_prefill_tokens(), 1_200);
        a.prefill_done();
        assert_eq!(state.queued_prefill_tokens(), 200);
        // A second first token, or the end after it, takes nothing more off.
        a.prefill_done();
        drop(a);
        assert_eq!(state.queued_prefill_tokens(), 200);
        // A request ending before its first token (cancelled, failed) leaves the queue too.
        drop(b);
        assert_eq!(state.queued_prefill_tokens(), 0);
        assert_eq!(state.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_idle_gives_up_after_the_timeout() {
        let state = WorkerState::new(Role::Both);
        let _guard = state.begin_request();
        assert!(!state.wait_idle(Duration::from_secs(3)).await);
        assert_eq!(state.in_flight(), 1);
    }
}
