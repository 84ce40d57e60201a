//! The public [`Simulator`]: request intake, aborts, holds and introspection. The step itself
//! lives in the `scheduler` module.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::{FxHashMap, FxHashSet};

use switchyard_core::{BlockHash, LoadStats, SnapshotBlock, TokenId};

use crate::{
    SimConfig, SimError, SimRequest,
    kv_cache::{BlockId, KvCache},
    sequence::Sequence,
};

/// A synchronous, deterministic simulated LLM engine.
///
/// The caller drives it: [`Simulator::add_request`] and [`Simulator::abort`] between steps,
/// [`Simulator::step`] for one engine iteration, which returns how long the iteration took in
/// simulated time. A live worker sleeps that long (divided by its speed-up); an offline replay
/// advances its virtual clock by it.
#[derive(Debug)]
pub struct Simulator {
    pub(crate) config: SimConfig,
    pub(crate) kv: KvCache,
    pub(crate) waiting: VecDeque<Sequence>,
    /// In admission order: the last one is the first to be preempted.
    pub(crate) running: Vec<Sequence>,
    /// Finished `hold_blocks` prefills and the prompt blocks they keep referenced.
    pub(crate) held: BTreeMap<u64, Vec<BlockId>>,
    /// The entries of `held` that are imports: pins a step gives up when nothing else can run,
    /// so imports waiting for their request can never deadlock the cache.
    pub(crate) import_holds: BTreeSet<u64>,
    /// The retention hints of entries of `held`, applied when their hold is released.
    pub(crate) held_retention: FxHashMap<u64, switchyard_core::Retention>,
    /// Ids of waiting, running and held requests.
    pub(crate) live_ids: FxHashSet<u64>,
    pub(crate) preemptions_total: u64,
    pub(crate) cached_prompt_tokens_total: u64,
    pub(crate) prompt_tokens_total: u64,
}

impl Simulator {
    pub fn new(config: SimConfig) -> Result<Self, SimError> {
        config.validate()?;
        let device_blocks = u32::try_from(config.num_device_blocks).map_err(|_| {
            SimError::InvalidConfig("num_device_blocks does not fit in 32 bits".into())
        })?;
        Ok(Self {
            kv: KvCache::new(
                device_blocks,
                config.block_size.as_usize(),
                config.num_host_blocks,
                config.retention_budget_blocks(),
            ),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            held: BTreeMap::new(),
            import_holds: BTreeSet::new(),
            held_retention: FxHashMap::default(),
            live_ids: FxHashSet::default(),
            preemptions_total: 0,
            cached_prompt_tokens_total: 0,
            prompt_tokens_total: 0,
        })
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Sets the clock retention hints expire against (it never goes backwards): the caller's
    /// time, virtual in a replay, wall-clock in a live worker. Call it before adding requests
    /// and before each step.
    pub fn set_clock(&mut self, now: std::time::Duration) {
        self.kv
            .set_now(u64::try_from(now.as_micros()).unwrap_or(u64::MAX));
    }

    /// Idle device blocks that retention hints keep pinned now.
    pub fn retained_blocks(&self) -> usize {
        self.kv.retained_blocks()
    }

    /// Queues a request behind those already waiting, after checking it can ever run.
    pub fn add_request(&mut self, req: SimRequest) -> Result<(), SimError> {
        let id = req.id;
        if req.prompt.is_empty() {
            return Err(SimError::EmptyPrompt { id });
        }
        if req.max_tokens == 0 {
            return Err(SimError::ZeroMaxTokens { id });
        }
        let prompt_tokens = req.prompt.len() as u64;
        if prompt_tokens + u64::from(req.max_tokens) > self.config.max_context_tokens {
            return Err(SimError::ContextTooLong {
                id,
                prompt_tokens,
                max_tokens: req.max_tokens,
                max_context_tokens: self.config.max_context_tokens,
            });
        }
        // The KV of every token but the last sampled one must fit at once, or the sequence
        // would preempt itself forever once it outgrew the cache.
        let generated = if req.hold_blocks { 1 } else { req.max_tokens };
        let kv_tokens = prompt_tokens + u64::from(generated) - 1;
        let needed_blocks = kv_tokens.div_ceil(u64::from(self.config.block_size.get()));
        if needed_blocks > self.config.num_device_blocks {
            return Err(SimError::ExceedsKvCapacity {
                id,
                needed_blocks,
                capacity_blocks: self.config.num_device_blocks,
            });
        }
        if let Some(hashes) = &req.prompt_hashes {
            let expected = self.config.block_size.full_blocks(req.prompt.len());
            if hashes.len() != expected {
                return Err(SimError::PromptHashCount {
                    id,
                    got: hashes.len(),
                    expected,
                });
            }
        }
        if !self.live_ids.insert(id) {
            return Err(SimError::DuplicateId { id });
        }
        let seq = Sequence::new(req, self.config.seed, self.config.block_size);
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Drops a waiting, running or held request; its blocks stay cached, unreferenced.
    /// Returns whether the id was known. No output is produced for an aborted request.
    pub fn abort(&mut self, id: u64) -> bool {
        if !self.live_ids.remove(&id) {
            return false;
        }
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            // A waiting sequence holds no blocks (preemption released them).
            self.waiting.remove(pos);
        } else if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(pos);
            self.kv.release(&seq.table);
        } else if let Some(table) = self.held.remove(&id) {
            self.import_holds.remove(&id);
            self.held_retention.remove(&id);
            self.kv.release(&table);
        }
        true
    }

    /// Drops the references a finished `hold_blocks` prefill (or a held import) keeps; a
    /// prefill's retention hint pins its blocks from now.
    pub fn release_hold(&mut self, id: u64) -> bool {
        let Some(table) = self.held.remove(&id) else {
            return false;
        };
        self.import_holds.remove(&id);
        self.live_ids.remove(&id);
        if let Some(retention) = self.held_retention.remove(&id) {
            self.pin_for(&table, retention);
        }
        self.kv.release(&table);
        true
    }

    /// The full prompt blocks a finished `hold_blocks` request keeps, in prompt order, with
    /// their tokens (what a decode worker pulls). `None` if the id holds nothing.
    pub fn held_blocks(&self, id: u64) -> Option<Vec<(BlockHash, Vec<TokenId>)>> {
        self.held
            .get(&id)?
            .iter()
            .map(|&b| self.kv.block_content(b))
            .collect()
    }

    /// Lets go of every import hold (their blocks stay cached, unreferenced). Returns whether
    /// there was any.
    pub(crate) fn release_import_holds(&mut self) -> bool {
        let ids = std::mem::take(&mut self.import_holds);
        for id in &ids {
            if let Some(table) = self.held.remove(id) {
                self.live_ids.remove(id);
                self.kv.release(&table);
            }
        }
        !ids.is_empty()
    }

    /// Whether a request is waiting or running. Held prefills are not work.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn load(&self) -> LoadStats {
        let bs = self.config.block_size.as_usize();
        let running_prefill: usize = self
            .running
            .iter()
            .filter(|s| !s.prefill_done)
            .map(Sequence::uncomputed)
            .sum();
        // Waiting requests are charged what admission would compute right now.
        let waiting_prefill: usize = self
            .waiting
            .iter()
            .map(|s| {
                let max_hit = (s.tokens.len() - 1) / bs;
                s.tokens.len() - self.kv.cached_prefix_len(&s.hashes, max_hit) * bs
            })
            .sum();
        LoadStats {
            queued_prefill_tokens: (running_prefill + waiting_prefill) as u64,
            waiting_requests: self.waiting.len() as u64,
            running_requests: self.running.len() as u64,
            active_decode_sequences: self.running.iter().filter(|s| s.prefill_done).count() as u64,
            active_blocks: self.kv.active_blocks() as u64,
            used_blocks: self.kv.used_blocks() as u64,
            capacity_blocks: self.kv.capacity() as u64,
            preemptions_total: self.preemptions_total,
            cached_prompt_tokens_total: self.cached_prompt_tokens_total,
            prompt_tokens_total: self.prompt_tokens_total,
        }
    }

    /// Every block cached in any tier now, ordered by tier then hash: what a snapshot sends and
    /// what applying every emitted event from the start yields.
    pub fn cached_blocks(&self) -> Vec<SnapshotBlock> {
        self.kv.snapshot()
    }
}
