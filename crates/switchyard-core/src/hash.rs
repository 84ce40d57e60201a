//! The chained block hash: Switchyard's own name for a prompt prefix.
//!
//! A prompt is cut into blocks of `block_size` tokens; only full blocks are hashed. Block *i* is
//! named by
//!
//! ```text
//! h_i = XXH3-64( le64(h_{i-1}) ‖ le32(t_0) ‖ … ‖ le32(t_{B-1}), seed = HASH_SEED )
//! h_{-1} = BlockHash::ROOT
//! ```
//!
//! so one number names the whole prefix up to and including block *i*. The definition is part of
//! Switchyard's contract: hashes are persisted (recordings, etcd) and compared across processes
//! and versions, so changing anything here breaks them. The vectors in
//! `tests/data/block_hash_vectors.json` pin it; `docs/block-hash.md` explains it.

use serde::{Deserialize, Serialize};

use crate::{BlockSize, TokenId};

/// Seed of the XXH3-64 hash ("SWYDBLK1" read as a little-endian u64).
pub const HASH_SEED: u64 = u64::from_le_bytes(*b"SWYDBLK1");

/// Chained hash of a full block and everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The parent of the first block of every prompt.
    pub const ROOT: BlockHash = BlockHash(0);

    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Hash of one block given its parent's hash (`None` for the first block of a prompt).
pub fn chain_hash(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
    let mut buf = Vec::with_capacity(8 + tokens.len() * 4);
    hash_into(&mut buf, parent.unwrap_or(BlockHash::ROOT), tokens)
}

/// [`chain_hash`] of block after block with one buffer: what verifying a chain of blocks uses,
/// where a buffer per block cost an allocation per block.
#[derive(Debug, Default)]
pub(crate) struct ChainHasher {
    buf: Vec<u8>,
}

impl ChainHasher {
    pub(crate) fn new(block_size: BlockSize) -> Self {
        Self {
            buf: Vec::with_capacity(8 + block_size.as_usize() * 4),
        }
    }

    /// Exactly [`chain_hash`]`(parent, tokens)`.
    pub(crate) fn hash(&mut self, parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
        hash_into(&mut self.buf, parent.unwrap_or(BlockHash::ROOT), tokens)
    }
}

fn hash_into(buf: &mut Vec<u8>, parent: BlockHash, tokens: &[TokenId]) -> BlockHash {
    // Sized once and overwritten in place: clearing and growing it again would zero it for
    // every block (a tenth of a long prompt's hashing).
    let len = 8 + tokens.len() * 4;
    if buf.len() != len {
        buf.resize(len, 0);
    }
    buf[..8].copy_from_slice(&parent.0.to_le_bytes());
    put_tokens(&mut buf[8..], tokens);
    BlockHash(xxhash_rust::xxh3::xxh3_64_with_seed(buf, HASH_SEED))
}

/// Writes the little-endian bytes of `tokens` into `out` (exactly their length), which the
/// compiler turns into a plain copy on little-endian machines, where growing a buffer token
/// by token cost more than the hashing (a long prompt's hash copies it whole).
fn put_tokens(out: &mut [u8], tokens: &[TokenId]) {
    for (bytes, t) in out.chunks_exact_mut(4).zip(tokens) {
        bytes.copy_from_slice(&t.to_le_bytes());
    }
}

/// What besides its tokens names a block — a LoRA adapter, a cache salt, multimodal inputs —
/// folded to 64 bits; `None` when nothing does. Blocks of the same tokens under different keys
/// never share a hash, so a request is only routed to KV it can reuse. Each part is length-
/// prefixed, so no two different part lists fold alike by concatenation.
pub fn block_key(parts: &[Option<&[u8]>]) -> Option<u64> {
    if parts.iter().all(Option::is_none) {
        return None;
    }
    let mut buf = Vec::new();
    buf.extend_from_slice(b"SWYDKEY1");
    for part in parts {
        match part {
            None => buf.push(0),
            Some(bytes) => {
                buf.push(1);
                buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                buf.extend_from_slice(bytes);
            }
        }
    }
    Some(xxhash_rust::xxh3::xxh3_64_with_seed(&buf, HASH_SEED))
}

/// [`chain_hash`] of a block that also has a [`block_key`]: with `None` it is exactly
/// [`chain_hash`]; with a key, the key's eight bytes follow the tokens in the hashed input
/// (a longer input than any plain block of the same size, so the two never coincide by
/// construction).
pub fn chain_hash_keyed(
    parent: Option<BlockHash>,
    tokens: &[TokenId],
    key: Option<u64>,
) -> BlockHash {
    let Some(key) = key else {
        return chain_hash(parent, tokens);
    };
    let mut buf = vec![0; 16 + tokens.len() * 4];
    let (head, rest) = buf.split_at_mut(8);
    head.copy_from_slice(&parent.unwrap_or(BlockHash::ROOT).0.to_le_bytes());
    let (body, tail) = rest.split_at_mut(tokens.len() * 4);
    put_tokens(body, tokens);
    tail.copy_from_slice(&key.to_le_bytes());
    BlockHash(xxhash_rust::xxh3::xxh3_64_with_seed(&buf, HASH_SEED))
}

/// Hashes of every full block of `tokens`, in order. The partial tail is ignored.
pub fn block_hashes(tokens: &[TokenId], block_size: BlockSize) -> Vec<BlockHash> {
    let mut hashes = Vec::with_capacity(block_size.full_blocks(tokens.len()));
    extend_block_hashes(&mut hashes, None, tokens, block_size);
    hashes
}

/// Appends the hashes of the full blocks of `tokens`, chaining from `parent`.
///
/// Lets a caller extend a prompt's hashes incrementally (a growing session, a prefill chunk)
/// without rehashing what it already knows.
pub fn extend_block_hashes(
    out: &mut Vec<BlockHash>,
    parent: Option<BlockHash>,
    tokens: &[TokenId],
    block_size: BlockSize,
) {
    let mut buf = Vec::with_capacity(8 + block_size.as_usize() * 4);
    let mut prev = parent.unwrap_or(BlockHash::ROOT);
    for block in tokens.chunks_exact(block_size.as_usize()) {
        prev = hash_into(&mut buf, prev, block);
        out.push(prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bs(n: u32) -> BlockSize {
        BlockSize::new(n).unwrap()
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let tokens: Vec<u32> = (0..35).collect();
        assert_eq!(block_hashes(&tokens, bs(16)).len(), 2);
        assert!(block_hashes(&tokens[..15], bs(16)).is_empty());
    }

    #[test]
    fn hash_depends_on_the_whole_prefix() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[0] = 999;
        let ha = block_hashes(&a, bs(16));
        let hb = block_hashes(&b, bs(16));
        assert_ne!(ha[0], hb[0]);
        // Same second block tokens, different first block: different names.
        assert_ne!(ha[1], hb[1]);
    }

    #[test]
    fn first_block_chains_from_root() {
        let t: Vec<u32> = (100..116).collect();
        assert_eq!(chain_hash(None, &t), chain_hash(Some(BlockHash::ROOT), &t));
    }

    proptest! {
        #[test]
        fn shared_prefix_gives_shared_hashes(
            prefix in proptest::collection::vec(any::<u32>(), 0..100),
            tail_a in proptest::collection::vec(any::<u32>(), 0..50),
            tail_b in proptest::collection::vec(any::<u32>(), 0..50),
            block in 1u32..20,
        ) {
            let size = bs(block);
            let a: Vec<u32> = prefix.iter().chain(&tail_a).copied().collect();
            let b: Vec<u32> = prefix.iter().chain(&tail_b).copied().collect();
            let common = size.full_blocks(prefix.len());
            let ha = block_hashes(&a, size);
            let hb = block_hashes(&b, size);
            prop_assert_eq!(&ha[..common], &hb[..common]);
        }

        #[test]
        fn incremental_extension_equals_full(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            split_blocks in 0usize..12,
            block in 1u32..16,
        ) {
            let size = bs(block);
            let full = block_hashes(&tokens, size);
            let cut = (split_blocks * size.as_usize()).min(size.full_blocks(tokens.len()) * size.as_usize());
            let mut inc = block_hashes(&tokens[..cut], size);
            let parent = inc.last().copied();
            extend_block_hashes(&mut inc, parent, &tokens[cut..], size);
            prop_assert_eq!(inc, full);
        }
    }

    #[test]
    fn keyed_blocks_differ_from_plain_ones_and_by_key() {
        let tokens: Vec<TokenId> = (0..16).collect();
        let plain = chain_hash(None, &tokens);
        assert_eq!(chain_hash_keyed(None, &tokens, None), plain);
        let lora = block_key(&[Some(b"adapter-a"), None]);
        let salt = block_key(&[None, Some(b"adapter-a")]);
        assert!(lora.is_some() && lora != salt, "parts are positional");
        assert_eq!(block_key(&[None, None]), None);
        let a = chain_hash_keyed(None, &tokens, lora);
        assert_ne!(a, plain);
        assert_ne!(a, chain_hash_keyed(None, &tokens, salt));
        assert_eq!(
            a,
            chain_hash_keyed(None, &tokens, block_key(&[Some(b"adapter-a"), None]))
        );
        // Length prefixes: ("ab", "c") and ("a", "bc") fold apart.
        assert_ne!(
            block_key(&[Some(b"ab"), Some(b"c")]),
            block_key(&[Some(b"a"), Some(b"bc")])
        );
    }
}
