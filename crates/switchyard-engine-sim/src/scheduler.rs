//! One engine iteration: vLLM V1-style continuous batching with chunked prefill and
//! recompute preemption.
//!
//! A step schedules in two passes under one token budget (`max_batched_tokens`):
//!
//! 1. **Running sequences**, in admission order: one token each when decoding, otherwise the
//!    next prefill chunk that fits the remaining budget. A sequence that needs a block when
//!    none can be had preempts the most recently admitted running sequence (possibly itself):
//!    its blocks are released, stay cached, and it goes back to the front of the queue. The
//!    oldest sequence never preempts itself: if it is alone and still short, held prefills pin
//!    the cache, and it waits instead of recomputing in a loop.
//! 2. **Waiting requests**, first come first served, unless step 1 preempted someone: each is
//!    admitted with its longest cached prefix (device or host) reused, while `max_num_seqs`,
//!    the budget and free blocks allow. The first that does not fit stops admission.
//!
//! Then the scheduled work "runs": computed tokens advance, blocks that became full are
//! registered in the prefix cache (emitting `Stored`), and every sequence whose tokens are all
//! computed samples its next token.

use std::mem;

use switchyard_core::StorageTier;

use crate::{
    BlockExport, Simulator, StepOutcome, TokenOutput,
    events::EventLog,
    retained::Pin,
    sequence::Sequence,
    timing::{StepWork, attention_pairs},
};

impl Simulator {
    /// Runs one engine iteration and reports what it produced and how long it took.
    ///
    /// When work is waiting but nothing can be scheduled and imports hold blocks, the import
    /// holds are released and the step retried: an import pins its blocks only so that other
    /// work cannot evict them before its request is admitted, never to the point of blocking
    /// that request (or everyone) for good.
    pub fn step(&mut self) -> StepOutcome {
        let outcome = self.step_once();
        if outcome.is_idle() && self.has_work() && self.release_import_holds() {
            return self.step_once();
        }
        outcome
    }

    fn step_once(&mut self) -> StepOutcome {
        let mut events = EventLog::default();
        let mut work = StepWork::default();
        let mut budget = self.config.max_batched_tokens;
        let (scheduled, preempted) = self.schedule_running(&mut budget, &mut events);
        let mut scheduled = scheduled;
        if preempted == 0 {
            self.admit_waiting(&mut budget, &mut scheduled, &mut work, &mut events);
        }
        let mut exports = Vec::new();
        let outputs = self.execute(&scheduled, &mut work, &mut events, &mut exports);
        StepOutcome {
            duration: self.config.timing.step_time(&work),
            outputs,
            events: events.into_events(),
            prefill_tokens: work.prefill_tokens as usize,
            decode_sequences: work.decode_sequences as usize,
            preempted,
            host_hit_blocks: work.host_to_device_blocks as usize,
            exports,
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size.as_usize())
    }

    /// Pass 1; returns `(running index, tokens to compute)` per scheduled sequence and the
    /// number of preemptions.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        events: &mut EventLog,
    ) -> (Vec<(usize, usize)>, usize) {
        let mut scheduled = Vec::with_capacity(self.running.len());
        let mut preempted = 0;
        let mut i = 0;
        'running: while i < self.running.len() && *budget > 0 {
            let seq = &self.running[i];
            let new_tokens = seq.uncomputed().min(*budget);
            let needed = self
                .blocks_for(seq.computed + new_tokens)
                .saturating_sub(seq.table.len());
            loop {
                if let Some(blocks) = self.kv.allocate(needed, events) {
                    self.running[i].table.extend(blocks);
                    scheduled.push((i, new_tokens));
                    *budget -= new_tokens;
                    i += 1;
                    break;
                }
                // Victims come from the tail, which has not been scheduled yet.
                let victim_index = self.running.len() - 1;
                if victim_index == 0 {
                    // Alone and still short of a block: validation guarantees one sequence
                    // fits the cache, so held prefills pin the rest. Preempting itself would
                    // only recompute in a loop; it waits, keeping its blocks, until an abort
                    // or a `release_hold` frees some (the step reports itself idle).
                    break 'running;
                }
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                self.preempt(victim);
                preempted += 1;
                if victim_index == i {
                    break 'running;
                }
            }
        }
        (scheduled, preempted)
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.kv.release(&seq.table);
        seq.reset_for_recompute();
        self.preemptions_total += 1;
        self.waiting.push_front(seq);
    }

    /// Pass 2: admits waiting requests FCFS while sequences, budget and blocks allow.
    fn admit_waiting(
        &mut self,
        budget: &mut usize,
        scheduled: &mut Vec<(usize, usize)>,
        work: &mut StepWork,
        events: &mut EventLog,
    ) {
        let bs = self.config.block_size.as_usize();
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            // Like vLLM, at least the last token is computed so there are logits to sample
            // from; a fully cached prompt thus recomputes its whole last block.
            let max_hit_blocks = (seq.tokens.len() - 1) / bs;
            let hit = self.kv.lookup_prefix(&seq.hashes, max_hit_blocks);
            let hit_tokens = hit.len() * bs;
            let new_tokens = (seq.tokens.len() - hit_tokens).min(*budget);
            let extra = self
                .blocks_for(hit_tokens + new_tokens)
                .saturating_sub(hit.len());
            let Some(table) = self.kv.admit(&seq.hashes, &hit, extra, events) else {
                break;
            };
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            seq.table = table;
            seq.computed = hit_tokens;
            seq.registered = hit.len();
            work.host_to_device_blocks +=
                hit.iter().filter(|t| **t == StorageTier::Host).count() as u64;
            if seq.cached_prompt_tokens.is_none() {
                let cached = hit_tokens.min(seq.prompt_len);
                seq.cached_prompt_tokens = Some(cached as u32);
                self.cached_prompt_tokens_total += cached as u64;
                self.prompt_tokens_total += seq.prompt_len as u64;
            }
            scheduled.push((self.running.len(), new_tokens));
            self.running.push(seq);
            *budget -= new_tokens;
        }
    }

    /// Runs the scheduled work: advances computed tokens, registers blocks that became full,
    /// samples, and retires finished sequences.
    fn execute(
        &mut self,
        scheduled: &[(usize, usize)],
        work: &mut StepWork,
        events: &mut EventLog,
        exports: &mut Vec<BlockExport>,
    ) -> Vec<TokenOutput> {
        let block_size = self.config.block_size;
        let bs = block_size.as_usize();
        let (vocab, eos) = (self.config.vocab_size, self.config.eos_token_id);
        let ending = Some((self.config.mean_output_tokens, eos));
        let mut outputs = Vec::new();
        let mut finished = vec![false; self.running.len()];
        for &(index, new_tokens) in scheduled {
            let seq = &mut self.running[index];
            let (start, end) = (seq.computed, seq.computed + new_tokens);
            if seq.prefill_done {
                work.decode_sequences += 1;
                work.decode_context_tokens += end as u64;
            } else {
                work.prefill_tokens += new_tokens as u64;
                work.prefill_attention_pairs += attention_pairs(start as u64, end as u64);
            }
            seq.computed = end;
            while seq.registered < end / bs {
                let k = seq.registered;
                let parent = k.checked_sub(1).map(|p| seq.hashes[p]);
                let tokens = &seq.tokens[k * bs..(k + 1) * bs];
                seq.table[k] =
                    self.kv
                        .register(seq.table[k], parent, seq.hashes[k], tokens, events);
                seq.registered += 1;
            }
            if seq.pipeline {
                // Only the blocks that became ready in this step are read: a long prompt in
                // many chunks costs one pass over its blocks in all, not one per chunk.
                let ready = seq.registered.min(seq.prompt_len / bs);
                if ready > seq.exported {
                    let blocks: Option<Vec<_>> = seq.table[seq.exported..ready]
                        .iter()
                        .map(|&b| self.kv.block_content(b))
                        .collect();
                    if let Some(blocks) = blocks {
                        exports.push(BlockExport {
                            id: seq.id,
                            first_block: seq.exported,
                            blocks,
                        });
                        seq.exported = ready;
                    }
                }
            }
            if end < seq.tokens.len() {
                continue; // mid-prefill: no logits yet
            }
            let token = seq.sample(vocab, ending);
            seq.completion_tokens += 1;
            seq.prefill_done = true;
            let finish = seq.finish_on(token, eos);
            let logprobs = seq.logprobs.map(|k| seq.logprob_of(token, k, vocab));
            outputs.push(TokenOutput {
                id: seq.id,
                token,
                finish,
                prompt_tokens: seq.prompt_len as u32,
                cached_prompt_tokens: seq.cached_prompt_tokens.unwrap_or(0),
                completion_tokens: seq.completion_tokens,
                logprobs,
            });
            if finish.is_some() {
                finished[index] = true;
            } else {
                seq.push_token(token, block_size);
            }
        }
        if finished.contains(&true) {
            let running = mem::take(&mut self.running);
            for (seq, done) in running.into_iter().zip(finished) {
                if done {
                    self.retire(seq);
                } else {
                    self.running.push(seq);
                }
            }
        }
        outputs
    }

    fn retire(&mut self, seq: Sequence) {
        if seq.hold_blocks {
            let keep = seq.prompt_len / self.config.block_size.as_usize();
            let (held, rest) = seq.table.split_at(keep.min(seq.table.len()));
            self.kv.release(rest);
            self.held.insert(seq.id, held.to_vec());
            // A held prefill's hint applies when its hold is released (`release_hold`).
            if seq.retention.is_some() {
                self.held_retention.insert(seq.id, seq.retention);
            }
        } else {
            self.live_ids.remove(&seq.id);
            self.pin_for(&seq.table, seq.retention);
            self.kv.release(&seq.table);
        }
    }

    /// Pins `table`'s cached blocks for `retention`'s time from now (nothing if it asks for
    /// nothing); the caller releases them next.
    pub(crate) fn pin_for(
        &mut self,
        table: &[crate::kv_cache::BlockId],
        retention: switchyard_core::Retention,
    ) {
        if retention.is_some() {
            let expiry_us = self
                .kv
                .now_us()
                .saturating_add(retention.ttl_ms.saturating_mul(1000));
            let pin = Pin {
                priority: retention.priority,
                expiry_us,
            };
            self.kv.pin(table, pin);
        }
    }
}
