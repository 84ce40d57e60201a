//! The digest of one worker's blocks as the index holds them, to compare with the digest the
//! worker computes over its own event log ([`switchyard_core::BlockSetDigest`]). Kept apart
//! from the index's storage: it only reads the worker's blocks through its runs.

use switchyard_core::{BlockSetDigest, StorageTier, WorkerId};

use super::{PrefixIndex, set_of};

impl PrefixIndex {
    /// Every `(block, tier)` pair the index holds for `worker`, digested; `None` for a worker
    /// the index does not know. O(blocks of the worker): meant for a periodic check.
    pub fn worker_digest(&self, worker: &WorkerId) -> Option<BlockSetDigest> {
        let &slot = self.by_id.get(worker)?;
        self.workers.get(slot as usize)?.as_ref()?;
        let mut digest = BlockSetDigest::default();
        // A block is in a tier's runs at most once.
        for tier in StorageTier::ALL {
            for block in self.runs.blocks_of(set_of(slot, tier)) {
                digest.add(block, tier);
            }
        }
        Some(digest)
    }
}

#[cfg(test)]
mod tests {
    use switchyard_core::{
        BlockHash, BlockSize, KvEvent, SnapshotBlock, StoredBlock, block_hashes,
    };

    use super::*;
    use crate::IndexConfig;

    fn stored(tokens: &[u32], tier: StorageTier) -> KvEvent {
        let bs = BlockSize::new(4).unwrap();
        KvEvent::Stored {
            parent: None,
            blocks: block_hashes(tokens, bs)
                .into_iter()
                .zip(tokens.chunks(4))
                .map(|(hash, t)| StoredBlock {
                    hash,
                    tokens: t.to_vec(),
                })
                .collect(),
            tier,
        }
    }

    #[test]
    fn the_index_digest_equals_the_digest_of_what_the_events_leave() {
        let mut index = PrefixIndex::new(IndexConfig::new(BlockSize::new(4).unwrap()));
        let w = WorkerId::new("w").unwrap();
        assert_eq!(index.worker_digest(&w), None);
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let hashes = block_hashes(&tokens, BlockSize::new(4).unwrap());
        index
            .apply(&w, 1, 0, &stored(&tokens, StorageTier::Device))
            .unwrap();
        index
            .apply(&w, 1, 1, &stored(&tokens[..4], StorageTier::Host))
            .unwrap();
        index
            .apply(
                &w,
                1,
                2,
                &KvEvent::Removed {
                    blocks: vec![hashes[1]],
                    tier: StorageTier::Device,
                },
            )
            .unwrap();
        // Removed and stored again: counted once.
        index
            .apply(&w, 1, 3, &stored(&tokens, StorageTier::Device))
            .unwrap();
        let want = BlockSetDigest::of([
            (hashes[0], StorageTier::Device),
            (hashes[0], StorageTier::Host),
            (hashes[1], StorageTier::Device),
        ]);
        assert_eq!(index.worker_digest(&w), Some(want));
        // A snapshot replaces the view, and the digest with it.
        index
            .apply_snapshot(
                &w,
                1,
                9,
                &[SnapshotBlock {
                    hash: BlockHash(5),
                    parent: None,
                    tier: StorageTier::Disk,
                }],
            )
            .unwrap();
        assert_eq!(
            index.worker_digest(&w),
            Some(BlockSetDigest::of([(BlockHash(5), StorageTier::Disk)]))
        );
    }
}
