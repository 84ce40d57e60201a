//! Token ids and block size.

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// A token id as the model's tokenizer produces it.
pub type TokenId = u32;

/// Tokens per KV block. Workers of one model must agree on it; it is never zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockSize(u32);

impl BlockSize {
    /// Largest block size accepted; engines use 16 to 512, so this only catches nonsense.
    pub const MAX: u32 = 1 << 16;

    pub fn new(tokens: u32) -> Result<Self, CoreError> {
        if tokens == 0 || tokens > Self::MAX {
            return Err(CoreError::InvalidBlockSize {
                got: u64::from(tokens),
                max: Self::MAX,
            });
        }
        Ok(Self(tokens))
    }

    pub fn get(self) -> u32 {
        self.0
    }

    pub fn as_usize(self) -> usize {
        self.0 as usize
    }

    /// Number of full blocks in `tokens` tokens (only full blocks are ever cached or hashed).
    pub fn full_blocks(self, tokens: usize) -> usize {
        tokens / self.as_usize()
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = CoreError;
    fn try_from(value: u32) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<BlockSize> for u32 {
    fn from(value: BlockSize) -> Self {
        value.0
    }
}

impl std::fmt::Display for BlockSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_huge_block_sizes_are_refused() {
        assert!(BlockSize::new(0).is_err());
        assert!(BlockSize::new(BlockSize::MAX + 1).is_err());
        assert_eq!(BlockSize::new(16).map(BlockSize::get), Ok(16));
    }

    #[test]
    fn full_blocks_ignores_the_partial_tail() {
        let bs = BlockSize::new(16).unwrap();
        assert_eq!(bs.full_blocks(15), 0);
        assert_eq!(bs.full_blocks(16), 1);
        assert_eq!(bs.full_blocks(47), 2);
    }

    #[test]
    fn deserialising_zero_fails() {
        assert!(serde_json::from_str::<BlockSize>("0").is_err());
        assert_eq!(serde_json::from_str::<BlockSize>("64").unwrap().get(), 64);
    }
}
