//! Counters of the engine adapter's KV event relay, readable at any time as [`AdapterStats`].

use std::sync::atomic::{AtomicU64, Ordering};

/// What the KV event relay has seen since the adapter started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterStats {
    /// Engine batches applied (live or replayed).
    pub batches: u64,
    /// Engine events in those batches.
    pub events: u64,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Gaps fully repaired from the engine's replay socket.
    pub replays: u64,
    /// Batches received through replay.
    pub replayed_batches: u64,
    /// Gaps replay could not repair (no replay endpoint, timeout, buffer too short): the rank
    /// was cleared and rebuilt from the events that followed.
    pub resyncs: u64,
    /// Engine restarts detected (sequence numbers going back).
    pub restarts: u64,
    /// Messages skipped as malformed (frame count, sequence frame or payload).
    pub malformed: u64,
    /// Full blocks a `BlockStored` listed beyond its tokens (partial pages), skipped.
    pub partial_blocks: u64,
    /// `BlockStored` events whose parent was unknown, skipped.
    pub unrelatable: u64,
}

/// The live counters behind [`AdapterStats`].
#[derive(Debug, Default)]
pub struct AdapterCounters {
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub resyncs: AtomicU64,
    pub restarts: AtomicU64,
    pub malformed: AtomicU64,
    pub partial_blocks: AtomicU64,
    pub unrelatable: AtomicU64,
}

impl AdapterCounters {
    pub fn add(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> AdapterStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AdapterStats {
            batches: get(&self.batches),
            events: get(&self.events),
            gaps: get(&self.gaps),
            replays: get(&self.replays),
            replayed_batches: get(&self.replayed_batches),
            resyncs: get(&self.resyncs),
            restarts: get(&self.restarts),
            malformed: get(&self.malformed),
            partial_blocks: get(&self.partial_blocks),
            unrelatable: get(&self.unrelatable),
        }
    }
}
