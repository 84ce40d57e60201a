//! A prompt's block hashes, computed where the prompt is tokenized (on the blocking pool, in
//! the same task, right after the tokens) instead of on the request's async task before each
//! attempt is routed. At 128k tokens hashing is ≈ 0.2 ms, four times the route itself
//! (`docs/BENCHMARKS.md`, "Routing overhead"); done once, it is also shared by a request's
//! choices and by its retries, and a migrated attempt hashes only the tokens it adds.

use std::sync::Arc;

use switchyard_core::{BlockHash, BlockSize, KvIdentity, TokenId};
use switchyard_router::RouteRequest;
use switchyard_router::serve;

use crate::cluster::pool::{ModelRoutes, WorkerPool};

/// How a prompt's blocks are named for routing: the model's block size and the request's KV
/// identity (adapter, cache salt).
#[derive(Debug, Clone)]
pub struct BlockNaming {
    pub block_size: BlockSize,
    pub identity: KvIdentity,
}

impl BlockNaming {
    /// The hashes of every full block of `tokens`.
    pub fn hash(&self, tokens: &[TokenId]) -> PromptHashes {
        PromptHashes {
            block_size: self.block_size,
            identity: self.identity.clone(),
            hashes: self.identity.block_hashes(tokens, self.block_size).into(),
        }
    }
}

/// The hashes of a prompt's full blocks under one block size and identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptHashes {
    block_size: BlockSize,
    identity: KvIdentity,
    hashes: Arc<[BlockHash]>,
}

impl PromptHashes {
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The prompt's first block (none for a prompt shorter than a block).
    pub fn first(&self) -> Option<BlockHash> {
        self.hashes.first().copied()
    }

    /// The hashes of `context` (this prompt followed by the tokens an attempt adds), when they
    /// were computed for `context`'s prefix under `block_size` and `identity`; `None` when
    /// they were not, and the caller hashes `context` itself.
    fn extended_to(
        &self,
        context: &[TokenId],
        block_size: BlockSize,
        identity: &KvIdentity,
    ) -> Option<Vec<BlockHash>> {
        let known = self.hashes.len() * block_size.as_usize();
        if block_size != self.block_size || identity != &self.identity || known > context.len() {
            return None;
        }
        let mut hashes = Vec::with_capacity(block_size.full_blocks(context.len()));
        hashes.extend_from_slice(&self.hashes);
        identity.extend_block_hashes(&mut hashes, &context[known..], block_size);
        Some(hashes)
    }
}

/// The route request for `context`, from the prompt's hashes when `known` holds them (only the
/// tokens after the prompt's last full block are hashed), else hashing `context` whole.
pub fn route_request_from(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    context: &[TokenId],
    known: Option<&PromptHashes>,
    identity: &KvIdentity,
    session: Option<String>,
) -> RouteRequest {
    match known.and_then(|k| k.extended_to(context, routes.block_size, identity)) {
        Some(block_hashes) => RouteRequest {
            block_hashes,
            prompt_tokens: context.len() as u64,
            block_size: routes.block_size,
            session,
            now: pool.now_tick(),
            adapter: identity.adapter.clone(),
        },
        None => route_request(pool, routes, context, identity, session),
    }
}

/// The route request for `tokens` (hashing happens here, outside any lock).
pub fn route_request(
    pool: &WorkerPool,
    routes: &ModelRoutes,
    tokens: &[TokenId],
    identity: &KvIdentity,
    session: Option<String>,
) -> RouteRequest {
    serve::route_request_as(
        tokens,
        identity,
        routes.block_size,
        session,
        pool.now_tick(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naming(identity: KvIdentity) -> BlockNaming {
        BlockNaming {
            block_size: BlockSize::new(16).unwrap(),
            identity,
        }
    }

    /// A migrated attempt's context is the prompt and what was generated: its hashes from the
    /// prompt's are the hashes of the whole, under a plain and a salted identity.
    #[test]
    fn an_attempts_hashes_extend_the_prompts() {
        let salted = KvIdentity::new(None, Some("s".into())).unwrap();
        for identity in [KvIdentity::PLAIN, salted] {
            let naming = naming(identity.clone());
            let context: Vec<TokenId> = (0..200).collect();
            for prompt_len in [0, 15, 16, 17, 100, 200] {
                let known = naming.hash(&context[..prompt_len]);
                assert_eq!(known.len(), prompt_len / 16);
                let hashes = known
                    .extended_to(&context, naming.block_size, &identity)
                    .expect("the prompt is the context's prefix");
                assert_eq!(
                    hashes,
                    identity.block_hashes(&context, naming.block_size),
                    "{identity:?} prompt of {prompt_len}"
                );
            }
        }
    }

    /// Hashes under another block size or identity, or of a longer text, are not used.
    #[test]
    fn hashes_of_another_naming_are_not_used() {
        let naming = naming(KvIdentity::PLAIN);
        let prompt: Vec<TokenId> = (0..64).collect();
        let known = naming.hash(&prompt);
        let salted = KvIdentity::new(None, Some("s".into())).unwrap();
        assert!(
            known
                .extended_to(&prompt, naming.block_size, &salted)
                .is_none()
        );
        let other = BlockSize::new(32).unwrap();
        assert!(
            known
                .extended_to(&prompt, other, &KvIdentity::PLAIN)
                .is_none()
        );
        assert!(
            known
                .extended_to(&prompt[..32], naming.block_size, &KvIdentity::PLAIN)
                .is_none()
        );
    }
}
