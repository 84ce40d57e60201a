//! Generation over the engine's HTTP API, streamed back as [`GenerationChunk`]s.
//!
//! * vLLM: `POST /v1/completions` with the prompt as token ids and `stream: true`. Token ids come
//!   back per chunk in `choices[].token_ids` when asked with `return_token_ids` (vLLM ≥ 0.10.2),
//!   or, with [`TokenIdSource::Logprobs`] for older builds, as `logprobs.tokens` strings
//!   `"token_id:<id>"` (`logprobs: 0` + `return_tokens_as_token_ids`). The final usage chunk
//!   (`stream_options.include_usage`) gives the cached prompt tokens.
//! * TensorRT-LLM (`trtllm-serve`): `POST /v1/completions` like vLLM, with `detokenize: false`,
//!   which makes each chunk carry `choices[].token_ids` (and empty text); its sampling fields
//!   under its own names (`response_format` for constraints). Its request model refuses fields it
//!   does not declare, so only those are sent.
//! * SGLang: its native `POST /generate` with `input_ids`, which returns `output_ids` and the
//!   cached token count in `meta_info` in every version; whether `output_ids` is cumulative or
//!   incremental depends on a server flag, so it is read against `meta_info.completion_tokens`.
//!
//! The response body is read by a task whose abort handle is the stream's drop guard: dropping
//! the stream drops the HTTP response, which closes the connection, and the engine aborts the
//! request.

use serde_json::{Value, json};
use switchyard_core::sse::SseDecoder;
use switchyard_core::{Guided, TokenLogprob};
use tokio::sync::mpsc;

use super::{EngineError, FinishReason, GenerateParams, GenerationChunk};

/// How token ids are requested from vLLM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenIdSource {
    /// `return_token_ids: true` → `choices[].token_ids` (vLLM ≥ 0.10.2).
    #[default]
    ReturnTokenIds,
    /// `logprobs: 0` + `return_tokens_as_token_ids: true` → `logprobs.tokens` (older vLLM).
    Logprobs,
}

impl std::str::FromStr for TokenIdSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "return_token_ids" => Ok(Self::ReturnTokenIds),
            "logprobs" => Ok(Self::Logprobs),
            _ => Err(format!(
                "unknown token id source {s:?} (return_token_ids or logprobs)"
            )),
        }
    }
}

/// Which HTTP dialect the engine speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Vllm(TokenIdSource),
    Sglang,
    Trtllm,
}

/// The request body for one generation. Sampling fields go in the engine's own names, and an
/// unset one is left out, so the engine's own defaults (the model's generation config) apply.
/// `skip_special_tokens` and `include_stop_str_in_output` shape text, which the gateway makes
/// itself from the token ids; the engine is asked for plain token ids.
pub fn request_body(dialect: Dialect, model: &str, p: &GenerateParams) -> (&'static str, Value) {
    let s = &p.sampling;
    // The sampling fields both engines name alike.
    let mut sampling = serde_json::Map::new();
    let mut put = |name: &str, value: Option<Value>| {
        if let Some(value) = value {
            sampling.insert(name.to_owned(), value);
        }
    };
    put("temperature", s.temperature.map(|v| json!(v)));
    put("top_p", s.top_p.map(|v| json!(v)));
    put("top_k", s.top_k.map(|v| json!(v)));
    put("min_p", s.min_p.map(|v| json!(v)));
    put("presence_penalty", s.presence_penalty.map(|v| json!(v)));
    put("frequency_penalty", s.frequency_penalty.map(|v| json!(v)));
    put("repetition_penalty", s.repetition_penalty.map(|v| json!(v)));
    put(
        "logit_bias",
        (!s.logit_bias.is_empty()).then(|| {
            // Both engines key the map by the token id as a string.
            let map: serde_json::Map<String, Value> = s
                .logit_bias
                .iter()
                .map(|(t, b)| (t.to_string(), json!(b)))
                .collect();
            Value::Object(map)
        }),
    );
    put("stop", (!s.stop.is_empty()).then(|| json!(s.stop)));
    put(
        "stop_token_ids",
        (!s.stop_token_ids.is_empty()).then(|| json!(s.stop_token_ids)),
    );
    put("ignore_eos", s.ignore_eos.then_some(json!(true)));
    match dialect {
        Dialect::Vllm(source) => {
            // vLLM serves a LoRA adapter under its own model name.
            let model = p.identity.adapter.as_deref().unwrap_or(model);
            let mut body = json!({
                "model": model,
                "prompt": p.prompt,
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": s.max_tokens,
                "skip_special_tokens": false,
                "request_id": p.request_id,
            });
            if let Some(fields) = body.as_object_mut() {
                fields.extend(sampling);
                if let Some(seed) = s.seed {
                    fields.insert("seed".into(), json!(seed));
                }
                if let Some(min) = s.min_tokens {
                    fields.insert("min_tokens".into(), json!(min));
                }
            }
            match source {
                TokenIdSource::ReturnTokenIds => body["return_token_ids"] = json!(true),
                TokenIdSource::Logprobs => {
                    body["logprobs"] = json!(0);
                    body["return_tokens_as_token_ids"] = json!(true);
                }
            }
            if let Some(k) = s.logprobs {
                // Top alternatives keyed by token id, so two tokens of the same text stay
                // apart.
                body["logprobs"] = json!(k);
                body["return_tokens_as_token_ids"] = json!(true);
            }
            if let Some(guided) = &s.guided {
                body["structured_outputs"] = vllm_structured_outputs(guided);
            }
            if let Some(salt) = &p.identity.salt {
                body["cache_salt"] = json!(salt);
            }
            if let Some(priority) = p.priority {
                body["priority"] = json!(priority);
            }
            ("/v1/completions", body)
        }
        Dialect::Trtllm => (
            "/v1/completions",
            super::trtllm::request_body(model, p, sampling),
        ),
        Dialect::Sglang => {
            sampling.insert("max_new_tokens".into(), json!(s.max_tokens));
            sampling.insert("skip_special_tokens".into(), json!(false));
            if let Some(seed) = s.seed {
                sampling.insert("sampling_seed".into(), json!(seed));
            }
            if let Some(min) = s.min_tokens {
                sampling.insert("min_new_tokens".into(), json!(min));
            }
            if let Some(guided) = &s.guided {
                let (name, value) = sglang_constraint(guided);
                sampling.insert(name.into(), json!(value));
            }
            let mut body = json!({
                "input_ids": p.prompt,
                "sampling_params": Value::Object(sampling),
                "stream": true,
                "rid": p.request_id,
            });
            if let Some(k) = s.logprobs {
                body["return_logprob"] = json!(true);
                body["top_logprobs_num"] = json!(k);
            }
            sglang_identity(&mut body, &p.identity);
            // `GenerateReqInput.priority`, read under `--enable-priority-scheduling`.
            if let Some(priority) = p.priority {
                body["priority"] = json!(priority);
            }
            ("/generate", body)
        }
    }
}

/// SGLang's names for a request's KV identity on `/generate`: the adapter as `lora_path`, the
/// salt as `cache_salt`.
pub(super) fn sglang_identity(body: &mut Value, identity: &switchyard_core::KvIdentity) {
    if let Some(adapter) = &identity.adapter {
        body["lora_path"] = json!(adapter);
    }
    if let Some(salt) = &identity.salt {
        body["cache_salt"] = json!(salt);
    }
}

/// vLLM's `structured_outputs` (0.10.2 and later) for a constraint.
fn vllm_structured_outputs(guided: &Guided) -> Value {
    match guided {
        Guided::JsonObject => json!({"json_object": true}),
        // The schema as an object (vLLM takes a string or an object); text that is not JSON
        // cannot reach here (the gateway parses it), but is passed as text rather than lost.
        Guided::JsonSchema(schema) => json!({
            "json": serde_json::from_str::<Value>(schema).unwrap_or_else(|_| json!(schema))
        }),
        Guided::Regex(regex) => json!({"regex": regex}),
        Guided::Choice(choices) => json!({"choice": choices}),
        Guided::Grammar(grammar) => json!({"grammar": grammar}),
    }
}

/// SGLang's sampling parameter for a constraint: `json_schema` (text), `regex` or `ebnf`. It
/// has no choice list, so choices become a regular expression matching exactly one of them.
pub(super) fn sglang_constraint(guided: &Guided) -> (&'static str, String) {
    match guided {
        Guided::JsonObject => ("json_schema", r#"{"type": "object"}"#.to_owned()),
        Guided::JsonSchema(schema) => ("json_schema", schema.clone()),
        Guided::Regex(regex) => ("regex", regex.clone()),
        Guided::Choice(choices) => {
            let alternatives: Vec<String> = choices.iter().map(|c| regex_literal(c)).collect();
            ("regex", format!("({})", alternatives.join("|")))
        }
        Guided::Grammar(grammar) => ("ebnf", grammar.clone()),
    }
}

/// `text` as a regular expression that matches exactly it.
fn regex_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Maps a refused HTTP request to our error: the request's fault or the engine's (retryable).
pub fn http_error(status: reqwest::StatusCode, body: &str) -> EngineError {
    let message = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| body.chars().take(300).collect());
    if status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408 {
        EngineError::InvalidRequest(format!("engine refused the request ({status}): {message}"))
    } else {
        EngineError::Unavailable(format!("engine answered {status}: {message}"))
    }
}

/// Turns the engine's SSE stream into chunks on `tx` until it ends or `tx` closes.
/// `logprobs`: the request's [`Sampling::logprobs`](switchyard_core::Sampling::logprobs), read
/// from the stream by [`engine_logprobs`](super::engine_logprobs).
pub async fn pump(
    mut response: reqwest::Response,
    dialect: Dialect,
    prompt_tokens: u32,
    logprobs: Option<u32>,
    tx: mpsc::UnboundedSender<Result<GenerationChunk, EngineError>>,
) {
    let mut state = StreamState::new(dialect, prompt_tokens).with_logprobs(logprobs);
    let mut events = SseDecoder::new();
    loop {
        let bytes = match response.chunk().await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => break,
            Err(err) => {
                let _ = tx.send(Err(EngineError::Unavailable(format!(
                    "engine stream broke: {err}"
                ))));
                return;
            }
        };
        for data in events.push(&bytes) {
            for item in state.on_data(&data) {
                let done = matches!(&item, Ok(c) if c.finish.is_some()) || item.is_err();
                if tx.send(item).is_err() || done {
                    return;
                }
            }
        }
    }
    if let Some(item) = state.finish() {
        let _ = tx.send(item);
    }
}

/// Per-request parse state.
#[derive(Debug)]
pub struct StreamState {
    dialect: Dialect,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    completion_tokens: u32,
    /// Alternatives per token when log probabilities were asked for.
    logprobs: Option<u32>,
    /// The finishing chunk, held until vLLM's usage chunk (or the end) arrives.
    pending_finish: Option<(Vec<u32>, Vec<TokenLogprob>, FinishReason)>,
    done: bool,
}

impl StreamState {
    pub fn new(dialect: Dialect, prompt_tokens: u32) -> Self {
        Self {
            dialect,
            prompt_tokens,
            cached_prompt_tokens: 0,
            completion_tokens: 0,
            logprobs: None,
            pending_finish: None,
            done: false,
        }
    }

    /// Reads `k` alternatives per token along with the tokens (when `Some`).
    pub fn with_logprobs(mut self, k: Option<u32>) -> Self {
        self.logprobs = k;
        self
    }

    fn chunk(
        &self,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        finish: Option<FinishReason>,
    ) -> GenerationChunk {
        GenerationChunk {
            tokens,
            logprobs,
            finish,
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            completion_tokens: self.completion_tokens,
        }
    }

    /// Handles one SSE event's data.
    pub fn on_data(&mut self, data: &str) -> Vec<Result<GenerationChunk, EngineError>> {
        if data.is_empty() || self.done {
            return Vec::new();
        }
        if data.trim() == "[DONE]" {
            return self.finish().into_iter().collect();
        }
        let value: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(err) => {
                self.done = true;
                return vec![Err(EngineError::Unavailable(format!(
                    "engine sent an unreadable stream event: {err}"
                )))];
            }
        };
        if let Some(error) = value.get("error") {
            self.done = true;
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            return vec![Err(EngineError::Failed(message))];
        }
        match self.dialect {
            // trtllm-serve streams vLLM's completion chunks (token ids per choice, a usage chunk).
            Dialect::Vllm(_) | Dialect::Trtllm => self.on_vllm(&value),
            Dialect::Sglang => self.on_sglang(&value),
        }
    }

    fn on_vllm(&mut self, value: &Value) -> Vec<Result<GenerationChunk, EngineError>> {
        let mut out = Vec::new();
        if let Some(choice) = value
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        {
            let tokens = match vllm_tokens(choice) {
                Ok(tokens) => tokens,
                Err(err) => {
                    self.done = true;
                    return vec![Err(err)];
                }
            };
            let logprobs = match self.logprobs {
                Some(k) => match super::engine_logprobs::vllm(choice, &tokens, k) {
                    Ok(logprobs) => logprobs,
                    Err(err) => {
                        self.done = true;
                        return vec![Err(err)];
                    }
                },
                None => Vec::new(),
            };
            self.completion_tokens += tokens.len() as u32;
            match choice.get("finish_reason").and_then(Value::as_str) {
                Some(reason) => {
                    self.pending_finish = Some((tokens, logprobs, finish_reason(reason)));
                }
                None if !tokens.is_empty() => out.push(Ok(self.chunk(tokens, logprobs, None))),
                None => {}
            }
        }
        if let Some(usage) = value.get("usage").filter(|u| !u.is_null()) {
            let num = |p: &str| {
                usage
                    .pointer(p)
                    .and_then(Value::as_u64)
                    .and_then(|n| u32::try_from(n).ok())
            };
            if let Some(n) = num("/prompt_tokens") {
                self.prompt_tokens = n;
            }
            if let Some(n) = num("/prompt_tokens_details/cached_tokens") {
                self.cached_prompt_tokens = n;
            }
            if let Some(n) = num("/completion_tokens") {
                self.completion_tokens = n;
            }
            out.extend(self.finish());
        }
        out
    }

    fn on_sglang(&mut self, value: &Value) -> Vec<Result<GenerationChunk, EngineError>> {
        let meta = value.get("meta_info");
        let num = |k: &str| {
            meta.and_then(|m| m.get(k))
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        if let Some(n) = num("prompt_tokens") {
            self.prompt_tokens = n;
        }
        if let Some(n) = num("cached_tokens") {
            self.cached_prompt_tokens = n;
        }
        let ids: Vec<u32> = value
            .get("output_ids")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect()
            })
            .unwrap_or_default();
        let total = num("completion_tokens");
        // Cumulative when the list is as long as the count so far; incremental otherwise.
        let tokens = match total {
            Some(total) if ids.len() as u32 == total && total >= self.completion_tokens => {
                ids[self.completion_tokens as usize..].to_vec()
            }
            _ => ids,
        };
        let logprobs = match (self.logprobs, meta) {
            (Some(k), Some(meta)) => match super::engine_logprobs::sglang(meta, &tokens, k) {
                Ok(logprobs) => logprobs,
                Err(err) => {
                    self.done = true;
                    return vec![Err(err)];
                }
            },
            (Some(_), None) if !tokens.is_empty() => {
                self.done = true;
                return vec![Err(EngineError::Unavailable(
                    "engine sent tokens without meta_info log probabilities".into(),
                ))];
            }
            _ => Vec::new(),
        };
        self.completion_tokens = total.unwrap_or(self.completion_tokens + tokens.len() as u32);
        let finish = meta
            .and_then(|m| m.get("finish_reason"))
            .filter(|f| !f.is_null())
            .map(|f| {
                f.get("type")
                    .and_then(Value::as_str)
                    .or_else(|| f.as_str())
                    .map_or(FinishReason::Stop, finish_reason)
            });
        match finish {
            Some(reason) => {
                self.done = true;
                vec![Ok(self.chunk(tokens, logprobs, Some(reason)))]
            }
            None if tokens.is_empty() => Vec::new(),
            None => vec![Ok(self.chunk(tokens, logprobs, None))],
        }
    }

    /// Ends the stream: the held finishing chunk, or an error if the engine never finished.
    pub fn finish(&mut self) -> Option<Result<GenerationChunk, EngineError>> {
        if self.done {
            return None;
        }
        self.done = true;
        Some(match self.pending_finish.take() {
            Some((tokens, logprobs, reason)) => Ok(self.chunk(tokens, logprobs, Some(reason))),
            None => Err(EngineError::Unavailable(
                "engine stream ended without a finish reason".into(),
            )),
        })
    }
}

fn finish_reason(reason: &str) -> FinishReason {
    match reason {
        "length" => FinishReason::Length,
        "abort" | "aborted" | "cancelled" => FinishReason::Aborted,
        _ => FinishReason::Stop,
    }
}

pub(crate) fn vllm_tokens(choice: &Value) -> Result<Vec<u32>, EngineError> {
    let bad = |what: &str| EngineError::Unavailable(format!("engine sent {what}"));
    if let Some(ids) = choice.get("token_ids").filter(|v| !v.is_null()) {
        return ids
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| bad("token_ids that are not token ids"));
    }
    if let Some(tokens) = choice.pointer("/logprobs/tokens").and_then(Value::as_array) {
        return tokens
            .iter()
            .map(|t| {
                t.as_str()
                    .and_then(|s| s.strip_prefix("token_id:"))
                    .and_then(|n| n.parse().ok())
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                bad("logprob tokens without token_id: (needs return_tokens_as_token_ids)")
            });
    }
    match choice.get("text").and_then(Value::as_str) {
        Some(text) if !text.is_empty() => Err(bad(
            "text without token ids (vLLM older than 0.10.2? try --vllm-token-ids logprobs)",
        )),
        _ => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(state: &mut StreamState, data: &str) -> Vec<Result<GenerationChunk, EngineError>> {
        switchyard_core::sse::events(&format!("data: {data}\n\n"))
            .iter()
            .flat_map(|d| state.on_data(d))
            .collect()
    }

    #[test]
    fn vllm_chunks_hold_the_finish_until_usage() {
        let mut s = StreamState::new(Dialect::Vllm(TokenIdSource::ReturnTokenIds), 8);
        let a = sse(
            &mut s,
            r#"{"choices":[{"text":"a","token_ids":[5,6],"finish_reason":null}]}"#,
        );
        assert_eq!(a[0].as_ref().unwrap().tokens, vec![5, 6]);
        let b = sse(
            &mut s,
            r#"{"choices":[{"text":"b","token_ids":[7],"finish_reason":"length"}]}"#,
        );
        assert!(b.is_empty());
        let c = sse(
            &mut s,
            r#"{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#,
        );
        let last = c[0].as_ref().unwrap();
        assert_eq!(last.tokens, vec![7]);
        assert_eq!(last.finish, Some(FinishReason::Length));
        assert_eq!((last.cached_prompt_tokens, last.completion_tokens), (4, 3));
        assert!(sse(&mut s, "[DONE]").is_empty());
    }

    #[test]
    fn vllm_logprob_tokens_and_missing_ids() {
        let mut s = StreamState::new(Dialect::Vllm(TokenIdSource::Logprobs), 1);
        let a = sse(
            &mut s,
            r#"{"choices":[{"text":"x","logprobs":{"tokens":["token_id:42"]},"finish_reason":"stop"}]}"#,
        );
        assert!(a.is_empty());
        let done = sse(&mut s, "[DONE]");
        assert_eq!(done[0].as_ref().unwrap().tokens, vec![42]);
        let mut s = StreamState::new(Dialect::Vllm(TokenIdSource::ReturnTokenIds), 1);
        let err = sse(&mut s, r#"{"choices":[{"text":"x","finish_reason":null}]}"#);
        assert!(matches!(err[0], Err(EngineError::Unavailable(_))));
    }

    #[test]
    fn constraints_go_in_each_engines_own_fields() {
        let with = |guided: Guided| GenerateParams {
            request_id: "r".into(),
            prompt: vec![1, 2],
            sampling: switchyard_core::Sampling {
                max_tokens: 2,
                guided: Some(guided),
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        };
        let vllm = |g| request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &with(g)).1;
        let sglang = |g| request_body(Dialect::Sglang, "m", &with(g)).1;
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
        assert_eq!(
            vllm(Guided::JsonSchema(schema.into()))["structured_outputs"],
            json!({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
        );
        assert_eq!(
            vllm(Guided::JsonObject)["structured_outputs"],
            json!({"json_object": true})
        );
        assert_eq!(
            vllm(Guided::Choice(vec!["a".into(), "b".into()]))["structured_outputs"],
            json!({"choice": ["a", "b"]})
        );
        assert_eq!(
            vllm(Guided::Regex("x+".into()))["structured_outputs"],
            json!({"regex": "x+"})
        );
        assert_eq!(
            vllm(Guided::Grammar("g".into()))["structured_outputs"],
            json!({"grammar": "g"})
        );
        let sp = |g| sglang(g)["sampling_params"].clone();
        assert_eq!(sp(Guided::JsonSchema(schema.into()))["json_schema"], schema);
        assert_eq!(sp(Guided::Regex("x+".into()))["regex"], "x+");
        assert_eq!(sp(Guided::Grammar("g".into()))["ebnf"], "g");
        assert_eq!(
            sp(Guided::Choice(vec!["a.b".into(), "c|d".into()]))["regex"],
            r"(a\.b|c\|d)"
        );
        // Unset: no field at all.
        let plain = GenerateParams {
            request_id: "r".into(),
            prompt: vec![1],
            sampling: switchyard_core::Sampling {
                max_tokens: 1,
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        };
        let (_, body) = request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &plain);
        assert!(body.get("structured_outputs").is_none());
    }

    #[test]
    fn the_adapter_and_the_salt_reach_each_engine_in_its_own_names() {
        let params = GenerateParams {
            request_id: "r".into(),
            prompt: vec![1, 2],
            sampling: switchyard_core::Sampling {
                max_tokens: 2,
                ..Default::default()
            },
            identity: switchyard_core::KvIdentity::new(Some("sql".into()), Some("t-1".into()))
                .unwrap(),
            retention: Default::default(),
            priority: None,
        };
        let (_, vllm) = request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &params);
        assert_eq!(
            (&vllm["model"], &vllm["cache_salt"]),
            (&json!("sql"), &json!("t-1"))
        );
        let (_, sglang) = request_body(Dialect::Sglang, "m", &params);
        assert_eq!(
            (&sglang["lora_path"], &sglang["cache_salt"]),
            (&json!("sql"), &json!("t-1"))
        );
        let plain = GenerateParams {
            identity: Default::default(),
            ..params
        };
        let (_, vllm) = request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &plain);
        assert_eq!(vllm["model"], "m");
        assert!(vllm.get("cache_salt").is_none());
        let (_, sglang) = request_body(Dialect::Sglang, "m", &plain);
        assert!(sglang.get("lora_path").is_none() && sglang.get("cache_salt").is_none());
    }

    #[test]
    fn a_priority_is_sent_at_the_top_of_each_engines_body_and_only_when_set() {
        let params = GenerateParams {
            request_id: "r".into(),
            prompt: vec![1, 2],
            sampling: switchyard_core::Sampling {
                max_tokens: 2,
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: Some(-7),
        };
        let (_, vllm) = request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &params);
        assert_eq!(vllm["priority"], json!(-7));
        let (_, sglang) = request_body(Dialect::Sglang, "m", &params);
        assert_eq!(sglang["priority"], json!(-7));
        assert!(sglang["sampling_params"].get("priority").is_none());
        let unset = GenerateParams {
            priority: None,
            ..params
        };
        for dialect in [
            Dialect::Vllm(TokenIdSource::ReturnTokenIds),
            Dialect::Sglang,
        ] {
            let (_, body) = request_body(dialect, "m", &unset);
            assert!(body.get("priority").is_none(), "{body}");
        }
    }

    #[test]
    fn logprobs_are_asked_in_each_engines_names_and_read_back_with_their_tokens() {
        let params = GenerateParams {
            request_id: "r".into(),
            prompt: vec![1, 2],
            sampling: switchyard_core::Sampling {
                max_tokens: 2,
                logprobs: Some(3),
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        };
        let (_, body) = request_body(Dialect::Vllm(TokenIdSource::ReturnTokenIds), "m", &params);
        assert_eq!(body["logprobs"], 3);
        assert_eq!(body["return_tokens_as_token_ids"], true);
        let (_, body) = request_body(Dialect::Sglang, "m", &params);
        assert_eq!(body["return_logprob"], true);
        assert_eq!(body["top_logprobs_num"], 3);
        let mut s = StreamState::new(Dialect::Vllm(TokenIdSource::ReturnTokenIds), 2)
            .with_logprobs(Some(1));
        let a = sse(
            &mut s,
            r#"{"choices":[{"token_ids":[5],"logprobs":{"token_logprobs":[-0.5],"top_logprobs":[{"token_id:5":-0.5,"token_id:6":-1.5}]},"finish_reason":null}]}"#,
        );
        let chunk = a[0].as_ref().unwrap();
        assert_eq!(chunk.logprobs.len(), 1);
        assert_eq!(chunk.logprobs[0].top.len(), 1);
        let missing = sse(
            &mut s,
            r#"{"choices":[{"token_ids":[5],"finish_reason":null}]}"#,
        );
        assert!(missing[0].is_err(), "tokens without the logprobs asked for");
        let mut s = StreamState::new(Dialect::Sglang, 2).with_logprobs(Some(0));
        let b = sse(
            &mut s,
            r#"{"output_ids":[4],"meta_info":{"completion_tokens":1,"output_token_logprobs":[[-0.25,4,null]],"finish_reason":{"type":"length"}}}"#,
        );
        let last = b[0].as_ref().unwrap();
        assert_eq!(last.logprobs[0].logprob, -0.25);
        assert!(last.logprobs[0].top.is_empty());
    }

    #[test]
    fn sglang_cumulative_and_incremental_output_ids() {
        let mut s = StreamState::new(Dialect::Sglang, 4);
        let a = sse(
            &mut s,
            r#"{"output_ids":[1,2],"meta_info":{"completion_tokens":2,"cached_tokens":2,"finish_reason":null}}"#,
        );
        assert_eq!(a[0].as_ref().unwrap().tokens, vec![1, 2]);
        let b = sse(
            &mut s,
            r#"{"output_ids":[1,2,3],"meta_info":{"completion_tokens":3,"finish_reason":{"type":"length","length":3}}}"#,
        );
        let last = b[0].as_ref().unwrap();
        assert_eq!(last.tokens, vec![3]);
        assert_eq!(last.finish, Some(FinishReason::Length));
        assert_eq!(last.cached_prompt_tokens, 2);
        let mut s = StreamState::new(Dialect::Sglang, 4);
        sse(
            &mut s,
            r#"{"output_ids":[1],"meta_info":{"completion_tokens":1}}"#,
        );
        let b = sse(
            &mut s,
            r#"{"output_ids":[9],"meta_info":{"completion_tokens":2}}"#,
        );
        assert_eq!(b[0].as_ref().unwrap().tokens, vec![9]);
    }

    #[test]
    fn http_errors_say_whose_fault() {
        let e = http_error(
            reqwest::StatusCode::BAD_REQUEST,
            r#"{"error":{"message":"too long"}}"#,
        );
        assert!(matches!(e, EngineError::InvalidRequest(m) if m.contains("too long")));
        let e = http_error(reqwest::StatusCode::SERVICE_UNAVAILABLE, "busy");
        assert!(matches!(e, EngineError::Unavailable(_)));
    }
}
