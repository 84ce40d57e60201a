//! The default policy: send the request where it will cost least.
//!
//! For each candidate:
//!
//! ```text
//! cost = prefill_weight × ((uncached_prompt_tokens + queued_prefill_tokens) / prefill rate
//!                          + onboarding seconds)
//!      + decode_weight  × active_blocks × block_size / prefill rate
//! ```
//!
//! The first term is the time standing between the request and its first token on that
//! worker: computing what it does not hold (the prompt past its cached leading blocks) and what
//! is already queued there, at the worker's announced prefill rate, plus bringing the cached
//! blocks held off the device (host, disk, remote) to it, priced from the worker's announced
//! tier bandwidths and latencies and its transfer queue (see `cost`). The second is decode
//! pressure: KV tokens of the sequences running there, each of which slows every decode step,
//! in the same seconds, so the weights say how much one second of queued prefill weighs against
//! the time to prefill the resident decode tokens (default 0.1).
//!
//! With `temperature == 0` the lowest cost wins; ties go to fewer running requests, then to the
//! highest rendezvous hash of (session id or first block hash, worker id), so equal cold
//! requests spread over workers while the same prompt keeps picking the same one, then to the
//! worker id. With `temperature > 0` the winner is sampled with probability
//! `∝ exp(-(cost - min) / (max - min) / temperature)` from a generator seeded by the policy
//! seed, so a run is reproducible.
//!
//! Among many candidates a decision without a temperature explains the best few only
//! (`shortlist`), and when the candidates are the model's whole roster it does not score each:
//! it prices the prompt's holders and reads the others from the load view's ranking by load
//! (`ranked`), so its work grows with the holders and the loads near the best, not with the
//! fleet. Either way the choice and the explanation are the full breakdown's.

use switchyard_core::WorkerId;

use super::cost;
pub use super::cost::KvConfig;
use super::dense::SlotOverlap;
use super::explain::{self, Explanation, WorkerScore, thousands};
use super::shortlist;
use super::{Candidate, Decision, Policy, RouteRequest, SharedAsk, ranked};
use crate::error::RouteError;
use crate::index::{PrefixIndex, TierOverlap};
use crate::load::LoadView;
use switchyard_core::rng::SplitMix64;

/// The `kv` policy; see the module docs.
#[derive(Debug, Clone)]
pub struct KvPolicy {
    config: KvConfig,
    rng: SplitMix64,
    /// Explain every candidate, however many (see `shortlist`).
    explain_all: bool,
}

impl KvPolicy {
    pub fn new(config: KvConfig, seed: u64) -> Result<Self, RouteError> {
        config.validate()?;
        Ok(Self {
            config,
            rng: SplitMix64::new(seed),
            explain_all: false,
        })
    }

    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// Scores with the given overlap source (the prefix index, or a prediction) and decides,
    /// explaining every candidate.
    pub fn decide(
        &mut self,
        policy: &'static str,
        request: &RouteRequest,
        candidates: &[Candidate],
        load: &LoadView,
        overlap_of: impl Fn(&WorkerId) -> TierOverlap,
    ) -> Result<Decision, RouteError> {
        if candidates.is_empty() {
            return Err(RouteError::NoCandidates);
        }
        let scorer = self.scorer(request, candidates, load, overlap_of);
        let mut scores = scorer.all();
        let sampled = self.config.temperature > 0.0 && scores.len() > 1;
        let chosen = if sampled {
            explain::sample(&mut scores, self.config.temperature, &mut self.rng)
        } else {
            explain::best(request, &scores)
        };
        let why = kv_why(request, &scores, chosen, sampled);
        Ok(finish(policy, request, scores, chosen, sampled, why))
    }

    /// [`KvPolicy::decide`] over the index's overlap without sampling (`None` when the policy
    /// samples): the best candidate, explained in full when `ask.explain_all` or when there
    /// are few candidates, else with the best few only: read from the load view's ranking when
    /// the candidates are its roster (`ranked`), else scored one by one (`shortlist`).
    fn decide_best(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
        ask: SharedAsk,
    ) -> Option<Result<Decision, RouteError>> {
        if self.config.temperature > 0.0 && candidates.len() > 1 {
            return None;
        }
        if let Err(err) = check_inputs(request, candidates, index) {
            return Some(Err(err));
        }
        let few = ask.explain_all || candidates.len() <= shortlist::EXPLAIN_ALL_UP_TO;
        let ranked = (!few && ask.rostered)
            .then(|| ranked::best_scores(request, candidates, index, load, &self.config))
            .flatten();
        let scores = match ranked {
            Some(scores) => scores,
            None => {
                let scorer = self.scorer(request, candidates, load, index_overlap(request, index));
                if few || scorer.prices_peer_copies() {
                    scorer.all()
                } else {
                    shortlist::best_scores(request, &scorer)
                }
            }
        };
        let chosen = explain::best(request, &scores);
        let why = kv_why(request, &scores, chosen, false);
        Some(Ok(finish("kv", request, scores, chosen, false, why)))
    }

    fn scorer<'a>(
        &'a self,
        request: &'a RouteRequest,
        candidates: &'a [Candidate],
        load: &'a LoadView,
        overlap_of: impl Fn(&WorkerId) -> TierOverlap,
    ) -> cost::Scorer<'a> {
        cost::Scorer::new(
            request,
            candidates,
            load,
            &self.config,
            overlap_of,
            cost::Pending::Counted,
        )
    }
}

/// Builds the decision for `scores[chosen]`.
pub(crate) fn finish(
    policy: &'static str,
    request: &RouteRequest,
    workers: Vec<WorkerScore>,
    chosen: usize,
    sampled: bool,
    why: String,
) -> Decision {
    let worker = workers[chosen].worker.clone();
    Decision {
        worker: worker.clone(),
        explanation: Explanation {
            policy,
            chosen: worker,
            why,
            prompt_tokens: request.prompt_tokens,
            prompt_blocks: request.block_hashes.len(),
            sampled,
            workers,
        },
    }
}

pub(crate) fn kv_why(
    request: &RouteRequest,
    scores: &[WorkerScore],
    chosen: usize,
    sampled: bool,
) -> String {
    let w = &scores[chosen];
    let how = if sampled {
        format!(
            "sampled with probability {:.2} for its predicted cost",
            w.probability.unwrap_or(0.0)
        )
    } else {
        "lowest predicted cost".to_owned()
    };
    let mut why = format!(
        "{}: {how} {:.3} s: prefill {} uncached + {} queued tokens ({} of {} prompt blocks cached on device{}), decode load {} active blocks",
        w.worker,
        w.score,
        thousands(w.uncached_prompt_tokens),
        thousands(w.queued_prefill_tokens),
        w.overlap.device,
        request.block_hashes.len(),
        onboarding_why(w),
        thousands(w.active_blocks),
    );
    if let Some(r) = explain::runner_up(request, scores, chosen) {
        let tie = if r.score == w.score {
            " (tie broken by running requests, then request hash)"
        } else {
            ""
        };
        why.push_str(&format!(
            "; runner-up {} cost {:.3} s ({} uncached + {} queued{}){tie}",
            r.worker,
            r.score,
            thousands(r.uncached_prompt_tokens),
            thousands(r.queued_prefill_tokens),
            onboarding_why(r),
        ));
    }
    why
}

/// `", 8 more loaded from host/disk/remote in 0.012 s (recompute 0.064 s)"`, or nothing when
/// the worker loads nothing.
fn onboarding_why(w: &WorkerScore) -> String {
    let o = &w.onboarding;
    let peer = if o.peer_blocks == 0 {
        String::new()
    } else {
        format!(
            ", {} more copied from a peer in {:.3} s (recompute {:.3} s)",
            o.peer_blocks, o.peer_seconds, o.peer_recompute_seconds
        )
    };
    if o.blocks() == 0 {
        return peer;
    }
    let assumed = if o.announced {
        ""
    } else {
        ", assumed tier costs"
    };
    format!(
        ", {} more loaded ({} host, {} disk, {} remote) in {:.3} s (recompute {:.3} s{assumed})",
        o.blocks(),
        o.host_blocks,
        o.disk_blocks,
        o.remote_blocks,
        o.seconds,
        o.recompute_seconds,
    ) + &peer
}

/// Checks the request was hashed like the index.
/// What every policy checks first: the request was hashed with the index's block size and
/// there is someone to choose from.
pub(crate) fn check_inputs(
    request: &RouteRequest,
    candidates: &[Candidate],
    index: &PrefixIndex,
) -> Result<(), RouteError> {
    if candidates.is_empty() {
        return Err(RouteError::NoCandidates);
    }
    if request.block_size != index.block_size() {
        return Err(RouteError::BlockSizeMismatch {
            request: request.block_size,
            index: index.block_size(),
        });
    }
    Ok(())
}

/// Overlap of every worker for the request, from the index, read by the index's worker slot
/// (`dense`).
pub(crate) fn index_overlap<'a>(
    request: &RouteRequest,
    index: &'a PrefixIndex,
) -> impl Fn(&WorkerId) -> TierOverlap + 'a {
    let dense = SlotOverlap::new(index, &index.overlap(&request.block_hashes));
    move |w: &WorkerId| dense.of(w)
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
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
        if let Some(decided) =
            self.choose_shared(request, candidates, index, load, SharedAsk::default())
        {
            return decided;
        }
        check_inputs(request, candidates, index)?;
        self.decide(
            "kv",
            request,
            candidates,
            load,
            index_overlap(request, index),
        )
    }

    fn explain_all(&mut self, all: bool) {
        self.explain_all = all;
    }

    fn choose_shared(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
        ask: SharedAsk,
    ) -> Option<Result<Decision, RouteError>> {
        let ask = SharedAsk {
            explain_all: ask.explain_all || self.explain_all,
            ..ask
        };
        self.decide_best(request, candidates, index, load, ask)
    }
}
