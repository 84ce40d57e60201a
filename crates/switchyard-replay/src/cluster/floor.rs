//! The TTFT floor: what each request's first token would cost in the best case any policy
//! could reach, so that a report can tell a tail made of compute from one made of queueing,
//! misses or copies.
//!
//! The best case is an idle worker that already holds, on device, every block any earlier
//! request sent (an infinite cache shared by all workers): the request then computes only the
//! blocks nobody sent before, alone, in the scheduler's chunks. Routing can only add to that
//! (a queue, a miss, a host load or a peer copy), so no run's TTFT percentile is below the
//! floor's. Blocks are checked one by one: the hashes are chained, so block *i* having been sent
//! means the whole prefix up to it was.

use rustc_hash::{FxHashMap, FxHashSet};
use switchyard_core::BlockHash;
use switchyard_engine_sim::SimConfig;

use crate::metrics::RequestRecord;
use crate::workload::Micros;

#[derive(Debug, Default)]
pub(super) struct TtftFloor {
    sent: FxHashSet<BlockHash>,
    by_request: FxHashMap<u64, Micros>,
}

impl TtftFloor {
    /// Records request `id`'s floor from the blocks sent before it, then counts its blocks as
    /// sent.
    pub(super) fn arrive(
        &mut self,
        id: u64,
        hashes: &[BlockHash],
        prompt_tokens: u64,
        sim: &SimConfig,
    ) {
        let known = hashes.iter().take_while(|h| self.sent.contains(h)).count() as u64;
        let cached = known * u64::from(sim.block_size.get());
        let floor =
            sim.timing
                .chunked_prefill_time(prompt_tokens, cached, sim.max_batched_tokens as u64);
        self.by_request.insert(id, floor.as_micros() as Micros);
        self.sent.extend(hashes.iter().copied());
    }

    /// The floors of `records`, in their order (0 for a request that never arrived).
    pub(super) fn of(&self, records: &[RequestRecord]) -> Vec<Micros> {
        records
            .iter()
            .map(|r| self.by_request.get(&r.id).copied().unwrap_or(0))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::BlockSize;

    fn sim() -> SimConfig {
        SimConfig {
            block_size: BlockSize::new(64).unwrap(),
            ..SimConfig::default()
        }
    }

    fn record(id: u64) -> RequestRecord {
        RequestRecord {
            id,
            worker: 0,
            arrival: 0,
            first_token: None,
            finished: None,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: 0,
            ok: true,
        }
    }

    #[test]
    fn a_later_turn_computes_only_what_nobody_sent() {
        let sim = sim();
        let h = |i: u64| BlockHash(i);
        let mut floor = TtftFloor::default();
        // First turn: 4 blocks, all new. Second: the same 4 plus 2 new. Third: a different
        // first block, so nothing of the chain after it counts even where ids repeat.
        floor.arrive(1, &[h(1), h(2), h(3), h(4)], 256, &sim);
        floor.arrive(2, &[h(1), h(2), h(3), h(4), h(5), h(6)], 400, &sim);
        floor.arrive(3, &[h(9), h(2), h(3)], 200, &sim);
        let got = floor.of(&[record(1), record(2), record(3), record(4)]);
        let us = |prompt, cached| {
            sim.timing
                .chunked_prefill_time(prompt, cached, sim.max_batched_tokens as u64)
                .as_micros() as Micros
        };
        assert_eq!(got, vec![us(256, 0), us(400, 256), us(200, 0), 0]);
        assert!(got[1] < us(400, 0));
    }
}
