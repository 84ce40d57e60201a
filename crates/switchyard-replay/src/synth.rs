//! Deterministic synthetic prompts from trace hash ids.
//!
//! Traces publish no text, only one id per block of the prompt prefix, chained so that equal
//! ids at a position mean equal prefixes. A replay turns each `(namespace, id)` into a fixed
//! block of token ids, so two prompts sharing ids share token-identical prefixes and the
//! engines' prefix caches (and the router's index) see the same sharing the trace recorded.
//! Different namespaces (one per replayed session) never share blocks.

use switchyard_core::TokenId;

/// Token ids are drawn from `TOKEN_BASE..TOKEN_BASE + TOKEN_SPAN`, clear of the special tokens
/// low in most vocabularies and inside the simulator's default 32k vocabulary.
pub const TOKEN_BASE: u32 = 1000;
pub const TOKEN_SPAN: u32 = 30_000;

/// A stable 64-bit hash (the workspace's SplitMix64).
pub(crate) use switchyard_core::rng::splitmix as mix;

/// How to build one request's prompt: the trace's block ids plus the prompt length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptSpec {
    /// Hash-id namespace: 0 for a global trace (Mooncake), one per replayed session otherwise.
    pub namespace: u64,
    /// Tokens per hash id in the trace.
    pub block_size: u32,
    pub hash_ids: Vec<u32>,
    /// Prompt length in tokens.
    pub input_tokens: u64,
    /// Seeds the tokens past the last id's block (unique per request, so never shared).
    pub tail_seed: u64,
}

/// Appends the tokens of block `id` of `namespace`, truncated to `len` tokens.
fn push_block(out: &mut Vec<TokenId>, namespace: u64, id: u64, len: usize) {
    let mut state = mix(mix(namespace ^ 0x5357_5944_5245_504c) ^ id);
    for _ in 0..len {
        state = mix(state);
        out.push(TOKEN_BASE + (state % u64::from(TOKEN_SPAN)) as u32);
    }
}

impl PromptSpec {
    /// The prompt's token ids.
    ///
    /// Every id contributes `block_size` tokens except that the prompt stops at
    /// `input_tokens`: when the ids cover more (Mooncake's partial last block also has an id)
    /// the last block is cut; when they cover less (Weka ids name full blocks only) the rest
    /// is request-unique filler. A prompt is never empty.
    pub fn tokens(&self) -> Vec<TokenId> {
        let bs = self.block_size as usize;
        let total = (self.input_tokens as usize).max(1);
        let mut out = Vec::with_capacity(total);
        for &id in &self.hash_ids {
            let left = total - out.len();
            if left == 0 {
                break;
            }
            push_block(&mut out, self.namespace, u64::from(id), left.min(bs));
        }
        let left = total - out.len();
        if left > 0 {
            push_block(
                &mut out,
                self.namespace,
                mix(self.tail_seed) | 1 << 63,
                left,
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(namespace: u64, ids: &[u32], input: u64, tail: u64) -> PromptSpec {
        PromptSpec {
            namespace,
            block_size: 4,
            hash_ids: ids.to_vec(),
            input_tokens: input,
            tail_seed: tail,
        }
    }

    #[test]
    fn same_id_gives_same_tokens_and_other_ids_differ() {
        let a = spec(0, &[1, 2, 3], 12, 0).tokens();
        let b = spec(0, &[1, 2, 9], 12, 1).tokens();
        assert_eq!(a.len(), 12);
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
        let other_ns = spec(7, &[1, 2, 3], 12, 0).tokens();
        assert_ne!(a[..4], other_ns[..4]);
    }

    #[test]
    fn partial_last_block_is_a_prefix_of_the_full_block() {
        let full = spec(0, &[5, 6], 8, 0).tokens();
        let cut = spec(0, &[5, 6], 6, 0).tokens();
        assert_eq!(cut.len(), 6);
        assert_eq!(cut[..], full[..6]);
    }

    #[test]
    fn tail_past_the_ids_is_request_unique() {
        let a = spec(0, &[5], 7, 1).tokens();
        let b = spec(0, &[5], 7, 2).tokens();
        assert_eq!(a.len(), 7);
        assert_eq!(a[..4], b[..4]);
        assert_ne!(a[4..], b[4..]);
        assert!(
            a.iter()
                .all(|t| (TOKEN_BASE..TOKEN_BASE + TOKEN_SPAN).contains(t))
        );
        assert_eq!(spec(0, &[], 0, 3).tokens().len(), 1);
    }
}
