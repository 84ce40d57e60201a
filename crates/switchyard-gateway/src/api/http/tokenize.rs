//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: the model's own tokenizer and chat
//! template, the same ones that tokenize its requests, off the reactor for long inputs.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use switchyard_tokenize::ChatRequest;

use super::pipeline::{model_routes, read_body};
use super::state::AppState;
use crate::api::openai::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use crate::error::ApiError;
use crate::serving::preprocess::{self, Sessions};

/// These vLLM utility endpoints take a handful of fields; any other is refused by name (they
/// run no generation, so nothing here is advisory).
fn refuse_unknown(
    unknown: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Result<(), ApiError> {
    match unknown.keys().next() {
        None => Ok(()),
        Some(field) => Err(ApiError::bad_param(
            field.clone(),
            format!(
                "unsupported field `{field}` (docs/openai-api.md lists the fields /tokenize and /detokenize take)"
            ),
        )),
    }
}

fn parse<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = read_body(state, body)?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// POST /tokenize: `{model, prompt}` or `{model, messages, add_generation_prompt}` →
/// `{count, max_model_len, tokens}`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match run_tokenize(&state, body).await {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(err) => err.into_response(),
    }
}

async fn run_tokenize(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<TokenizeResponse, ApiError> {
    let request: TokenizeRequest = parse(state, body)?;
    refuse_unknown(&request.unknown)?;
    let routes = model_routes(state, &request.model)?;
    // A LoRA adapter tokenizes as its base model.
    let tokenizer = state.tokenizers.for_model(&routes.model);
    let max = usize::try_from(routes.max_context_tokens).unwrap_or(usize::MAX);
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            if request.add_generation_prompt.is_some() || request.chat_template_kwargs.is_some() {
                return Err(ApiError::bad_param(
                    "add_generation_prompt",
                    "`add_generation_prompt` and `chat_template_kwargs` go with `messages`",
                ));
            }
            preprocess::encode_text(
                &state.observers.metrics,
                tokenizer,
                prompt,
                Sessions::Bypass,
                max,
            )
            .await?
        }
        (None, Some(messages)) => {
            let messages = preprocess::parse_messages(messages)?;
            let mut chat = ChatRequest::new(messages);
            chat.add_generation_prompt = request.add_generation_prompt.unwrap_or(true);
            if let Some(kwargs) = &request.chat_template_kwargs {
                chat.template_kwargs =
                    super::fields::template_kwargs(kwargs, "chat_template_kwargs")?;
            }
            preprocess::encode_chat_request(&state.observers.metrics, tokenizer, chat, max).await?
        }
        _ => {
            return Err(ApiError::bad_param(
                "prompt",
                "give either `prompt` or `messages`",
            ));
        }
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: routes.max_context_tokens,
        tokens,
    })
}

/// POST /detokenize: `{model, tokens}` → `{prompt}`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = (|| {
        let request: DetokenizeRequest = parse(&state, body)?;
        refuse_unknown(&request.unknown)?;
        let routes = model_routes(&state, &request.model)?;
        let tokenizer = state.tokenizers.for_model(&routes.model);
        let vocab = tokenizer.dir.tokenizer().vocab_size();
        if let Some(bad) = request.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_param(
                "tokens",
                format!("token id {bad} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let prompt = tokenizer
            .dir
            .tokenizer()
            .decode(&request.tokens, false)
            .map_err(|e| ApiError::bad_param("tokens", e.to_string()))?;
        Ok::<_, ApiError>(DetokenizeResponse { prompt })
    })();
    match answer {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(err) => err.into_response(),
    }
}
