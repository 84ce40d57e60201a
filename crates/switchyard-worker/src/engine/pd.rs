//! Disaggregated prefill/decode through engines that move KV themselves.
//!
//! The gateway's choice and the gRPC contract are the same as with the simulator; what differs
//! is who moves the KV. Here the prefill worker's answer carries the engine's own transfer
//! parameters (`PrefillResponse.engine_transfer_params`), the gateway copies them unchanged into
//! the decode request, and the decode worker hands them to its engine, which fetches the KV from
//! the prefill engine over its own transport (NIXL, Mooncake, …). Nothing goes over `PullKv`.
//!
//! * **vLLM** (a KV connector such as `NixlConnector`): the prefill engine runs the prompt with
//!   `max_tokens: 1` and `kv_transfer_params` asking for a remote decode; it keeps the blocks and
//!   answers with the parameters a decode engine needs to read them (`remote_engine_id`,
//!   `remote_block_ids`, `remote_host`, `remote_port`, …). The decode engine gets the original
//!   request plus those parameters and generates the whole completion, first token included.
//! * **SGLang** (`--disaggregation-mode prefill|decode`): both engines get the same bootstrap
//!   address (the prefill engine's bootstrap server) and room; the prefill request only completes
//!   once the decode engine has connected and taken the KV, so the prefill worker starts it in
//!   the background and answers at once. The background request is owned: it ends when the
//!   engine finishes it, when the handle's hold expires, or when the worker shuts down (dropping
//!   the HTTP request makes SGLang abort it).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::openai_http::{self, Dialect};
use super::vllm::VllmEngine;
use super::{
    EngineError, FinishReason, GenerateParams, GenerationStream, PrefillOutcome, PrefillParams,
};

/// How long a prefill worker waits for SGLang to accept the background prefill before answering
/// anyway: long enough to see a refused connection (a dead engine), short enough not to matter.
/// SGLang sends its streaming response headers at once, so this wait is normally much shorter.
const SGLANG_ACCEPT_WAIT: Duration = Duration::from_secs(1);

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const SGLANG_DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

impl VllmEngine {
    /// vLLM's prefill: the prompt with `max_tokens: 1`, asking the engine to keep the KV for a
    /// remote decode. Its answer's `kv_transfer_params` become the engine transfer parameters.
    pub(super) async fn prefill_vllm(
        &self,
        params: PrefillParams,
    ) -> Result<PrefillOutcome, EngineError> {
        let generate = GenerateParams {
            request_id: params.request_id.clone(),
            prompt: params.prompt.clone(),
            sampling: switchyard_core::Sampling {
                max_tokens: 1,
                temperature: Some(0.0),
                // vLLM hands out transfer parameters only for a request that stopped at its
                // length cap; a first token that happened to be end-of-sequence would end it
                // otherwise.
                ignore_eos: true,
                ..switchyard_core::Sampling::default()
            },
            identity: params.identity.clone(),
            retention: params.retention,
            priority: params.priority,
        };
        let (path, mut body) = openai_http::request_body(self.dialect, &self.model, &generate);
        body["stream"] = json!(false);
        if let Some(fields) = body.as_object_mut() {
            fields.remove("stream_options");
        }
        // The same values vLLM's own disaggregation proxy sends: "decode elsewhere".
        body["kv_transfer_params"] = json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        });
        let response = self.post(path, &params.request_id, &body).await?;
        let text = response
            .text()
            .await
            .map_err(|e| EngineError::Unavailable(format!("engine answer broke off: {e}")))?;
        let answer: Value = serde_json::from_str(&text).map_err(|e| {
            EngineError::Unavailable(format!("engine sent an unreadable prefill answer: {e}"))
        })?;
        let transfer = match answer.get("kv_transfer_params") {
            Some(Value::Object(fields)) if !fields.is_empty() => Value::Object(fields.clone()),
            _ => {
                return Err(EngineError::Unsupported(
                    "the vllm engine returned no kv_transfer_params: start it with a KV connector \
                     (--kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}')",
                ));
            }
        };
        let choice = answer
            .pointer("/choices/0")
            .ok_or_else(|| EngineError::Unavailable("engine answered without a choice".into()))?;
        let first_token = openai_http::vllm_tokens(choice)?
            .first()
            .copied()
            .ok_or_else(|| EngineError::Unavailable("engine's prefill produced no token".into()))?;
        let count = |pointer: &str| {
            answer
                .pointer(pointer)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
        Ok(PrefillOutcome {
            handle: format!("vllm:{}", params.request_id),
            block_hashes: params
                .identity
                .block_hashes(&params.prompt, self.spec.block_size),
            prompt_tokens: count("/usage/prompt_tokens").unwrap_or(prompt_tokens),
            cached_prompt_tokens: count("/usage/prompt_tokens_details/cached_tokens")
                .unwrap_or(0)
                .min(prompt_tokens),
            first_token,
            // The engine, not this worker, decides how long it keeps the blocks (vLLM:
            // VLLM_NIXL_ABORT_REQUEST_TIMEOUT); the hold is what the caller was promised.
            expires_at: SystemTime::now() + params.hold,
            engine_transfer_params: Some(transfer.to_string()),
            pipelined: false,
        })
    }

    /// SGLang's prefill: starts the bootstrapped request in the background and answers with the
    /// bootstrap address and room before the engine finishes (it waits for the decode side).
    pub(super) async fn prefill_sglang(
        &self,
        params: PrefillParams,
    ) -> Result<PrefillOutcome, EngineError> {
        let room = bootstrap_room();
        let (host, port) = (&self.bootstrap.0, self.bootstrap.1);
        let mut body = json!({
            "input_ids": params.prompt,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "skip_special_tokens": false},
            "stream": true,
            "rid": params.request_id,
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": room,
        });
        openai_http::sglang_identity(&mut body, &params.identity);
        // Set only when the engine schedules by priority (the service checks).
        if let Some(priority) = params.priority {
            body["priority"] = json!(priority);
        }
        self.set_eviction_priority(&mut body, &params.retention);
        // Not `post`: this request outlives the call (it finishes in the background task).
        let mut send = Box::pin(
            self.http
                .post(format!("{}/generate", self.base_url))
                .json(&body)
                .send(),
        );
        let accepted = tokio::select! {
            sent = &mut send => Some(sent),
            _ = tokio::time::sleep(SGLANG_ACCEPT_WAIT) => None,
        };
        let early = match accepted {
            Some(Err(e)) => {
                return Err(EngineError::Unavailable(format!("engine unreachable: {e}")));
            }
            Some(Ok(response)) if !response.status().is_success() => {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                return Err(openai_http::http_error(status, &text));
            }
            Some(Ok(response)) => Some(response),
            None => None,
        };
        let (hold, cancel, request) = (params.hold, self.cancel.clone(), params.request_id.clone());
        let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
        self.tasks.spawn(async move {
            let run = async move {
                let response = match early {
                    Some(response) => response,
                    None => send.await.map_err(|e| format!("engine unreachable: {e}"))?,
                };
                if !response.status().is_success() {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    return Err(openai_http::http_error(status, &text).to_string());
                }
                // Read like any SGLang stream, so an abort (no decode engine came, a failed
                // transfer) is told apart from a prefill that handed its KV over.
                let (tx, mut rx) = mpsc::unbounded_channel();
                openai_http::pump(response, Dialect::Sglang, prompt_tokens, None, tx).await;
                let mut last = None;
                while let Ok(item) = rx.try_recv() {
                    last = Some(item);
                }
                match last {
                    Some(Ok(chunk)) if chunk.finish != Some(FinishReason::Aborted) => Ok(()),
                    Some(Ok(_)) => Err("the engine aborted it".to_owned()),
                    Some(Err(e)) => Err(e.to_string()),
                    None => Err("the engine's stream ended without an answer".to_owned()),
                }
            };
            tokio::select! {
                outcome = run => match outcome {
                    Ok(()) => tracing::debug!(%request, room, "sglang prefill handed its kv over"),
                    Err(error) => tracing::warn!(%request, room, %error, "sglang prefill failed"),
                },
                _ = tokio::time::sleep(hold) => {
                    tracing::warn!(%request, room, ?hold, "no decode engine took the sglang prefill within its hold; abandoning it");
                }
                _ = cancel.cancelled() => {}
            }
        });
        Ok(PrefillOutcome {
            handle: format!("sglang:{room}"),
            block_hashes: params
                .identity
                .block_hashes(&params.prompt, self.spec.block_size),
            prompt_tokens,
            // Not known yet: the engine is still working when this answer leaves. The decode
            // engine generates the first token itself, so nothing depends on these.
            cached_prompt_tokens: 0,
            first_token: 0,
            expires_at: SystemTime::now() + params.hold,
            engine_transfer_params: Some(
                json!({"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room})
                    .to_string(),
            ),
            // Answered before the engine finished, but there is nothing to PullKv: the decode
            // engine fetches the KV through the bootstrap room, not this worker.
            pipelined: false,
        })
    }

    /// The decode request: the original generation plus the prefill's transfer parameters, in
    /// the shape this engine expects. Parameters of the other engine kind are refused (they
    /// would make the engine wait for KV that never comes).
    pub(super) async fn generate_transfer(
        &self,
        params: GenerateParams,
        transfer: Map<String, Value>,
    ) -> Result<GenerationStream, EngineError> {
        let (path, mut body) = openai_http::request_body(self.dialect, &self.model, &params);
        match self.dialect {
            Dialect::Trtllm => {
                super::trtllm::check_request(&params)?;
                let generation = super::trtllm_pd::generation_params(transfer)?;
                body["disaggregated_params"] = Value::Object(generation);
            }
            Dialect::Vllm(_) => {
                if transfer.get("do_remote_prefill") != Some(&Value::Bool(true)) {
                    return Err(EngineError::Unsupported(
                        "engine transfer parameters are not vLLM's kv_transfer_params for a remote \
                         prefill (do_remote_prefill is not true): was the prefill worker a vllm one?",
                    ));
                }
                body["kv_transfer_params"] = Value::Object(transfer);
            }
            Dialect::Sglang => {
                let valid = transfer.get("bootstrap_host").is_some_and(Value::is_string)
                    && transfer.get("bootstrap_port").is_some_and(Value::is_u64)
                    && transfer.get("bootstrap_room").is_some_and(Value::is_u64);
                if !valid {
                    return Err(EngineError::Unsupported(
                        "engine transfer parameters are not SGLang's bootstrap host, port and room: \
                         was the prefill worker an sglang one?",
                    ));
                }
                if let Some(fields) = body.as_object_mut() {
                    fields.extend(transfer);
                }
                self.set_eviction_priority(&mut body, &params.retention);
            }
        }
        self.stream_request(path, body, &params).await
    }
}

/// Where SGLang's decode engines reach this worker's prefill engine's bootstrap server:
/// `--engine-bootstrap-host`, else the engine URL's host.
pub fn bootstrap_host(configured: Option<&str>, engine_url: &str) -> Result<String, String> {
    if let Some(host) = configured.filter(|h| !h.is_empty()) {
        return Ok(host.to_owned());
    }
    let url = reqwest::Url::parse(engine_url).map_err(|e| format!("{engine_url:?}: {e}"))?;
    url.host_str()
        .map(|h| h.trim_matches(|c| c == '[' || c == ']').to_owned())
        .ok_or_else(|| format!("{engine_url:?} has no host"))
}

/// A fresh bootstrap room: random, below 2^63 as SGLang's own router draws them (the engines
/// keep rooms in signed 64-bit fields in places).
fn bootstrap_room() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded from the operating system's randomness; hashing a counter and the
    // clock with it gives unpredictable, non-repeating rooms without another dependency.
    let mut hasher = RandomState::new().build_hasher();
    COUNTER.fetch_add(1, Ordering::Relaxed).hash(&mut hasher);
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
        .hash(&mut hasher);
    hasher.finish() >> 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_host_comes_from_the_flag_or_the_engine_url() {
        assert_eq!(
            bootstrap_host(Some("10.0.0.5"), "http://127.0.0.1:30000").unwrap(),
            "10.0.0.5"
        );
        assert_eq!(
            bootstrap_host(None, "http://prefill-0.svc:30000").unwrap(),
            "prefill-0.svc"
        );
        assert_eq!(bootstrap_host(None, "http://[::1]:30000").unwrap(), "::1");
        assert!(bootstrap_host(None, "not a url").is_err());
    }

    #[test]
    fn bootstrap_rooms_differ_and_fit_a_signed_64_bit_field() {
        let rooms: std::collections::BTreeSet<u64> = (0..1000).map(|_| bootstrap_room()).collect();
        assert_eq!(rooms.len(), 1000);
        assert!(rooms.iter().all(|&r| r <= i64::MAX as u64));
    }
}
