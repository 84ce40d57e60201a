//! Counters of the engine adapter's KV event relay, kept per data-parallel rank and readable at
//! any time as [`AdapterStats`] (the worker's `/metrics` exports them per rank).

use std::sync::atomic::{AtomicU64, Ordering};

/// What the KV event relay has seen since the adapter started (one rank, or all summed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterStats {
    /// Engine batches applied (live or replayed).
    pub batches: u64,
    /// Engine events in those batches.
    pub events: u64,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Replays that applied batches: gaps fully repaired, and catch-ups after joining a running
    /// engine or after its restart.
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
    /// Events the decoder could not use (an unknown type, a malformed field), skipped alone.
    pub skipped_events: u64,
    /// `BlockStored` events with a larger block size than the worker's, skipped.
    pub block_size_mismatches: u64,
    /// Stores of entries the engine already held (re-announcements), ignored.
    pub duplicate_stores: u64,
    /// Removals of entries the worker did not know held, ignored.
    pub unknown_removals: u64,
    /// Stores of non-full-attention KV-cache groups (sliding window, Mamba), skipped.
    pub other_groups: u64,
    /// Events naming a medium the worker does not know (counted as a non-device tier).
    pub unknown_media: u64,
    /// TensorRT-LLM: gaps at the start of a poll, where the engine's event buffer
    /// (`event_buffer_max_size`) wrapped before the worker read it (also counted in `gaps`).
    pub buffer_wraps: u64,
    /// TensorRT-LLM: polls of `/kv_cache_events` that failed (engine unreachable, an error
    /// status, a body that is not a JSON list), counted on rank 0.
    pub poll_failures: u64,
}

impl AdapterStats {
    fn plus(self, o: Self) -> Self {
        Self {
            batches: self.batches + o.batches,
            events: self.events + o.events,
            gaps: self.gaps + o.gaps,
            replays: self.replays + o.replays,
            replayed_batches: self.replayed_batches + o.replayed_batches,
            resyncs: self.resyncs + o.resyncs,
            restarts: self.restarts + o.restarts,
            malformed: self.malformed + o.malformed,
            partial_blocks: self.partial_blocks + o.partial_blocks,
            unrelatable: self.unrelatable + o.unrelatable,
            skipped_events: self.skipped_events + o.skipped_events,
            block_size_mismatches: self.block_size_mismatches + o.block_size_mismatches,
            duplicate_stores: self.duplicate_stores + o.duplicate_stores,
            unknown_removals: self.unknown_removals + o.unknown_removals,
            other_groups: self.other_groups + o.other_groups,
            unknown_media: self.unknown_media + o.unknown_media,
            buffer_wraps: self.buffer_wraps + o.buffer_wraps,
            poll_failures: self.poll_failures + o.poll_failures,
        }
    }
}

/// The live counters of one rank.
#[derive(Debug, Default)]
pub struct RankCounters {
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
    pub skipped_events: AtomicU64,
    pub block_size_mismatches: AtomicU64,
    pub duplicate_stores: AtomicU64,
    pub unknown_removals: AtomicU64,
    pub other_groups: AtomicU64,
    pub unknown_media: AtomicU64,
    pub buffer_wraps: AtomicU64,
    pub poll_failures: AtomicU64,
}

impl RankCounters {
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
            skipped_events: get(&self.skipped_events),
            block_size_mismatches: get(&self.block_size_mismatches),
            duplicate_stores: get(&self.duplicate_stores),
            unknown_removals: get(&self.unknown_removals),
            other_groups: get(&self.other_groups),
            unknown_media: get(&self.unknown_media),
            buffer_wraps: get(&self.buffer_wraps),
            poll_failures: get(&self.poll_failures),
        }
    }
}

/// The live counters behind [`AdapterStats`], one set per data-parallel rank.
#[derive(Debug)]
pub struct AdapterCounters {
    /// Never empty.
    ranks: Vec<RankCounters>,
}

impl AdapterCounters {
    pub fn new(dp_ranks: u32) -> Self {
        Self {
            ranks: (0..dp_ranks.max(1))
                .map(|_| RankCounters::default())
                .collect(),
        }
    }

    /// The counters of `rank`; a rank past the configured ones (which the followers never
    /// produce) is counted on the last rank rather than lost.
    pub fn rank(&self, rank: u32) -> &RankCounters {
        let last = self.ranks.len().saturating_sub(1);
        &self.ranks[(rank as usize).min(last)]
    }

    /// Every rank's figures, in rank order.
    pub fn per_rank(&self) -> Vec<AdapterStats> {
        self.ranks.iter().map(RankCounters::snapshot).collect()
    }

    /// All ranks summed.
    pub fn snapshot(&self) -> AdapterStats {
        self.ranks
            .iter()
            .map(RankCounters::snapshot)
            .fold(AdapterStats::default(), AdapterStats::plus)
    }
}

impl Default for AdapterCounters {
    fn default() -> Self {
        Self::new(1)
    }
}

/// How the adapter's periodic scrape of the engine's own `/metrics` is going.
#[derive(Debug, Default)]
pub struct EngineScrapeCounters {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    /// 1 while the last scrape succeeded.
    pub up: AtomicU64,
}

/// Figures an engine keeps beyond its load, for the worker's `/metrics`; what an engine does
/// not have stays `None` or empty and is not exported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineTelemetry {
    /// KV handles held for a decode worker to pull.
    pub held_kv_handles: Option<u64>,
    /// KV handles that expired unpulled since start.
    pub expired_kv_handles: Option<u64>,
    /// Idle KV blocks retention hints keep pinned.
    pub retained_kv_blocks: Option<u64>,
    /// The KV event relay's counters, per data-parallel rank.
    pub relay_ranks: Vec<AdapterStats>,
    /// Scrapes of the engine's `/metrics`: (succeeded, failed, last one succeeded).
    pub engine_scrapes: Option<(u64, u64, bool)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_count_apart_and_sum_up() {
        let c = AdapterCounters::new(2);
        c.rank(0).add(&c.rank(0).gaps, 1);
        c.rank(1).add(&c.rank(1).gaps, 2);
        // Past the configured ranks: kept on the last one.
        c.rank(7).add(&c.rank(7).restarts, 1);
        let ranks = c.per_rank();
        assert_eq!((ranks[0].gaps, ranks[1].gaps), (1, 2));
        assert_eq!(ranks[1].restarts, 1);
        assert_eq!(c.snapshot().gaps, 3);
    }
}
