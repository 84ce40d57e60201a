//! The bodies the server wraps around each request and response: a request body with a
//! deadline ([`DeadlineBody`], failing with [`BodyTimeout`]) and a response body that keeps its
//! request counted as in flight until it is finished ([`HeldBody`], for the idle timeout).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// Requests in flight on one connection and since when it has had none.
#[derive(Debug)]
pub(super) struct Activity {
    started: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `started` when the last request finished (or the connection opened).
    idle_since_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            started: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// How long the connection has had no request in flight (zero while it has one).
    pub(super) fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        let since = self.idle_since_ms.load(Ordering::Acquire);
        Duration::from_millis(self.now_ms().saturating_sub(since))
    }
}

/// One request in flight, from its headers until its response body is done or dropped.
#[derive(Debug)]
pub(super) struct InFlight(Arc<Activity>);

impl InFlight {
    pub(super) fn start(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        activity
            .idle_since_ms
            .store(activity.now_ms(), Ordering::Release);
        activity.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until it is finished.
#[derive(Debug)]
pub(super) struct HeldBody<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B> HeldBody<B> {
    pub(super) fn new(inner: B, in_flight: InFlight) -> Self {
        Self {
            inner,
            _in_flight: in_flight,
        }
    }
}

impl<B: HttpBody + Unpin> HttpBody for HeldBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request body took longer than the body timeout to arrive.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the request body did not arrive within {0} s")]
pub struct BodyTimeout(pub u64);

impl BodyTimeout {
    /// The body timeout behind a body-reading error, if that is what it was.
    pub fn find(err: &(dyn std::error::Error + 'static)) -> Option<BodyTimeout> {
        let mut current = Some(err);
        while let Some(err) = current {
            if let Some(timeout) = err.downcast_ref::<BodyTimeout>() {
                return Some(*timeout);
            }
            current = err.source();
        }
        None
    }
}

/// A request body that fails with [`BodyTimeout`] unless it has all arrived by `deadline`.
#[derive(Debug)]
pub(super) struct DeadlineBody<B> {
    inner: B,
    deadline: Instant,
    /// Made on the first poll of a body that is not already complete.
    sleep: Option<Pin<Box<Sleep>>>,
    secs: u64,
}

impl<B> DeadlineBody<B> {
    pub(super) fn new(inner: B, deadline: Instant) -> Self {
        let secs = deadline
            .saturating_duration_since(Instant::now())
            .as_secs_f64()
            .round() as u64;
        Self {
            inner,
            deadline,
            sleep: None,
            secs,
        }
    }
}

impl<B> HttpBody for DeadlineBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(this.secs))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
