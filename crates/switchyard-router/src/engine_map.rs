//! Translating an engine's own block hashes into Switchyard's chained hashes.
//!
//! vLLM and SGLang name blocks by their own 64-bit hashes, which differ between engines and
//! versions. Their `Stored` events also carry the blocks' token ids, so the adapter recomputes
//! Switchyard's [`chain_hash`](switchyard_core::chain_hash) from them and remembers the correspondence here; a later engine
//! `Removed{engine hashes}` is then translated back. One map per worker, owned by the adapter
//! that consumes that worker's stream and dropped with it (and [`EngineHashMap::clear`]ed on a
//! new incarnation or a `Cleared` event).
//!
//! A mapping lives while its block is held in at least one tier. The map is bounded: past
//! `capacity` mappings the oldest is forgotten, after which a `Removed` naming it is skipped
//! (counted in [`EngineHashMap::unknown_removed`]) and a `Stored` whose parent it was fails with
//! [`IndexError::UnknownEngineParent`], telling the consumer to resync. Size the capacity above
//! the worker's total block capacity across tiers and neither happens.

use std::collections::VecDeque;

use switchyard_core::{
    BlockHash, BlockSize, KvEvent, StorageTier, StoredBlock, TokenId, chain_hash_keyed,
};

use crate::error::IndexError;
use crate::hasher::FxHashMap;
use crate::index::tier_bit;

/// Engine block hash → (Switchyard block hash, tiers the engine holds it in).
#[derive(Debug)]
pub struct EngineHashMap {
    block_size: BlockSize,
    capacity: usize,
    map: FxHashMap<u64, (BlockHash, u8)>,
    /// Insertion order for eviction; may hold stale keys (skipped when popped).
    order: VecDeque<u64>,
    unknown_removed: u64,
}

impl EngineHashMap {
    pub fn new(block_size: BlockSize, capacity: usize) -> Self {
        Self {
            block_size,
            capacity: capacity.max(1),
            map: FxHashMap::default(),
            order: VecDeque::new(),
            unknown_removed: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Engine hashes named by `Removed` events that the map did not know.
    pub fn unknown_removed(&self) -> u64 {
        self.unknown_removed
    }

    /// Switchyard's hash for an engine hash, if known.
    pub fn get(&self, engine_hash: u64) -> Option<BlockHash> {
        self.map.get(&engine_hash).map(|(h, _)| *h)
    }

    /// Whether the engine holds `engine_hash` in `tier` as far as this map knows (a `Stored`
    /// of it there already came, and no `Removed` since).
    pub fn holds(&self, engine_hash: u64, tier: StorageTier) -> bool {
        self.map
            .get(&engine_hash)
            .is_some_and(|(_, tiers)| tiers & tier_bit(tier) != 0)
    }

    /// Forgets everything (engine restart or `Cleared`).
    pub fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    /// Turns an engine `Stored` event (engine hashes, the flat token ids of those full blocks,
    /// the engine parent hash) into a Switchyard [`KvEvent::Stored`], recording the mappings.
    pub fn stored(
        &mut self,
        engine_parent: Option<u64>,
        engine_hashes: &[u64],
        tokens: &[TokenId],
        tier: StorageTier,
    ) -> Result<KvEvent, IndexError> {
        self.stored_keyed(engine_parent, engine_hashes, tokens, &[], tier)
    }

    /// [`stored`](Self::stored) for blocks that carry a key besides their tokens
    /// ([`switchyard_core::block_key`]: an adapter, a cache salt, multimodal inputs), one per
    /// block; an empty `keys` means none does.
    pub fn stored_keyed(
        &mut self,
        engine_parent: Option<u64>,
        engine_hashes: &[u64],
        tokens: &[TokenId],
        keys: &[Option<u64>],
        tier: StorageTier,
    ) -> Result<KvEvent, IndexError> {
        let (parent, hashes) = self.rehash(engine_parent, engine_hashes, tokens, keys)?;
        let bs = self.block_size.as_usize();
        let mut blocks = Vec::with_capacity(engine_hashes.len());
        for ((&engine_hash, hash), block_tokens) in engine_hashes
            .iter()
            .zip(hashes)
            .zip(tokens.chunks_exact(bs))
        {
            self.remember(engine_hash, hash, tier_bit(tier));
            blocks.push(StoredBlock {
                hash,
                tokens: block_tokens.to_vec(),
            });
        }
        Ok(KvEvent::Stored {
            parent,
            blocks,
            tier,
        })
    }

    /// The Switchyard parent and block hashes that [`stored_keyed`](Self::stored_keyed) would
    /// give these blocks, without recording anything: a consumer can see beforehand which engine
    /// hashes would now name other blocks than the ones the map holds for them.
    pub fn rehash(
        &self,
        engine_parent: Option<u64>,
        engine_hashes: &[u64],
        tokens: &[TokenId],
        keys: &[Option<u64>],
    ) -> Result<(Option<BlockHash>, Vec<BlockHash>), IndexError> {
        let bs = self.block_size.as_usize();
        if tokens.len() != engine_hashes.len() * bs {
            return Err(IndexError::EngineBlockCountMismatch {
                hashes: engine_hashes.len(),
                blocks: tokens.len().div_ceil(bs),
            });
        }
        let parent = match engine_parent {
            None => None,
            Some(p) => Some(self.get(p).ok_or(IndexError::UnknownEngineParent(p))?),
        };
        let mut prev = parent;
        let mut hashes = Vec::with_capacity(engine_hashes.len());
        for (i, block_tokens) in tokens.chunks_exact(bs).enumerate() {
            let hash = chain_hash_keyed(prev, block_tokens, keys.get(i).copied().flatten());
            hashes.push(hash);
            prev = Some(hash);
        }
        Ok((parent, hashes))
    }

    /// Turns an engine `Removed` event into a Switchyard [`KvEvent::Removed`] of the blocks the
    /// map knew held in `tier`; engine hashes it did not know there are skipped and counted.
    pub fn removed(&mut self, engine_hashes: &[u64], tier: StorageTier) -> KvEvent {
        let bit = tier_bit(tier);
        let mut blocks = Vec::with_capacity(engine_hashes.len());
        for engine_hash in engine_hashes {
            match self.map.get_mut(engine_hash) {
                Some((hash, tiers)) if *tiers & bit != 0 => {
                    blocks.push(*hash);
                    *tiers &= !bit;
                    if *tiers == 0 {
                        self.map.remove(engine_hash);
                    }
                }
                _ => self.unknown_removed += 1,
            }
        }
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            let mut seen = crate::hasher::FxHashSet::default();
            self.order
                .retain(|k| map.contains_key(k) && seen.insert(*k));
        }
        KvEvent::Removed { blocks, tier }
    }

    fn remember(&mut self, engine_hash: u64, hash: BlockHash, bit: u8) {
        if let Some((known, tiers)) = self.map.get_mut(&engine_hash) {
            *known = hash;
            *tiers |= bit;
            return;
        }
        while self.map.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        self.map.insert(engine_hash, (hash, bit));
        self.order.push_back(engine_hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::block_hashes;

    fn bs() -> BlockSize {
        BlockSize::new(4).unwrap()
    }

    #[test]
    fn stored_events_are_rehashed_and_removals_translated() {
        let mut m = EngineHashMap::new(bs(), 100);
        let tokens: Vec<u32> = (0..12).collect();
        let ours = block_hashes(&tokens, bs());
        let ev = m
            .stored(None, &[0xa, 0xb], &tokens[..8], StorageTier::Device)
            .unwrap();
        assert!(ev.validate(bs()).is_ok());
        let ev2 = m
            .stored(Some(0xb), &[0xc], &tokens[8..], StorageTier::Device)
            .unwrap();
        let KvEvent::Stored { parent, blocks, .. } = ev2 else {
            unreachable!()
        };
        assert_eq!(parent, Some(ours[1]));
        assert_eq!(blocks[0].hash, ours[2]);

        // Also offloaded to host: removal from device keeps the mapping for the host removal.
        m.stored(None, &[0xa], &tokens[..4], StorageTier::Host)
            .unwrap();
        assert_eq!(
            m.removed(&[0xa, 0xdead], StorageTier::Device),
            KvEvent::Removed {
                blocks: vec![ours[0]],
                tier: StorageTier::Device
            }
        );
        assert_eq!(m.unknown_removed(), 1);
        assert_eq!(m.get(0xa), Some(ours[0]));
        m.removed(&[0xa], StorageTier::Host);
        assert_eq!(m.get(0xa), None);
    }

    #[test]
    fn unknown_parent_and_mismatched_lengths_are_errors() {
        let mut m = EngineHashMap::new(bs(), 100);
        let tokens: Vec<u32> = (0..8).collect();
        assert_eq!(
            m.stored(Some(7), &[1, 2], &tokens, StorageTier::Device),
            Err(IndexError::UnknownEngineParent(7))
        );
        assert!(matches!(
            m.stored(None, &[1, 2], &tokens[..7], StorageTier::Device),
            Err(IndexError::EngineBlockCountMismatch { .. })
        ));
        assert!(m.is_empty());
    }

    #[test]
    fn the_map_is_bounded() {
        let mut m = EngineHashMap::new(bs(), 3);
        let tokens: Vec<u32> = (0..20).collect();
        m.stored(None, &[1, 2, 3, 4, 5], &tokens, StorageTier::Device)
            .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m.get(1), None);
        assert!(m.get(5).is_some());
        m.clear();
        assert!(m.is_empty());
    }
}
