//! Admitting KV blocks computed elsewhere: the decode side of disaggregated serving.
//!
//! A decode worker pulls a prompt's blocks from a prefill worker and places them into its
//! device cache as ordinary cached (unreferenced, evictable) blocks, emitting `Stored` for each
//! new one, exactly as if it had computed them. The decode request that follows then finds them
//! as a prefix hit, so the simulator needs no special "imported" sequence state and the token
//! accounting of the continuation is the ordinary one.

use switchyard_core::{BlockHash, KvEvent, TokenId};

use crate::{Simulator, events::EventLog};

/// What [`Simulator::import_blocks`] did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ImportOutcome {
    /// Blocks now cached on the device from the import (new or already present).
    pub imported: usize,
    /// Blocks that were already cached and so not stored again.
    pub already_cached: usize,
    /// The KV events of the import (`Stored` for new blocks, `Removed` for evictions).
    pub events: Vec<KvEvent>,
}

impl Simulator {
    /// Places a chain of full blocks (in prompt order, the first one's parent `parent`, each
    /// later one's the block before it) into the device cache.
    ///
    /// Blocks are referenced while the import runs so that allocating the later ones cannot
    /// evict the earlier ones. Without a `hold` they are then released, tail first, so they sit
    /// on the LRU list like any finished sequence's blocks. With `hold = Some(id)` they stay
    /// referenced under `id` (appended to what earlier imports into `id` hold) until
    /// [`Simulator::release_hold`] or [`Simulator::abort`] of `id`: a chunked import keeps its
    /// earlier chunks while the later ones arrive, and requests queued meanwhile cannot evict
    /// them before the decode request is admitted. A step that finds nothing else to run gives
    /// import holds up (see [`Simulator::step`]), so they can delay eviction but never deadlock
    /// the cache. An `id` that names a waiting or running request is refused (nothing imported).
    ///
    /// When the cache cannot make room (everything else is in use) the import stops: a shorter
    /// prefix is still a valid prefix and the request recomputes the rest. Blocks of the wrong
    /// size end the import too (they cannot be this model's).
    pub fn import_blocks(
        &mut self,
        hold: Option<u64>,
        parent: Option<BlockHash>,
        blocks: &[(BlockHash, Vec<TokenId>)],
    ) -> ImportOutcome {
        if let Some(id) = hold
            && !self.held.contains_key(&id)
            && !self.live_ids.insert(id)
        {
            return ImportOutcome::default();
        }
        let bs = self.config.block_size.as_usize();
        let mut events = EventLog::default();
        let mut table = Vec::with_capacity(blocks.len());
        let mut already_cached = 0;
        let mut parent = parent;
        for (hash, tokens) in blocks {
            if tokens.len() != bs {
                break;
            }
            let block = if let Some(block) = self.kv.cached_device_block(*hash) {
                self.kv.reference(block);
                already_cached += 1;
                block
            } else {
                let Some(fresh) = self.kv.allocate(1, &mut events) else {
                    break;
                };
                let Some(&block) = fresh.first() else {
                    break;
                };
                self.kv.register(block, parent, *hash, tokens, &mut events)
            };
            table.push(block);
            parent = Some(*hash);
        }
        let imported = table.len();
        match hold {
            Some(id) => {
                self.import_holds.insert(id);
                self.held.entry(id).or_default().extend(table);
            }
            None => self.kv.release(&table),
        }
        ImportOutcome {
            imported,
            already_cached,
            events: events.into_events(),
        }
    }
}

#[cfg(test)]
mod tests {
    use switchyard_core::{KvEvent, block_hashes};

    use crate::testutil::{Driver, bs, req, tiny};

    fn chain(prompt: &[u32]) -> Vec<(switchyard_core::BlockHash, Vec<u32>)> {
        let size = bs(16);
        block_hashes(prompt, size)
            .into_iter()
            .zip(prompt.chunks_exact(size.as_usize()))
            .map(|(h, t)| (h, t.to_vec()))
            .collect()
    }

    #[test]
    fn imported_blocks_are_cached_announced_and_hit() {
        let mut d = Driver::new(tiny(16, 1024));
        let prompt: Vec<u32> = (0..256).collect();
        let blocks = chain(&prompt);
        let outcome = d.import(&blocks);
        assert_eq!(outcome.imported, 16);
        assert_eq!(outcome.already_cached, 0);
        let stored: Vec<_> = outcome
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Stored { blocks, parent, .. } => Some((parent, blocks.len())),
                _ => None,
            })
            .collect();
        // One chain: one merged event with no parent and all 16 blocks.
        assert_eq!(stored, vec![(&None, 16)]);
        let cached: Vec<_> = d.sim.cached_blocks().iter().map(|b| b.hash).collect();
        for (hash, _) in &blocks {
            assert!(cached.contains(hash));
        }
        // Cached, not in use: the import pins nothing.
        assert_eq!(d.sim.load().active_blocks, 0);

        // The request that follows hits all but the last block (logits need one computed token).
        d.add(req(1, prompt, 2));
        let first_step = d.steps.len();
        d.run(20);
        assert_eq!(d.outputs[&1][0].1.cached_prompt_tokens, 240);
        let computed: usize = d.steps[first_step..].iter().map(|s| s.prefill_tokens).sum();
        assert_eq!(computed, 16);
    }

    #[test]
    fn importing_what_is_cached_stores_nothing_new() {
        let mut d = Driver::new(tiny(16, 1024));
        let prompt: Vec<u32> = (0..128).collect();
        let first = d.import(&chain(&prompt));
        assert_eq!(first.imported, 8);
        let again = d.import(&chain(&prompt));
        assert_eq!(again.imported, 8);
        assert_eq!(again.already_cached, 8);
        assert!(again.events.is_empty());
    }

    #[test]
    fn an_import_larger_than_the_cache_keeps_a_prefix() {
        let mut d = Driver::new(tiny(16, 4));
        let prompt: Vec<u32> = (0..16 * 6).collect();
        let outcome = d.import(&chain(&prompt));
        // Four blocks fit; the fifth would need to evict the chain's own referenced blocks.
        assert_eq!(outcome.imported, 4);
        assert_eq!(d.sim.load().active_blocks, 0);
    }

    #[test]
    fn a_held_import_in_chunks_keeps_its_chain_until_released() {
        let mut d = Driver::new(tiny(16, 1024));
        let prompt: Vec<u32> = (0..256).collect();
        let blocks = chain(&prompt);
        let (head, tail) = blocks.split_at(6);
        let first = d.import_held(Some(77), None, head);
        let second = d.import_held(Some(77), Some(head[5].0), tail);
        assert_eq!((first.imported, second.imported), (6, 10));
        // The second chunk continues the chain: its Stored names the first chunk's tail.
        let parents: Vec<_> = second
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Stored { parent, .. } => Some(*parent),
                _ => None,
            })
            .collect();
        assert_eq!(parents, vec![Some(head[5].0)]);
        // Held: pinned, so a burst of other work cannot evict them before the decode request.
        assert_eq!(d.sim.load().active_blocks, 16);
        assert!(d.sim.release_hold(77));
        assert_eq!(d.sim.load().active_blocks, 0);
        // A hold id that is a live request's is refused.
        d.add(req(5, (1000..1100).collect(), 2));
        assert_eq!(d.import_held(Some(5), None, head).imported, 0);
    }

    #[test]
    fn held_imports_give_way_when_nothing_else_can_run() {
        // 8 blocks: an import holds 6; a request needing 4 cannot be admitted beside it.
        let mut d = Driver::new(tiny(16, 8));
        let prompt: Vec<u32> = (0..16 * 6).collect();
        assert_eq!(d.import_held(Some(50), None, &chain(&prompt)).imported, 6);
        d.add(req(1, (5000..5000 + 16 * 3).collect(), 2));
        d.run(20);
        assert_eq!(d.outputs[&1].len(), 2);
        // The hold was given up, not leaked: releasing it now finds nothing.
        assert!(!d.sim.release_hold(50));
        assert_eq!(d.sim.load().active_blocks, 0);
    }

    #[test]
    fn wrong_sized_blocks_end_the_import() {
        let mut d = Driver::new(tiny(16, 64));
        let mut blocks = chain(&(0..64).collect::<Vec<u32>>());
        blocks[2].1.pop();
        assert_eq!(d.import(&blocks).imported, 2);
    }
}
