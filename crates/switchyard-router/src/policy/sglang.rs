//! `sglang-ca`: the SGLang router's cache-aware policy, for comparison in the same simulator and
//! on the same traces as `kv` (issue 45). It reads no KV event: it keeps an approximate tree of
//! what it routed where (here the [`PredictedCache`] `approx-kv` keeps, by block rather than by
//! character, its oldest entries evicted past `max_tree_blocks`, as SGLang's periodic eviction
//! trims its tree to `max_tree_size`), and decides in two modes:
//!
//! * **imbalanced** — the busiest worker has more than `balance_abs_threshold` requests beyond
//!   the idlest, and more than `balance_rel_threshold` times as many: the idlest worker;
//! * **balanced** — the worker whose tree matches the longest prefix of the prompt, when the
//!   match covers more than `cache_threshold` of it; else the worker with the smallest tree (the
//!   most room to cache).
//!
//! Defaults are SGLang's (`--cache-threshold 0.3`, `--balance-abs-threshold 64`,
//! `--balance-rel-threshold 1.5`). Load is requests running or queued on the worker, as SGLang
//! counts its in-flight requests.

use serde::{Deserialize, Serialize};
use switchyard_core::WorkerId;

use super::approx::PredictedCache;
use super::cost;
use super::explain;
use super::kv::{KvConfig, finish};
use super::{Candidate, Decision, Policy, RouteRequest};
use crate::error::RouteError;
use crate::index::{PrefixIndex, TierOverlap};
use crate::load::LoadView;

/// `[policy_settings.sglang]`: the cache-aware policy's knobs, under SGLang's names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SglangConfig {
    /// Least share of the prompt a worker's tree must match for the match to decide.
    pub cache_threshold: f64,
    /// Requests the busiest worker must have beyond the idlest for the fleet to be imbalanced.
    pub balance_abs_threshold: u64,
    /// … and the ratio busiest / idlest it must exceed.
    pub balance_rel_threshold: f64,
    /// Most (block, worker) pairs in the tree; the oldest go first.
    pub max_tree_blocks: usize,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_blocks: 1 << 20,
        }
    }
}

impl SglangConfig {
    pub fn validate(&self) -> Result<(), RouteError> {
        if !(0.0..=1.0).contains(&self.cache_threshold)
            || !self.balance_rel_threshold.is_finite()
            || self.balance_rel_threshold < 1.0
            || self.max_tree_blocks == 0
        {
            return Err(RouteError::InvalidConfig(
                "sglang.cache_threshold must be in [0, 1], sglang.balance_rel_threshold at least 1 and sglang.max_tree_blocks positive".into(),
            ));
        }
        Ok(())
    }
}

/// Which of its modes decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Imbalanced,
    Matched,
    SmallestTree,
}

/// SGLang's cache-aware policy (see the module note).
#[derive(Debug, Clone)]
pub struct SglangCaPolicy {
    config: SglangConfig,
    /// Fills the common breakdown the explanation shows.
    breakdown: KvConfig,
    tree: PredictedCache,
}

impl SglangCaPolicy {
    pub fn new(config: SglangConfig) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self {
            config,
            breakdown: KvConfig::default(),
            tree: PredictedCache::default(),
        })
    }

    /// The fleet is imbalanced when the busiest of `loads` exceeds the idlest by both
    /// thresholds.
    fn imbalanced(&self, loads: &[u64]) -> bool {
        let (Some(&max), Some(&min)) = (loads.iter().max(), loads.iter().min()) else {
            return false;
        };
        max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold
    }
}

impl Policy for SglangCaPolicy {
    fn name(&self) -> &'static str {
        "sglang-ca"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        _index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        if candidates.is_empty() {
            return Err(RouteError::NoCandidates);
        }
        let tree = &self.tree;
        let overlap_of =
            |w: &WorkerId| TierOverlap::uniform(tree.overlap(w, &request.block_hashes));
        let mut scores = cost::breakdown(
            request,
            candidates,
            load,
            &self.breakdown,
            overlap_of,
            cost::Pending::Ignored,
        );
        let loads: Vec<u64> = scores.iter().map(|s| s.running_requests).collect();
        let block = u64::from(request.block_size.get());
        let match_rate =
            |blocks: u32| (u64::from(blocks) * block) as f64 / request.prompt_tokens.max(1) as f64;
        let mode = if self.imbalanced(&loads) {
            for s in &mut scores {
                s.score = s.running_requests as f64;
            }
            Mode::Imbalanced
        } else {
            for s in &mut scores {
                s.score = 1.0 - match_rate(s.overlap.device).min(1.0);
            }
            let best = explain::best(request, &scores);
            if match_rate(scores[best].overlap.device) > self.config.cache_threshold {
                Mode::Matched
            } else {
                for s in &mut scores {
                    s.score = self.tree.held(&s.worker) as f64;
                }
                Mode::SmallestTree
            }
        };
        let chosen = explain::best(request, &scores);
        let w = &scores[chosen];
        let why = match mode {
            Mode::Imbalanced => format!(
                "{}: fewest requests ({}) of an imbalanced fleet ({} to {})",
                w.worker,
                w.running_requests,
                loads.iter().min().copied().unwrap_or(0),
                loads.iter().max().copied().unwrap_or(0),
            ),
            Mode::Matched => format!(
                "{}: its routed-request tree matches {:.0} % of the prompt (over the {:.0} % threshold)",
                w.worker,
                100.0 * match_rate(w.overlap.device).min(1.0),
                100.0 * self.config.cache_threshold,
            ),
            Mode::SmallestTree => format!(
                "{}: no tree matches over {:.0} % of the prompt; the smallest tree ({} blocks)",
                w.worker,
                100.0 * self.config.cache_threshold,
                w.score,
            ),
        };
        let decision = finish(self.name(), request, scores, chosen, false, why);
        self.tree.record(
            &decision.worker,
            &request.block_hashes,
            request.now,
            self.config.max_tree_blocks,
        );
        Ok(decision)
    }

    fn worker_removed(&mut self, worker: &WorkerId) {
        self.tree.remove_worker(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;
    use crate::load::LoadConfig;
    use switchyard_core::{BlockHash, BlockSize};

    fn request(blocks: &[u64], prompt_tokens: u64) -> RouteRequest {
        RouteRequest {
            block_hashes: blocks.iter().map(|&b| BlockHash(b)).collect(),
            prompt_tokens,
            block_size: BlockSize::new(16).unwrap(),
            session: None,
            now: 0,
            adapter: None,
        }
    }

    #[test]
    fn imbalance_needs_both_thresholds() {
        let policy = SglangCaPolicy::new(SglangConfig::default()).unwrap();
        assert!(!policy.imbalanced(&[0, 64]), "64 more is not over 64");
        assert!(policy.imbalanced(&[0, 65]));
        assert!(!policy.imbalanced(&[200, 290]), "290 is not over 1.5 × 200");
        assert!(policy.imbalanced(&[100, 200]));
        assert!(!policy.imbalanced(&[]));
        let bad = SglangConfig {
            cache_threshold: 1.5,
            ..SglangConfig::default()
        };
        assert!(SglangCaPolicy::new(bad).is_err());
    }

    /// Balanced: a prompt matching little goes to the smallest tree, its continuation (matching
    /// most of it) to where the first went; the tree sizes follow what was routed.
    #[test]
    fn balanced_routing_follows_the_tree_then_the_smallest_one() {
        let mut policy = SglangCaPolicy::new(SglangConfig::default()).unwrap();
        let index = PrefixIndex::new(IndexConfig::new(BlockSize::new(16).unwrap()));
        let load = LoadView::new(LoadConfig::default());
        let candidates: Vec<Candidate> = ["a", "b"]
            .into_iter()
            .map(|w| Candidate::from(WorkerId::new(w).unwrap()))
            .collect();
        let first = policy
            .choose(&request(&[1, 2, 3, 4], 64), &candidates, &index, &load)
            .unwrap();
        assert!(
            first.explanation.why.contains("smallest tree"),
            "{}",
            first.explanation.why
        );
        let holder = first.worker.clone();
        assert_eq!(policy.tree.held(&holder), 4);
        let next = policy
            .choose(&request(&[1, 2, 3, 4, 5], 80), &candidates, &index, &load)
            .unwrap();
        assert_eq!(next.worker, holder, "{}", next.explanation.why);
        assert!(
            next.explanation.why.contains("matches 80 %"),
            "{}",
            next.explanation.why
        );
        // Another conversation matches nothing: the other, smaller tree.
        let other = policy
            .choose(&request(&[9, 8], 32), &candidates, &index, &load)
            .unwrap();
        assert_ne!(other.worker, holder, "{}", other.explanation.why);
    }
}
