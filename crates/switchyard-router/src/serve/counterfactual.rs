//! Counterfactuals: what another policy would have chosen for a decision already made.
//!
//! A decision's [`Explanation`](crate::policy::Explanation) already holds, per candidate and in the order the candidates
//! were given, the load figures the policy saw (queued prefill, running requests, decoding
//! sequences, active blocks) and the leading prompt blocks the index said it held, per tier.
//! [`RescoreBasis`] keeps the little the explanation lacks: the routing clock, the prompt's
//! first block hash and the session (the tie-break key of every policy), each candidate's
//! capacity, and — only when the deciding policy did not score with the index's overlap
//! (`approx-kv` predicts its own) — the index's overlap per candidate. About 80 bytes plus 8
//! per candidate (20 under `approx-kv`) on top of the explanation the decision log keeps anyway.
//!
//! [`rescore`] rebuilds exactly that moment — a [`PrefixIndex`] whose workers hold the recorded
//! overlap of a chain of blocks that starts with the recorded first block, a [`LoadView`] whose
//! reports are the recorded figures — and lets a freshly built policy choose over it with the
//! same [`Policy::choose`](crate::policy::Policy::choose) the live router calls. The index is the one *as recorded*, not the
//! index now: by the time anyone asks, the request itself has stored its prompt on the worker
//! it went to, and an index read now would favour the live choice. Policies with state start
//! fresh (round-robin at its first turn, random from its seed, session with no pins, approx-kv
//! with no predictions): their state at the decision's time is not kept. A decision among
//! many candidates explains only its best few (`policy::shortlist`): it is re-scored over those.

use switchyard_core::rng::mix64;
use switchyard_core::{BlockHash, BlockSize, LoadStats, SnapshotBlock, StorageTier};

use crate::error::RouteError;
use crate::index::{IndexConfig, PrefixIndex, TierOverlap};
use crate::load::{LoadConfig, LoadView, Tick};
use crate::policy::{Candidate, Decision, PolicyConfig, PolicyKind, RouteRequest};

/// What a decision keeps so that it can be re-scored later; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct RescoreBasis {
    /// The routing clock when the decision was made.
    pub now: Tick,
    /// The prompt's first full block (none for a prompt shorter than a block).
    pub first_block: Option<BlockHash>,
    pub session: Option<String>,
    /// Device capacity in blocks per candidate, in the explanation's order.
    pub capacity_blocks: Box<[u64]>,
    /// The index's overlap per candidate, when the explanation's is not the index's.
    pub index_overlap: Option<Box<[TierOverlap]>>,
}

impl RescoreBasis {
    /// The basis of `decision`, made for `request` over `index` and `load` (before or after the
    /// decision was booked: capacities and the index do not change with a booking).
    pub fn capture(
        request: &RouteRequest,
        decision: &Decision,
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Self {
        let workers = &decision.explanation.workers;
        let overlap_from_index = PolicyKind::named(decision.explanation.policy)
            .is_none_or(PolicyKind::scores_index_overlap);
        let index_overlap = (!overlap_from_index).then(|| {
            let scores = index.overlap(&request.block_hashes);
            workers
                .iter()
                .map(|w| {
                    index
                        .worker_key(&w.worker)
                        .map_or_else(TierOverlap::default, |k| scores.get(k))
                })
                .collect()
        });
        Self {
            now: request.now,
            first_block: request.block_hashes.first().copied(),
            session: request.session.clone(),
            capacity_blocks: workers
                .iter()
                .map(|w| load.capacity_blocks(&w.worker))
                .collect(),
            index_overlap,
        }
    }

    /// Bytes this basis holds, inline and on the heap.
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.session.as_ref().map_or(0, String::capacity)
            + self.capacity_blocks.len() * std::mem::size_of::<u64>()
            + self
                .index_overlap
                .as_ref()
                .map_or(0, |o| o.len() * std::mem::size_of::<TierOverlap>())
    }
}

/// What `kind` (built fresh from `config`) would have chosen for `decision`, over the
/// candidates, load and index overlap recorded at decision time; see the module docs.
pub fn rescore(
    kind: PolicyKind,
    config: &PolicyConfig,
    block_size: BlockSize,
    decision: &Decision,
    basis: &RescoreBasis,
) -> Result<Decision, RouteError> {
    let explanation = &decision.explanation;
    let prompt_blocks = explanation.prompt_blocks;
    // A chain standing for the prompt's blocks: the real first block (the tie-break key), then
    // hashes no real chain shares. Overlap only counts leading blocks, so which hashes follow
    // the first does not change any score.
    let block_hashes: Vec<BlockHash> = match basis.first_block {
        None => Vec::new(),
        Some(first) => std::iter::once(first)
            .chain((1..prompt_blocks as u64).map(|i| BlockHash(mix64(first.0 ^ mix64(i)))))
            .collect(),
    };
    let request = RouteRequest {
        block_hashes,
        prompt_tokens: explanation.prompt_tokens,
        block_size,
        session: basis.session.clone(),
        now: basis.now,
        // Rescored over the explanation's own candidates.
        adapter: None,
    };
    let mut index = PrefixIndex::new(IndexConfig {
        verify_hashes: false,
        ..IndexConfig::new(block_size)
    });
    let mut load = LoadView::new(LoadConfig::default());
    for (i, w) in explanation.workers.iter().enumerate() {
        let overlap = basis
            .index_overlap
            .as_ref()
            .and_then(|o| o.get(i).copied())
            .unwrap_or(w.overlap);
        let blocks = held_blocks(&request.block_hashes, overlap);
        if !blocks.is_empty() {
            // A fresh index accepts the snapshot of any worker (it only fails past its worker
            // cap, which one decision's candidates cannot reach).
            index
                .apply_snapshot(&w.worker, 0, 0, &blocks)
                .map_err(|e| RouteError::InvalidConfig(format!("rebuilding the index: {e}")))?;
        }
        let stats = LoadStats {
            queued_prefill_tokens: w.queued_prefill_tokens,
            running_requests: w.running_requests,
            active_decode_sequences: w.active_decode_sequences,
            active_blocks: w.active_blocks,
            capacity_blocks: basis.capacity_blocks.get(i).copied().unwrap_or(0),
            ..LoadStats::default()
        };
        load.report(&w.worker, stats, basis.now);
        load.report_transfer_queue(&w.worker, w.onboarding.queued_bytes);
    }
    // The tier costs the decision was priced with, announced or assumed as then.
    let candidates: Vec<Candidate> = explanation
        .workers
        .iter()
        .map(|w| Candidate {
            worker: w.worker.clone(),
            kv_tiers: w.onboarding.announced.then_some(w.onboarding.costs),
            kv_peer: None,
        })
        .collect();
    let mut policy = kind.build(config)?;
    policy.choose(&request, &candidates, &index, &load)
}

/// The snapshot of a worker whose leading blocks of `chain` have `overlap`: device blocks
/// first, then host, then disk, then remote, so the index computes the same nested counts.
fn held_blocks(chain: &[BlockHash], overlap: TierOverlap) -> Vec<SnapshotBlock> {
    let any = (overlap.any_tier as usize).min(chain.len());
    (0..any)
        .map(|i| {
            let tier = if i < overlap.device as usize {
                StorageTier::Device
            } else if i < overlap.device_or_host as usize {
                StorageTier::Host
            } else if i < overlap.device_host_or_disk as usize {
                StorageTier::Disk
            } else {
                StorageTier::Remote
            };
            SnapshotBlock {
                hash: chain[i],
                parent: i.checked_sub(1).map(|p| chain[p]),
                tier,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use switchyard_core::{KvEvent, StoredBlock, TokenId, WorkerId, block_hashes};

    use super::*;
    use crate::serve::ServingCore;

    const BS: u32 = 16;

    fn bs() -> BlockSize {
        BlockSize::new(BS).unwrap()
    }

    fn w(n: &str) -> WorkerId {
        WorkerId::new(n).unwrap()
    }

    /// A core where `a` holds 6 of the prompt's 8 blocks on device (2 more on host), `b` 2,
    /// and `a` is the busiest.
    fn busy_core(kind: PolicyKind) -> (ServingCore, RouteRequest, Vec<Candidate>) {
        let mut core = ServingCore::new(
            bs(),
            IndexConfig::new(bs()),
            LoadConfig::default(),
            kind,
            &PolicyConfig::default(),
        )
        .unwrap();
        let tokens: Vec<TokenId> = (0..8 * BS + 5).collect();
        let hashes = block_hashes(&tokens, bs());
        let stored = |from: usize, to: usize, tier| KvEvent::Stored {
            parent: from.checked_sub(1).map(|p| hashes[p]),
            blocks: (from..to)
                .map(|i| StoredBlock {
                    hash: hashes[i],
                    tokens: tokens[i * BS as usize..(i + 1) * BS as usize].to_vec(),
                })
                .collect(),
            tier,
        };
        core.index
            .apply(&w("a"), 1, 0, &stored(0, 6, StorageTier::Device))
            .unwrap();
        core.index
            .apply(&w("a"), 1, 1, &stored(6, 8, StorageTier::Host))
            .unwrap();
        core.index
            .apply(&w("b"), 1, 0, &stored(0, 2, StorageTier::Device))
            .unwrap();
        let report = |queued, active| LoadStats {
            queued_prefill_tokens: queued,
            running_requests: 3,
            active_blocks: active,
            capacity_blocks: 1000,
            ..LoadStats::default()
        };
        core.load.report(&w("a"), report(500, 40), 1);
        core.load.report(&w("b"), report(0, 4), 1);
        core.load.report(&w("c"), report(0, 0), 1);
        let request = crate::serve::route_request(&tokens, bs(), Some("s1".into()), 10);
        let candidates = ["a", "b", "c"].map(|n| Candidate::from(w(n))).to_vec();
        (core, request, candidates)
    }

    #[test]
    fn rescoring_under_each_policy_gives_what_that_policy_would_have_decided_then() {
        for live in PolicyKind::ALL {
            let (mut core, request, candidates) = busy_core(live);
            let (decision, _) = core.route_decode(&request, &candidates, 8).unwrap();
            let basis = RescoreBasis::capture(&request, &decision, &core.index, &core.load);
            // The request is booked now and later ones move the index: neither changes what
            // the decision is re-scored against.
            core.index.remove_worker(&w("b"));
            for kind in PolicyKind::ALL {
                let (mut fresh, request, candidates) = busy_core(kind);
                let want = fresh.route_decode(&request, &candidates, 8).unwrap().0;
                let got = rescore(kind, &PolicyConfig::default(), bs(), &decision, &basis).unwrap();
                assert_eq!(got, want, "live {live}, rescored {kind}");
            }
        }
    }

    #[test]
    fn the_basis_is_small_and_keeps_index_overlap_only_under_approx_kv() {
        let (mut core, request, candidates) = busy_core(PolicyKind::Kv);
        let (decision, _) = core.route_decode(&request, &candidates, 8).unwrap();
        let basis = RescoreBasis::capture(&request, &decision, &core.index, &core.load);
        assert!(basis.index_overlap.is_none());
        assert_eq!(
            basis.bytes(),
            std::mem::size_of::<RescoreBasis>() + 2 + 3 * 8
        );
        assert!(std::mem::size_of::<RescoreBasis>() <= 96);

        let (mut core, request, candidates) = busy_core(PolicyKind::ApproxKv);
        let (decision, _) = core.route_decode(&request, &candidates, 8).unwrap();
        let basis = RescoreBasis::capture(&request, &decision, &core.index, &core.load);
        let overlap = basis.index_overlap.as_deref().unwrap();
        assert_eq!(
            overlap[0],
            TierOverlap {
                device: 6,
                device_or_host: 8,
                device_host_or_disk: 8,
                any_tier: 8
            }
        );
        // Re-scored under kv, the index's overlap counts, not approx-kv's empty prediction.
        let kv = rescore(
            PolicyKind::Kv,
            &PolicyConfig::default(),
            bs(),
            &decision,
            &basis,
        );
        assert_eq!(kv.unwrap().explanation.workers[0].overlap, overlap[0]);
    }
}
