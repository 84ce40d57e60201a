//! A cheap, order-independent digest of a set of cached blocks, so a consumer of a worker's KV
//! events (the gateway's prefix index) can check that it holds exactly the blocks the worker's
//! own event log holds without shipping either set.
//!
//! Each `(block, tier)` pair is mixed to 64 bits (SplitMix64's finaliser over the hash and the
//! tier) and the digest is the wrapping sum of the mixed values plus the number of pairs. A sum
//! is kept up to date in O(1) per change on the worker (add on store, subtract on removal) and
//! computed in O(n) on the gateway; two sets differ in digest unless their mixed sums collide,
//! which a single lost or extra block never makes happen (the mix is a bijection).

use serde::{Deserialize, Serialize};

use crate::{BlockHash, BlockSize, StorageTier, TokenId, chain_hash};

/// The block hash scheme workers and gateways must share ([`crate::hash`]); sent with each
/// digest so a peer with another scheme is reported rather than silently never matching.
pub const HASH_SCHEME: &str = "xxh3-64-chained/SWYDBLK1";

/// Digest of a set of `(block, tier)` pairs; see the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockSetDigest {
    /// Number of `(block, tier)` pairs.
    pub blocks: u64,
    /// Wrapping sum of the pairs' mixed values.
    pub sum: u64,
}

impl BlockSetDigest {
    /// Adds one pair that was not in the set.
    pub fn add(&mut self, hash: BlockHash, tier: StorageTier) {
        self.blocks += 1;
        self.sum = self.sum.wrapping_add(mix(hash, tier));
    }

    /// Removes one pair that was in the set.
    pub fn remove(&mut self, hash: BlockHash, tier: StorageTier) {
        self.blocks = self.blocks.saturating_sub(1);
        self.sum = self.sum.wrapping_sub(mix(hash, tier));
    }

    /// The digest of `pairs` (each pair once).
    pub fn of(pairs: impl IntoIterator<Item = (BlockHash, StorageTier)>) -> Self {
        let mut digest = Self::default();
        for (hash, tier) in pairs {
            digest.add(hash, tier);
        }
        digest
    }
}

fn mix(hash: BlockHash, tier: StorageTier) -> u64 {
    let salt = match tier {
        StorageTier::Device => 0x9e37_79b9_7f4a_7c15,
        StorageTier::Host => 0xbf58_476d_1ce4_e5b9,
        StorageTier::Disk => 0x94d0_49bb_1331_11eb,
        StorageTier::Remote => 0xd6e8_feb8_6659_fd93,
    };
    let mut z = hash.get() ^ salt;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash of one fixed probe block (`1..=block_size`) under this build's scheme: two
/// processes that hash blocks differently (another seed, another algorithm) disagree on it.
pub fn hash_probe(block_size: BlockSize) -> u64 {
    let tokens: Vec<TokenId> = (1..=block_size.get()).collect();
    chain_hash(None, &tokens).get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_does_not_matter_and_removal_undoes_addition() {
        let pairs = [
            (BlockHash(1), StorageTier::Device),
            (BlockHash(2), StorageTier::Device),
            (BlockHash(2), StorageTier::Host),
        ];
        let forward = BlockSetDigest::of(pairs);
        let backward = BlockSetDigest::of(pairs.into_iter().rev());
        assert_eq!(forward, backward);
        let mut d = forward;
        d.add(BlockHash(7), StorageTier::Disk);
        assert_ne!(d, forward);
        d.remove(BlockHash(7), StorageTier::Disk);
        assert_eq!(d, forward);
    }

    #[test]
    fn one_missing_or_moved_block_changes_the_digest() {
        let full = BlockSetDigest::of([
            (BlockHash(1), StorageTier::Device),
            (BlockHash(2), StorageTier::Device),
        ]);
        let missing = BlockSetDigest::of([(BlockHash(1), StorageTier::Device)]);
        let moved = BlockSetDigest::of([
            (BlockHash(1), StorageTier::Device),
            (BlockHash(2), StorageTier::Host),
        ]);
        assert_ne!(full, missing);
        assert_ne!(full.sum, moved.sum);
        assert_eq!(full.blocks, moved.blocks);
    }

    #[test]
    fn the_probe_depends_on_the_block_size() {
        let a = hash_probe(BlockSize::new(16).unwrap());
        let b = hash_probe(BlockSize::new(32).unwrap());
        assert_ne!(a, b);
        assert_eq!(a, hash_probe(BlockSize::new(16).unwrap()));
    }
}
