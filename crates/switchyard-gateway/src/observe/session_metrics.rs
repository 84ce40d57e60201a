//! The metrics of session scheduling ([`crate::serving::sessions`]), part of the gateway's
//! `/metrics`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The session scheduling series of `/metrics` (clones share their values).
#[derive(Debug, Clone)]
pub struct SessionMetrics {
    /// Turns that waited between turns because their session's working set did not fit.
    pub(crate) held: Counter,
    /// Of those, turns let go at their aging bound rather than because room appeared.
    pub(crate) aged: Counter,
    /// Residencies given up (a younger resident that outgrew its worker, idle residents making
    /// room for an aged turn).
    pub(crate) demotions: Counter,
    /// Held turns whose client went away before they were let go.
    pub(crate) withdrawn: Counter,
    /// Turns waiting now.
    pub(crate) waiting: Gauge,
    /// Sessions whose working set is counted on the workers now.
    pub(crate) resident: Gauge,
    /// How long held turns waited.
    pub(crate) held_seconds: Histogram,
}

impl Default for SessionMetrics {
    fn default() -> Self {
        Self {
            held: Counter::default(),
            aged: Counter::default(),
            demotions: Counter::default(),
            withdrawn: Counter::default(),
            waiting: Gauge::default(),
            resident: Gauge::default(),
            // 1 ms to ≈ 16 min.
            held_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 20)),
        }
    }
}

impl SessionMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "session_turns_held",
            "Session turns held between turns because their working set did not fit beside the resident sessions'",
            self.held.clone(),
        );
        registry.register(
            "session_turns_aged",
            "Held session turns let go at their aging bound rather than because room appeared",
            self.aged.clone(),
        );
        registry.register(
            "session_demotions",
            "Session residencies given up at a tool-call boundary (outgrown, or to make room for an aged turn)",
            self.demotions.clone(),
        );
        registry.register(
            "session_turns_withdrawn",
            "Held session turns whose client went away before they were let go",
            self.withdrawn.clone(),
        );
        registry.register(
            "session_turns_waiting",
            "Session turns waiting now",
            self.waiting.clone(),
        );
        registry.register(
            "sessions_resident",
            "Sessions whose working set is counted on the workers now",
            self.resident.clone(),
        );
        registry.register(
            "session_hold_seconds",
            "How long held session turns waited",
            self.held_seconds.clone(),
        );
    }
}
