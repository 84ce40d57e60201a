//! `approx-kv`: cache-aware routing for engines that publish no KV events.
//!
//! The policy predicts each worker's cache from its own past decisions: after choosing a worker
//! for a request it records the request's block hashes as held there. A recorded pair expires
//! `ttl` after it was last recorded (engines evict under pressure; a prediction that old is more
//! likely wrong than right), and at most `max_entries` pairs are kept, the oldest recordings
//! dropping first. Scoring is the `kv` cost with this predicted overlap, counted as device hits;
//! the load terms still come from the [`LoadView`]. The [`PrefixIndex`] is not consulted.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use switchyard_core::{BlockHash, WorkerId};

use super::kv::{KvPolicy, kv_why};
use super::{Candidate, Decision, Policy, RouteRequest};
use crate::error::RouteError;
use crate::hasher::FxHashMap;
use crate::index::{PrefixIndex, TierOverlap};
use crate::load::{LoadView, Tick};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApproxConfig {
    /// A predicted (block, worker) pair is forgotten this long (microseconds) after it was last
    /// recorded.
    pub ttl: Tick,
    /// Most (block, worker) pairs predicted.
    pub max_entries: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: 120_000_000,
            max_entries: 1 << 20,
        }
    }
}

/// Predicted (block, worker) pairs with the time each was last recorded.
#[derive(Debug, Clone, Default)]
pub struct PredictedCache {
    blocks: FxHashMap<BlockHash, Vec<(u32, Tick)>>,
    /// Recordings in time order; a recording superseded by a later one is skipped when popped.
    queue: VecDeque<(Tick, BlockHash, u32)>,
    workers: Vec<WorkerId>,
    by_id: FxHashMap<WorkerId, u32>,
    entries: usize,
    /// Pairs predicted per worker slot.
    held: Vec<usize>,
}

impl PredictedCache {
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Records `blocks` as held by `worker` at `now`.
    pub fn record(
        &mut self,
        worker: &WorkerId,
        blocks: &[BlockHash],
        now: Tick,
        max_entries: usize,
    ) {
        let slot = match self.by_id.get(worker) {
            Some(&s) => s,
            None => {
                self.workers.push(worker.clone());
                self.held.push(0);
                let s = (self.workers.len() - 1) as u32;
                self.by_id.insert(worker.clone(), s);
                s
            }
        };
        for &b in blocks {
            let holders = self.blocks.entry(b).or_default();
            match holders.iter_mut().find(|(s, _)| *s == slot) {
                Some(h) => h.1 = now,
                None => {
                    holders.push((slot, now));
                    self.entries += 1;
                    if let Some(held) = self.held.get_mut(slot as usize) {
                        *held += 1;
                    }
                }
            }
            self.queue.push_back((now, b, slot));
        }
        while self.entries > max_entries {
            if !self.pop_oldest() {
                break;
            }
        }
        if self.queue.len() > 2 * self.entries + 1024 {
            let blocks = &self.blocks;
            self.queue.retain(|(t, b, s)| {
                blocks
                    .get(b)
                    .is_some_and(|hs| hs.iter().any(|(hs_slot, last)| hs_slot == s && last == t))
            });
        }
    }

    /// Forgets pairs last recorded `ttl` or more before `now`.
    pub fn expire(&mut self, now: Tick, ttl: Tick) {
        while let Some(&(t, _, _)) = self.queue.front() {
            if now.saturating_sub(t) < ttl {
                break;
            }
            self.pop_oldest();
        }
    }

    /// Pops the oldest recording; drops its pair unless recorded again since. Returns false
    /// when the queue is empty.
    fn pop_oldest(&mut self) -> bool {
        let Some((t, b, slot)) = self.queue.pop_front() else {
            return false;
        };
        if let Some(holders) = self.blocks.get_mut(&b)
            && let Some(i) = holders
                .iter()
                .position(|(s, last)| *s == slot && *last <= t)
        {
            holders.swap_remove(i);
            self.entries -= 1;
            if let Some(held) = self.held.get_mut(slot as usize) {
                *held -= 1;
            }
            if holders.is_empty() {
                self.blocks.remove(&b);
            }
        }
        true
    }

    /// Leading blocks of `blocks` predicted on `worker`.
    pub fn overlap(&self, worker: &WorkerId, blocks: &[BlockHash]) -> u32 {
        let Some(&slot) = self.by_id.get(worker) else {
            return 0;
        };
        blocks
            .iter()
            .take_while(|b| {
                self.blocks
                    .get(b)
                    .is_some_and(|hs| hs.iter().any(|(s, _)| *s == slot))
            })
            .count() as u32
    }

    /// Forgets everything predicted on `worker`.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        let Some(&slot) = self.by_id.get(worker) else {
            return;
        };
        let mut removed = 0;
        self.blocks.retain(|_, hs| {
            let before = hs.len();
            hs.retain(|(s, _)| *s != slot);
            removed += before - hs.len();
            !hs.is_empty()
        });
        self.entries -= removed;
        if let Some(held) = self.held.get_mut(slot as usize) {
            *held = 0;
        }
    }

    /// Pairs predicted on `worker` (SGLang's per-worker tree size).
    pub fn held(&self, worker: &WorkerId) -> usize {
        self.by_id
            .get(worker)
            .and_then(|&slot| self.held.get(slot as usize))
            .copied()
            .unwrap_or(0)
    }
}

/// The `approx-kv` policy; see the module docs.
#[derive(Debug, Clone)]
pub struct ApproxKvPolicy {
    config: ApproxConfig,
    kv: KvPolicy,
    cache: PredictedCache,
}

impl ApproxKvPolicy {
    pub fn new(config: ApproxConfig, kv: KvPolicy) -> Result<Self, RouteError> {
        if config.ttl == 0 || config.max_entries == 0 {
            return Err(RouteError::InvalidConfig(
                "approx-kv ttl and max entries must be positive".into(),
            ));
        }
        Ok(Self {
            config,
            kv,
            cache: PredictedCache::default(),
        })
    }

    pub fn predicted(&self) -> &PredictedCache {
        &self.cache
    }
}

impl Policy for ApproxKvPolicy {
    fn name(&self) -> &'static str {
        "approx-kv"
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
        self.cache.expire(request.now, self.config.ttl);
        let cache = &self.cache;
        let overlap_of =
            |w: &WorkerId| TierOverlap::uniform(cache.overlap(w, &request.block_hashes));
        let mut d = self
            .kv
            .decide("approx-kv", request, candidates, load, overlap_of)?;
        let idx = d
            .explanation
            .workers
            .iter()
            .position(|w| w.worker == d.worker)
            .unwrap_or(0);
        d.explanation.why = format!(
            "{} (overlap predicted from past decisions, no kv events)",
            kv_why(request, &d.explanation.workers, idx, d.explanation.sampled)
        );
        self.cache.record(
            &d.worker,
            &request.block_hashes,
            request.now,
            self.config.max_entries,
        );
        Ok(d)
    }

    fn worker_removed(&mut self, worker: &WorkerId) {
        self.cache.remove_worker(worker);
    }
}
