//! Log probabilities of generated tokens: what an engine reports per token when a request asks
//! for them (`Sampling::logprobs`), carried unchanged through the protocol to the gateway, which
//! writes them in OpenAI's shapes.

use serde::{Deserialize, Serialize};

use crate::TokenId;

/// Most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit, and
/// vLLM's default `--max-logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One generated token's log probability and the most likely alternatives at its position.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token generated.
    pub token: TokenId,
    /// Its log probability (natural log, at most 0).
    pub logprob: f32,
    /// The most likely tokens at this position, most likely first: as many as asked for.
    pub top: Vec<TopLogprob>,
}

/// One alternative of a [`TokenLogprob`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: TokenId,
    pub logprob: f32,
}

impl TokenLogprob {
    /// Whether the figures are what a distribution can give: every log probability at most 0
    /// and finite, the alternatives sorted most likely first, and the generated token, when it
    /// is among them, with its own log probability. Engines are not trusted blindly.
    pub fn is_consistent(&self) -> bool {
        let valid = |lp: f32| lp.is_finite() && lp <= 0.0;
        valid(self.logprob)
            && self.top.iter().all(|t| valid(t.logprob))
            && self.top.windows(2).all(|w| w[0].logprob >= w[1].logprob)
            && self
                .top
                .iter()
                .filter(|t| t.token == self.token)
                .all(|t| (t.logprob - self.logprob).abs() <= 1e-4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consistency_catches_what_no_distribution_gives() {
        let top = |pairs: &[(TokenId, f32)]| {
            pairs
                .iter()
                .map(|&(token, logprob)| TopLogprob { token, logprob })
                .collect::<Vec<_>>()
        };
        let good = TokenLogprob {
            token: 5,
            logprob: -0.7,
            top: top(&[(9, -0.2), (5, -0.7)]),
        };
        assert!(good.is_consistent());
        let positive = TokenLogprob {
            logprob: 0.1,
            ..good.clone()
        };
        assert!(!positive.is_consistent());
        let unsorted = TokenLogprob {
            top: top(&[(5, -0.7), (9, -0.2)]),
            ..good.clone()
        };
        assert!(!unsorted.is_consistent());
        let disagreeing = TokenLogprob {
            top: top(&[(9, -0.2), (5, -0.9)]),
            ..good
        };
        assert!(!disagreeing.is_consistent());
    }
}
