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

use std::fmt::Write as _;

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
    // One buffer written in place: the sentence is built for every decision.
    let w = &scores[chosen];
    let mut why = String::with_capacity(320);
    let _ = write!(why, "{}: ", w.worker);
    if sampled {
        let _ = write!(
            why,
            "sampled with probability {:.2} for its predicted cost",
            w.probability.unwrap_or(0.0)
        );
    } else {
        why.push_str("lowest predicted cost");
    }
    let _ = write!(
        why,
        " {:.3} s: prefill {} uncached + {} queued tokens ({} of {} prompt blocks cached on device{}), decode load {} active blocks",
        w.score,
        thousands(w.uncached_prompt_tokens),
        thousands(w.queued_prefill_tokens),
        w.overlap.device,
        request.block_hashes.len(),
        OnboardingWhy(w),
        thousands(w.active_blocks),
    );
    if let Some(r) = explain::runner_up(request, scores, chosen) {
        let tie = if r.score == w.score {
            " (tie broken by running requests, then request hash)"
        } else {
            ""
        };
        let _ = write!(
            why,
            "; runner-up {} cost {:.3} s ({} uncached + {} queued{}){tie}",
            r.worker,
            r.score,
            thousands(r.uncached_prompt_tokens),
            thousands(r.queued_prefill_tokens),
            OnboardingWhy(r),
        );
    }
    why
}

/// `", 8 more loaded from host/disk/remote in 0.012 s (recompute 0.064 s)"`, or nothing when
/// the worker loads nothing.
struct OnboardingWhy<'a>(&'a WorkerScore);

impl std::fmt::Display for OnboardingWhy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = &self.0.onboarding;
        if o.blocks() > 0 {
            let assumed = if o.announced {
                ""
            } else {
                ", assumed tier costs"
            };
            write!(
                f,
                ", {} more loaded ({} host, {} disk, {} remote) in {:.3} s (recompute {:.3} s{assumed})",
                o.blocks(),
                o.host_blocks,
                o.disk_blocks,
                o.remote_blocks,
                o.seconds,
                o.recompute_seconds,
            )?;
        }
        if o.peer_blocks > 0 {
            write!(
                f,
                ", {} more copied from a peer in {:.3} s (recompute {:.3} s)",
                o.peer_blocks, o.peer_seconds, o.peer_recompute_seconds
            )?;
        }
        Ok(())
    }
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

#[cfg(test)]
mod why_tests {
    use switchyard_core::{BlockHash, BlockSize, KvTierCosts, WorkerId};

    use super::kv_why;
    use crate::index::TierOverlap;
    use crate::policy::RouteRequest;
    use crate::policy::cost::Onboarding;
    use crate::policy::explain::WorkerScore;

    fn score(worker: &str, cost: f64, uncached: u64, queued: u64, active: u64) -> WorkerScore {
        WorkerScore {
            worker: WorkerId::new(worker).unwrap(),
            overlap: TierOverlap {
                device: 3,
                device_or_host: 3,
                device_host_or_disk: 3,
                any_tier: 3,
            },
            pending_blocks: 0,
            uncached_prompt_tokens: uncached,
            queued_prefill_tokens: queued,
            running_requests: 0,
            active_decode_sequences: 0,
            active_blocks: active,
            kv_utilisation: 0.0,
            onboarding: Onboarding {
                host_blocks: 0,
                disk_blocks: 0,
                remote_blocks: 0,
                bytes: 0,
                queued_bytes: 0,
                seconds: 0.0,
                recompute_seconds: 0.0,
                peer_blocks: 0,
                peer_seconds: 0.0,
                peer_recompute_seconds: 0.0,
                costs: KvTierCosts::typical(1 << 20),
                announced: true,
            },
            overflow_blocks: 0,
            prefill_term: cost,
            decode_term: 0.0,
            score: cost,
            probability: None,
        }
    }

    /// The whole sentence, every clause: thousands separators, the loaded and copied prefix,
    /// assumed costs, sampling, the runner-up and its tie.
    #[test]
    fn the_sentence_names_every_figure() {
        let request = RouteRequest {
            block_hashes: (0..12).map(BlockHash).collect(),
            prompt_tokens: 1_234_567,
            block_size: BlockSize::new(16).unwrap(),
            session: None,
            now: 0,
            adapter: None,
        };
        let mut chosen = score("w1", 0.5, 1_234_567, 1000, 987_654_321);
        chosen.onboarding.host_blocks = 5;
        chosen.onboarding.disk_blocks = 2;
        chosen.onboarding.remote_blocks = 1;
        chosen.onboarding.seconds = 0.0125;
        chosen.onboarding.recompute_seconds = 0.064;
        chosen.onboarding.announced = false;
        chosen.onboarding.peer_blocks = 48;
        chosen.onboarding.peer_seconds = 0.002;
        chosen.onboarding.peer_recompute_seconds = 0.03;
        let mut other = score("w2", 0.75, 999, 12_000, 0);
        other.onboarding.peer_blocks = 4;
        other.onboarding.peer_seconds = 0.001;
        other.onboarding.peer_recompute_seconds = 0.004;
        let scores = vec![chosen, other];
        assert_eq!(
            kv_why(&request, &scores, 0, false),
            "w1: lowest predicted cost 0.500 s: prefill 1,234,567 uncached + 1,000 queued tokens \
             (3 of 12 prompt blocks cached on device, 8 more loaded (5 host, 2 disk, 1 remote) in \
             0.013 s (recompute 0.064 s, assumed tier costs), 48 more copied from a peer in 0.002 s \
             (recompute 0.030 s)), decode load 987,654,321 active blocks; runner-up w2 cost 0.750 s \
             (999 uncached + 12,000 queued, 4 more copied from a peer in 0.001 s (recompute \
             0.004 s))"
        );
        let mut sampled = scores;
        sampled[0].probability = Some(0.625);
        sampled[0].onboarding = sampled[1].onboarding;
        sampled[0].onboarding.peer_blocks = 0;
        sampled[1].score = 0.5;
        assert_eq!(
            kv_why(&request, &sampled, 0, true),
            "w1: sampled with probability 0.62 for its predicted cost 0.500 s: prefill 1,234,567 \
             uncached + 1,000 queued tokens (3 of 12 prompt blocks cached on device), decode load \
             987,654,321 active blocks; runner-up w2 cost 0.500 s (999 uncached + 12,000 queued, 4 \
             more copied from a peer in 0.001 s (recompute 0.004 s)) (tie broken by running \
             requests, then request hash)"
        );
        assert_eq!(
            kv_why(&request, &sampled[..1], 0, false),
            "w1: lowest predicted cost 0.500 s: prefill 1,234,567 uncached + 1,000 queued tokens \
             (3 of 12 prompt blocks cached on device), decode load 987,654,321 active blocks"
        );
    }
}
