//! How a request is sampled: every field a client may set, validated once, carried from the
//! gateway through the protocol to the engine. A field left unset stays unset all the way, so
//! the engine's own generation defaults (a model's `generation_config.json`, say) apply.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::TokenId;
use crate::guided::Guided;
use crate::logprobs::MAX_TOP_LOGPROBS;

/// A request's sampling settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// Tokens to generate at most; at least 1.
    pub max_tokens: u32,
    /// 0 is greedy; unset: the engine's default.
    pub temperature: Option<f32>,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches `top_p`, in
    /// (0, 1].
    pub top_p: Option<f32>,
    /// Sample among the `top_k` most likely tokens; at least 1.
    pub top_k: Option<u32>,
    /// Drop tokens less likely than `min_p` times the most likely one, in [0, 1].
    pub min_p: Option<f32>,
    /// In [-2, 2], as OpenAI's.
    pub presence_penalty: Option<f32>,
    /// In [-2, 2], as OpenAI's.
    pub frequency_penalty: Option<f32>,
    /// Multiplicative penalty of repeated tokens (vLLM, SGLang), greater than 0; 1 is none.
    pub repetition_penalty: Option<f32>,
    /// Token id → bias added to its logit, each in [-100, 100] (OpenAI's range).
    pub logit_bias: BTreeMap<TokenId, f32>,
    /// The same seed and prompt give the same tokens.
    pub seed: Option<u64>,
    /// Strings that end generation (the gateway also applies them to the text it returns).
    pub stop: Vec<String>,
    /// Token ids that end generation.
    pub stop_token_ids: Vec<TokenId>,
    /// Tokens to generate before end-of-sequence or a stop may end the generation.
    pub min_tokens: Option<u32>,
    /// Keep generating past end-of-sequence until `max_tokens`.
    pub ignore_eos: bool,
    /// Leave special tokens out of the engine's text (it does not change the token ids).
    pub skip_special_tokens: Option<bool>,
    /// Keep a matched stop string at the end of the text.
    pub include_stop_str_in_output: Option<bool>,
    /// Report each generated token's log probability with this many most likely alternatives
    /// (0 to [`MAX_TOP_LOGPROBS`]); unset: none.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// A constraint on the output (a JSON schema, choices, …); unset: none.
    #[serde(default)]
    pub guided: Option<Guided>,
}

/// A sampling field out of its range: which field, and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {rule}")]
pub struct SamplingError {
    pub field: &'static str,
    pub rule: &'static str,
}

/// OpenAI's limit on stop strings.
pub const MAX_STOP_STRINGS: usize = 4;
/// OpenAI's limit on `logit_bias` entries is unstated; this keeps a request's size bounded.
pub const MAX_LOGIT_BIAS: usize = 1024;

impl Sampling {
    /// Checks every field's range; the error names the first field that is out of it.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let err = |field, rule| Err(SamplingError { field, rule });
        let finite = |x: Option<f32>| x.is_none_or(f32::is_finite);
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1");
        }
        if !finite(self.temperature) || self.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t))
        {
            return err("temperature", "must be between 0 and 2");
        }
        if !finite(self.top_p) || self.top_p.is_some_and(|p| p <= 0.0 || p > 1.0) {
            return err("top_p", "must be greater than 0 and at most 1");
        }
        if self.top_k == Some(0) {
            return err("top_k", "must be at least 1 (leave it unset to disable it)");
        }
        if !finite(self.min_p) || self.min_p.is_some_and(|p| !(0.0..=1.0).contains(&p)) {
            return err("min_p", "must be between 0 and 1");
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !finite(value) || value.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
                return err(field, "must be between -2 and 2");
            }
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty.is_some_and(|v| v <= 0.0) {
            return err("repetition_penalty", "must be greater than 0");
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return err("logit_bias", "has more than 1024 entries");
        }
        if self
            .logit_bias
            .values()
            .any(|b| !b.is_finite() || !(-100.0..=100.0).contains(b))
        {
            return err("logit_bias", "values must be between -100 and 100");
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return err("stop", "takes at most 4 strings");
        }
        if self.stop.iter().any(String::is_empty) {
            return err("stop", "strings must not be empty");
        }
        if self.min_tokens.is_some_and(|m| m > self.max_tokens) {
            return err("min_tokens", "must not exceed max_tokens");
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return err("logprobs", "takes at most 20 alternatives per token");
        }
        if let Some(guided) = &self.guided
            && let Err(rule) = guided.validate()
        {
            return err("structured_outputs", rule);
        }
        Ok(())
    }

    /// Whether the generation is deterministic for its prompt: greedy, or seeded.
    pub fn is_reproducible(&self) -> bool {
        self.temperature == Some(0.0) || self.seed.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> Sampling {
        Sampling {
            max_tokens: 16,
            ..Sampling::default()
        }
    }

    #[test]
    fn unset_fields_are_valid_and_each_range_is_named() {
        assert_eq!(sampling().validate(), Ok(()));
        let cases: Vec<(Sampling, &str)> = vec![
            (
                Sampling {
                    max_tokens: 0,
                    ..sampling()
                },
                "max_tokens",
            ),
            (
                Sampling {
                    temperature: Some(2.5),
                    ..sampling()
                },
                "temperature",
            ),
            (
                Sampling {
                    temperature: Some(f32::NAN),
                    ..sampling()
                },
                "temperature",
            ),
            (
                Sampling {
                    top_p: Some(0.0),
                    ..sampling()
                },
                "top_p",
            ),
            (
                Sampling {
                    top_k: Some(0),
                    ..sampling()
                },
                "top_k",
            ),
            (
                Sampling {
                    min_p: Some(1.5),
                    ..sampling()
                },
                "min_p",
            ),
            (
                Sampling {
                    presence_penalty: Some(3.0),
                    ..sampling()
                },
                "presence_penalty",
            ),
            (
                Sampling {
                    frequency_penalty: Some(-2.5),
                    ..sampling()
                },
                "frequency_penalty",
            ),
            (
                Sampling {
                    repetition_penalty: Some(0.0),
                    ..sampling()
                },
                "repetition_penalty",
            ),
            (
                Sampling {
                    logit_bias: BTreeMap::from([(5, 101.0)]),
                    ..sampling()
                },
                "logit_bias",
            ),
            (
                Sampling {
                    stop: vec!["a".into(); 5],
                    ..sampling()
                },
                "stop",
            ),
            (
                Sampling {
                    stop: vec![String::new()],
                    ..sampling()
                },
                "stop",
            ),
            (
                Sampling {
                    min_tokens: Some(17),
                    ..sampling()
                },
                "min_tokens",
            ),
            (
                Sampling {
                    logprobs: Some(21),
                    ..sampling()
                },
                "logprobs",
            ),
        ];
        for (bad, field) in cases {
            let e = bad.validate().unwrap_err();
            assert_eq!(e.field, field, "{bad:?}");
            assert!(e.to_string().starts_with(&format!("`{field}`")), "{e}");
        }
        let edges = Sampling {
            temperature: Some(0.0),
            top_p: Some(1.0),
            top_k: Some(1),
            min_p: Some(0.0),
            presence_penalty: Some(-2.0),
            frequency_penalty: Some(2.0),
            repetition_penalty: Some(1.0),
            logit_bias: BTreeMap::from([(1, -100.0), (2, 100.0)]),
            stop: vec!["a".into(); 4],
            min_tokens: Some(16),
            ..sampling()
        };
        assert_eq!(edges.validate(), Ok(()));
        assert!(edges.is_reproducible());
    }
}
