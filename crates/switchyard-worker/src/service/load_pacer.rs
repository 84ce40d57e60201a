//! When a load-report stream sends a report: every interval, or, when the caller asked for
//! pushes, shortly after each load change with the interval as a heartbeat for quiet times.
//! A pushed report is followed by one settle check a little later, sent only if the load moved
//! since: the engine applies some changes after the agent saw them (an abort when the caller
//! goes away), and without the check the report would wait for the heartbeat.
//!
//! Pushing is what lets several gateway replicas see each other's routed requests within
//! milliseconds instead of one interval: each replica books only its own requests on top of a
//! report, so a burst spread over replicas could otherwise pile onto the worker that every
//! replica's last report showed idle.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, Interval, MissedTickBehavior};

/// Why a report is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Due {
    /// The interval passed (the first report, or nothing else sent for that long).
    Heartbeat,
    /// The load changed.
    Push,
    /// A while after a push: send only if the load differs from the pushed report.
    Settle,
}

/// Paces one load-report stream.
pub(super) struct LoadPacer {
    heartbeat: Interval,
    push: Option<Push>,
}

struct Push {
    /// A report follows a change after this long, and at most one goes out per this long.
    gap: Duration,
    changes: watch::Receiver<u64>,
    /// When the settle check after the last push is due.
    settle_at: Option<Instant>,
}

/// How long after a push the settle check comes, in gaps.
const SETTLE_GAPS: u32 = 10;

impl LoadPacer {
    /// Reports every `interval`; with `push_gap`, also `push_gap` after each change seen on
    /// `changes` (then `interval` is counted from the last report, whatever sent it).
    pub(super) fn new(
        interval: Duration,
        push_gap: Option<Duration>,
        changes: watch::Receiver<u64>,
    ) -> Self {
        let mut heartbeat = tokio::time::interval(interval);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self {
            heartbeat,
            push: push_gap.map(|gap| Push {
                gap,
                changes,
                settle_at: None,
            }),
        }
    }

    /// Waits until the next report is due (the first one at once).
    pub(super) async fn wait(&mut self) -> Due {
        let Some(push) = self.push.as_mut() else {
            self.heartbeat.tick().await;
            return Due::Heartbeat;
        };
        let settle_at = push.settle_at;
        let due = tokio::select! {
            _ = self.heartbeat.tick() => Due::Heartbeat,
            // A closed channel (the worker state is gone) leaves the heartbeat alone.
            Ok(()) = push.changes.changed() => {
                // The changes of the next `gap` share this report, which bounds the rate; the
                // wait also lets the engine take the request whose arrival was the change.
                tokio::time::sleep(push.gap).await;
                Due::Push
            }
            () = sleep_until_opt(settle_at), if settle_at.is_some() => {
                push.settle_at = None;
                return Due::Settle;
            }
        };
        push.changes.mark_unchanged();
        push.settle_at = (due == Due::Push).then(|| Instant::now() + push.gap * SETTLE_GAPS);
        self.heartbeat.reset();
        due
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_secs(60);
    const GAP: Duration = Duration::from_millis(5);

    #[tokio::test(start_paused = true)]
    async fn without_push_only_the_interval_sends() {
        let (changes_tx, changes) = watch::channel(0u64);
        let mut pacer = LoadPacer::new(INTERVAL, None, changes);
        let start = Instant::now();
        assert_eq!(pacer.wait().await, Due::Heartbeat);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "the first report goes at once"
        );
        changes_tx.send_modify(|n| *n += 1);
        assert_eq!(pacer.wait().await, Due::Heartbeat);
        assert_eq!(
            start.elapsed(),
            INTERVAL,
            "a change does not send without push"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_is_pushed_after_the_gap_and_a_burst_shares_one_report() {
        let (changes_tx, changes) = watch::channel(0u64);
        let mut pacer = LoadPacer::new(INTERVAL, Some(GAP), changes);
        pacer.wait().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let changed_at = Instant::now();
        changes_tx.send_modify(|n| *n += 1);
        let burst = tokio::spawn(async move {
            // Four more changes, 1 ms apart (the timer's resolution), inside the 5 ms gap.
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_millis(1)).await;
                changes_tx.send_modify(|n| *n += 1);
            }
            changes_tx
        });
        assert_eq!(pacer.wait().await, Due::Push);
        assert_eq!(changed_at.elapsed(), GAP);
        let changes_tx = burst.await.unwrap();
        // The burst ended within the gap: it is in that report. Then only the settle check
        // and the heartbeat, counted from the pushed report, are due.
        let pushed_at = Instant::now();
        assert_eq!(pacer.wait().await, Due::Settle);
        assert_eq!(pushed_at.elapsed(), GAP * SETTLE_GAPS);
        assert_eq!(pacer.wait().await, Due::Heartbeat);
        assert_eq!(pushed_at.elapsed(), INTERVAL);
        changes_tx.send_modify(|n| *n += 1);
        let changed_at = Instant::now();
        assert_eq!(pacer.wait().await, Due::Push);
        assert_eq!(changed_at.elapsed(), GAP);
        // A change before the settle check is pushed; the check then follows that push.
        tokio::time::sleep(GAP).await;
        changes_tx.send_modify(|n| *n += 1);
        assert_eq!(pacer.wait().await, Due::Push);
        let pushed_at = Instant::now();
        assert_eq!(pacer.wait().await, Due::Settle);
        assert_eq!(pushed_at.elapsed(), GAP * SETTLE_GAPS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_change_channel_leaves_the_heartbeat() {
        let (changes_tx, changes) = watch::channel(0u64);
        let mut pacer = LoadPacer::new(INTERVAL, Some(GAP), changes);
        pacer.wait().await;
        drop(changes_tx);
        let start = Instant::now();
        assert_eq!(pacer.wait().await, Due::Heartbeat);
        assert_eq!(start.elapsed(), INTERVAL);
    }
}
