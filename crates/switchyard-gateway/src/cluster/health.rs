//! Whether a worker answers, as the gateway sees it, independent of its registry lease.
//!
//! A worker's lease outlives the worker by up to its TTL (10 s by default), and a frozen
//! worker keeps its lease until its keep-alives stop. The gateway does not wait for the
//! registry: a worker is *unresponsive* from the moment its load stream breaks or stays silent
//! for `unresponsive_after` (reports come every `load_interval_ms`) after it has reported
//! once, or a request to it fails at the transport (connection refused or reset, not an error
//! the worker sent). An
//! unresponsive worker gets no new requests (unless no worker of the model answers, when
//! routing tries them all rather than refuse), its streams in flight move to another worker at
//! once, and it is back in routing with its next load report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use switchyard_core::WorkerId;
use tokio::sync::watch;

/// A worker's liveness: answering, or not since some moment and for some reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    Answering,
    Unresponsive { reason: String, since: Instant },
}

impl Liveness {
    pub fn is_answering(&self) -> bool {
        matches!(self, Liveness::Answering)
    }
}

/// The liveness of one worker, shared by its subscriber, dispatch and routing.
#[derive(Debug)]
pub struct Health {
    state: watch::Sender<Liveness>,
    /// Whether `state` is [`Liveness::Answering`], written with it: routing reads it for every
    /// candidate of every request, and a flag is read without the watch's lock (whose counter
    /// the cores deciding at once would pass between them).
    answering: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// A worker just registered is presumed answering until shown otherwise.
    pub fn new() -> Self {
        Self {
            state: watch::Sender::new(Liveness::Answering),
            answering: AtomicBool::new(true),
        }
    }

    pub fn is_answering(&self) -> bool {
        self.answering.load(Ordering::Acquire)
    }

    pub fn liveness(&self) -> Liveness {
        self.state.borrow().clone()
    }

    /// The worker answered (a load report arrived). Whether that changed anything.
    pub fn answered(&self, worker: &WorkerId) -> bool {
        let changed = self.state.send_if_modified(|state| {
            if state.is_answering() {
                return false;
            }
            *state = Liveness::Answering;
            self.answering.store(true, Ordering::Release);
            true
        });
        if changed {
            tracing::info!(worker = %worker, "worker answers again; back in routing");
        }
        changed
    }

    /// The worker stopped answering for `reason`. Whether that changed anything (a worker
    /// already unresponsive keeps its first reason and time).
    pub fn failed(&self, worker: &WorkerId, reason: impl Into<String>) -> bool {
        let mut reason = Some(reason.into());
        let changed = self.state.send_if_modified(|state| {
            if !state.is_answering() {
                return false;
            }
            *state = Liveness::Unresponsive {
                reason: reason.take().unwrap_or_default(),
                since: Instant::now(),
            };
            self.answering.store(false, Ordering::Release);
            true
        });
        if changed && let Liveness::Unresponsive { reason, .. } = &*self.state.borrow() {
            tracing::warn!(worker = %worker, %reason, "worker stopped answering; out of routing until it answers again");
        }
        changed
    }

    /// Follows changes (dispatch watches the worker of each stream in flight).
    pub fn subscribe(&self) -> watch::Receiver<Liveness> {
        self.state.subscribe()
    }
}

/// Whether a failed gRPC call failed in the transport (the worker could not be reached, or its
/// connection broke) rather than with a status the worker sent. tonic attaches the transport's
/// error as the source of the statuses it makes itself; a status read from the wire has none.
pub fn is_transport_failure(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn liveness_changes_once_per_transition_and_wakes_watchers() {
        let id = WorkerId::new("w").unwrap_or_else(|e| panic!("{e}"));
        let health = Health::new();
        assert!(health.is_answering());
        let mut watcher = health.subscribe();
        assert!(!health.answered(&id), "already answering");
        assert!(health.failed(&id, "load stream ended"));
        assert!(
            !health.failed(&id, "a second reason"),
            "the first reason stays"
        );
        assert!(watcher.has_changed().unwrap_or(false));
        let seen = watcher.borrow_and_update().clone();
        assert!(
            matches!(seen, Liveness::Unresponsive { ref reason, .. } if reason == "load stream ended")
        );
        assert!(!health.is_answering());
        assert!(health.answered(&id));
        assert!(health.is_answering());
        assert!(watcher.has_changed().unwrap_or(false));
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_transport_failure() {
        use switchyard_proto::v1::InfoRequest;
        use switchyard_proto::v1::worker_client::WorkerClient;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        drop(listener);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap_or_else(|e| panic!("{e}"))
            .connect_lazy();
        let status = WorkerClient::new(channel)
            .info(InfoRequest {})
            .await
            .expect_err("nothing listens there");
        assert!(is_transport_failure(&status), "{status:?}");
    }

    #[test]
    fn statuses_from_the_wire_are_not_transport_failures() {
        assert!(!is_transport_failure(&tonic::Status::unavailable(
            "the worker is draining"
        )));
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(is_transport_failure(&tonic::Status::from_error(Box::new(
            io
        ))));
    }
}
