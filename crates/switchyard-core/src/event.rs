//! The KV event model.
//!
//! A worker publishes, in order, one event per change of its prefix cache. Each event carries a
//! sequence number that starts at 0 for every engine incarnation and grows by one per event, so a
//! consumer can tell a gap (resync from a snapshot) from a restart (new incarnation: drop what it
//! knew about the worker).

use serde::{Deserialize, Serialize};

use crate::{BlockHash, BlockSize, CoreError, TokenId, WorkerId, hash::ChainHasher};

/// Per-incarnation event sequence number.
pub type EventSeq = u64;

/// Identifies one run of an engine; a restarted engine has a new one.
pub type Incarnation = u64;

/// Where a cached block lives.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum StorageTier {
    /// Accelerator memory: a hit here costs nothing.
    #[default]
    Device,
    /// Host memory: a hit here costs a copy back to the device.
    Host,
    /// The worker's local disk.
    Disk,
    /// A store outside the worker's node (SGLang's `EXTERNAL` medium, LMCache's remote
    /// backends, media an engine names that Switchyard does not know): reached over the
    /// network, and possibly shared by several workers.
    Remote,
}

impl StorageTier {
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::Host,
        StorageTier::Disk,
        StorageTier::Remote,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StorageTier::Device => "device",
            StorageTier::Host => "host",
            StorageTier::Disk => "disk",
            StorageTier::Remote => "remote",
        }
    }
}

impl std::str::FromStr for StorageTier {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "device" | "gpu" => Ok(StorageTier::Device),
            "host" | "cpu" => Ok(StorageTier::Host),
            "disk" => Ok(StorageTier::Disk),
            "remote" | "external" => Ok(StorageTier::Remote),
            _ => Err(CoreError::UnknownTier(s.to_owned())),
        }
    }
}

/// One newly cached full block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    pub hash: BlockHash,
    pub tokens: Vec<TokenId>,
}

/// A change to a worker's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Consecutive blocks of one sequence became cached. `parent` is the hash of the block before
    /// `blocks[0]`, `None` when `blocks[0]` is a prompt's first block.
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<StoredBlock>,
        tier: StorageTier,
    },
    /// Blocks left the given tier.
    Removed {
        blocks: Vec<BlockHash>,
        tier: StorageTier,
    },
    /// Everything the worker held is gone (cache reset).
    Cleared,
}

impl KvEvent {
    /// Checks that a `Stored` event's hashes are the chain of its tokens, every block full.
    ///
    /// Consumers call this on events that come from outside the process, so a confused or
    /// malicious publisher cannot plant blocks under names that do not match their tokens.
    pub fn validate(&self, block_size: BlockSize) -> Result<(), CoreError> {
        if let KvEvent::Stored { parent, blocks, .. } = self {
            let mut prev = *parent;
            // One buffer for the event's blocks, not one per block (a gateway verifies every
            // block it ingests).
            let mut hasher = ChainHasher::new(block_size);
            for block in blocks {
                if block.tokens.len() != block_size.as_usize() {
                    return Err(CoreError::PartialBlock {
                        got: block.tokens.len(),
                        block_size: block_size.get(),
                    });
                }
                let expected = hasher.hash(prev, &block.tokens);
                if expected != block.hash {
                    return Err(CoreError::HashMismatch {
                        hash: block.hash.to_string(),
                        expected: expected.to_string(),
                    });
                }
                prev = Some(block.hash);
            }
        }
        Ok(())
    }

    /// Number of blocks the event names.
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            KvEvent::Removed { blocks, .. } => blocks.len(),
            KvEvent::Cleared => 0,
        }
    }
}

/// An event as published: who, which incarnation, which position in the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventEnvelope {
    pub worker: WorkerId,
    pub incarnation: Incarnation,
    pub seq: EventSeq,
    pub event: KvEvent,
}

/// One block of a worker's snapshot, sent to resynchronise a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotBlock {
    pub hash: BlockHash,
    /// `None` for a prompt's first block. A source that does not track parents sends `None`
    /// for every block; the prefix index then keeps each block alone and looks every block the
    /// worker stores later up among them.
    pub parent: Option<BlockHash>,
    pub tier: StorageTier,
}

impl SnapshotBlock {
    /// A prompt's chained block hashes as snapshot blocks in `tier`, each naming its parent.
    pub fn chain(hashes: &[BlockHash], tier: StorageTier) -> impl Iterator<Item = Self> + '_ {
        hashes
            .iter()
            .enumerate()
            .map(move |(j, &hash)| SnapshotBlock {
                hash,
                parent: j.checked_sub(1).map(|p| hashes[p]),
                tier,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hashes;

    #[test]
    fn a_snapshot_chain_names_each_blocks_parent() {
        let h = block_hashes(&[1, 2, 3, 4, 5, 6], BlockSize::new(2).unwrap());
        let got: Vec<SnapshotBlock> = SnapshotBlock::chain(&h, StorageTier::Host).collect();
        let parents: Vec<Option<BlockHash>> = got.iter().map(|b| b.parent).collect();
        assert_eq!(parents, vec![None, Some(h[0]), Some(h[1])]);
        assert!(got.iter().zip(&h).all(|(b, &hash)| b.hash == hash));
        assert!(got.iter().all(|b| b.tier == StorageTier::Host));
    }

    #[test]
    fn validate_accepts_a_true_chain_and_refuses_forgeries() {
        let bs = BlockSize::new(4).unwrap();
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = block_hashes(&tokens, bs);
        let stored = KvEvent::Stored {
            parent: None,
            blocks: vec![
                StoredBlock {
                    hash: hashes[0],
                    tokens: tokens[..4].to_vec(),
                },
                StoredBlock {
                    hash: hashes[1],
                    tokens: tokens[4..].to_vec(),
                },
            ],
            tier: StorageTier::Device,
        };
        assert!(stored.validate(bs).is_ok());

        let forged = KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                hash: hashes[1],
                tokens: tokens[..4].to_vec(),
            }],
            tier: StorageTier::Device,
        };
        assert!(forged.validate(bs).is_err());

        let partial = KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                hash: hashes[0],
                tokens: tokens[..3].to_vec(),
            }],
            tier: StorageTier::Device,
        };
        assert!(matches!(
            partial.validate(bs),
            Err(CoreError::PartialBlock { .. })
        ));
    }

    #[test]
    fn events_serialise_with_a_type_tag() {
        let json = serde_json::to_value(KvEvent::Cleared).unwrap();
        assert_eq!(json["type"], "cleared");
        let removed = KvEvent::Removed {
            blocks: vec![BlockHash(5)],
            tier: StorageTier::Host,
        };
        let back: KvEvent =
            serde_json::from_str(&serde_json::to_string(&removed).unwrap()).unwrap();
        assert_eq!(back, removed);
    }

    #[test]
    fn tiers_parse_engine_media_names() {
        assert_eq!("GPU".parse::<StorageTier>().unwrap(), StorageTier::Device);
        assert_eq!("cpu".parse::<StorageTier>().unwrap(), StorageTier::Host);
        assert!("tape".parse::<StorageTier>().is_err());
    }
}
