//! Log probabilities as vLLM and SGLang report them, read into [`TokenLogprob`]s.
//!
//! * vLLM (`POST /v1/completions` with `logprobs: k` and `return_tokens_as_token_ids: true`):
//!   each choice's `logprobs` holds `token_logprobs` (one per token) and `top_logprobs` (one map
//!   per token, keyed `"token_id:<id>"`, of the k most likely tokens plus the sampled one).
//! * SGLang (`POST /generate` with `return_logprob: true` and `top_logprobs_num: k`): each
//!   event's `meta_info` holds `output_token_logprobs` (`[logprob, token_id, text]` per token)
//!   and `output_top_logprobs` (a list of such triples per token), cumulative or incremental as
//!   `output_ids` are; the last entries are this event's tokens either way.
//!
//! Either way the alternatives are sorted most likely first and cut to the k asked for, and a
//! figure no distribution gives (a positive or non-finite log probability) is refused as the
//! engine's error.

use serde_json::Value;
use switchyard_core::{TokenId, TokenLogprob, TopLogprob};

use super::EngineError;

fn bad(what: String) -> EngineError {
    EngineError::Unavailable(format!("engine sent {what}"))
}

fn number(v: &Value) -> Option<f32> {
    // vLLM writes -inf for impossible tokens as a very negative number; JSON has no infinity.
    v.as_f64().map(|x| x as f32)
}

fn finish(token: TokenId, logprob: f32, mut top: Vec<TopLogprob>, k: u32) -> TokenLogprob {
    top.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
    top.truncate(k as usize);
    TokenLogprob {
        token,
        logprob,
        top,
    }
}

fn checked(entry: TokenLogprob) -> Result<TokenLogprob, EngineError> {
    if entry.is_consistent() {
        Ok(entry)
    } else {
        Err(bad(format!(
            "log probabilities no distribution gives for token {}: {entry:?}",
            entry.token
        )))
    }
}

/// The log probabilities of `tokens`, the tokens of one vLLM choice chunk, with `k`
/// alternatives each.
pub fn vllm(choice: &Value, tokens: &[TokenId], k: u32) -> Result<Vec<TokenLogprob>, EngineError> {
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    let logprobs = choice
        .get("logprobs")
        .filter(|v| !v.is_null())
        .ok_or_else(|| bad("tokens without the log probabilities asked for".into()))?;
    let chosen = logprobs
        .get("token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("log probabilities without token_logprobs".into()))?;
    if chosen.len() != tokens.len() {
        return Err(bad(format!(
            "{} log probabilities for {} tokens",
            chosen.len(),
            tokens.len()
        )));
    }
    let tops = logprobs.get("top_logprobs").and_then(Value::as_array);
    let mut out = Vec::with_capacity(tokens.len());
    for (i, (&token, lp)) in tokens.iter().zip(chosen).enumerate() {
        let logprob = number(lp).ok_or_else(|| {
            bad(format!(
                "a token log probability that is not a number: {lp}"
            ))
        })?;
        let mut top = Vec::new();
        if let Some(map) = tops.and_then(|t| t.get(i)).and_then(Value::as_object) {
            for (key, value) in map {
                let id = key
                    .strip_prefix("token_id:")
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "a top log probability keyed {key:?}, not token_id:<id> (needs return_tokens_as_token_ids)"
                        ))
                    })?;
                let logprob = number(value).ok_or_else(|| {
                    bad(format!(
                        "a top log probability that is not a number: {value}"
                    ))
                })?;
                top.push(TopLogprob { token: id, logprob });
            }
        }
        out.push(checked(finish(token, logprob, top, k))?);
    }
    Ok(out)
}

/// One `[logprob, token_id, text]` triple of SGLang's.
fn triple(v: &Value) -> Option<(f32, TokenId)> {
    let a = v.as_array()?;
    let logprob = number(a.first()?)?;
    let token = a.get(1)?.as_u64().and_then(|n| TokenId::try_from(n).ok())?;
    Some((logprob, token))
}

/// The log probabilities of `tokens`, the new tokens of one SGLang event, with `k`
/// alternatives each.
pub fn sglang(meta: &Value, tokens: &[TokenId], k: u32) -> Result<Vec<TokenLogprob>, EngineError> {
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    let chosen = meta
        .get("output_token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("tokens without output_token_logprobs".into()))?;
    let n = tokens.len();
    if chosen.len() < n {
        return Err(bad(format!(
            "{} log probabilities for {n} new tokens",
            chosen.len()
        )));
    }
    let chosen = &chosen[chosen.len() - n..];
    let tops = meta
        .get("output_top_logprobs")
        .and_then(Value::as_array)
        .map(|t| &t[t.len().saturating_sub(n)..]);
    let mut out = Vec::with_capacity(n);
    for (i, (&token, entry)) in tokens.iter().zip(chosen).enumerate() {
        let (logprob, id) =
            triple(entry).ok_or_else(|| bad(format!("an unreadable log probability {entry}")))?;
        if id != token {
            return Err(bad(format!(
                "the log probability of token {id} where token {token} was generated"
            )));
        }
        let mut top = Vec::new();
        if let Some(list) = tops.and_then(|t| t.get(i)).and_then(Value::as_array) {
            for alt in list {
                let (logprob, token) = triple(alt)
                    .ok_or_else(|| bad(format!("an unreadable top log probability {alt}")))?;
                top.push(TopLogprob { token, logprob });
            }
        }
        out.push(checked(finish(token, logprob, top, k))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn vllm_maps_token_id_keys_sorted_and_cut_to_k() {
        let choice = json!({"logprobs": {
            "tokens": ["token_id:7", "token_id:9"],
            "token_logprobs": [-0.5, -1.25],
            "top_logprobs": [
                {"token_id:3": -2.0, "token_id:7": -0.5, "token_id:4": -0.25},
                {"token_id:9": -1.25, "token_id:1": -0.5}
            ],
            "text_offset": [0, 2]
        }});
        let got = vllm(&choice, &[7, 9], 2).unwrap();
        assert_eq!(got[0].logprob, -0.5);
        assert_eq!(
            got[0].top.iter().map(|t| t.token).collect::<Vec<_>>(),
            [4, 7]
        );
        assert_eq!(got[1].top.len(), 2);
        assert_eq!(got[1].top[0].token, 1);
        assert!(vllm(&choice, &[7], 2).is_err(), "count mismatch");
        let text_keys =
            json!({"logprobs": {"token_logprobs": [-0.1], "top_logprobs": [{" the": -0.1}]}});
        assert!(vllm(&text_keys, &[5], 1).is_err());
        let positive = json!({"logprobs": {"token_logprobs": [0.5], "top_logprobs": null}});
        assert!(vllm(&positive, &[5], 0).is_err());
        assert!(vllm(&json!({"logprobs": null}), &[5], 0).is_err());
        assert!(vllm(&json!({}), &[], 0).unwrap().is_empty());
    }

    #[test]
    fn sglang_takes_the_last_entries_of_cumulative_or_incremental_lists() {
        let cumulative = json!({
            "output_token_logprobs": [[-0.1, 5, null], [-0.3, 6, null]],
            "output_top_logprobs": [[[-0.1, 5, null]], [[-0.2, 8, null], [-0.3, 6, null]]]
        });
        let got = sglang(&cumulative, &[6], 5).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].token, got[0].logprob), (6, -0.3));
        assert_eq!(
            got[0].top.iter().map(|t| t.token).collect::<Vec<_>>(),
            [8, 6]
        );
        let both = sglang(&cumulative, &[5, 6], 1).unwrap();
        assert_eq!(both[1].top.len(), 1);
        assert!(sglang(&cumulative, &[7], 1).is_err(), "another token");
        assert!(sglang(&cumulative, &[1, 2, 3], 1).is_err(), "too few");
        assert!(sglang(&json!({}), &[1], 1).is_err());
    }
}
