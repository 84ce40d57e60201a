//! Prefixes on their way to a worker's cache: the prompt blocks of requests routed there and
//! not finished yet. A session's next turn often arrives while the previous one still waits
//! for its prefill — all the more when the fleet is overloaded — and no KV event has announced
//! its blocks yet; a policy that reads only the index then sees no locality and scatters the
//! session's turns.
//!
//! A request `n` queued on a worker behind a request `r` finds the blocks it shares with `r`
//! cached only if `r` has computed them before `n` is first scheduled: engines schedule their
//! queue in order, `step_tokens` prompt tokens per step (vLLM's `max_num_batched_tokens`,
//! SGLang's chunked prefill size), and look a new request's prefix up when it is first
//! scheduled, so two requests prefilled in the same step both compute the shared blocks. `r`
//! finishes the first `L` shared blocks when its prefill reaches token `L × block`; `n` is first
//! scheduled once the work queued ahead of it is down to less than one step. Between the two
//! lie `r`'s prompt past the shared blocks and the prefill queued behind `r`; when that is at
//! least one step, `n` finds the blocks ([`PendingPrefixes::leading`]). A request whose prefill
//! is done has its blocks cached whatever the queue.
//!
//! Entries leave when their request finishes (its blocks are then in the index, or evicted),
//! or after the load view's in-flight TTL when a request's end was never seen; at most
//! [`MAX_PENDING`] requests are kept, the oldest dropped first.

use std::collections::VecDeque;

use switchyard_core::{BlockHash, WorkerId};

use super::{RequestId, Tick};
use crate::hasher::FxHashMap;

/// Most requests whose prefixes are kept.
pub const MAX_PENDING: usize = 65_536;

#[derive(Debug)]
struct Pending {
    worker: WorkerId,
    /// The prompt's full-block chain.
    blocks: Vec<BlockHash>,
    prompt_tokens: u64,
    /// What the worker computes of the prompt (0 for a decode worker whose KV comes from a
    /// prefill worker).
    prefill_tokens: u64,
    prefill_done: bool,
}

/// What a request routed to a worker brings to its cache.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    pub request: RequestId,
    pub worker: &'a WorkerId,
    pub blocks: &'a [BlockHash],
    pub prompt_tokens: u64,
    pub prefill_tokens: u64,
}

/// The prefixes of requests in flight; see the module docs.
#[derive(Debug, Default)]
pub struct PendingPrefixes {
    requests: FxHashMap<RequestId, Pending>,
    /// Requests by their first block (chained hashes: a request shares a prefix with a chain
    /// only if it shares its first block).
    by_first: FxHashMap<BlockHash, Vec<RequestId>>,
    /// Each worker's requests in routing order (its queue).
    queues: FxHashMap<WorkerId, VecDeque<RequestId>>,
    /// Requests in routing order, for expiry (a finished request's entry is skipped).
    order: VecDeque<(Tick, RequestId)>,
}

impl PendingPrefixes {
    /// `incoming` was routed at `now`.
    pub fn add(&mut self, incoming: Incoming<'_>, now: Tick, ttl: Tick) {
        let request = incoming.request;
        self.remove(request);
        self.expire(now, ttl);
        while self.requests.len() >= MAX_PENDING {
            let Some((_, oldest)) = self.order.pop_front() else {
                break;
            };
            self.remove(oldest);
        }
        let Some(&first) = incoming.blocks.first() else {
            return;
        };
        self.by_first.entry(first).or_default().push(request);
        self.queues
            .entry(incoming.worker.clone())
            .or_default()
            .push_back(request);
        self.requests.insert(
            request,
            Pending {
                worker: incoming.worker.clone(),
                blocks: incoming.blocks.to_vec(),
                prompt_tokens: incoming.prompt_tokens,
                prefill_tokens: incoming.prefill_tokens,
                prefill_done: false,
            },
        );
        self.order.push_back((now, request));
    }

    /// `request` now computes `prefill_tokens` of its prompt (its serving mode changed).
    pub fn set_prefill_tokens(&mut self, request: RequestId, prefill_tokens: u64) {
        if let Some(p) = self.requests.get_mut(&request) {
            p.prefill_tokens = prefill_tokens;
        }
    }

    /// `request`'s prefill finished: its blocks are computed.
    pub fn prefill_done(&mut self, request: RequestId) {
        if let Some(p) = self.requests.get_mut(&request) {
            p.prefill_done = true;
        }
    }

    /// `request` finished (or moved): its blocks are no longer pending.
    pub fn remove(&mut self, request: RequestId) {
        let Some(pending) = self.requests.remove(&request) else {
            return;
        };
        if let Some(first) = pending.blocks.first()
            && let Some(ids) = self.by_first.get_mut(first)
        {
            if let Some(i) = ids.iter().position(|&id| id == request) {
                ids.swap_remove(i);
            }
            if ids.is_empty() {
                self.by_first.remove(first);
            }
        }
        if let Some(queue) = self.queues.get_mut(&pending.worker) {
            if let Some(i) = queue.iter().position(|&id| id == request) {
                queue.remove(i);
            }
            if queue.is_empty() {
                self.queues.remove(&pending.worker);
            }
        }
    }

    /// Forgets every request of a worker that left.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        let gone: Vec<RequestId> = self
            .queues
            .get(worker)
            .map(|q| q.iter().copied().collect())
            .unwrap_or_default();
        for id in gone {
            self.remove(id);
        }
    }

    fn expire(&mut self, now: Tick, ttl: Tick) {
        while let Some(&(routed_at, request)) = self.order.front() {
            let expired = now.saturating_sub(routed_at) >= ttl;
            if !expired && self.requests.contains_key(&request) {
                break;
            }
            self.order.pop_front();
            if expired {
                self.remove(request);
            }
        }
    }

    /// Requests whose prefixes are kept.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// For each worker where a request routed now would find some: how many leading blocks of
    /// `chain` requests in flight there will have computed by the time it is first scheduled
    /// (`block` tokens per block, `step_tokens` prompt tokens per engine step; see the module
    /// docs).
    pub fn leading(
        &self,
        chain: &[BlockHash],
        block: u32,
        step_tokens: u64,
    ) -> Vec<(WorkerId, u32)> {
        let Some(ids) = chain.first().and_then(|b| self.by_first.get(b)) else {
            return Vec::new();
        };
        let mut best: FxHashMap<&WorkerId, u32> = FxHashMap::default();
        let mut behind: FxHashMap<&WorkerId, FxHashMap<RequestId, u64>> = FxHashMap::default();
        for id in ids {
            let Some(r) = self.requests.get(id) else {
                continue;
            };
            let shared = shared_prefix(&r.blocks, chain) as u32;
            if shared == 0 || best.get(&r.worker).is_some_and(|&n| n >= shared) {
                continue;
            }
            if !r.prefill_done {
                let queued_behind = *behind
                    .entry(&r.worker)
                    .or_insert_with(|| self.queued_behind(&r.worker))
                    .get(id)
                    .unwrap_or(&0);
                let rest = r
                    .prompt_tokens
                    .saturating_sub(u64::from(shared) * u64::from(block));
                if rest + queued_behind < step_tokens {
                    continue;
                }
            }
            best.insert(&r.worker, shared);
        }
        best.into_iter().map(|(w, n)| (w.clone(), n)).collect()
    }

    /// For each request queued on `worker`, the prefill tokens routed there after it and not
    /// computed yet.
    fn queued_behind(&self, worker: &WorkerId) -> FxHashMap<RequestId, u64> {
        let mut out = FxHashMap::default();
        let mut after = 0u64;
        for id in self.queues.get(worker).into_iter().flatten().rev() {
            out.insert(*id, after);
            if let Some(r) = self.requests.get(id)
                && !r.prefill_done
            {
                after += r.prefill_tokens;
            }
        }
        out
    }
}

/// How many leading blocks `a` and `b` share. Chained hashes: equal at `i` means equal
/// before `i`, so the first difference is found by bisection.
fn shared_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests;
