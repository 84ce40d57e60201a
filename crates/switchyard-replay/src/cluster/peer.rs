//! Prefix copies between workers: the placement half of sub-agent routing, carried out.
//!
//! With [`ClusterConfig::with_placement`] the router may price copying the device prefix a peer
//! holds instead of recomputing it (`switchyard_router`'s placement). When a decision does, the
//! request's blocks past the chosen worker's own cached prefix are pulled from the source
//! worker over the chosen worker's link, planned through its staging area and charged
//! with [`switchyard_engine_sim::TimingModel::transfer_time`] as the disaggregation pull is;
//! copies into one worker queue on its link. The blocks land as a held import (announced to
//! the index like computed blocks), the request is admitted then and finds them as a prefix
//! hit, and the hold goes at its first token. The copy is DMA: it delays this request only.
//! A copy that finds no room is cut short, and the request recomputes the rest.

use switchyard_core::{BlockHash, TierLink, TokenId};
use switchyard_engine_sim::{KvLayout, SimRequest};
use switchyard_router::serve::Booking;
use switchyard_router::{Candidate, Decision};

use super::{Cluster, ClusterConfig, Event};
use crate::workload::{Micros, Outbox, Workload};

use indicatif::ProgressBar;

/// Simulator ids of copy holds: apart from requests, prefills and disaggregation holds.
const PEER_HOLD_ID_BASE: u64 = 5 << 60;

/// Fixed cost of starting one copy between workers, in microseconds (the router prices with it).
const PEER_LATENCY_US: u64 = 10;

impl ClusterConfig {
    /// This configuration with sub-agent placement: the router may price copying a peer's
    /// device prefix over the workers' KV link (the simulator's `kv_transfer_gbps`), and the
    /// cluster carries those copies out.
    pub fn with_placement(mut self) -> Self {
        let bytes_per_s = self.sim.timing.kv_transfer_gbps * 1e9 / 8.0;
        self.policy_config.kv.peer_link = Some(TierLink {
            bytes_per_s: bytes_per_s.round().max(1.0) as u64,
            latency_us: PEER_LATENCY_US,
        });
        self
    }
}

/// A request whose prefix is on its way from a peer.
#[derive(Debug)]
pub(super) struct PeerCopy {
    worker: usize,
    request: SimRequest,
    /// The request's record.
    slot: usize,
    booking: Booking,
    parent: Option<BlockHash>,
    blocks: Vec<(BlockHash, Vec<TokenId>)>,
}

/// What the decision copies: the chosen worker's own cached blocks and the peer's blocks past
/// them, or `None` when it copies nothing.
pub(super) fn copy_range(decision: &Decision) -> Option<(u32, u32)> {
    // The cluster's workers announce no peer link: the configured one joins every pair.
    let candidates: Vec<Candidate> = (decision.explanation.workers.iter())
        .map(|w| Candidate::from(w.worker.clone()))
        .collect();
    decision.peer_source(&candidates)?;
    let chosen = decision.chosen()?;
    Some((chosen.overlap.any_tier, chosen.onboarding.peer_blocks))
}

impl Cluster {
    /// Starts copying blocks `own..own + count` of `request`'s prompt to worker `w`; the request
    /// is admitted when they land.
    pub(super) fn start_peer_copy(
        &mut self,
        w: usize,
        (own, count): (u32, u32),
        hashes: &[BlockHash],
        request: SimRequest,
        slot: usize,
        booking: Booking,
    ) {
        let bs = self.block_size.as_usize();
        let (own, count) = (own as usize, count as usize);
        let blocks: Vec<(BlockHash, Vec<TokenId>)> = hashes
            .iter()
            .enumerate()
            .skip(own)
            .take(count)
            .filter_map(|(i, &h)| Some((h, request.prompt.get(i * bs..(i + 1) * bs)?.to_vec())))
            .collect();
        let layout = self
            .config
            .disagg
            .as_ref()
            .map_or_else(KvLayout::default, |d| d.layout);
        let worker = &mut self.workers[w];
        let plan =
            worker
                .staging
                .plan(&layout, &layout, self.block_size.get(), blocks.len() as u32);
        let link = worker
            .sim
            .config()
            .timing
            .transfer_time(plan.bytes, plan.descriptors);
        let start = worker.peer_link_free_at.max(self.now);
        let at = start + PEER_LATENCY_US + link.as_micros() as Micros;
        worker.peer_link_free_at = at;
        let stats = &mut self.flows.stats;
        stats.peer_copies += 1;
        stats.peer_bytes += plan.bytes;
        stats.transfer_s += link.as_secs_f64();
        let parent = own.checked_sub(1).and_then(|i| hashes.get(i).copied());
        self.schedule(
            at,
            Event::PeerLanded(Box::new(PeerCopy {
                worker: w,
                request,
                slot,
                booking,
                parent,
                blocks,
            })),
        );
    }

    /// A copy landed: the worker imports it, held for the request, and admits the request.
    pub(super) fn peer_landed(
        &mut self,
        copy: PeerCopy,
        workload: &mut dyn Workload,
        out: &mut Outbox,
        progress: &ProgressBar,
    ) {
        let PeerCopy {
            worker: w,
            request,
            slot,
            booking,
            parent,
            blocks,
        } = copy;
        let hold = PEER_HOLD_ID_BASE + request.id;
        let outcome = self.workers[w]
            .sim
            .import_blocks(Some(hold), parent, &blocks);
        self.flows.stats.blocks_not_placed += (blocks.len() - outcome.imported) as u64;
        self.flows.stats.peer_blocks += outcome.imported as u64;
        self.publish(w, outcome.events);
        self.peer_holds.insert(request.id, (w, hold));
        let id = request.id;
        self.admit(w, request, slot, booking, workload, out, progress);
        if !self.live.contains_key(&id) {
            self.peer_admitted(id);
        }
    }

    /// The request's first token (or its failure): the copy's hold goes.
    pub(super) fn peer_admitted(&mut self, id: u64) {
        if let Some((w, hold)) = self.peer_holds.remove(&id) {
            self.workers[w].sim.release_hold(hold);
        }
    }
}
