//! Sub-agent placement: where a request whose prefix another worker holds should run.
//!
//! A sub-agent (or any later turn of a session) shares its parent's leading blocks. The cost
//! model already sends it where that prefix is cheapest to reach: a worker holding it on device,
//! or one loading it from its host, disk or remote tier, against recomputing it. When the
//! holder is saturated (its queued prefill outweighs the hit), a third way is priced here: copy
//! the blocks the holder has on its device over the link between workers (the disaggregation
//! pull's link) to a less loaded worker, instead of recomputing them there. The copy is chosen
//! only where it is faster than recomputing the same tokens; the explanation shows both times.
//!
//! The copy's source is the candidate holding the longest device prefix ([`Decision::peer_source`]).
//! Fan-out stays fair through the same load terms: each sub-agent routed is booked on its worker
//! (its uncached tokens queue there), so the next one sees that queue and goes to the next
//! cheapest worker instead of piling onto the parent's.

use switchyard_core::{KvTierCosts, TierLink, WorkerId};

use super::Decision;

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
pub(crate) fn peer_copy(
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
    /// the first other candidate holding the longest device prefix, the one the copy was
    /// priced against.
    pub fn peer_source(&self) -> Option<&WorkerId> {
        let chosen = self.chosen()?;
        if chosen.onboarding.peer_blocks == 0 {
            return None;
        }
        let wanted = chosen.overlap.any_tier + chosen.onboarding.peer_blocks;
        self.explanation
            .workers
            .iter()
            .find(|w| w.worker != self.worker && w.overlap.device >= wanted)
            .map(|w| &w.worker)
    }
}
