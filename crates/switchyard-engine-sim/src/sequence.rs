//! A request's state inside the engine, and its deterministic token sampler.

use switchyard_core::{
    BlockHash, BlockSize, MAX_TOP_LOGPROBS, TokenId, TokenLogprob, TopLogprob, chain_hash,
    chain_hash_keyed,
};

use crate::{FinishReason, SimRequest, kv_cache::BlockId};

/// A cheap, well-mixed 64-bit hash (the workspace's SplitMix64).
use switchyard_core::rng::splitmix as mix;

/// Keeps the end-of-sequence draw apart from the token draw of the same position.
const ENDING_SALT: u64 = 0x454f_535f_454e_4421;

/// Stream salts of seeded and greedy sequences (no engine seed in them).
const SEEDED: u64 = 0x5345_4544_4544_0001;
const GREEDY: u64 = 0x4752_4545_4459_0001;
/// Salt of the log-probability draws, apart from the token draw.
const LOGPROBS: u64 = 0x4c4f_4750_524f_0001;

#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: u64,
    pub(crate) prompt_len: usize,
    pub(crate) max_tokens: u32,
    pub(crate) ignore_eos: bool,
    pub(crate) stop_token_ids: Vec<TokenId>,
    pub(crate) min_tokens: u32,
    pub(crate) banned: Vec<TokenId>,
    pub(crate) forced: Vec<TokenId>,
    /// The tokens to generate, when the caller wrote them ([`SimRequest::script`]).
    script: Vec<TokenId>,
    pub(crate) hold_blocks: bool,
    pub(crate) retention: switchyard_core::Retention,
    pub(crate) pipeline: bool,
    /// Alternatives per token when log probabilities are asked for.
    pub(crate) logprobs: Option<u32>,
    /// Greedy decoding: the sampled token is always the most likely one.
    greedy: bool,
    /// Leading prompt blocks already exported (pipelined prefill); survives preemption, so a
    /// recompute exports nothing twice.
    pub(crate) exported: usize,
    /// Seeds every token of this request; fixed at arrival so a recompute resamples nothing.
    stream: u64,
    /// Prompt then generated tokens; a preempted sequence recomputes all of them.
    pub(crate) tokens: Vec<TokenId>,
    /// Chained hashes of every full block of `tokens`, under the request's identity.
    pub(crate) hashes: Vec<BlockHash>,
    /// The keys of the first block and of every later one under the request's identity
    /// (`KvIdentity::block_key`; `None` when plain).
    keys: (Option<u64>, Option<u64>),
    pub(crate) completion_tokens: u32,
    /// Tokens whose KV is computed (the last sampled token's is not, until it is decoded).
    pub(crate) computed: usize,
    pub(crate) table: Vec<BlockId>,
    /// Leading blocks of `table` registered in the prefix cache.
    pub(crate) registered: usize,
    /// The sequence has sampled since its (re)admission, so it now decodes.
    pub(crate) prefill_done: bool,
    /// Set at first admission.
    pub(crate) cached_prompt_tokens: Option<u32>,
}

impl Sequence {
    pub(crate) fn new(mut req: SimRequest, engine_seed: u64, block_size: BlockSize) -> Self {
        let hashes = match req.prompt_hashes.take() {
            Some(hashes) => {
                debug_assert_eq!(
                    hashes,
                    req.identity.block_hashes(&req.prompt, block_size),
                    "a caller's prompt hashes must be the prompt's"
                );
                hashes
            }
            None => req.identity.block_hashes(&req.prompt, block_size),
        };
        let keys = (req.identity.block_key(true), req.identity.block_key(false));
        // The prompt takes part so that two requests sharing a seed but not a prompt differ,
        // as they would with a real model's logits.
        let prompt_print = chain_hash(None, &req.prompt).get();
        let stream = match (req.seed, req.greedy) {
            // Seeded: the seed and the prompt alone decide, so any simulator gives the same
            // tokens (as an engine with the same weights would).
            (Some(seed), _) => mix(SEEDED ^ mix(seed ^ mix(prompt_print))),
            // Greedy: the prompt alone decides.
            (None, true) => mix(GREEDY ^ mix(prompt_print)),
            (None, false) => mix(engine_seed ^ mix(req.id ^ mix(prompt_print))),
        };
        Self {
            id: req.id,
            prompt_len: req.prompt.len(),
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            stop_token_ids: req.stop_token_ids,
            min_tokens: req.min_tokens,
            banned: req.banned,
            forced: req.forced,
            script: req.script,
            hold_blocks: req.hold_blocks,
            retention: req.retention,
            pipeline: req.hold_blocks && req.pipeline,
            logprobs: req.logprobs,
            greedy: req.greedy,
            exported: 0,
            stream,
            tokens: req.prompt,
            hashes,
            keys,
            completion_tokens: 0,
            computed: 0,
            table: Vec::new(),
            registered: 0,
            prefill_done: false,
            cached_prompt_tokens: None,
        }
    }

    /// The token this request samples at position `tokens.len()`: among the forced tokens when
    /// there are some, never a banned one.
    ///
    /// With `ending = (mean, eos)` (see `SimConfig::mean_output_tokens`) the token is the end of
    /// sequence — the request's first stop token, else `eos` — with probability 1/`mean`, once
    /// `min_tokens` are out and unless the request ignores EOS.
    pub(crate) fn sample(&self, vocab_size: u32, ending: Option<(u32, TokenId)>) -> TokenId {
        let position = self.tokens.len() as u64;
        if let Some(last) = self.script.last() {
            let generated = self.tokens.len().saturating_sub(self.prompt_len);
            return self.script.get(generated).copied().unwrap_or(*last);
        }
        let mut draw = mix(self.stream ^ mix(position));
        if !self.forced.is_empty() {
            return self.forced[(draw % self.forced.len() as u64) as usize];
        }
        if let Some((mean, eos)) = ending
            && mean > 0
            && !self.ignore_eos
            && self.completion_tokens >= self.min_tokens
            && mix(draw ^ ENDING_SALT).is_multiple_of(u64::from(mean))
        {
            return self.stop_token_ids.first().copied().unwrap_or(eos);
        }
        for _ in 0..64 {
            let token = (draw % u64::from(vocab_size)) as TokenId;
            if !self.banned.contains(&token) {
                return token;
            }
            draw = mix(draw);
        }
        // Nearly everything banned: the first token that is not.
        (0..vocab_size)
            .find(|t| !self.banned.contains(t))
            .unwrap_or(0)
    }

    /// The log probability of `token`, sampled at position `tokens.len()`, with the `k` most
    /// likely tokens there. The simulator has no model, so it makes up a distribution, the same
    /// for the same stream and position whatever `k` is asked: `token` sits at a rank drawn from
    /// the stream (always first when greedy or forced), the other places go to tokens drawn
    /// from the stream, and the probabilities fall geometrically from the first (between 0.2
    /// and 0.6) by factors between 0.05 and 0.4, so they sum below 1 and come out sorted.
    pub(crate) fn logprob_of(&self, token: TokenId, k: u32, vocab_size: u32) -> TokenLogprob {
        let position = self.tokens.len() as u64;
        let mut draw = mix(LOGPROBS ^ self.stream ^ mix(position));
        let mut next = || {
            draw = mix(draw);
            draw
        };
        let unit = |x: u64| (x >> 11) as f64 / (1u64 << 53) as f64;
        let places = MAX_TOP_LOGPROBS as usize;
        let rank = if self.greedy || !self.forced.is_empty() {
            0
        } else {
            // Mostly the first, sometimes one of the next three, as sampling a peaked
            // distribution goes.
            match next() % 8 {
                0..=4 => 0,
                5 => 1,
                6 => 2,
                _ => 3,
            }
        };
        let mut tokens = Vec::with_capacity(places);
        while tokens.len() < places {
            if tokens.len() == rank {
                tokens.push(token);
                continue;
            }
            let mut candidate = (next() % u64::from(vocab_size.max(1))) as TokenId;
            let mut tries = 0;
            while (candidate == token
                || tokens.contains(&candidate)
                || self.banned.contains(&candidate))
                && tries < 64
            {
                candidate = (next() % u64::from(vocab_size.max(1))) as TokenId;
                tries += 1;
            }
            if tries == 64 {
                // A vocabulary too small for twenty distinct alternatives.
                if tokens.len() <= rank {
                    tokens.push(token);
                }
                break;
            }
            tokens.push(candidate);
        }
        let mut p = 0.2 + 0.4 * unit(next());
        let mut top = Vec::with_capacity(tokens.len());
        for t in tokens {
            top.push(TopLogprob {
                token: t,
                logprob: p.ln() as f32,
            });
            p *= 0.05 + 0.35 * unit(next());
        }
        let logprob = top
            .iter()
            .find(|t| t.token == token)
            .map_or(f32::MIN, |t| t.logprob);
        top.truncate(k as usize);
        TokenLogprob {
            token,
            logprob,
            top,
        }
    }

    /// Whether sampling `token` (already counted in `completion_tokens`) ends the sequence.
    pub(crate) fn finish_on(&self, token: TokenId, eos: TokenId) -> Option<FinishReason> {
        if self.hold_blocks {
            return Some(FinishReason::Length);
        }
        if !self.script.is_empty() {
            return if self.completion_tokens as usize >= self.script.len() {
                Some(FinishReason::Stop)
            } else {
                (self.completion_tokens >= self.max_tokens).then_some(FinishReason::Length)
            };
        }
        if self.completion_tokens < self.min_tokens {
            return None;
        }
        if (token == eos && !self.ignore_eos) || self.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        (self.completion_tokens >= self.max_tokens).then_some(FinishReason::Length)
    }

    pub(crate) fn push_token(&mut self, token: TokenId, block_size: BlockSize) {
        self.tokens.push(token);
        let bs = block_size.as_usize();
        if self.tokens.len().is_multiple_of(bs) {
            let start = self.tokens.len() - bs;
            let parent = self.hashes.last().copied();
            // The first block carries the salt too (a prompt shorter than a block).
            let key = if parent.is_some() {
                self.keys.1
            } else {
                self.keys.0
            };
            self.hashes
                .push(chain_hash_keyed(parent, &self.tokens[start..], key));
        }
    }

    /// Tokens still to compute before the next sample.
    pub(crate) fn uncomputed(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Forgets the computed KV (the blocks were released by the caller) so the sequence
    /// recomputes prompt and output on re-admission.
    pub(crate) fn reset_for_recompute(&mut self) {
        self.table.clear();
        self.computed = 0;
        self.registered = 0;
        self.prefill_done = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(n: u32) -> BlockSize {
        BlockSize::new(n).unwrap()
    }

    #[test]
    fn incremental_hashes_match_a_full_rehash() {
        let mut seq = Sequence::new(SimRequest::new(1, (0..5).collect(), 10), 0, bs(4));
        for t in 100..111 {
            seq.push_token(t, bs(4));
        }
        assert_eq!(
            seq.hashes,
            switchyard_core::block_hashes(&seq.tokens, bs(4))
        );
    }

    #[test]
    fn sampling_depends_on_seed_prompt_and_position() {
        let a = Sequence::new(SimRequest::new(1, vec![1, 2, 3], 4), 0, bs(4));
        let same = Sequence::new(SimRequest::new(1, vec![1, 2, 3], 4), 0, bs(4));
        let other_seed = Sequence::new(SimRequest::new(1, vec![1, 2, 3], 4), 1, bs(4));
        let other_prompt = Sequence::new(SimRequest::new(1, vec![1, 2, 4], 4), 0, bs(4));
        let v = 1 << 30;
        assert_eq!(a.sample(v, None), same.sample(v, None));
        assert_ne!(a.sample(v, None), other_seed.sample(v, None));
        assert_ne!(a.sample(v, None), other_prompt.sample(v, None));
    }

    #[test]
    fn a_seed_or_greedy_decoding_gives_the_same_tokens_on_any_engine() {
        let v = 32_000;
        let prompt: Vec<TokenId> = (1..40).collect();
        let req = |id, seed, greedy| SimRequest {
            seed,
            greedy,
            ..SimRequest::new(id, prompt.clone(), 4)
        };
        // Two engines (seeds 1 and 2), two request ids.
        let on = |r: SimRequest, engine| Sequence::new(r, engine, bs(4)).sample(v, None);
        assert_eq!(on(req(1, Some(7), false), 1), on(req(9, Some(7), false), 2));
        assert_eq!(on(req(1, None, true), 1), on(req(9, None, true), 2));
        assert_ne!(on(req(1, None, false), 1), on(req(1, None, false), 2));
    }

    #[test]
    fn logprobs_are_deterministic_sorted_and_hold_the_sampled_token() {
        let v = 32_000;
        let mut seq = Sequence::new(
            SimRequest {
                seed: Some(3),
                ..SimRequest::new(1, (1..20).collect(), 8)
            },
            0,
            bs(4),
        );
        let mut found_below_first = false;
        for _ in 0..40 {
            let token = seq.sample(v, None);
            let full = seq.logprob_of(token, 20, v);
            assert!(full.is_consistent(), "{full:?}");
            assert_eq!(full.top.len(), 20);
            assert!(full.top.iter().any(|t| t.token == token), "{full:?}");
            let sum: f64 = full.top.iter().map(|t| f64::from(t.logprob).exp()).sum();
            assert!(sum < 1.0, "probabilities sum to {sum}");
            // Asking for fewer alternatives gives a prefix of the same list, and the same
            // log probability.
            let three = seq.logprob_of(token, 3, v);
            assert_eq!(three.top[..], full.top[..3]);
            assert_eq!(three.logprob, full.logprob);
            assert_eq!(seq.logprob_of(token, 0, v).top, vec![]);
            found_below_first |= full.top[0].token != token;
            seq.push_token(token, bs(4));
        }
        assert!(
            found_below_first,
            "sampling sometimes picks a less likely token"
        );
        let greedy = Sequence::new(
            SimRequest {
                greedy: true,
                ..SimRequest::new(1, (1..20).collect(), 8)
            },
            0,
            bs(4),
        );
        let token = greedy.sample(v, None);
        assert_eq!(greedy.logprob_of(token, 2, v).top[0].token, token);
    }

    #[test]
    fn logit_bias_bans_and_forces_and_min_tokens_hold_off_the_end() {
        let v = 16;
        let banned: Vec<TokenId> = (0..15).collect();
        let seq = Sequence::new(
            SimRequest {
                banned,
                ..SimRequest::new(1, vec![1, 2, 3], 4)
            },
            0,
            bs(4),
        );
        assert_eq!(seq.sample(v, None), 15, "only token 15 is left");
        let seq = Sequence::new(
            SimRequest {
                forced: vec![5, 6],
                ..SimRequest::new(1, vec![1, 2, 3], 4)
            },
            0,
            bs(4),
        );
        assert!([5, 6].contains(&seq.sample(v, None)));
        let mut seq = Sequence::new(
            SimRequest {
                min_tokens: 2,
                stop_token_ids: vec![9],
                ..SimRequest::new(1, vec![1, 2, 3], 4)
            },
            0,
            bs(4),
        );
        seq.completion_tokens = 1;
        assert_eq!(seq.finish_on(9, 0), None, "held off before min_tokens");
        assert_eq!(seq.finish_on(0, 0), None);
        seq.completion_tokens = 2;
        assert_eq!(seq.finish_on(9, 0), Some(FinishReason::Stop));
    }
}
