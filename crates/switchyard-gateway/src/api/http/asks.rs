//! What a request asks for beyond its prompt, read and checked once: its sampling
//! (`switchyard_core::Sampling::validate`), how many choices, log probabilities in the
//! endpoint's own form, and `echo`. A field the gateway cannot honour is refused by name.

use std::collections::BTreeMap;

use switchyard_core::{MAX_TOP_LOGPROBS, Sampling, TokenId};

use crate::api::openai::SamplingFields;
use crate::error::ApiError;

/// What a choice's text is read into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A chat answer: its reasoning and tool calls are read out of the text (by the model's
    /// output parsers); log probabilities in the chat form.
    Chat,
    /// A text completion: the text as it is; log probabilities in the completions form.
    Text,
}

impl Shape {
    pub(crate) fn is_chat(self) -> bool {
        self == Shape::Chat
    }
}

/// Most choices one request may ask for (prompts × `n`), as OpenAI caps `n`.
pub const MAX_CHOICES: u32 = 128;
/// OpenAI's limit on a text completion's `logprobs`.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// Log probabilities as the endpoint asks for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsAsk {
    /// Chat: `logprobs: true` with `top_logprobs` alternatives.
    Chat { top: u32 },
    /// Text completions: `logprobs: k`.
    Text { k: u32 },
}

impl LogprobsAsk {
    /// Alternatives per token, as the engine is asked for them.
    pub fn alternatives(self) -> u32 {
        match self {
            LogprobsAsk::Chat { top } => top,
            LogprobsAsk::Text { k } => k,
        }
    }
}

/// Everything a request asks for besides its prompt and sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asks {
    /// Choices per prompt.
    pub n: u32,
    pub logprobs: Option<LogprobsAsk>,
    /// Text completions: answer with the prompt before the completion.
    pub echo: bool,
}

/// Reads `n`, `best_of`, the log-probability fields and `echo` of a request with `prompts`
/// prompts.
pub fn asks_of(
    shape: Shape,
    s: &SamplingFields,
    echo: bool,
    prompts: usize,
) -> Result<Asks, ApiError> {
    let n = s.n.unwrap_or(1);
    if n == 0 {
        return Err(ApiError::bad_param("n", "`n` must be at least 1"));
    }
    let total = u64::from(n) * prompts as u64;
    if total > u64::from(MAX_CHOICES) {
        return Err(ApiError::bad_param(
            "n",
            format!(
                "{prompts} prompt(s) with n = {n} make {total} choices; at most {MAX_CHOICES} are served per request"
            ),
        ));
    }
    if s.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::bad_param(
            "best_of",
            "`best_of` other than `n` is not supported (the gateway does not rank extra candidates)",
        ));
    }
    let logprobs = logprobs_of(shape, s)?;
    if echo && logprobs.is_some() {
        return Err(ApiError::bad_param(
            "echo",
            "`echo` with `logprobs` needs the prompt's log probabilities, which the engines are not asked for; drop one of the two",
        ));
    }
    Ok(Asks { n, logprobs, echo })
}

fn logprobs_of(shape: Shape, s: &SamplingFields) -> Result<Option<LogprobsAsk>, ApiError> {
    use serde_json::Value;
    match shape {
        // A Responses request carries no log-probability fields (it refuses `top_logprobs`).
        Shape::Chat => {
            let on = match &s.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => {
                    return Err(ApiError::bad_param(
                        "logprobs",
                        "`logprobs` of a chat completion is true or false (`top_logprobs` says how many alternatives)",
                    ));
                }
            };
            let top = s.top_logprobs.unwrap_or(0);
            if top > MAX_TOP_LOGPROBS {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    "`top_logprobs` must be between 0 and 20",
                ));
            }
            if !on && top > 0 {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            Ok(on.then_some(LogprobsAsk::Chat { top }))
        }
        Shape::Text => {
            if s.top_logprobs.is_some() {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    "`top_logprobs` is a chat field; text completions take `logprobs: <alternatives>`",
                ));
            }
            match &s.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
                Some(Value::Number(k)) => match k.as_u64() {
                    Some(k) if k <= u64::from(MAX_COMPLETION_LOGPROBS) => {
                        Ok(Some(LogprobsAsk::Text { k: k as u32 }))
                    }
                    _ => Err(ApiError::bad_param(
                        "logprobs",
                        "`logprobs` of a text completion must be between 0 and 5",
                    )),
                },
                Some(_) => Err(ApiError::bad_param(
                    "logprobs",
                    "`logprobs` of a text completion is a number of alternatives (0 to 5)",
                )),
            }
        }
    }
}

/// The request's sampling with `max_tokens` settled, validated once
/// (`switchyard_core::Sampling::validate`).
pub fn sampling_of(
    s: &SamplingFields,
    max_tokens: u32,
    logprobs: Option<LogprobsAsk>,
) -> Result<Sampling, ApiError> {
    let top_k = match s.top_k {
        // vLLM's and SGLang's "disabled".
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(_) => {
            return Err(ApiError::bad_param(
                "top_k",
                "`top_k` must be at least 1 (or -1 to disable it)",
            ));
        }
    };
    let mut logit_bias = BTreeMap::new();
    for (token, bias) in s.logit_bias.iter().flatten() {
        let token: TokenId = token.parse().map_err(|_| {
            ApiError::bad_param(
                "logit_bias",
                format!("`logit_bias` keys are token ids; {token:?} is not one"),
            )
        })?;
        logit_bias.insert(token, *bias);
    }
    let sampling = Sampling {
        max_tokens,
        temperature: s.temperature,
        top_p: s.top_p,
        top_k,
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty,
        logit_bias,
        seed: s.seed,
        stop: s.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
        min_tokens: s.min_tokens,
        ignore_eos: s.ignore_eos,
        skip_special_tokens: s.skip_special_tokens,
        include_stop_str_in_output: s.include_stop_str_in_output,
        logprobs: logprobs.map(LogprobsAsk::alternatives),
        guided: super::guided::guided_of(s)?,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::bad_param(e.field, e.to_string()))?;
    Ok(sampling)
}

/// The sampling of choice `i` of a prompt: with a seed, choice i uses seed + i (as vLLM does),
/// so the choices differ and each is reproducible.
pub fn for_choice(sampling: &Sampling, i: u32) -> Sampling {
    Sampling {
        seed: sampling.seed.map(|s| s.wrapping_add(u64::from(i))),
        ..sampling.clone()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(v: serde_json::Value) -> SamplingFields {
        serde_json::from_value(v).unwrap()
    }

    fn param(r: Result<Asks, ApiError>) -> String {
        match r {
            Err(ApiError::BadRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn logprobs_are_read_in_each_endpoints_form() {
        let chat = |v| asks_of(Shape::Chat, &fields(v), false, 1);
        let text = |v| asks_of(Shape::Text, &fields(v), false, 1);
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 3}))
                .unwrap()
                .logprobs,
            Some(LogprobsAsk::Chat { top: 3 })
        );
        assert_eq!(chat(json!({"logprobs": false})).unwrap().logprobs, None);
        assert_eq!(param(chat(json!({"top_logprobs": 2}))), "top_logprobs");
        assert_eq!(
            param(chat(json!({"logprobs": true, "top_logprobs": 21}))),
            "top_logprobs"
        );
        assert_eq!(param(chat(json!({"logprobs": 3}))), "logprobs");
        assert_eq!(
            text(json!({"logprobs": 5})).unwrap().logprobs,
            Some(LogprobsAsk::Text { k: 5 })
        );
        assert_eq!(
            text(json!({"logprobs": 0})).unwrap().logprobs,
            Some(LogprobsAsk::Text { k: 0 })
        );
        assert_eq!(param(text(json!({"logprobs": 6}))), "logprobs");
        assert_eq!(param(text(json!({"logprobs": true}))), "logprobs");
        assert_eq!(param(text(json!({"top_logprobs": 1}))), "top_logprobs");
    }

    #[test]
    fn choices_best_of_and_echo_are_checked() {
        let ask = |v, echo, prompts| asks_of(Shape::Text, &fields(v), echo, prompts);
        assert_eq!(ask(json!({"n": 3}), false, 2).unwrap().n, 3);
        assert_eq!(param(ask(json!({"n": 0}), false, 1)), "n");
        assert_eq!(param(ask(json!({"n": 65}), false, 2)), "n");
        assert_eq!(ask(json!({"n": 2, "best_of": 2}), false, 1).unwrap().n, 2);
        assert_eq!(param(ask(json!({"best_of": 3}), false, 1)), "best_of");
        assert!(ask(json!({}), true, 1).unwrap().echo);
        assert_eq!(param(ask(json!({"logprobs": 1}), true, 1)), "echo");
    }

    #[test]
    fn each_choice_gets_its_own_seed_and_logprobs_reach_the_sampling() {
        let s = sampling_of(
            &fields(json!({"seed": 7})),
            8,
            Some(LogprobsAsk::Chat { top: 4 }),
        )
        .unwrap();
        assert_eq!(s.logprobs, Some(4));
        assert_eq!(for_choice(&s, 0).seed, Some(7));
        assert_eq!(for_choice(&s, 2).seed, Some(9));
        let unseeded = sampling_of(&fields(json!({})), 8, None).unwrap();
        assert_eq!(for_choice(&unseeded, 3).seed, None);
    }
}
