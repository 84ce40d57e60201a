//! The per-worker breakdown every policy fills, the shared choice rule and the explanation.

use std::cmp::Ordering;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};

use serde::Serialize;
use switchyard_core::WorkerId;

use super::RouteRequest;
use super::cost::Onboarding;
use crate::hasher::FxHasher;
use crate::index::TierOverlap;
use switchyard_core::rng::{SplitMix64, mix64};

/// Why a request went where it went: the admin API returns this as JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    /// Policy that decided.
    pub policy: &'static str,
    pub chosen: WorkerId,
    /// One sentence on why the winner won.
    pub why: String,
    pub prompt_tokens: u64,
    pub prompt_blocks: usize,
    /// Whether the winner was sampled (random, kv with a temperature) rather than the best.
    pub sampled: bool,
    /// The candidates explained, in the order the caller gave them: every one, or, when the
    /// `kv` policy decided among many and was not asked for all, the best few (`shortlist`).
    pub workers: Vec<WorkerScore>,
}

/// One candidate's figures. `score` is the deciding policy's own figure, lower is better; the
/// other fields are the same for every policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerScore {
    pub worker: WorkerId,
    /// Leading prompt blocks the worker holds, per tier level (with `pending_blocks` counted
    /// as device blocks).
    pub overlap: TierOverlap,
    /// Leading prompt blocks requests routed to the worker and not finished are bringing to
    /// its cache (`load::pending`), counted as held: this request queues behind them. Only the
    /// `kv` and `approx-kv` policies count them; left out of the JSON when none.
    #[serde(skip_serializing_if = "no_blocks")]
    pub pending_blocks: u32,
    /// Prompt tokens the worker would have to compute: the prompt past its longest cached
    /// prefix in any tier.
    pub uncached_prompt_tokens: u64,
    /// Prefill tokens already queued there (reported plus routed since).
    pub queued_prefill_tokens: u64,
    pub running_requests: u64,
    pub active_decode_sequences: u64,
    pub active_blocks: u64,
    pub kv_utilisation: f64,
    /// Bringing the cached prefix's non-device blocks to the device, against recomputing them.
    pub onboarding: Onboarding,
    /// Blocks the request's uncached prompt needs beyond the worker's device capacity, on top
    /// of its active blocks (`cost`, the memory term): priced as their recomputation. Left out
    /// of the JSON when none.
    #[serde(skip_serializing_if = "no_overflow")]
    pub overflow_blocks: u64,
    /// `prefill_weight × ((uncached + queued + overflow tokens) / prefill rate + onboarding
    /// seconds)`, seconds.
    pub prefill_term: f64,
    /// `decode_weight × active_blocks × block_size / prefill rate`, seconds.
    pub decode_term: f64,
    pub score: f64,
    /// Probability of being picked, when the policy sampled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probability: Option<f64>,
}

fn no_blocks(blocks: &u32) -> bool {
    *blocks == 0
}

fn no_overflow(blocks: &u64) -> bool {
    *blocks == 0
}

/// A stable per-request key for rendezvous tie-breaking: the session id if any, else the
/// prompt's first block, so the same cold prompt keeps landing on the same worker.
pub(crate) fn request_key(request: &RouteRequest) -> u64 {
    let mut h = FxHasher::default();
    match (&request.session, request.block_hashes.first()) {
        (Some(s), _) => s.hash(&mut h),
        (None, Some(b)) => b.hash(&mut h),
        (None, None) => request.prompt_tokens.hash(&mut h),
    }
    h.finish()
}

pub(crate) fn rendezvous(key: u64, worker: &WorkerId) -> u64 {
    let mut h = FxHasher::default();
    worker.hash(&mut h);
    mix64(key ^ h.finish())
}

/// Deterministic order: lower score, then fewer running requests, then the higher rendezvous
/// hash of (request key, worker id), then the worker id.
pub(crate) fn compare(request: &RouteRequest, a: &WorkerScore, b: &WorkerScore) -> Ordering {
    compare_keyed(request_key(request), a, b)
}

/// [`compare`] with the request's key computed once for many comparisons.
fn compare_keyed(key: u64, a: &WorkerScore, b: &WorkerScore) -> Ordering {
    order(
        key,
        (a.score, a.running_requests, &a.worker),
        (b.score, b.running_requests, &b.worker),
    )
}

/// [`compare`] on what it reads of a breakdown — (score, running requests, worker) — with
/// the request's key: the shortlist ranks candidates by it before building any breakdown.
pub(crate) fn order(key: u64, a: (f64, u64, &WorkerId), b: (f64, u64, &WorkerId)) -> Ordering {
    a.0.total_cmp(&b.0)
        .then(a.1.cmp(&b.1))
        .then_with(|| rendezvous(key, b.2).cmp(&rendezvous(key, a.2)))
        .then_with(|| a.2.cmp(b.2))
}

/// Index of the best candidate under [`compare`]; `scores` must not be empty.
pub(crate) fn best(request: &RouteRequest, scores: &[WorkerScore]) -> usize {
    let key = request_key(request);
    let mut best = 0;
    for i in 1..scores.len() {
        if compare_keyed(key, &scores[i], &scores[best]) == Ordering::Less {
            best = i;
        }
    }
    best
}

/// Softmax sampling over normalised scores: `p_i ∝ exp(-(s_i - min) / (max - min) / t)`.
/// Fills `probability` on every candidate and returns the sampled index.
pub(crate) fn sample(scores: &mut [WorkerScore], temperature: f64, rng: &mut SplitMix64) -> usize {
    let min = scores.iter().map(|s| s.score).fold(f64::INFINITY, f64::min);
    let max = scores
        .iter()
        .map(|s| s.score)
        .fold(f64::NEG_INFINITY, f64::max);
    let range = if max > min { max - min } else { 1.0 };
    let weights: Vec<f64> = scores
        .iter()
        .map(|s| (-(s.score - min) / range / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    for (s, w) in scores.iter_mut().zip(&weights) {
        s.probability = Some(w / total);
    }
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len() - 1
}

/// `1234567` → `"1,234,567"`, written where it is formatted (no string of its own: a
/// decision's explanation formats several per request).
pub(crate) fn thousands(n: u64) -> Thousands {
    Thousands(n)
}

/// [`thousands`]'s figure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Thousands(u64);

impl std::fmt::Display for Thousands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // u64::MAX has 20 digits.
        let mut digits = [0u8; 20];
        let mut len = 0;
        let mut n = self.0;
        loop {
            digits[len] = b'0' + (n % 10) as u8;
            len += 1;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        for i in (0..len).rev() {
            f.write_char(char::from(digits[i]))?;
            if i > 0 && i % 3 == 0 {
                f.write_char(',')?;
            }
        }
        Ok(())
    }
}

/// The runner-up (best other than `chosen`) under [`compare`].
pub(crate) fn runner_up<'a>(
    request: &RouteRequest,
    scores: &'a [WorkerScore],
    chosen: usize,
) -> Option<&'a WorkerScore> {
    let key = request_key(request);
    scores
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != chosen)
        .map(|(_, s)| s)
        .min_by(|a, b| compare_keyed(key, a, b))
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0).to_string(), "0");
        assert_eq!(thousands(7).to_string(), "7");
        assert_eq!(thousands(999).to_string(), "999");
        assert_eq!(thousands(1000).to_string(), "1,000");
        assert_eq!(thousands(1024).to_string(), "1,024");
        assert_eq!(thousands(100_000).to_string(), "100,000");
        assert_eq!(thousands(1_234_567).to_string(), "1,234,567");
        assert_eq!(
            thousands(u64::MAX).to_string(),
            "18,446,744,073,709,551,615"
        );
    }
}
