//! What besides its tokens names a request's KV: the LoRA adapter it runs under and its cache
//! salt. Engines keep such KV apart from the base model's KV of the same tokens (vLLM folds both
//! into its block hashes, SGLang into its radix tree's namespace), so a request may only be routed
//! to blocks cached under the same identity.
//!
//! One rule names a block under an identity, on the gateway's side (hashing a request) and on the
//! worker's (rehashing an engine's events) alike: every block carries the adapter, the first
//! block of a prompt also carries the salt, and anything else an engine keys a block by (vLLM's
//! multimodal inputs, prompt embeddings) is a third part that no text request has. Salting the
//! first block alone is enough: every later hash chains from it. It is also what vLLM publishes
//! (the salt in the first block's `extra_keys`), and what an SGLang namespace amounts to.

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::hash::{BlockHash, block_key, chain_hash_keyed};
use crate::tokens::{BlockSize, TokenId};

/// Longest adapter name or cache salt accepted, in bytes.
pub const MAX_IDENTITY_PART_BYTES: usize = 256;

/// A request's KV identity; the default (no adapter, no salt) is the base model's plain KV.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvIdentity {
    /// The LoRA adapter the request runs under, by the name the engine serves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// The cache salt (vLLM's and SGLang's `cache_salt`): only requests with the same salt
    /// share KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
}

impl KvIdentity {
    /// The plain identity: the base model, no salt.
    pub const PLAIN: KvIdentity = KvIdentity {
        adapter: None,
        salt: None,
    };

    /// An identity from optional parts, validated: a part is non-empty and at most
    /// [`MAX_IDENTITY_PART_BYTES`] long (an empty salt is refused rather than read as none).
    pub fn new(adapter: Option<String>, salt: Option<String>) -> Result<Self, CoreError> {
        for (what, part) in [("adapter", &adapter), ("cache_salt", &salt)] {
            if let Some(part) = part {
                if part.is_empty() {
                    return Err(CoreError::InvalidIdentity(format!("{what} is empty")));
                }
                if part.len() > MAX_IDENTITY_PART_BYTES {
                    return Err(CoreError::InvalidIdentity(format!(
                        "{what} is {} bytes, more than {MAX_IDENTITY_PART_BYTES}",
                        part.len()
                    )));
                }
            }
        }
        Ok(Self { adapter, salt })
    }

    pub fn is_plain(&self) -> bool {
        self.adapter.is_none() && self.salt.is_none()
    }

    /// The key of a block under this identity: `first` for the first block of a prompt (the
    /// one whose parent is the root), the only one that carries the salt.
    pub fn block_key(&self, first: bool) -> Option<u64> {
        identity_block_key(
            self.adapter.as_deref(),
            self.salt.as_deref().filter(|_| first),
            None,
        )
    }

    /// Hashes of every full block of `tokens` under this identity (exactly
    /// [`crate::block_hashes`] for the plain identity).
    pub fn block_hashes(&self, tokens: &[TokenId], block_size: BlockSize) -> Vec<BlockHash> {
        let mut hashes = Vec::with_capacity(block_size.full_blocks(tokens.len()));
        self.extend_block_hashes(&mut hashes, tokens, block_size);
        hashes
    }

    /// Appends to `hashes` (the hashes of the full blocks before `tokens`, under this identity)
    /// the hashes of the full blocks of `tokens`: a prompt's hashes extended by the tokens a
    /// migrated attempt adds to it, without hashing the prompt again.
    pub fn extend_block_hashes(
        &self,
        hashes: &mut Vec<BlockHash>,
        tokens: &[TokenId],
        block_size: BlockSize,
    ) {
        let parent = hashes.last().copied();
        if self.is_plain() {
            crate::hash::extend_block_hashes(hashes, parent, tokens, block_size);
            return;
        }
        let (first, rest) = (self.block_key(true), self.block_key(false));
        let mut parent = parent;
        hashes.extend(tokens.chunks_exact(block_size.as_usize()).map(|block| {
            let key = if parent.is_none() { first } else { rest };
            let hash = chain_hash_keyed(parent, block, key);
            parent = Some(hash);
            hash
        }));
    }
}

/// The key of one block from its parts: the adapter, the salt (present on a prompt's first
/// block only) and whatever else the engine keys it by (encoded by the caller; `None` for text).
pub fn identity_block_key(
    adapter: Option<&str>,
    salt: Option<&str>,
    other: Option<&[u8]>,
) -> Option<u64> {
    block_key(&[adapter.map(str::as_bytes), salt.map(str::as_bytes), other])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{block_hashes, chain_hash};

    fn bs() -> BlockSize {
        BlockSize::new(4).unwrap()
    }

    fn id(adapter: Option<&str>, salt: Option<&str>) -> KvIdentity {
        KvIdentity::new(adapter.map(Into::into), salt.map(Into::into)).unwrap()
    }

    /// A prompt's hashes extended by later tokens are the hashes of the whole, under every
    /// kind of identity, whatever the cut (mid-block included: only full blocks are hashed,
    /// so the extension starts at the last full block of the first part).
    #[test]
    fn extending_a_prompts_hashes_equals_hashing_the_whole() {
        let tokens: Vec<TokenId> = (0..37).collect();
        for identity in [
            KvIdentity::PLAIN,
            id(Some("lora-a"), None),
            id(None, Some("salt")),
            id(Some("lora-a"), Some("salt")),
        ] {
            let whole = identity.block_hashes(&tokens, bs());
            assert_eq!(whole.len(), 9);
            for cut in 0..=tokens.len() {
                let full = cut / 4 * 4;
                let mut hashes = identity.block_hashes(&tokens[..cut], bs());
                identity.extend_block_hashes(&mut hashes, &tokens[full..], bs());
                assert_eq!(hashes, whole, "{identity:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn the_plain_identity_hashes_as_plain_blocks() {
        let tokens: Vec<u32> = (0..18).collect();
        assert_eq!(
            KvIdentity::PLAIN.block_hashes(&tokens, bs()),
            block_hashes(&tokens, bs())
        );
    }

    #[test]
    fn identities_never_share_a_block() {
        let tokens: Vec<u32> = (0..16).collect();
        let ids = [
            id(None, None),
            id(Some("a"), None),
            id(Some("b"), None),
            id(None, Some("a")),
            id(Some("a"), Some("a")),
            id(Some("a"), Some("s")),
        ];
        let mut seen = std::collections::HashSet::new();
        for identity in &ids {
            for hash in identity.block_hashes(&tokens, bs()) {
                assert!(seen.insert(hash), "{identity:?} reuses {hash:?}");
            }
        }
    }

    #[test]
    fn the_salt_keys_the_first_block_and_the_adapter_every_block() {
        let tokens: Vec<u32> = (0..12).collect();
        let salted = id(None, Some("s")).block_hashes(&tokens, bs());
        let first = chain_hash_keyed(
            None,
            &tokens[..4],
            identity_block_key(None, Some("s"), None),
        );
        assert_eq!(salted[0], first);
        assert_eq!(salted[1], chain_hash(Some(first), &tokens[4..8]));
        let adapted = id(Some("a"), Some("s")).block_hashes(&tokens, bs());
        let key = identity_block_key(Some("a"), None, None);
        assert_eq!(
            adapted[2],
            chain_hash_keyed(Some(adapted[1]), &tokens[8..], key)
        );
    }

    #[test]
    fn empty_and_oversized_parts_are_refused() {
        assert!(KvIdentity::new(None, Some(String::new())).is_err());
        assert!(KvIdentity::new(Some("x".repeat(257)), None).is_err());
        assert!(KvIdentity::new(Some("x".repeat(256)), Some("s".into())).is_ok());
    }
}
