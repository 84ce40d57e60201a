//! How many worker streams the gateway opens at once, and how far its subscription to the
//! fleet has come.
//!
//! A starting gateway follows every registered worker at once: two streams each (KV events with
//! a snapshot, load reports). Opened all together, 1,000 workers meant 2,000 connection and
//! snapshot requests in flight on a busy machine; those that missed their 2 s connect or open
//! window were abandoned and retried, redoing the work they had cost, and a gateway took minutes
//! to follow every worker (`docs/scaling.md`). So each stream's open — from the request to its
//! first message — holds one of `subscribe_concurrency` permits, and gives it back at the latest
//! after `unresponsive_after`, so a frozen worker delays the others by that much at most.
//!
//! A worker counts as subscribed once its first snapshot is in the index and its first load
//! report arrived: `/admin/subscriptions` and `switchyard_workers_subscribed` show the progress.
//! Until then it is routed on load alone (it holds no blocks in the index).

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;
use tokio::sync::{Semaphore, SemaphorePermit};

/// Stream opens a gateway runs at once unless configured (`subscribe_concurrency`).
pub const DEFAULT_CONCURRENCY: usize = 64;

/// The gateway's stream opens in flight and its subscribed workers.
#[derive(Debug)]
pub struct Subscriptions {
    permits: Semaphore,
    concurrency: usize,
    opening: AtomicUsize,
    /// The most opens seen in flight at once (the bound's evidence, for tests and operators).
    peak: AtomicUsize,
    subscribed: AtomicUsize,
    opening_gauge: Gauge,
    subscribed_gauge: Gauge,
}

/// One stream open in flight; dropping it frees its permit.
#[derive(Debug)]
pub struct Opening<'a> {
    _permit: Option<SemaphorePermit<'a>>,
    owner: &'a Subscriptions,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        self.owner.opening.fetch_sub(1, Ordering::Relaxed);
        self.owner.opening_gauge.dec();
    }
}

/// Which of a worker's two streams has delivered its first message.
#[derive(Debug, Clone, Copy)]
pub enum Stream {
    /// The KV event stream: its snapshot (or first event) is applied.
    Events = 1,
    /// The load stream: its first report arrived.
    Load = 2,
}

const BOTH: u8 = Stream::Events as u8 | Stream::Load as u8;
const GONE: u8 = 4;

/// A worker's progress: which streams have delivered, and whether it left.
#[derive(Debug, Default)]
pub struct WorkerSubscription(AtomicU8);

impl WorkerSubscription {
    pub fn is_subscribed(&self) -> bool {
        self.0.load(Ordering::Relaxed) & BOTH == BOTH
    }
}

/// What `/admin/subscriptions` answers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SubscriptionProgress {
    /// Workers the gateway follows.
    pub workers: usize,
    /// Of them, those whose snapshot and first load report are in.
    pub subscribed: usize,
    /// Stream opens in flight now, at most `concurrency`.
    pub opening: usize,
    pub peak_opening: usize,
    pub concurrency: usize,
}

impl Subscriptions {
    /// `concurrency` is at least 1 (the config refuses 0).
    pub fn new(concurrency: usize, opening_gauge: Gauge, subscribed_gauge: Gauge) -> Self {
        let concurrency = concurrency.max(1);
        Self {
            permits: Semaphore::new(concurrency),
            concurrency,
            opening: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            subscribed: AtomicUsize::new(0),
            opening_gauge,
            subscribed_gauge,
        }
    }

    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Waits for a permit to open a stream.
    pub async fn open(&self) -> Opening<'_> {
        // Acquiring fails only on a closed semaphore, and this one is never closed; were it
        // ever, the open would go ahead unbounded rather than never.
        let permit = self.permits.acquire().await.ok();
        let now = self.opening.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.opening_gauge.inc();
        Opening {
            _permit: permit,
            owner: self,
        }
    }

    /// `stream` of `worker` delivered its first message.
    pub fn delivered(&self, worker: &WorkerSubscription, stream: Stream) {
        let bit = stream as u8;
        if worker.0.load(Ordering::Relaxed) & bit != 0 {
            return;
        }
        let before = worker.0.fetch_or(bit, Ordering::Relaxed);
        if before & GONE == 0 && before & BOTH != BOTH && (before | bit) & BOTH == BOTH {
            self.subscribed.fetch_add(1, Ordering::Relaxed);
            self.subscribed_gauge.inc();
        }
    }

    /// `worker` left: it no longer counts.
    pub fn left(&self, worker: &WorkerSubscription) {
        let before = worker.0.fetch_or(GONE, Ordering::Relaxed);
        if before & GONE == 0 && before & BOTH == BOTH {
            self.subscribed.fetch_sub(1, Ordering::Relaxed);
            self.subscribed_gauge.dec();
        }
    }

    pub fn progress(&self, workers: usize) -> SubscriptionProgress {
        SubscriptionProgress {
            workers,
            subscribed: self.subscribed.load(Ordering::Relaxed),
            opening: self.opening.load(Ordering::Relaxed),
            peak_opening: self.peak.load(Ordering::Relaxed),
            concurrency: self.concurrency,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_beyond_the_bound_wait_for_a_permit() {
        let subs = Subscriptions::new(2, Gauge::default(), Gauge::default());
        let a = subs.open().await;
        let _b = subs.open().await;
        let third = tokio::time::timeout(std::time::Duration::from_millis(50), subs.open()).await;
        assert!(third.is_err(), "a third open waits while two are in flight");
        drop(a);
        let _c = subs.open().await;
        let progress = subs.progress(3);
        assert_eq!((progress.opening, progress.peak_opening), (2, 2));
    }

    #[test]
    fn a_worker_counts_once_both_streams_delivered_and_not_after_it_left() {
        let gauge = Gauge::default();
        let subs = Subscriptions::new(4, Gauge::default(), gauge.clone());
        let (w, v) = (WorkerSubscription::default(), WorkerSubscription::default());
        subs.delivered(&w, Stream::Events);
        assert_eq!(subs.progress(2).subscribed, 0, "load not in yet");
        subs.delivered(&w, Stream::Load);
        subs.delivered(&w, Stream::Events);
        assert!(w.is_subscribed());
        assert_eq!((subs.progress(2).subscribed, gauge.get()), (1, 1));
        subs.left(&w);
        subs.left(&w);
        assert_eq!((subs.progress(1).subscribed, gauge.get()), (0, 0));
        // A worker that leaves before it is whole never counts.
        subs.delivered(&v, Stream::Load);
        subs.left(&v);
        subs.delivered(&v, Stream::Events);
        assert_eq!(subs.progress(0).subscribed, 0);
    }
}
