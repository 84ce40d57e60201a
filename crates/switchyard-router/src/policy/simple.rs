//! Policies that ignore the caches: round robin, random, least loaded. They exist for
//! comparison and still fill the full breakdown (overlap included) so their explanations show
//! what a cache-aware choice would have seen.

use super::cost;
use super::explain::{self, thousands};
use super::kv::{KvConfig, check_inputs, finish, index_overlap};
use super::{Candidate, Decision, Policy, RouteRequest, WorkerScore};
use crate::error::RouteError;
use crate::index::PrefixIndex;
use crate::load::LoadView;
use switchyard_core::rng::SplitMix64;

/// What each of these policies starts from: the inputs checked, then every candidate's full
/// breakdown (overlap included), whose `score` the policy then overwrites with its own.
fn checked_breakdown(
    config: &KvConfig,
    request: &RouteRequest,
    candidates: &[Candidate],
    index: &PrefixIndex,
    load: &LoadView,
) -> Result<Vec<WorkerScore>, RouteError> {
    check_inputs(request, candidates, index)?;
    Ok(cost::breakdown(
        request,
        candidates,
        load,
        config,
        index_overlap(request, index),
        cost::Pending::Ignored,
    ))
}

/// Candidates in turn, in the order the caller gives them. `score` is each candidate's distance
/// (in turns) from the one whose turn it is.
#[derive(Debug, Clone)]
pub struct RoundRobinPolicy {
    config: KvConfig,
    next: u64,
}

impl RoundRobinPolicy {
    pub fn new(config: KvConfig) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self { config, next: 0 })
    }
}

impl Policy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        let mut scores = checked_breakdown(&self.config, request, candidates, index, load)?;
        let n = candidates.len() as u64;
        let chosen = (self.next % n) as usize;
        self.next = self.next.wrapping_add(1);
        for (i, s) in scores.iter_mut().enumerate() {
            s.score = ((i as u64 + n - chosen as u64) % n) as f64;
        }
        let why = format!(
            "{}: its turn in round-robin order ({} of {} candidates)",
            scores[chosen].worker,
            chosen + 1,
            n
        );
        Ok(finish(self.name(), request, scores, chosen, false, why))
    }
}

/// A uniformly random candidate from a seeded generator. `score` is 0 for every candidate.
#[derive(Debug, Clone)]
pub struct RandomPolicy {
    config: KvConfig,
    rng: SplitMix64,
}

impl RandomPolicy {
    pub fn new(config: KvConfig, seed: u64) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self {
            config,
            rng: SplitMix64::new(seed),
        })
    }
}

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        let mut scores = checked_breakdown(&self.config, request, candidates, index, load)?;
        let chosen = self.rng.below(candidates.len());
        let p = 1.0 / candidates.len() as f64;
        for s in &mut scores {
            s.score = 0.0;
            s.probability = Some(p);
        }
        let why = format!(
            "{}: drawn uniformly at random from {} candidates",
            scores[chosen].worker,
            candidates.len()
        );
        Ok(finish(self.name(), request, scores, chosen, true, why))
    }
}

/// The lowest `prefill_weight × queued prefill seconds + decode_weight × active KV tokens /
/// prefill rate`, that is the kv cost without the cache terms; ties as in `kv`.
#[derive(Debug, Clone)]
pub struct LeastLoadedPolicy {
    config: KvConfig,
}

impl LeastLoadedPolicy {
    pub fn new(config: KvConfig) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self { config })
    }
}

impl Policy for LeastLoadedPolicy {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        let mut scores = checked_breakdown(&self.config, request, candidates, index, load)?;
        for s in &mut scores {
            s.score = self.config.prefill_weight
                * s.onboarding
                    .costs
                    .recompute_seconds(s.queued_prefill_tokens)
                + s.decode_term;
        }
        let chosen = explain::best(request, &scores);
        let w = &scores[chosen];
        let why = format!(
            "{}: least loaded ({} queued prefill tokens, {} active blocks, {} running requests)",
            w.worker,
            thousands(w.queued_prefill_tokens),
            thousands(w.active_blocks),
            w.running_requests
        );
        Ok(finish(self.name(), request, scores, chosen, false, why))
    }
}
