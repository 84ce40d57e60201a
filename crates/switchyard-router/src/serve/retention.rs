//! Retention hints from a session's observed think times: how long a finished turn's prefix is
//! worth keeping on its worker, because the session's next turn (after a tool call, a user's
//! reading) will arrive on top of it.
//!
//! Per session the estimator keeps when its last turn ended and a running estimate of its
//! gaps (the time from a turn's end to the next turn's arrival, measured only when none of the
//! session's requests was in flight, so a sub-agent's overlap is not mistaken for a pause).
//! A request's hint asks to keep its prefix for `factor ×` that estimate (the initial guess
//! until one gap was seen), at most `cap`: long enough to cover a typical pause with margin,
//! never so long that a session that went away pins a cache for good. The engine honours it
//! within its own budget, so the hint only orders eviction.

use serde::{Deserialize, Serialize};
use switchyard_core::Retention;

use crate::hasher::FxHashMap;
use crate::load::Tick;

/// How retention hints are derived from think times.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Longest hint, in milliseconds.
    pub cap_ms: u64,
    /// The hint before a session's first observed gap, in milliseconds.
    pub initial_ms: u64,
    /// The hint is this many times the session's estimated gap.
    pub factor: f64,
    /// Weight of the newest gap in the estimate (exponential moving average), in (0, 1].
    pub smoothing: f64,
    /// Priority the hints carry.
    pub priority: u8,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            cap_ms: 300_000,
            initial_ms: 60_000,
            factor: 2.0,
            smoothing: 0.3,
            priority: 1,
        }
    }
}

impl RetentionConfig {
    /// A one-sentence reason the configuration cannot be used.
    pub fn validate(&self) -> Result<(), String> {
        if self.cap_ms == 0 {
            return Err("retention cap_ms must be at least 1".into());
        }
        if !(self.factor.is_finite() && self.factor > 0.0) {
            return Err(format!("retention factor must be > 0, got {}", self.factor));
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(format!(
                "retention smoothing must be in (0, 1], got {}",
                self.smoothing
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct SessionGaps {
    in_flight: u32,
    last_end: Option<Tick>,
    estimate_ms: Option<f64>,
}

/// Sessions kept before idle ones are forgotten.
const MAX_SESSIONS: usize = 65_536;

/// Per-session think-time estimates and the hints they give.
#[derive(Debug, Clone)]
pub struct ThinkTimes {
    config: RetentionConfig,
    sessions: FxHashMap<String, SessionGaps>,
}

impl ThinkTimes {
    pub fn new(config: RetentionConfig) -> Self {
        Self {
            config,
            sessions: FxHashMap::default(),
        }
    }

    /// A request of `session` arrives at `now` (microseconds): learns the gap since the
    /// session's last turn ended and returns the hint the request should carry.
    pub fn arrive(&mut self, session: &str, now: Tick) -> Retention {
        if self.sessions.len() >= MAX_SESSIONS && !self.sessions.contains_key(session) {
            self.forget_idle(now);
        }
        let smoothing = self.config.smoothing;
        let s = self.sessions.entry(session.to_owned()).or_default();
        if s.in_flight == 0
            && let Some(end) = s.last_end
        {
            let gap_ms = now.saturating_sub(end) as f64 / 1e3;
            s.estimate_ms = Some(match s.estimate_ms {
                Some(old) => old + smoothing * (gap_ms - old),
                None => gap_ms,
            });
        }
        s.in_flight += 1;
        let estimate = *s;
        self.hint(&estimate)
    }

    /// A request of `session` ended at `now` (microseconds).
    pub fn finished(&mut self, session: &str, now: Tick) {
        if let Some(s) = self.sessions.get_mut(session) {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.last_end = Some(now);
        }
    }

    fn hint(&self, s: &SessionGaps) -> Retention {
        let ms = match s.estimate_ms {
            Some(gap) => (gap * self.config.factor).ceil() as u64,
            None => self.config.initial_ms,
        };
        Retention {
            ttl_ms: ms.clamp(1, self.config.cap_ms),
            priority: self.config.priority,
        }
    }

    /// Drops sessions with nothing in flight whose last turn ended more than a cap ago.
    fn forget_idle(&mut self, now: Tick) {
        let horizon = self.config.cap_ms.saturating_mul(1_000);
        self.sessions.retain(|_, s| {
            s.in_flight > 0 || s.last_end.is_some_and(|e| now.saturating_sub(e) < horizon)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn the_hint_follows_the_observed_gaps_within_the_cap() {
        let mut t = ThinkTimes::new(RetentionConfig::default());
        // No gap seen yet: the initial guess.
        assert_eq!(t.arrive("a", 0).ttl_ms, 60_000);
        t.finished("a", 2 * S);
        // 10 s pause: twice that.
        assert_eq!(t.arrive("a", 12 * S).ttl_ms, 20_000);
        t.finished("a", 13 * S);
        // A 40 s pause moves the average by 30 %: 10 + 0.3 × 30 = 19 s, hint 38 s.
        assert_eq!(t.arrive("a", 53 * S).ttl_ms, 38_000);
        t.finished("a", 54 * S);
        // A huge pause is capped.
        let hint = t.arrive("a", 100_000 * S);
        assert_eq!(hint.ttl_ms, 300_000);
        assert_eq!(hint.priority, 1);
        // Another session is independent.
        assert_eq!(t.arrive("b", 100_000 * S).ttl_ms, 60_000);
    }

    #[test]
    fn overlapping_requests_of_a_session_are_not_a_pause() {
        let mut t = ThinkTimes::new(RetentionConfig::default());
        t.arrive("a", 0);
        t.finished("a", S);
        t.arrive("a", 3 * S); // gap 2 s: hint 4 s
        // A sub-agent starts while the parent turn runs: no gap is learnt from it.
        assert_eq!(t.arrive("a", 100 * S).ttl_ms, 4_000);
        t.finished("a", 101 * S);
        t.finished("a", 102 * S);
        assert_eq!(t.arrive("a", 104 * S).ttl_ms, 4_000);
    }

    #[test]
    fn bad_configurations_are_refused() {
        assert!(RetentionConfig::default().validate().is_ok());
        for bad in [
            RetentionConfig {
                cap_ms: 0,
                ..RetentionConfig::default()
            },
            RetentionConfig {
                factor: f64::NAN,
                ..RetentionConfig::default()
            },
            RetentionConfig {
                smoothing: 0.0,
                ..RetentionConfig::default()
            },
        ] {
            assert!(bad.validate().is_err());
        }
    }
}
