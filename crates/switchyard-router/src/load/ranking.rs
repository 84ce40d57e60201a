//! The model's workers ordered by their load, kept with every load change, so that a decision
//! reads the best workers that hold none of the prompt instead of scoring every worker.
//!
//! For a worker that holds none of the prompt (no cached block, none pending), the `kv` cost
//! depends on the prompt only through its length:
//!
//! ```text
//! cost = prefill_weight × (prompt + queued prefill) / rate + decode_weight × active blocks × block size / rate
//!      = (prefill_weight × prompt + key) / rate,   key = prefill_weight × queued + decode_weight × active tokens
//! ```
//!
//! so among workers of one prefill rate their order is fixed by `key` whatever the prompt. The
//! ranking keeps, per prefill rate (a *group*), the workers in *buckets* of equal load (queued
//! prefill, active blocks, running requests) ordered by `key`: every worker of a bucket has the
//! same cost to the bit for any prompt, so a decision prices a bucket once and, when its
//! workers tie, compares them by the rendezvous hash alone, from a hash of each worker's id kept
//! here. A change of a worker's load moves it between buckets: `O(log buckets)`.
//!
//! The workers ranked are a *roster* the caller sets ([`Ranking::set_roster`]): the model's
//! candidates in the caller's order (a position is an index into that list), with each one's
//! prefill rate. Workers of the load view outside the roster are not ranked.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};

use switchyard_core::WorkerId;

use super::WorkerLoad;
use crate::hasher::{FxHashMap, FxHasher};

/// The cost weights and block size the ranking orders by (the `kv` policy's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankWeights {
    pub prefill_weight: f64,
    pub decode_weight: f64,
    pub block_size: u32,
}

/// One worker of a roster.
#[derive(Debug, Clone)]
pub struct RosterWorker {
    pub id: WorkerId,
    /// Prompt tokens per second it prefills (the rate its cost is priced at).
    pub prefill_tokens_per_s: u64,
    /// Whether a copy of a peer's KV may be priced to it (then the cost of a worker depends on
    /// the others' overlap, and the ranking is not used).
    pub prices_peer_copies: bool,
}

/// What puts workers in one bucket: equal figures mean an equal cost for any prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BucketKey {
    /// `key` (module docs) as the bits of a non-negative `f64`: ordered as the number.
    weighted: u64,
    pub queued_prefill_tokens: u64,
    pub active_blocks: u64,
    pub running_requests: u64,
    /// The device capacity the cost's memory term reads (`cost::figures_of`).
    pub capacity_blocks: u64,
}

impl BucketKey {
    /// `key` (module docs) in weighted tokens.
    pub fn weighted_tokens(&self) -> f64 {
        f64::from_bits(self.weighted)
    }
}

/// The workers of one prefill rate, by bucket.
#[derive(Debug, Default)]
pub struct Group {
    pub prefill_tokens_per_s: u64,
    /// Positions of the workers of each bucket, in no particular order.
    buckets: BTreeMap<BucketKey, Vec<u32>>,
}

impl Group {
    /// The buckets, lowest `key` first.
    pub fn buckets(&self) -> impl Iterator<Item = (&BucketKey, &[u32])> + '_ {
        self.buckets.iter().map(|(k, v)| (k, v.as_slice()))
    }
}

#[derive(Debug, Clone, Copy)]
struct Place {
    group: u32,
    key: BucketKey,
    /// Index in its bucket's list.
    at: u32,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Ranking {
    weights: Option<RankWeights>,
    /// This roster's number, unique in the process (0 before a roster is set): a look-up of a
    /// position kept elsewhere names the roster it was made for ([`Ranking::epoch`]).
    epoch: u32,
    position: FxHashMap<WorkerId, u32>,
    /// Per position: the worker's id hash ([`Ranking::id_hash`]), its load, its place.
    hashes: Vec<u64>,
    loads: Vec<WorkerLoad>,
    places: Vec<Place>,
    groups: Vec<Group>,
    prices_peer_copies: bool,
    /// Emptied buckets' lists, kept for the next new bucket: a booking moves its worker to a
    /// bucket of its own more often than not, and a release empties it again. At most one per
    /// position (a list is made only when none is kept, and a bucket holds a position).
    spare: Vec<Vec<u32>>,
}

impl Ranking {
    /// Ranks `roster` (positions in its order) by `weights`, with each worker's load now.
    pub fn set_roster(
        &mut self,
        weights: RankWeights,
        roster: impl IntoIterator<Item = RosterWorker>,
        load_of: impl Fn(&WorkerId) -> WorkerLoad,
    ) {
        *self = Self {
            weights: Some(weights),
            epoch: next_epoch(),
            ..Self::default()
        };
        let mut group_of: FxHashMap<u64, u32> = FxHashMap::default();
        for (pos, w) in roster.into_iter().enumerate() {
            let pos = pos as u32;
            let groups = &mut self.groups;
            let group = *group_of.entry(w.prefill_tokens_per_s).or_insert_with(|| {
                groups.push(Group {
                    prefill_tokens_per_s: w.prefill_tokens_per_s,
                    buckets: BTreeMap::new(),
                });
                (groups.len() - 1) as u32
            });
            self.prices_peer_copies |= w.prices_peer_copies;
            let load = load_of(&w.id);
            let key = self.key_of(&load);
            self.hashes.push(id_hash(&w.id));
            self.loads.push(load);
            self.places.push(Place { group, key, at: 0 });
            self.position.insert(w.id, pos);
            self.enter(pos);
        }
    }

    /// The roster's number: a new one at each [`Ranking::set_roster`], never 0 once set and
    /// never the same for two rosters in the process (until 2³² have been set), so a position
    /// remembered with it is known stale when the roster changed.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The weights the ranking orders by; `None` before a roster is set.
    pub fn weights(&self) -> Option<RankWeights> {
        self.weights
    }

    /// Workers in the roster.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Whether every worker of the roster is in a bucket (none has left since the roster was
    /// set).
    pub fn all_ranked(&self) -> bool {
        self.position.len() == self.hashes.len()
    }

    /// Whether some worker of the roster may be priced a peer copy.
    pub fn prices_peer_copies(&self) -> bool {
        self.prices_peer_copies
    }

    /// The worker's position in the roster.
    pub fn position(&self, worker: &WorkerId) -> Option<u32> {
        self.position.get(worker).copied()
    }

    /// The load of the worker at `pos` as [`super::LoadView::get`] gives it.
    pub fn load(&self, pos: u32) -> &WorkerLoad {
        &self.loads[pos as usize]
    }

    /// The hash of the worker's id at `pos` that the rendezvous tie-break mixes with the
    /// request's key ([`id_hash`]).
    pub fn id_hash(&self, pos: u32) -> u64 {
        self.hashes[pos as usize]
    }

    /// The groups of workers by prefill rate.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// `worker`'s load is now `load`: it moves to its bucket (nothing when it is not ranked).
    pub fn refresh(&mut self, worker: &WorkerId, load: WorkerLoad) {
        let Some(pos) = self.position(worker) else {
            return;
        };
        let key = self.key_of(&load);
        self.loads[pos as usize] = load;
        if key != self.places[pos as usize].key {
            self.leave(pos);
            self.places[pos as usize].key = key;
            self.enter(pos);
        }
    }

    /// `worker` left: it is no longer ranked (its position stays, in no bucket), so a decision
    /// over the ranking never reads it until the next roster, however late that comes (the
    /// gateway batches member-list rebuilds while a burst of workers joins or leaves).
    pub fn retire(&mut self, worker: &WorkerId) {
        if let Some(pos) = self.position.remove(worker) {
            self.leave(pos);
        }
    }

    fn key_of(&self, l: &WorkerLoad) -> BucketKey {
        let w = self.weights.unwrap_or(RankWeights {
            prefill_weight: 0.0,
            decode_weight: 0.0,
            block_size: 1,
        });
        let weighted = w.prefill_weight * l.queued_prefill_tokens as f64
            + w.decode_weight * (l.active_blocks * u64::from(w.block_size)) as f64;
        BucketKey {
            // Weights are finite and non-negative (`KvConfig::validate`): so is the sum, and
            // `+ 0.0` turns a negative zero into zero, whose bits order first.
            weighted: (weighted + 0.0).to_bits(),
            queued_prefill_tokens: l.queued_prefill_tokens,
            active_blocks: l.active_blocks,
            running_requests: l.running_requests,
            capacity_blocks: l.capacity_blocks,
        }
    }

    fn enter(&mut self, pos: u32) {
        let place = &mut self.places[pos as usize];
        let spare = &mut self.spare;
        let bucket = self.groups[place.group as usize]
            .buckets
            .entry(place.key)
            .or_insert_with(|| spare.pop().unwrap_or_default());
        place.at = bucket.len() as u32;
        bucket.push(pos);
    }

    fn leave(&mut self, pos: u32) {
        let place = self.places[pos as usize];
        let buckets = &mut self.groups[place.group as usize].buckets;
        let Some(bucket) = buckets.get_mut(&place.key) else {
            return;
        };
        bucket.swap_remove(place.at as usize);
        if let Some(&moved) = bucket.get(place.at as usize) {
            self.places[moved as usize].at = place.at;
        }
        if bucket.is_empty()
            && let Some(list) = buckets.remove(&place.key)
        {
            self.spare.push(list);
        }
    }
}

/// The hash of a worker's id the rendezvous tie-break mixes with a request's key (the policy's
/// `rendezvous` computes it the same way).
/// A roster number not given before (skipping 0, which means none).
fn next_epoch() -> u32 {
    static EPOCH: AtomicU32 = AtomicU32::new(0);
    loop {
        let e = EPOCH.fetch_add(1, AtomicOrdering::Relaxed).wrapping_add(1);
        if e != 0 {
            return e;
        }
    }
}

pub fn id_hash(worker: &WorkerId) -> u64 {
    let mut h = FxHasher::default();
    worker.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: &str) -> WorkerId {
        WorkerId::new(n).unwrap()
    }

    fn loaded(queued: u64, active: u64, running: u64) -> WorkerLoad {
        WorkerLoad {
            queued_prefill_tokens: queued,
            active_blocks: active,
            running_requests: running,
            ..WorkerLoad::default()
        }
    }

    /// A ranking of `n` idle workers `w0`, `w1`, … at the prefill rate `rate(i)`, with their
    /// ids.
    fn ranked(
        n: usize,
        rate: impl Fn(usize) -> u64,
        decode_weight: f64,
    ) -> (Ranking, Vec<WorkerId>) {
        let mut ranking = Ranking::default();
        let ids: Vec<WorkerId> = (0..n).map(|i| w(&format!("w{i}"))).collect();
        let roster = ids.iter().enumerate().map(|(i, id)| RosterWorker {
            id: id.clone(),
            prefill_tokens_per_s: rate(i),
            prices_peer_copies: false,
        });
        let weights = RankWeights {
            prefill_weight: 1.0,
            decode_weight,
            block_size: 16,
        };
        ranking.set_roster(weights, roster, |_| WorkerLoad::default());
        (ranking, ids)
    }

    /// How many buckets hold each of the `n` positions.
    fn bucket_counts(ranking: &Ranking, n: usize) -> Vec<u32> {
        let mut seen = vec![0; n];
        for group in ranking.groups() {
            for (_, members) in group.buckets() {
                for &pos in members {
                    seen[pos as usize] += 1;
                }
            }
        }
        seen
    }

    /// Every worker is in exactly the bucket of its load, through moves that empty buckets and
    /// swap workers within them.
    #[test]
    fn workers_sit_in_the_bucket_of_their_load() {
        let (mut ranking, ids) = ranked(6, |i| if i < 4 { 10_000 } else { 20_000 }, 0.1);
        assert_eq!(ranking.groups().len(), 2);
        let moves = [
            (0, 100, 0, 1),
            (1, 100, 0, 1),
            (0, 0, 0, 0),
            (2, 0, 10, 1),
            (1, 5, 0, 1),
        ];
        for (i, queued, active, running) in moves {
            ranking.refresh(&ids[i], loaded(queued, active, running));
        }
        ranking.refresh(&w("stranger"), loaded(1, 1, 1));
        let mut seen = vec![0; ids.len()];
        for group in ranking.groups() {
            let mut last = None;
            for (key, members) in group.buckets() {
                assert!(!members.is_empty());
                assert!(last.is_none_or(|l: f64| l <= key.weighted_tokens()));
                last = Some(key.weighted_tokens());
                for &pos in members {
                    seen[pos as usize] += 1;
                    let l = ranking.load(pos);
                    assert_eq!(
                        (l.queued_prefill_tokens, l.active_blocks, l.running_requests),
                        (
                            key.queued_prefill_tokens,
                            key.active_blocks,
                            key.running_requests
                        )
                    );
                }
            }
        }
        assert_eq!(seen, vec![1; ids.len()]);
        assert_eq!(ranking.load(1).queued_prefill_tokens, 5);

        // A worker that left is in no bucket, stays out when its load moves, and retiring it
        // again touches no one else.
        ranking.retire(&ids[3]);
        ranking.refresh(&ids[3], loaded(7, 7, 7));
        ranking.retire(&ids[3]);
        ranking.refresh(&ids[2], loaded(0, 0, 0));
        assert_eq!(bucket_counts(&ranking, ids.len()), vec![1, 1, 1, 0, 1, 1]);
        assert_eq!(ranking.position(&ids[3]), None);
    }

    /// The lists of emptied buckets are reused, never more of them kept than there are
    /// positions, and every worker stays in exactly one bucket through thousands of moves.
    #[test]
    fn emptied_bucket_lists_are_reused_and_bounded() {
        let (mut ranking, ids) = ranked(8, |_| 10_000, 0.0);
        let mut rng = switchyard_core::rng::SplitMix64::new(7);
        let mut lists_made = 0;
        for _ in 0..5_000 {
            let worker = rng.below(ids.len());
            let spare_before = ranking.spare.len();
            let buckets_before: usize = ranking.groups().iter().map(|g| g.buckets.len()).sum();
            ranking.refresh(&ids[worker], loaded(rng.below(6) as u64, 0, 0));
            let buckets_after: usize = ranking.groups().iter().map(|g| g.buckets.len()).sum();
            // A list was made when the kept ones did not cover the buckets that appeared.
            if buckets_after + ranking.spare.len() > buckets_before + spare_before {
                lists_made += 1;
            }
            assert!(ranking.spare.len() + buckets_after <= ids.len());
            assert!(ranking.spare.iter().all(Vec::is_empty));
        }
        assert!(lists_made <= ids.len(), "{lists_made} lists made");
        assert_eq!(bucket_counts(&ranking, ids.len()), vec![1; ids.len()]);
    }
}
