//! Choosing a request's endpoints: read the prompt from the body the proxy forwards (parse,
//! chat template, tokenize, as the gateway does), admit it, and let the gateway's routing
//! ([`switchyard_gateway::serving::routing`], over the one serving core) choose the worker. The picker
//! adds only what the proxy needs: the chosen worker's engine endpoint and, after it, the other
//! candidates' endpoints best first as fallbacks.

use std::sync::Arc;

use serde_json::Value;
use switchyard_core::{KvIdentity, TokenId};
use switchyard_gateway::access::admission::{Admitted, FlowKey};
use switchyard_gateway::access::quota::QuotaPass;
use switchyard_gateway::api::http::AppState;
use switchyard_gateway::api::http::fields::template_kwargs;
use switchyard_gateway::cluster::pool::ModelRoutes;
use switchyard_gateway::error::ApiError;
use switchyard_gateway::observe::audit::RequestTags;
use switchyard_gateway::serving::model::{salted_identity, served_model};
use switchyard_gateway::serving::preprocess::{self, Sessions};
use switchyard_gateway::serving::routing::{self, RoutedRequest};
use switchyard_router::serve::DecodeFilter;
use switchyard_router::{RouteError, RouteRequest};
use switchyard_tokenize::ChatRequest;

use crate::config::{EppConfig, FailureMode};
use crate::envoy::{Headers, in_subset};

/// The header naming the model when the body does not (a request without a body); the
/// Gateway API Inference Extension's model header.
pub const MODEL_HEADER: &str = "x-gateway-model-name";

/// What one request asks of the picker.
#[derive(Debug)]
pub struct PickInput<'a> {
    pub headers: &'a Headers,
    /// The whole request body; `None` when the destination must be chosen before it is seen
    /// (a request without a body, or the proxy's `streamed` mode).
    pub body: Option<&'a [u8]>,
    /// The proxy's subset hint: `None` for no hint.
    pub subset: Option<&'a [String]>,
}

/// A chosen destination. While it lives the request is booked on its worker and holds its
/// admission slot and its tenant's quota pass; dropping it (the request ended, or the proxy
/// went away) releases them, charging the tokens counted in `quota`.
#[derive(Debug)]
pub struct Picked {
    pub routed: RoutedRequest,
    pub request: RouteRequest,
    pub max_tokens: u32,
    /// `primary,fallback,…` as `ip:port`s: the header value and the `envoy.lb` entry.
    pub destination: String,
    pub request_id: String,
    /// The tenant's fleet-wide quota; the prompt's tokens are charged at the pick, the
    /// completion's when the response ends ([`crate::usage`]).
    pub quota: QuotaPass,
    _admitted: Admitted,
}

/// A request's prompt as the body gives it.
#[derive(Debug, Default)]
struct Asked {
    model: Option<String>,
    user: Option<String>,
    max_tokens: Option<u32>,
    /// The request's `cache_salt`: the engine keys the prompt's blocks by it, so routing must
    /// hash the prompt under it too.
    identity: KvIdentity,
    prompt: Option<PromptText>,
}

#[derive(Debug)]
enum PromptText {
    /// Rendered as the model server renders it: its messages, tools and template switches
    /// (`chat_template_kwargs`, `add_generation_prompt`), so the picker hashes the tokens the
    /// engine will compute.
    Chat(ChatRequest),
    Text(String),
    Tokens(Vec<TokenId>),
}

/// Chooses the destination of one request.
pub async fn pick(
    state: &AppState,
    epp: &EppConfig,
    input: PickInput<'_>,
) -> Result<Picked, ApiError> {
    let headers = input.headers;
    let request_id = headers
        .get("x-request-id")
        .map_or_else(|| format!("epp-{:016x}", rand_id()), str::to_owned);
    let session = headers.get("x-session-id").map(str::to_owned);
    let path = headers.get(":path").unwrap_or_default();
    let asked = match input.body.map(|body| read_body(path, body)) {
        None => Asked::default(),
        Some(Ok(asked)) => asked,
        Some(Err(err)) if epp.failure_mode == FailureMode::Closed => return Err(err),
        Some(Err(err)) => {
            tracing::warn!(request_id, error = %err, "cannot read the prompt; picking by load (failure mode open)");
            Asked::default()
        }
    };
    let (routes, adapter) =
        model_routes(state, asked.model.as_deref().or(headers.get(MODEL_HEADER)))?;
    // A LoRA adapter's blocks hash under it, and only engines that serve it are picked.
    let identity = KvIdentity {
        adapter,
        ..asked.identity.clone()
    };
    let flow = FlowKey::of_request(
        session.clone(),
        asked.user.as_deref(),
        &headers.to_http(),
        None,
    );
    // The tenant's fleet-wide quota first, as in the gateway: a request over it waits for no
    // local slot.
    let quota = state.quota.enter(&flow.tenant).await?;
    // The picker's waiters keep arrival order within their flow (no priority read here); the
    // body, priority included, goes to the engine as the client sent it.
    let admitted = state
        .admission
        .admit(flow, None, None, &state.observers.metrics)
        .await?;
    let tokens = match asked.prompt {
        None => Vec::new(),
        Some(prompt) => match tokenize(state, &routes, prompt, session.clone()).await {
            Ok(tokens) => tokens,
            Err(err) if epp.failure_mode == FailureMode::Closed => return Err(err),
            Err(err) => {
                tracing::warn!(request_id, error = %err, "cannot tokenize the prompt; picking by load (failure mode open)");
                Vec::new()
            }
        },
    };
    let session_tag = session.clone();
    let request = routing::route_request(&state.pool, &routes, &tokens, &identity, session);
    let room = routes
        .max_context_tokens
        .saturating_sub(tokens.len() as u64)
        .max(1);
    let max_tokens = asked
        .max_tokens
        .unwrap_or(state.config.default_max_tokens)
        .min(u32::try_from(room).unwrap_or(u32::MAX));
    let subset = input.subset;
    let within = |info: &switchyard_core::WorkerInfo| match (subset, &info.engine_endpoint) {
        (None, _) => true,
        (Some(subset), Some(endpoint)) => in_subset(subset, endpoint),
        (Some(_), None) => false,
    };
    let note = subset.map(|s| format!("endpoint picker: subset of {} endpoint(s)", s.len()));
    let filter = DecodeFilter {
        exclude: &[],
        // The proxy sends the request to one engine: no prefill worker is arranged for it.
        aggregated_only: true,
        adapter: request.adapter.as_deref(),
    };
    let tags = Arc::new(RequestTags {
        request_id: request_id.clone(),
        session: session_tag,
        ..RequestTags::default()
    });
    let routed = routing::route_within(
        &state.pool,
        &state.observers,
        &routes,
        routing::DecodeAsk {
            note: note.as_deref(),
            ..routing::DecodeAsk::first(&request, max_tokens, filter, &tags)
        },
        &within,
    )
    .map_err(|err| unavailable(&routes, subset, err))?;
    let destination = destination(state, &routed, &request, epp.fallbacks);
    quota.charge(tokens.len() as u64);
    Ok(Picked {
        routed,
        request,
        max_tokens,
        destination,
        request_id,
        quota,
        _admitted: admitted,
    })
}

/// The model's routing state: the model the request names (a base model, or a LoRA adapter:
/// then its base model's, and the adapter), else the only model served.
fn model_routes(
    state: &AppState,
    model: Option<&str>,
) -> Result<(Arc<ModelRoutes>, Option<String>), ApiError> {
    if let Some(model) = model {
        let served = served_model(&state.pool, model)?;
        return Ok((served.routes, served.adapter));
    }
    let models = state.pool.models();
    let mut served = models
        .into_iter()
        .filter(|(_, routes)| !routes.members.snapshot().members.is_empty());
    match (served.next(), served.next()) {
        (Some((_, routes)), None) => Ok((routes, None)),
        (None, _) => Err(ApiError::Unavailable(
            "no model server is registered".into(),
        )),
        (Some(_), Some(_)) => Err(ApiError::bad_param(
            "model",
            format!(
                "the request names no model and several are served; name one in the body or the {MODEL_HEADER} header"
            ),
        )),
    }
}

fn unavailable(routes: &ModelRoutes, subset: Option<&[String]>, err: RouteError) -> ApiError {
    match (err, subset) {
        (RouteError::NoCandidates, Some(subset)) => ApiError::Unavailable(format!(
            "none of the {} endpoint(s) of the subset hint is a ready model server of model {}",
            subset.len(),
            routes.model
        )),
        (RouteError::NoCandidates, None) => ApiError::Unavailable(format!(
            "no model server of model {} with an HTTP endpoint is ready",
            routes.model
        )),
        (err, _) => ApiError::Internal(err.to_string()),
    }
}

/// The chosen worker's endpoint, then up to `fallbacks` others, best first.
fn destination(
    state: &AppState,
    routed: &RoutedRequest,
    request: &RouteRequest,
    fallbacks: usize,
) -> String {
    routed
        .decision
        .ranked(request)
        .into_iter()
        .filter_map(|id| state.pool.worker(id))
        .filter_map(|w| w.info().engine_endpoint)
        .take(1 + fallbacks)
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads what routing needs from an OpenAI request body: the model, the prompt (chat messages,
/// text or token ids), `max_tokens`, `user` and `cache_salt`. Other fields are the model server's to judge.
fn read_body(path: &str, body: &[u8]) -> Result<Asked, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not JSON: {e}")))?;
    let Value::Object(mut fields) = value else {
        return Err(ApiError::bad_request(
            "the request body is not a JSON object",
        ));
    };
    let model = match fields.remove("model") {
        Some(Value::String(model)) => Some(model),
        Some(_) => return Err(ApiError::bad_param("model", "model must be a string")),
        None => None,
    };
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| fields.get(*k).and_then(Value::as_u64))
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    let user = fields
        .get("user")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let identity = match fields.remove("cache_salt") {
        None | Some(Value::Null) => KvIdentity::PLAIN,
        Some(Value::String(salt)) => salted_identity(Some(salt))?,
        Some(_) => {
            return Err(ApiError::bad_param(
                "cache_salt",
                "cache_salt must be a string",
            ));
        }
    };
    let chat = path.starts_with("/v1/chat/") || fields.contains_key("messages");
    let prompt = if chat {
        let messages = match fields.remove("messages") {
            Some(Value::Array(messages)) => preprocess::parse_messages(messages)?,
            _ => return Err(ApiError::bad_param("messages", "messages must be a list")),
        };
        let mut chat = ChatRequest::new(messages);
        chat.tools = match fields.remove("tools") {
            Some(Value::Array(tools)) => Some(tools),
            _ => None,
        };
        if let Some(kwargs) = fields.remove("chat_template_kwargs") {
            chat.template_kwargs = template_kwargs(&kwargs, "chat_template_kwargs")?;
        }
        if let Some(Value::Bool(open)) = fields.remove("add_generation_prompt") {
            chat.add_generation_prompt = open;
        }
        PromptText::Chat(chat)
    } else {
        match fields.remove("prompt") {
            Some(prompt) => prompt_of(prompt)?,
            None => {
                return Err(ApiError::bad_param(
                    "prompt",
                    "the body has neither messages nor prompt",
                ));
            }
        }
    };
    Ok(Asked {
        model,
        user,
        max_tokens,
        identity,
        prompt: Some(prompt),
    })
}

/// A completion prompt: text, token ids, or a batch of either (routed by its first prompt,
/// which the engine runs alongside the others).
fn prompt_of(prompt: Value) -> Result<PromptText, ApiError> {
    let bad = || {
        ApiError::bad_param(
            "prompt",
            "prompt must be a string, a list of token ids, or a non-empty list of either",
        )
    };
    match prompt {
        Value::String(text) => Ok(PromptText::Text(text)),
        Value::Array(items) => match items.first() {
            Some(Value::Number(_)) => items
                .iter()
                .map(|t| t.as_u64().and_then(|t| TokenId::try_from(t).ok()))
                .collect::<Option<Vec<_>>>()
                .map(PromptText::Tokens)
                .ok_or_else(bad),
            Some(Value::String(_) | Value::Array(_)) => items
                .into_iter()
                .next()
                .map_or_else(|| Err(bad()), prompt_of),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// The prompt's tokens, as the gateway tokenizes them (off the reactor, through the session
/// cache, within the model's context).
async fn tokenize(
    state: &AppState,
    routes: &ModelRoutes,
    prompt: PromptText,
    session: Option<String>,
) -> Result<Vec<TokenId>, ApiError> {
    let tokenizer = state.tokenizers.for_model(&routes.model);
    let max = preprocess::prompt_limit(routes.max_context_tokens);
    let sessions = Sessions::Track(session);
    match prompt {
        PromptText::Tokens(tokens) => Ok(tokens),
        PromptText::Text(text) => {
            preprocess::encode_text(&state.observers.metrics, tokenizer, text, sessions, max).await
        }
        PromptText::Chat(chat) => {
            preprocess::encode_chat(&state.observers.metrics, tokenizer, chat, sessions, max).await
        }
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn bodies_give_model_prompt_and_limits_or_a_named_error() {
        let chat = read_body(
            "/v1/chat/completions",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":7,"user":"u","vllm_extra":1}"#,
        )
        .unwrap();
        assert_eq!(chat.model.as_deref(), Some("m"));
        assert_eq!(chat.max_tokens, Some(7));
        assert_eq!(chat.user.as_deref(), Some("u"));
        assert!(matches!(chat.prompt, Some(PromptText::Chat(_))));
        // The template switches a client sets reach the picker's rendering, as the engine's.
        let switched = read_body(
            "/v1/chat/completions",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":false}"#,
        )
        .unwrap();
        let Some(PromptText::Chat(chat)) = switched.prompt else {
            panic!("a chat prompt");
        };
        assert_eq!(chat.template_kwargs["enable_thinking"], Value::Bool(false));
        assert!(!chat.add_generation_prompt);
        let bad = read_body(
            "/v1/chat/completions",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":[1]}"#,
        )
        .unwrap_err();
        assert!(bad.to_string().contains("chat_template_kwargs"), "{bad}");
        let tokens = read_body("/v1/completions", br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(tokens.prompt, Some(PromptText::Tokens(t)) if t == [1, 2, 3]));
        let batch = read_body("/v1/completions", br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert!(matches!(batch.prompt, Some(PromptText::Text(t)) if t == "a"));
        for (body, says) in [
            (&b"{not json"[..], "not JSON"),
            (b"[1]", "not a JSON object"),
            (br#"{"model":3,"prompt":"x"}"#, "model must be a string"),
            (br#"{"model":"m"}"#, "neither messages nor prompt"),
            (br#"{"model":"m","prompt":[-1]}"#, "prompt must be"),
            (br#"{"model":"m","prompt":[]}"#, "prompt must be"),
            (
                br#"{"model":"m","messages":"hi"}"#,
                "messages must be a list",
            ),
        ] {
            let err = read_body("/v1/completions", body).unwrap_err();
            assert_eq!(err.status().as_u16(), 400);
            assert!(err.to_string().contains(says), "{err}");
        }
    }
}
