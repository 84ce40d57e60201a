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

/// The first state of block `id` of `namespace`'s token stream.
fn block_state(namespace: u64, id: u64) -> u64 {
    mix(mix(namespace ^ 0x5357_5944_5245_504c) ^ id)
}

/// The token a stream state stands for.
fn token_of(state: u64) -> TokenId {
    TOKEN_BASE + (state % u64::from(TOKEN_SPAN)) as u32
}

/// Appends the tokens of block `id` of `namespace`, truncated to `len` tokens.
fn push_block(out: &mut Vec<TokenId>, namespace: u64, id: u64, len: usize) {
    let mut state = block_state(namespace, id);
    for _ in 0..len {
        state = mix(state);
        out.push(token_of(state));
    }
}

/// Appends the full `bs`-token blocks of `ids`, exactly as [`push_block`] one after the other
/// would. A block's stream is a serial chain of SplitMix64 steps, one multiply-bound step per
/// token (synthesis was a tenth of a replay's time); drawing four blocks at once lets the core
/// overlap their chains.
fn push_full_blocks(out: &mut Vec<TokenId>, namespace: u64, ids: &[u32], bs: usize) {
    let start = out.len();
    out.resize(start + ids.len() * bs, 0);
    let Some(dest) = out.get_mut(start..) else {
        return;
    };
    let mut groups = ids.chunks_exact(4);
    let mut quads = dest.chunks_exact_mut(4 * bs.max(1));
    for (group, quad) in (&mut groups).zip(&mut quads) {
        let (a, rest) = quad.split_at_mut(bs);
        let (b, rest) = rest.split_at_mut(bs);
        let (c, d) = rest.split_at_mut(bs);
        let mut s = [0u64; 4];
        for (state, &id) in s.iter_mut().zip(group) {
            *state = block_state(namespace, u64::from(id));
        }
        for (((ta, tb), tc), td) in a.iter_mut().zip(b).zip(c).zip(d) {
            s = [mix(s[0]), mix(s[1]), mix(s[2]), mix(s[3])];
            (*ta, *tb, *tc, *td) = (
                token_of(s[0]),
                token_of(s[1]),
                token_of(s[2]),
                token_of(s[3]),
            );
        }
    }
    let rest = quads.into_remainder();
    for (&id, block) in groups
        .remainder()
        .iter()
        .zip(rest.chunks_exact_mut(bs.max(1)))
    {
        let mut state = block_state(namespace, u64::from(id));
        for t in block {
            state = mix(state);
            *t = token_of(state);
        }
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
        self.tokens_with_room(0)
    }

    /// [`Self::tokens`] in a vector with room for `room` more (the tokens a simulator will
    /// append as it generates, so a long prompt is not copied to grow).
    pub fn tokens_with_room(&self, room: usize) -> Vec<TokenId> {
        let bs = self.block_size as usize;
        let total = (self.input_tokens as usize).max(1);
        let mut out = Vec::with_capacity(total.saturating_add(room));
        // The ids whose whole block fits, then at most one cut block.
        let full = total
            .checked_div(bs)
            .map_or(0, |blocks| self.hash_ids.len().min(blocks));
        push_full_blocks(&mut out, self.namespace, &self.hash_ids[..full], bs);
        if let Some(&id) = self.hash_ids.get(full) {
            let left = total - out.len();
            if left > 0 {
                push_block(&mut out, self.namespace, u64::from(id), left.min(bs));
            }
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
    fn blocks_drawn_side_by_side_equal_blocks_drawn_one_by_one() {
        for count in 0..10u32 {
            for bs in [1usize, 3, 64] {
                let ids: Vec<u32> = (0..count).map(|i| i * 7 + 1).collect();
                let mut one_by_one = vec![9];
                for &id in &ids {
                    push_block(&mut one_by_one, 5, u64::from(id), bs);
                }
                let mut side_by_side = vec![9];
                push_full_blocks(&mut side_by_side, 5, &ids, bs);
                assert_eq!(side_by_side, one_by_one, "{count} blocks of {bs}");
            }
        }
    }

    #[test]
    fn prompts_equal_the_block_by_block_definition() {
        // The definition: each id in turn, cut at the prompt's length, then the filler.
        let reference = |p: &PromptSpec| {
            let total = (p.input_tokens as usize).max(1);
            let mut out = Vec::new();
            for &id in &p.hash_ids {
                let left = total - out.len();
                push_block(
                    &mut out,
                    p.namespace,
                    u64::from(id),
                    left.min(p.block_size as usize),
                );
            }
            let left = total - out.len();
            push_block(&mut out, p.namespace, mix(p.tail_seed) | 1 << 63, left);
            out
        };
        for input in [0, 1, 3, 4, 17, 20, 21, 40] {
            for ids in [
                &[][..],
                &[1],
                &[1, 2, 3, 4, 5],
                &[9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
            ] {
                let p = spec(3, ids, input, 11);
                assert_eq!(p.tokens(), reference(&p), "{ids:?} for {input} tokens");
            }
        }
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
