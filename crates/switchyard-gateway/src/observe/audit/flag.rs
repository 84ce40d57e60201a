//! Why a decision's realized prefix hit was far from its prediction: the flag a decision's
//! outcome carries ([`super::realized`] sets it, [`super::decisions`] shows it, the audit
//! metrics count it per cause).

use serde::Serialize;

/// Why a realized hit was far from the prediction (the most likely reason the gateway can tell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The worker publishes no KV events (never configured, or cut).
    KvEventsSilent,
    /// The index lists blocks the engine no longer holds and nothing is arriving to correct it
    /// (a lost removal, a cache reset without an event, a diverged index).
    IndexStale,
    /// The index learned of the blocks' removal after the decision: evicted while in flight.
    EvictedInFlight,
    /// Events are arriving, but the removal had not reached the index when it decided.
    EventLag,
    /// The engine reused blocks the index did not list for it: stored events lost or late.
    IndexMissingBlocks,
}

impl Cause {
    pub const ALL: [Cause; 5] = [
        Self::KvEventsSilent,
        Self::IndexStale,
        Self::EvictedInFlight,
        Self::EventLag,
        Self::IndexMissingBlocks,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::KvEventsSilent => "kv_events_silent",
            Self::IndexStale => "index_stale",
            Self::EvictedInFlight => "evicted_in_flight",
            Self::EventLag => "event_lag",
            Self::IndexMissingBlocks => "index_missing_blocks",
        }
    }
}

/// A misprediction, as a decision's outcome shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Flag {
    pub cause: Cause,
    pub why: String,
}
