//! Per-request records and the figures a report is made of.

use serde::Serialize;

use crate::workload::Micros;

/// What happened to one request (virtual or wall-clock microseconds since the replay start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestRecord {
    pub id: u64,
    /// Index of the worker it was routed to (offline), 0 in live mode.
    pub worker: u32,
    pub arrival: Micros,
    pub first_token: Option<Micros>,
    pub finished: Option<Micros>,
    pub prompt_tokens: u64,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub ok: bool,
}

impl RequestRecord {
    /// Time per output token after the first, in seconds.
    pub fn tpot_s(&self) -> Option<f64> {
        let (first, end) = (self.first_token?, self.finished?);
        (self.output_tokens > 1)
            .then(|| (end - first) as f64 / 1e6 / (self.output_tokens - 1) as f64)
    }
}

/// Percentiles of a latency, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (sorted in place).
    pub fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            let k = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
            values[k - 1]
        };
        Self {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// The figures of one run (one policy at one load level).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Policy (or endpoint) name.
    pub label: String,
    /// Load level: concurrency (closed loop) or speed factor (open loop).
    pub level: f64,
    pub workers: usize,
    pub requests_completed: u64,
    pub requests_failed: u64,
    pub sessions_completed: u64,
    /// First arrival to last completion, in seconds.
    pub duration_s: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    /// Output tokens per second per user: the median over requests of 1/TPOT.
    pub interactivity_tok_s: f64,
    pub output_tokens: u64,
    pub output_tok_s_per_worker: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Prompt tokens served from cache / prompt tokens.
    pub cache_hit_rate: f64,
    /// Prompt tokens served from the host tier / prompt tokens (offline runs; a recompute
    /// after preemption that hits host again counts again). The device tier's share is
    /// `cache_hit_rate - host_hit_rate`.
    #[serde(default)]
    pub host_hit_rate: f64,
    /// Prompt tokens copied from a peer worker's device instead of recomputed / prompt tokens
    /// (offline runs with placement); counted in the device tier's share too, since the copy
    /// lands there before the request is admitted. Left out of the JSON when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub peer_hit_rate: f64,
    /// Prompt tokens the workers computed, recomputes after preemption included (offline).
    #[serde(default)]
    pub recomputed_tokens: u64,
    /// KV bytes moved: host-tier hits copied to the device plus transfers between workers
    /// (offline).
    #[serde(default)]
    pub transferred_bytes: u64,
    /// The TTFT each completed request would have had alone on an idle worker already holding
    /// every block any earlier request sent (offline): no routing, cache or placement policy
    /// gets a request's first token sooner, so a tail at its floor is compute, not queueing or
    /// misses. Left out of the JSON when not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_floor_ms: Option<Percentiles>,
    /// Turns session scheduling held at a tool-call boundary (offline). Left out of the JSON
    /// when 0.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub held_turns: u64,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_zero(rate: &f64) -> bool {
    *rate == 0.0
}

impl Summary {
    pub fn from_records(
        label: &str,
        level: f64,
        workers: usize,
        sessions_completed: u64,
        records: &[RequestRecord],
    ) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
        let mut ttft: Vec<f64> = ok
            .iter()
            .filter_map(|r| Some((r.first_token? - r.arrival) as f64 / 1e3))
            .collect();
        let tpot_s: Vec<f64> = ok.iter().filter_map(|r| r.tpot_s()).collect();
        let mut tpot_ms: Vec<f64> = tpot_s.iter().map(|s| s * 1e3).collect();
        let mut per_user: Vec<f64> = tpot_s
            .iter()
            .filter(|s| **s > 0.0)
            .map(|s| 1.0 / s)
            .collect();
        let start = records.iter().map(|r| r.arrival).min().unwrap_or(0);
        let end = ok.iter().filter_map(|r| r.finished).max().unwrap_or(start);
        let duration_s = (end.saturating_sub(start)) as f64 / 1e6;
        let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let prompt_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let cached_tokens: u64 = ok.iter().map(|r| r.cached_tokens).sum();
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        Self {
            label: label.to_owned(),
            level,
            workers,
            requests_completed: ok.len() as u64,
            requests_failed: (records.len() - ok.len()) as u64,
            sessions_completed,
            duration_s,
            ttft_ms: Percentiles::of(&mut ttft),
            tpot_ms: Percentiles::of(&mut tpot_ms),
            interactivity_tok_s: Percentiles::of(&mut per_user).p50,
            output_tokens,
            output_tok_s_per_worker: ratio(output_tokens as f64, duration_s * workers as f64),
            prompt_tokens,
            cached_tokens,
            cache_hit_rate: ratio(cached_tokens as f64, prompt_tokens as f64),
            host_hit_rate: 0.0,
            peer_hit_rate: 0.0,
            recomputed_tokens: 0,
            transferred_bytes: 0,
            ttft_floor_ms: None,
            held_turns: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(&mut []).p50, 0.0);
    }

    #[test]
    fn summary_counts_hits_and_throughput() {
        let r = |id, arrival, first, end, out, cached| RequestRecord {
            id,
            worker: 0,
            arrival,
            first_token: Some(first),
            finished: Some(end),
            prompt_tokens: 100,
            cached_tokens: cached,
            output_tokens: out,
            ok: true,
        };
        let records = [
            r(0, 0, 100_000, 1_000_000, 10, 0),
            r(1, 0, 200_000, 2_000_000, 10, 50),
        ];
        let s = Summary::from_records("kv", 1.0, 2, 0, &records);
        assert_eq!(s.requests_completed, 2);
        assert!((s.cache_hit_rate - 0.25).abs() < 1e-12);
        assert!((s.duration_s - 2.0).abs() < 1e-12);
        assert!((s.output_tok_s_per_worker - 5.0).abs() < 1e-12);
        assert!((s.ttft_ms.p50 - 100.0).abs() < 1e-9);
        assert!((s.tpot_ms.p50 - 100.0).abs() < 1e-9);
        // Nearest-rank median of 10 and 5 tok/s.
        assert!((s.interactivity_tok_s - 5.0).abs() < 1e-9);
    }
}
