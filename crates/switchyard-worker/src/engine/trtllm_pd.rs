//! Disaggregated prefill/decode through TensorRT-LLM's `disaggregated_params`, the way its own
//! proxy (`tensorrt_llm/serve/openai_disagg_server.py`) splits a request between a context and
//! a generation server. The engines move the KV themselves (the cache transceiver: NIXL, UCX);
//! the workers only carry the parameters.
//!
//! * **Context (prefill).** The prompt goes to the context server's `/v1/completions` with the
//!   request's sampling, `max_tokens: 1`, unstreamed, and
//!   `disaggregated_params: {"request_type": "context_only"}`.
//!   The engine computes the KV, keeps it for a generation server, samples the first token and
//!   answers with the choice's `disaggregated_params`: `request_type`, `first_gen_tokens`,
//!   `ctx_request_id`, `encoded_opaque_state` (base64 of its communicator state), and what newer
//!   releases add (`draft_tokens`, `disagg_request_id`, `ctx_dp_rank`, `ctx_info_endpoint`, …).
//!   Those become the engine transfer parameters, unchanged.
//! * **Generation (decode).** The original request goes to the generation server with those
//!   parameters and `request_type: "generation_only"`: its transceiver fetches the KV from the
//!   context server, and it generates the whole completion starting with `first_gen_tokens`, so
//!   its stream is passed through as it is. A transfer that fails is reported inside the
//!   stream (an SSE `error` event before the first token), which the decode worker reports as
//!   a failed pull ([`crate::engine_transfer`]).
//!
//! The context server samples the first token, so the context request carries the client's
//! sampling (`PrefillRequest.sampling`: temperature, top-k/p, penalties, seed, logit bias, the
//! constraint), cut to one token that always ends by length; from a gateway that sends none,
//! the first token is greedy.

use std::time::SystemTime;

use serde_json::{Map, Value, json};

use super::openai_http::{self, Dialect};
use super::vllm::VllmEngine;
use super::{EngineError, GenerateParams, PrefillOutcome, PrefillParams};

/// The prefill request: the prompt, one token sampled as the request asks (greedy when it
/// does not say), unstreamed, as a context-only request.
pub(super) fn context_body(model: &str, params: &PrefillParams) -> Value {
    let asked = params
        .sampling
        .clone()
        .unwrap_or_else(|| switchyard_core::Sampling {
            temperature: Some(0.0),
            ..switchyard_core::Sampling::default()
        });
    let generate = GenerateParams {
        request_id: params.request_id.clone(),
        prompt: params.prompt.clone(),
        sampling: switchyard_core::Sampling {
            max_tokens: 1,
            // The context phase always ends by length and hands over: an end-of-sequence or
            // stop first token is for the generation server's stop check, as every later token
            // is. Neither has text to stop on yet, nor a minimum to reach.
            ignore_eos: true,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            min_tokens: None,
            logprobs: None,
            ..asked
        },
        identity: params.identity.clone(),
        retention: params.retention,
        priority: params.priority,
    };
    let (_, mut body) = openai_http::request_body(Dialect::Trtllm, model, &generate);
    if let Some(fields) = body.as_object_mut() {
        fields.insert("stream".into(), json!(false));
        fields.remove("stream_options");
        fields.insert(
            "disaggregated_params".into(),
            json!({"request_type": "context_only"}),
        );
    }
    body
}

/// What a context server's answer says.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ContextAnswer {
    /// The choice's `disaggregated_params`, as the engine gave them.
    pub params: Map<String, Value>,
    pub first_token: u32,
    pub ctx_request_id: u64,
    pub prompt_tokens: Option<u32>,
    pub cached_prompt_tokens: Option<u32>,
}

/// Reads a context-only answer. No `disaggregated_params`: the engine has no cache transceiver
/// (not a prefill worker's engine, whoever retries); parameters without a context request id
/// or first token: an answer the generation server could not use (the engine's fault).
pub(super) fn read_context_answer(answer: &Value) -> Result<ContextAnswer, EngineError> {
    let choice = answer
        .pointer("/choices/0")
        .ok_or_else(|| EngineError::Unavailable("engine answered without a choice".into()))?;
    let params = match choice.get("disaggregated_params") {
        Some(Value::Object(fields)) if !fields.is_empty() => fields.clone(),
        _ => {
            return Err(EngineError::Unsupported(
                "the trtllm engine returned no disaggregated_params: give it a \
                 cache_transceiver_config (e.g. {backend: DEFAULT}) in its LLM API options",
            ));
        }
    };
    let ctx_request_id = params
        .get("ctx_request_id")
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            EngineError::Unavailable(
                "the trtllm engine's disaggregated_params name no ctx_request_id".into(),
            )
        })?;
    let first_token = params
        .get("first_gen_tokens")
        .and_then(Value::as_array)
        .and_then(|t| t.first())
        .and_then(Value::as_u64)
        .and_then(|t| u32::try_from(t).ok())
        .ok_or_else(|| {
            EngineError::Unavailable(
                "the trtllm engine's disaggregated_params carry no first_gen_tokens".into(),
            )
        })?;
    let count = |pointer: &str| {
        answer
            .pointer(pointer)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
    };
    Ok(ContextAnswer {
        params,
        first_token,
        ctx_request_id,
        prompt_tokens: count("/usage/prompt_tokens"),
        cached_prompt_tokens: count("/usage/prompt_tokens_details/cached_tokens"),
    })
}

/// The generation request's `disaggregated_params`: a context phase's parameters with
/// `request_type: "generation_only"`, everything else as the context engine gave it. Parameters
/// that are not a TensorRT-LLM context phase's (another engine kind's) are refused: the engine
/// would wait for KV no context server holds.
pub(super) fn generation_params(
    mut transfer: Map<String, Value>,
) -> Result<Map<String, Value>, EngineError> {
    let from_context = matches!(
        transfer.get("request_type").and_then(Value::as_str),
        Some("context_only" | "generation_only")
    );
    let usable = from_context
        && transfer.get("ctx_request_id").is_some_and(Value::is_u64)
        && transfer
            .get("first_gen_tokens")
            .and_then(Value::as_array)
            .is_some_and(|t| !t.is_empty() && t.iter().all(Value::is_u64));
    if !usable {
        return Err(EngineError::Unsupported(
            "engine transfer parameters are not TensorRT-LLM's disaggregated_params of a \
             context_only request (request_type, ctx_request_id, first_gen_tokens): was the \
             prefill worker a trtllm one?",
        ));
    }
    transfer.insert("request_type".into(), json!("generation_only"));
    Ok(transfer)
}

impl VllmEngine {
    /// TensorRT-LLM's prefill: a context-only request; its `disaggregated_params` become the
    /// engine transfer parameters.
    pub(super) async fn prefill_trtllm(
        &self,
        params: PrefillParams,
    ) -> Result<PrefillOutcome, EngineError> {
        super::trtllm::check_identity(&params.identity)?;
        let body = context_body(&self.model, &params);
        let response = self
            .post("/v1/completions", &params.request_id, &body)
            .await?;
        let text = response
            .text()
            .await
            .map_err(|e| EngineError::Unavailable(format!("engine answer broke off: {e}")))?;
        let answer: Value = serde_json::from_str(&text).map_err(|e| {
            EngineError::Unavailable(format!("engine sent an unreadable context answer: {e}"))
        })?;
        let context = read_context_answer(&answer)?;
        let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
        Ok(PrefillOutcome {
            handle: format!("trtllm:{}", context.ctx_request_id),
            block_hashes: params
                .identity
                .block_hashes(&params.prompt, self.spec.block_size),
            prompt_tokens: context.prompt_tokens.unwrap_or(prompt_tokens),
            cached_prompt_tokens: context.cached_prompt_tokens.unwrap_or(0).min(prompt_tokens),
            first_token: context.first_token,
            // The engine decides how long it keeps unread KV (its kv_transfer_timeout_ms); the
            // hold is what the caller was promised.
            expires_at: SystemTime::now() + params.hold,
            engine_transfer_params: Some(Value::Object(context.params).to_string()),
            pipelined: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn prefill(prompt: Vec<u32>) -> PrefillParams {
        PrefillParams {
            request_id: "r".into(),
            prompt,
            hold: Duration::from_secs(1),
            pipelined: false,
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
            sampling: None,
        }
    }

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    #[test]
    fn the_context_request_is_a_one_token_unstreamed_context_only_completion() {
        let body = context_body("m", &prefill(vec![5, 6, 7]));
        assert_eq!(body["prompt"], json!([5, 6, 7]));
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["stream"], false);
        assert!(body.get("stream_options").is_none(), "{body}");
        assert_eq!(body["detokenize"], false);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(
            body["disaggregated_params"],
            json!({"request_type": "context_only"})
        );
        // No sampling given (an older gateway): greedy.
        assert_eq!(body["temperature"], 0.0);
    }

    #[test]
    fn the_context_request_samples_its_token_as_the_request_asks() {
        let asked = switchyard_core::Sampling {
            max_tokens: 200,
            temperature: Some(0.7),
            top_k: Some(20),
            seed: Some(9),
            stop: vec!["\n".into()],
            stop_token_ids: vec![2],
            min_tokens: Some(5),
            guided: Some(switchyard_core::Guided::JsonObject),
            ..Default::default()
        };
        let body = context_body(
            "m",
            &PrefillParams {
                sampling: Some(asked),
                ..prefill(vec![5, 6, 7])
            },
        );
        assert_eq!(
            (&body["temperature"], &body["top_k"]),
            (&json!(0.7f32), &json!(20))
        );
        assert_eq!(body["seed"], 9);
        assert_eq!(body["response_format"], json!({"type": "json_object"}));
        // One token that ends by length, whatever stops the rest.
        assert_eq!(
            (&body["max_tokens"], &body["ignore_eos"]),
            (&json!(1), &json!(true))
        );
        for absent in ["stop", "stop_token_ids", "min_tokens"] {
            assert!(body.get(absent).is_none(), "{absent}: {body}");
        }
    }

    #[test]
    fn a_context_answer_gives_its_parameters_first_token_and_counts() {
        // The shape of trtllm-serve's CompletionResponse for a context_only request.
        let params = json!({"request_type": "context_only", "first_gen_tokens": [311],
            "ctx_request_id": 9001, "encoded_opaque_state": "eyJ9", "draft_tokens": null,
            "disagg_request_id": null, "ctx_dp_rank": 0, "ctx_info_endpoint": null});
        let answer = json!({"choices": [{"index": 0, "text": "", "token_ids": [311],
            "finish_reason": "length", "disaggregated_params": params}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                      "prompt_tokens_details": {"cached_tokens": 8}},
            "prompt_token_ids": [1, 2]});
        let read = read_context_answer(&answer).unwrap();
        assert_eq!(read.params, object(params));
        assert_eq!((read.first_token, read.ctx_request_id), (311, 9001));
        assert_eq!(
            (read.prompt_tokens, read.cached_prompt_tokens),
            (Some(10), Some(8))
        );
    }

    #[test]
    fn context_answers_without_usable_parameters_are_refused() {
        let with = |params: Value| json!({"choices": [{"disaggregated_params": params}]});
        // No transceiver on the engine: it is not a context server.
        assert!(matches!(
            read_context_answer(&json!({"choices": [{"token_ids": [1]}]})),
            Err(EngineError::Unsupported(_))
        ));
        assert!(matches!(
            read_context_answer(&with(json!({"request_type": "context_only",
                "first_gen_tokens": [1]}))),
            Err(EngineError::Unavailable(_))
        ));
        assert!(matches!(
            read_context_answer(&with(json!({"request_type": "context_only",
                "ctx_request_id": 3, "first_gen_tokens": []}))),
            Err(EngineError::Unavailable(_))
        ));
        assert!(matches!(
            read_context_answer(&json!({"choices": []})),
            Err(EngineError::Unavailable(_))
        ));
    }

    #[test]
    fn generation_params_flip_the_request_type_and_keep_the_rest() {
        let context = object(
            json!({"request_type": "context_only", "first_gen_tokens": [4],
            "ctx_request_id": 7, "encoded_opaque_state": "abc", "ctx_dp_rank": 1,
            "future_field": {"x": 1}}),
        );
        let generation = generation_params(context.clone()).unwrap();
        assert_eq!(generation["request_type"], "generation_only");
        for (key, value) in &context {
            if key != "request_type" {
                assert_eq!(&generation[key], value, "{key}");
            }
        }
        assert_eq!(generation.len(), context.len());
    }

    #[test]
    fn other_engines_transfer_parameters_are_refused() {
        for other in [
            // vLLM's kv_transfer_params
            json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_block_ids": [1]}),
            // SGLang's bootstrap
            json!({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2}),
            // a context phase's, incomplete
            json!({"request_type": "context_only", "first_gen_tokens": [4]}),
            json!({"request_type": "context_only", "ctx_request_id": 7}),
            json!({"request_type": "context_and_generation", "ctx_request_id": 7,
                   "first_gen_tokens": [4]}),
        ] {
            assert!(
                matches!(
                    generation_params(object(other.clone())),
                    Err(EngineError::Unsupported(_))
                ),
                "{other}"
            );
        }
    }
}
