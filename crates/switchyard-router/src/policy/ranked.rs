//! Deciding among many candidates without scoring each: the `kv` decision over the load
//! view's ranking of the model's roster (`load::ranking`).
//!
//! A worker that holds none of the prompt (no block in any tier, none pending) costs
//! `(prefill_weight × prompt + key) / rate`, where `key` depends on its load alone; the ranking
//! keeps the roster per prefill rate in buckets of equal load ordered by `key`. So the
//! [`EXPLAINED`] best under the choice rule are found among:
//!
//! - the *holders* (the index's overlap and the pending prefixes), each priced in full, the
//!   index's deepest first, until the least cost a holder as deep as the next can have (its
//!   uncached prompt plus the lowest load of a rate group, over that rate) is above the worst
//!   of the best kept: those left cost more, whether priced as holders or, in the buckets, as
//!   workers holding none (a bound below that cost too), so they are neither priced nor read,
//!   and the index stops there ([`PrefixIndex::overlap_deepest_first_while`]) unless a worker
//!   with pending blocks is still to be found (its overlap in the index, the pending blocks
//!   counted on top, is priced after the walk);
//! - per rate group, the buckets of the other workers in `key` order, each bucket priced once
//!   (its workers cost the same to the bit: [`cost::figures_of`] reads nothing else of them),
//!   its workers compared by the rendezvous hash when they tie, until the lowest cost the next
//!   bucket can have is above the worst of the best kept.
//!
//! The result is the shortlist's (`shortlist`) exactly: the same total order over the same
//! costs, and a worker is left unread only when its cost is certainly above the
//! [`EXPLAINED`]-th best. The bound divides `prefill_weight × prompt + key` by the rate and
//! lowers it by a millionth of a millionth, far more than the rounding of the few operations
//! between it and the cost the scorer computes (a few units in the last place).
//!
//! A decision's work is then the index's overlap walk down to the cut (for thousands of
//! holders of one system prompt, one map lookup per depth where some stop and the holders
//! read), their pricing, the buckets read, and the workers of the buckets read: with loads that differ, a few buckets of
//! one worker each; when many idle workers tie (one bucket of equal load), every one of them is
//! hashed (a multiply-and-shift over a list of positions, with no id read), as the rendezvous
//! rule must see them all to pick among them.

use std::cmp::Ordering;
use std::ops::ControlFlow;

use switchyard_core::KvTierCosts;
use switchyard_core::rng::mix64;

use super::cost::{self, KvConfig};
use super::explain::{self, WorkerScore};
use super::placement::PeerCopy;
use super::shortlist::EXPLAINED;
use super::{Candidate, RouteRequest};
use crate::hasher::FxHashMap;
use crate::index::{PrefixIndex, TierOverlap, WorkerKey};
use crate::load::ranking::Ranking;
use crate::load::{LoadView, WorkerLoad};

/// How far below the exact bucket bound the cut-off is placed (see the module docs).
const BOUND_MARGIN: f64 = 1e-12;

/// A candidate kept among the best so far.
#[derive(Debug, Clone, Copy)]
struct Pick {
    cost: f64,
    running: u64,
    rendezvous: u64,
    pos: u32,
    overlap: TierOverlap,
    pending: u32,
}

/// Which workers of a bucket can enter the best kept, all of whom tie on cost and running
/// requests: every one, those whose rendezvous hash is at least the worst kept's (the
/// bucket ties with it; an equal hash goes on to the id), or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    All,
    From(u64),
    Closed,
}

/// The best so far, best first, at most [`EXPLAINED`].
struct Top<'a> {
    picks: Vec<Pick>,
    candidates: &'a [Candidate],
}

impl Top<'_> {
    /// Whether `a` goes before `b` under the choice rule (`explain::order`).
    fn beats(&self, a: &Pick, b: &Pick) -> bool {
        let by_id = || {
            self.candidates[a.pos as usize]
                .worker
                .cmp(&self.candidates[b.pos as usize].worker)
        };
        a.cost
            .total_cmp(&b.cost)
            .then(a.running.cmp(&b.running))
            .then(b.rendezvous.cmp(&a.rendezvous))
            .then_with(by_id)
            == Ordering::Less
    }

    fn full(&self) -> bool {
        self.picks.len() == EXPLAINED
    }

    /// The cost of the worst kept, once full.
    fn cut(&self) -> Option<f64> {
        self.full().then(|| self.picks[EXPLAINED - 1].cost)
    }

    /// Which workers of a bucket costing `cost` with `running` requests can still enter.
    fn gate(&self, cost: f64, running: u64) -> Gate {
        let Some(last) = self.picks.get(EXPLAINED - 1) else {
            return Gate::All;
        };
        match cost.total_cmp(&last.cost).then(running.cmp(&last.running)) {
            Ordering::Less => Gate::All,
            Ordering::Equal => Gate::From(last.rendezvous),
            Ordering::Greater => Gate::Closed,
        }
    }

    fn offer(&mut self, new: Pick) {
        if self.full() && !self.beats(&new, &self.picks[EXPLAINED - 1]) {
            return;
        }
        let at = (self.picks.iter())
            .position(|p| self.beats(&new, p))
            .unwrap_or(self.picks.len());
        self.picks.insert(at, new);
        self.picks.truncate(EXPLAINED);
    }
}

/// The breakdowns of the [`EXPLAINED`] best candidates under the choice rule, in the
/// candidates' order, read from the load view's ranking: `candidates` must be the ranking's
/// roster itself, in its order (`SharedAsk::rostered`). `None` when the ranking cannot decide
/// this request (another weighting or block size, peer copies priced): the caller scores every
/// candidate.
pub(crate) fn best_scores(
    request: &RouteRequest,
    candidates: &[Candidate],
    index: &PrefixIndex,
    load: &LoadView,
    cfg: &KvConfig,
) -> Option<Vec<WorkerScore>> {
    let ranking = load.ranking();
    let bs = request.block_size.get();
    let weights = ranking.weights()?;
    let usable = weights.prefill_weight == cfg.prefill_weight
        && weights.decode_weight == cfg.decode_weight
        && weights.block_size == bs
        && ranking.len() == candidates.len()
        && cfg.peer_link.is_none()
        && !ranking.prices_peer_copies();
    if !usable {
        return None;
    }
    let key = explain::request_key(request);
    let mut top = Top {
        picks: Vec::with_capacity(EXPLAINED + 1),
        candidates,
    };
    let Pending {
        indexed: mut pending_of,
        unindexed: mut with_pending,
    } = pending(request, index, load, ranking, cfg);
    let mut holding = vec![0u64; candidates.len().div_ceil(64)];
    // Holders come grouped by where they stop in the prompt, and most of a group have the same
    // load and tier rates: those priced alike are priced once (the same inputs, to the bit).
    let mut last: Option<(TierOverlap, &WorkerLoad, Option<KvTierCosts>, f64)> = None;
    let mut price = |top: &mut Top, pos: u32, overlap: TierOverlap, pending: u32| {
        holding[pos as usize / 64] |= 1 << (pos % 64);
        let l = ranking.load(pos);
        let c = &candidates[pos as usize];
        let cost = match last {
            Some((o, lo, tiers, cost)) if o == overlap && *lo == *l && tiers == c.kv_tiers => cost,
            _ => {
                let figures = cost::figures_of(request, cfg, c, overlap, l, PeerCopy::default());
                let cost = figures.cost();
                last = Some((overlap, l, c.kv_tiers, cost));
                cost
            }
        };
        if top.cut().is_some_and(|cut| cost > cut) {
            return;
        }
        top.offer(Pick {
            cost,
            running: l.running_requests,
            rendezvous: mix64(key ^ ranking.id_hash(pos)),
            pos,
            overlap,
            pending,
        });
    };
    for &(pos, overlap, pending) in &with_pending {
        price(&mut top, pos, overlap, pending);
    }
    with_pending.clear();
    // Deepest first: once the least cost a holder this deep can have is above the worst kept,
    // so is every holder after it, and the index stops (see the module docs), unless a worker
    // with pending blocks is still to be found (its overlap with them counted, it is priced
    // after the walk).
    // Made once the best kept are full (a decision among a few holders never needs it).
    let mut floor: Option<Option<Floor>> = None;
    let mut floor_at: Option<(u32, f64)> = None;
    let mut cut_off = false;
    let _ = index.overlap_deepest_first_while(&request.block_hashes, |worker, overlap| {
        if !pending_of.is_empty()
            && let Some((pos, n)) = pending_of.remove(&worker)
        {
            with_pending.push((pos, cost::with_pending(overlap, n), n));
        } else if !cut_off {
            if let Some(cut) = top.cut()
                && let Some(floor) =
                    floor.get_or_insert_with(|| Floor::new(request, ranking, cfg.prefill_weight))
            {
                let least = match floor_at {
                    Some((depth, least)) if depth == overlap.any_tier => least,
                    _ => {
                        let least = floor.least(overlap.any_tier);
                        floor_at = Some((overlap.any_tier, least));
                        least
                    }
                };
                cut_off = least > cut;
            }
            if !cut_off && let Some(pos) = position_of(index, ranking, worker) {
                price(&mut top, pos, overlap, 0);
            }
        }
        if cut_off && pending_of.is_empty() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    // Those holding none of the prompt.
    with_pending.extend((pending_of.into_values()).map(|(pos, n)| pending_only(pos, n)));
    for &(pos, overlap, pending) in &with_pending {
        price(&mut top, pos, overlap, pending);
    }
    let prompt = cfg.prefill_weight * request.prompt_tokens as f64;
    for group in ranking.groups() {
        let rate = group.prefill_tokens_per_s as f64;
        for (bucket, members) in group.buckets() {
            if let Some(cut) = top.cut() {
                let least = (prompt + bucket.weighted_tokens()) / rate * (1.0 - BOUND_MARGIN);
                if least > cut {
                    break;
                }
            }
            let Some(&first) = members.first() else {
                continue;
            };
            let l = ranking.load(first);
            let none = TierOverlap::default();
            let c = &candidates[first as usize];
            let cost = cost::figures_of(request, cfg, c, none, l, PeerCopy::default()).cost();
            let running = l.running_requests;
            let mut gate = top.gate(cost, running);
            for &pos in members {
                let rendezvous = match gate {
                    Gate::Closed => break,
                    Gate::All => mix64(key ^ ranking.id_hash(pos)),
                    Gate::From(floor) => {
                        let r = mix64(key ^ ranking.id_hash(pos));
                        if r < floor {
                            continue;
                        }
                        r
                    }
                };
                if holding[pos as usize / 64] & (1 << (pos % 64)) != 0 {
                    continue;
                }
                top.offer(Pick {
                    cost,
                    running,
                    rendezvous,
                    pos,
                    overlap: none,
                    pending: 0,
                });
                gate = top.gate(cost, running);
            }
        }
    }
    let mut picks = top.picks;
    picks.sort_unstable_by_key(|p| p.pos);
    Some(
        picks
            .into_iter()
            .map(|p| {
                let c = &candidates[p.pos as usize];
                let l = *ranking.load(p.pos);
                let figures = cost::figures_of(request, cfg, c, p.overlap, &l, PeerCopy::default());
                cost::breakdown_of(c, p.overlap, p.pending, l, figures)
            })
            .collect(),
    )
}

/// The roster's workers with pending blocks of the prompt (`LoadView::pending_leading`).
struct Pending {
    /// Those the index knows, by index key, with their roster position and pending blocks:
    /// their overlap is found in the index walk, the pending blocks counted on top of it
    /// (`cost::with_pending`).
    indexed: FxHashMap<WorkerKey, (u32, u32)>,
    /// The others, by position, with their overlap (the pending blocks) and the pending blocks.
    unindexed: Vec<(u32, TierOverlap, u32)>,
}

/// The worker at roster position `pos` holding nothing of the prompt but the `n` leading blocks
/// requests in flight bring it: its overlap, those counted, and `n`.
fn pending_only(pos: u32, n: u32) -> (u32, TierOverlap, u32) {
    (pos, cost::with_pending(TierOverlap::default(), n), n)
}

fn pending(
    request: &RouteRequest,
    index: &PrefixIndex,
    load: &LoadView,
    ranking: &Ranking,
    cfg: &KvConfig,
) -> Pending {
    let pending = load.pending_leading(
        &request.block_hashes,
        request.block_size.get(),
        cfg.prefill_step_tokens,
    );
    let mut pending_of: FxHashMap<WorkerKey, (u32, u32)> = FxHashMap::default();
    let mut unindexed = Vec::new();
    for (w, n) in &pending {
        let Some(pos) = ranking.position(w) else {
            continue;
        };
        match index.worker_key(w) {
            Some(k) => {
                pending_of.insert(k, (pos, *n));
            }
            None => unindexed.push(pending_only(pos, *n)),
        }
    }
    Pending {
        indexed: pending_of,
        unindexed,
    }
}

/// The least cost a worker of the roster holding `any_tier` leading blocks of the prompt can
/// have: its prompt past them, plus the lowest `key` of a prefill rate's workers, over that
/// rate (`load::ranking`), the least over the rates, lowered by [`BOUND_MARGIN`]. The memory
/// term and the onboarding only add to a cost, so no worker holding as much costs less. `None`
/// when some worker of the roster is in no bucket (it left: its load is not the ranking's).
struct Floor {
    prompt_tokens: u64,
    block_size: u64,
    prefill_weight: f64,
    /// Per rate group: its least `key` and its rate.
    groups: Vec<(f64, f64)>,
}

impl Floor {
    fn new(request: &RouteRequest, ranking: &Ranking, prefill_weight: f64) -> Option<Self> {
        if !ranking.all_ranked() {
            return None;
        }
        let groups = (ranking.groups().iter())
            .filter_map(|g| {
                let (least, _) = g.buckets().next()?;
                Some((least.weighted_tokens(), g.prefill_tokens_per_s as f64))
            })
            .collect();
        Some(Floor {
            prompt_tokens: request.prompt_tokens,
            block_size: u64::from(request.block_size.get()),
            prefill_weight,
            groups,
        })
    }

    fn least(&self, any_tier: u32) -> f64 {
        let uncached = (self.prompt_tokens).saturating_sub(u64::from(any_tier) * self.block_size);
        let prompt = self.prefill_weight * uncached as f64;
        let least = (self.groups.iter())
            .map(|&(key, rate)| (prompt + key) / rate)
            .fold(f64::INFINITY, f64::min);
        least * (1.0 - BOUND_MARGIN)
    }
}

/// The roster position of the index's worker `key`, if in the roster: kept on the index's slot
/// with the ranking's epoch ([`PrefixIndex::slot_tag`]) after the first look-up by id, so a
/// decision among thousands of holders reads an array instead of hashing each one's id.
fn position_of(index: &PrefixIndex, ranking: &Ranking, key: WorkerKey) -> Option<u32> {
    let epoch = ranking.epoch();
    let tag = index.slot_tag(key);
    if epoch != 0 && (tag >> 32) as u32 == epoch {
        let pos = tag as u32;
        return (pos != NOT_RANKED).then_some(pos);
    }
    let pos = index.worker_id(key).and_then(|w| ranking.position(w));
    if epoch != 0 {
        index.tag_slot(
            key,
            (u64::from(epoch) << 32) | u64::from(pos.unwrap_or(NOT_RANKED)),
        );
    }
    pos
}

/// A slot tag's position for a worker the index knows and the roster does not.
const NOT_RANKED: u32 = u32::MAX;
