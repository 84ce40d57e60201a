//! Keeping the pools from flapping.
//!
//! Moving a worker costs a drain (its in-flight requests finish first) and, for a prefill
//! worker turned decode, a cold cache; a planner that follows every wobble of the load spends
//! its capacity on moves. So a new size is applied only when
//!
//! - **hysteresis**: the same target was wanted for `hysteresis_intervals` intervals in a row
//!   (a one-interval spike does not move workers), unless a pool is *short* (it has fewer
//!   workers than the load needs: waiting only lets its queue grow), and
//! - **cooldown**: at least `cooldown` has passed since the last change (the previous move has
//!   settled and shows in the figures).
//!
//! Both are skipped when the current pools break the limits (a pool below its minimum, both
//! pools empty): that is repaired at once.

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::connector::PoolSizes;
use crate::sizing::Limits;

/// What the stabiliser lets through.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Verdict {
    /// Keep the pools as they are.
    Hold { why: String },
    /// Move the pools to `target`.
    Scale { target: PoolSizes, why: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StabilitySettings {
    pub cooldown: Duration,
    pub hysteresis_intervals: u32,
}

/// The stabiliser's memory between intervals.
#[derive(Debug)]
pub struct Stabilizer {
    settings: StabilitySettings,
    last_change: Option<Instant>,
    streak: Option<(PoolSizes, u32)>,
}

impl Stabilizer {
    pub fn new(settings: StabilitySettings) -> Self {
        Self {
            settings,
            last_change: None,
            streak: None,
        }
    }

    /// Decides whether to move from `current` to `wanted` (already within `limits`) at `now`;
    /// `short`: a pool has fewer workers than the load needs.
    pub fn judge(
        &mut self,
        current: PoolSizes,
        wanted: PoolSizes,
        limits: &Limits,
        short: bool,
        now: Instant,
    ) -> Verdict {
        if wanted == current {
            self.streak = None;
            return Verdict::Hold {
                why: format!(
                    "pools already at {} prefill / {} decode",
                    current.prefill, current.decode
                ),
            };
        }
        if let Some(broken) = broken_limit(current, limits) {
            self.changed(now);
            return Verdict::Scale {
                target: wanted,
                why: format!("{broken}; repairing at once"),
            };
        }
        let count = match self.streak {
            Some((target, n)) if target == wanted => n + 1,
            _ => 1,
        };
        self.streak = Some((wanted, count));
        if count < self.settings.hysteresis_intervals && !short {
            return Verdict::Hold {
                why: format!(
                    "{} prefill / {} decode wanted for {count} of {} intervals (hysteresis)",
                    wanted.prefill, wanted.decode, self.settings.hysteresis_intervals
                ),
            };
        }
        if let Some(last) = self.last_change {
            let since = now.saturating_duration_since(last);
            if since < self.settings.cooldown {
                return Verdict::Hold {
                    why: format!(
                        "cooldown: {:.1} s of {:.1} s since the last change",
                        since.as_secs_f64(),
                        self.settings.cooldown.as_secs_f64()
                    ),
                };
            }
        }
        self.changed(now);
        Verdict::Scale {
            target: wanted,
            why: if count < self.settings.hysteresis_intervals {
                format!(
                    "{} prefill / {} decode wanted now: a pool is short of what the load needs",
                    wanted.prefill, wanted.decode
                )
            } else {
                format!(
                    "{} prefill / {} decode wanted for {count} intervals",
                    wanted.prefill, wanted.decode
                )
            },
        }
    }

    fn changed(&mut self, now: Instant) {
        self.last_change = Some(now);
        self.streak = None;
    }

    /// Forgets the last change (a move that failed), so the next interval may try again.
    pub fn change_failed(&mut self) {
        self.last_change = None;
    }
}

fn broken_limit(current: PoolSizes, limits: &Limits) -> Option<String> {
    if current.total() == 0 {
        return Some("both pools are empty".into());
    }
    if current.prefill < limits.min_prefill {
        return Some(format!(
            "prefill pool has {} workers, below its minimum {}",
            current.prefill, limits.min_prefill
        ));
    }
    if current.decode < limits.min_decode {
        return Some(format!(
            "decode pool has {} workers, below its minimum {}",
            current.decode, limits.min_decode
        ));
    }
    if current.total() > limits.max_total {
        return Some(format!(
            "{} workers, above the maximum {}",
            current.total(),
            limits.max_total
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const LIMITS: Limits = Limits {
        min_prefill: 1,
        min_decode: 1,
        max_total: 8,
    };

    fn sizes(prefill: u32, decode: u32) -> PoolSizes {
        PoolSizes { prefill, decode }
    }

    fn stabilizer(cooldown_secs: u64, hysteresis: u32) -> Stabilizer {
        Stabilizer::new(StabilitySettings {
            cooldown: Duration::from_secs(cooldown_secs),
            hysteresis_intervals: hysteresis,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_target_must_hold_for_the_hysteresis_intervals() {
        let mut s = stabilizer(0, 3);
        let now = Instant::now;
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, now()),
            Verdict::Hold { .. }
        ));
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, now()),
            Verdict::Hold { .. }
        ));
        // A different wish restarts the count.
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(1, 3), &LIMITS, false, now()),
            Verdict::Hold { .. }
        ));
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, now()),
            Verdict::Hold { .. }
        ));
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, now()),
            Verdict::Hold { .. }
        ));
        assert_eq!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, now()),
            Verdict::Scale {
                target: sizes(3, 1),
                why: "3 prefill / 1 decode wanted for 3 intervals".into()
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_change_within_the_cooldown() {
        let mut s = stabilizer(60, 1);
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, Instant::now()),
            Verdict::Scale { .. }
        ));
        tokio::time::advance(Duration::from_secs(30)).await;
        let held = s.judge(sizes(3, 1), sizes(2, 2), &LIMITS, false, Instant::now());
        match held {
            Verdict::Hold { why } => {
                assert!(why.starts_with("cooldown: 30.0 s of 60.0 s"), "{why}")
            }
            other => panic!("expected a hold, got {other:?}"),
        }
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(matches!(
            s.judge(sizes(3, 1), sizes(2, 2), &LIMITS, false, Instant::now()),
            Verdict::Scale { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn broken_limits_are_repaired_despite_cooldown_and_hysteresis() {
        let mut s = stabilizer(600, 5);
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, Instant::now()),
            Verdict::Hold { .. }
        ));
        match s.judge(sizes(4, 0), sizes(3, 1), &LIMITS, false, Instant::now()) {
            Verdict::Scale { target, why } => {
                assert_eq!(target, sizes(3, 1));
                assert!(why.contains("decode pool has 0 workers"), "{why}");
            }
            other => panic!("expected a repair, got {other:?}"),
        }
        assert!(matches!(
            s.judge(sizes(0, 0), sizes(0, 1), &LIMITS, false, Instant::now()),
            Verdict::Scale { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_pool_skips_the_hysteresis_but_not_the_cooldown() {
        let mut s = stabilizer(60, 3);
        match s.judge(sizes(1, 3), sizes(3, 1), &LIMITS, true, Instant::now()) {
            Verdict::Scale { why, .. } => assert!(why.contains("short"), "{why}"),
            other => panic!("expected a move, got {other:?}"),
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(matches!(
            s.judge(sizes(3, 1), sizes(1, 3), &LIMITS, true, Instant::now()),
            Verdict::Hold { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_change_does_not_start_a_cooldown() {
        let mut s = stabilizer(600, 1);
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, Instant::now()),
            Verdict::Scale { .. }
        ));
        s.change_failed();
        assert!(matches!(
            s.judge(sizes(2, 2), sizes(3, 1), &LIMITS, false, Instant::now()),
            Verdict::Scale { .. }
        ));
    }
}
