//! Sub-agent placement: where a request whose prefix another worker holds should run.
//!
//! A sub-agent (or any later turn of a session) shares its parent's leading blocks. The cost
//! model already sends it where that prefix is cheapest to reach: a worker holding it on device,
//! or one loading it from its host, disk or remote tier, against recomputing it. When the
//! holder is saturated (its queued prefill outweighs the hit), a third way is priced here: copy
//! the blocks the holder has on its device over the link between workers to a less loaded
//! worker, instead of recomputing them there. The copy is chosen only where it is faster than
//! recomputing the same tokens; the explanation shows both times.
//!
//! Which pairs can copy ([`PeerView`]): a worker that announced a peer link
//! ([`switchyard_core::WorkerInfo::kv_peer`], carried in [`super::Candidate::kv_peer`]) takes a
//! copy over that link from another such worker of its engine kind (the live gateway: vLLM
//! pulls through its KV connector, TensorRT-LLM through its cache transceiver, the simulator
//! over `PullKv`); a pair where either side announced none, or of two engine kinds, is never
//! priced a copy and recomputes. The replay lab's cluster instead sets one link for all of
//! its workers ([`super::KvConfig::peer_link`]), which applies between candidates that announce
//! none.
//!
//! The copy's source is the compatible candidate holding the longest device prefix
//! ([`Decision::peer_source`]). Fan-out stays fair through the same load terms: each sub-agent
//! routed is booked on its worker (its uncached tokens queue there), so the next one sees that
//! queue and goes to the next cheapest worker instead of piling onto the parent's.

use serde::Serialize;
use switchyard_core::{EngineKind, KvTierCosts, TierLink, WorkerId};

use super::{Candidate, Decision};
use crate::index::TierOverlap;

/// A worker's announced peer link and the engine kind whose KV it exchanges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeerLink {
    pub engine: EngineKind,
    pub link: TierLink,
}

/// Whether `to` can take a copy of `from`'s KV: both announced a peer link for the same engine
/// kind, or neither announced one (the configured link of the replay lab's cluster, applied
/// only when one is set).
fn compatible(to: &Candidate, from: &Candidate) -> bool {
    match (to.kv_peer, from.kv_peer) {
        (Some(a), Some(b)) => a.engine == b.engine,
        (None, None) => true,
        _ => false,
    }
}

/// The copies a request's candidates could take from each other: per candidate, the longest
/// device prefix a compatible peer holds, and the link it would come over.
pub(crate) struct PeerView<'a> {
    candidates: &'a [Candidate],
    overlaps: &'a [TierOverlap],
    configured: Option<TierLink>,
}

impl<'a> PeerView<'a> {
    /// Over `candidates` with their `overlaps` (same order); `configured` is the one link of
    /// the replay lab's cluster ([`super::KvConfig::peer_link`]).
    pub(crate) fn new(
        candidates: &'a [Candidate],
        overlaps: &'a [TierOverlap],
        configured: Option<TierLink>,
    ) -> Self {
        Self {
            candidates,
            overlaps,
            configured,
        }
    }

    /// The copy candidate `i` (with `costs`) would take: from the compatible peer holding the
    /// longest device prefix, over its announced link (or the configured one); none when it
    /// can exchange KV with no one.
    pub(crate) fn copy_for(&self, i: usize, costs: &KvTierCosts, block_size: u32) -> PeerCopy {
        let Some(to) = self.candidates.get(i) else {
            return PeerCopy::default();
        };
        let Some(link) = to.kv_peer.map(|p| p.link).or(self.configured) else {
            return PeerCopy::default();
        };
        let own = self.overlaps.get(i).map_or(0, |o| o.any_tier);
        let peer_device = (self.candidates.iter().zip(self.overlaps))
            .enumerate()
            .filter(|&(j, (from, _))| j != i && compatible(to, from))
            .map(|(_, (_, o))| o.device)
            .max()
            .unwrap_or(0);
        peer_copy(own, peer_device, &link, costs, block_size)
    }
}

/// Blocks of a peer's device prefix a worker would copy, and how long the copy takes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct PeerCopy {
    pub blocks: u32,
    pub seconds: f64,
    /// Seconds recomputing the same tokens would take instead.
    pub recompute_seconds: f64,
}

/// The copy that would extend a worker's own cached prefix of `own` blocks to the
/// `peer_device` blocks the best peer holds on device, over `link`; none when the peer holds no
/// more than the worker, or when recomputing the difference is no slower.
fn peer_copy(
    own: u32,
    peer_device: u32,
    link: &TierLink,
    costs: &KvTierCosts,
    block_size: u32,
) -> PeerCopy {
    let blocks = peer_device.saturating_sub(own);
    if blocks == 0 {
        return PeerCopy::default();
    }
    let seconds = link.seconds(u64::from(blocks) * costs.bytes_per_block, 0);
    let recompute_seconds = costs.recompute_seconds(u64::from(blocks) * u64::from(block_size));
    if seconds >= recompute_seconds {
        return PeerCopy::default();
    }
    PeerCopy {
        blocks,
        seconds,
        recompute_seconds,
    }
}

impl Decision {
    /// The worker the chosen worker copies its prefix from, when the decision priced a copy:
    /// the first other candidate among `candidates` (the ones it was decided over) that can
    /// hand the chosen worker its KV and holds the longest device prefix, the one the copy
    /// was priced against.
    pub fn peer_source(&self, candidates: &[Candidate]) -> Option<&WorkerId> {
        let chosen = self.chosen()?;
        if chosen.onboarding.peer_blocks == 0 {
            return None;
        }
        let to = candidates.iter().find(|c| c.worker == self.worker)?;
        let can_give = |w: &WorkerId| {
            candidates
                .iter()
                .any(|c| c.worker == *w && compatible(to, c))
        };
        let wanted = chosen.overlap.any_tier + chosen.onboarding.peer_blocks;
        self.explanation
            .workers
            .iter()
            .find(|w| w.worker != self.worker && w.overlap.device >= wanted && can_give(&w.worker))
            .map(|w| &w.worker)
    }
}
