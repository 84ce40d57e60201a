//! A request's prompts: how each endpoint gives them, tokenizing them off the reactor, and
//! settling each prompt's `max_tokens` against the model's context.

use std::sync::Arc;

use switchyard_core::TokenId;
use switchyard_telemetry::GATEWAY_SPANS;
use switchyard_tokenize::{ChatMessage, ChatRequest};
use tracing::Instrument;
use tracing::field::Empty;

use super::state::AppState;
use crate::cluster::pool::ModelRoutes;
use crate::error::ApiError;
use crate::serving::preprocess::{self, ModelTokenizer, Sessions};
use crate::serving::routing::{BlockNaming, PromptHashes};

/// How a request gives its prompts: the only thing the two endpoints do differently.
#[derive(Debug)]
pub enum PromptSource {
    Chat {
        messages: Vec<ChatMessage>,
        tools: Option<Vec<serde_json::Value>>,
        tool_choice: Option<serde_json::Value>,
        parallel_tool_calls: Option<bool>,
    },
    Texts(Vec<String>),
    Tokens(Vec<Vec<TokenId>>),
}

impl PromptSource {
    pub fn count(&self) -> usize {
        match self {
            PromptSource::Chat { .. } => 1,
            PromptSource::Texts(t) => t.len(),
            PromptSource::Tokens(t) => t.len(),
        }
    }
}

/// How a chat prompt is rendered besides its messages and tools: the template variables
/// (`chat_template_kwargs` and the reasoning switches) and whether it ends opening the
/// assistant's turn. The engine is sent the tokens rendered so, so both see the same prompt.
#[derive(Debug, Clone)]
pub struct Template {
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    pub add_generation_prompt: bool,
}

/// A tokenized prompt, its block hashes, and the text it came from when the client gave text.
pub(super) struct Tokenized {
    pub(super) tokens: Vec<TokenId>,
    pub(super) hashes: PromptHashes,
    pub(super) text: Option<String>,
}

/// Tokenizes the request's prompts off the reactor, each within the model's context, and
/// hashes their blocks as `naming` says in the same task. One prompt goes through the session
/// cache; the prompts of a batch are one-offs that would only crowd it.
pub(super) async fn tokenize(
    state: &AppState,
    tokenizer: &Arc<ModelTokenizer>,
    source: PromptSource,
    template: Template,
    session: Option<String>,
    routes: &ModelRoutes,
    naming: &BlockNaming,
) -> Result<Vec<Tokenized>, ApiError> {
    let max_prompt = preprocess::prompt_limit(routes.max_context_tokens);
    let track = |count: usize| {
        if count == 1 {
            Sessions::Track(session.clone())
        } else {
            Sessions::Bypass
        }
    };
    let preprocess_span = tracing::info_span!(
        target: GATEWAY_SPANS,
        "preprocess",
        input = Empty,
        prompt_tokens = Empty,
        session_cache_hit = Empty,
        reused_tokens = Empty,
        prefix_cache_tokens = Empty,
    );
    let prompts = async {
        let span = tracing::Span::current();
        match source {
            PromptSource::Chat {
                messages, tools, ..
            } => {
                span.record("input", "chat");
                let mut chat = ChatRequest::new(messages);
                chat.tools = tools;
                chat.template_kwargs = template.kwargs;
                chat.add_generation_prompt = template.add_generation_prompt;
                let (tokens, hashes) = preprocess::encode_chat_named(
                    &state.observers.metrics,
                    Arc::clone(tokenizer),
                    chat,
                    track(1),
                    max_prompt,
                    naming.clone(),
                )
                .await?;
                Ok(vec![Tokenized {
                    tokens,
                    hashes,
                    text: None,
                }])
            }
            PromptSource::Texts(texts) => {
                span.record("input", "text");
                let sessions = track(texts.len());
                let mut out = Vec::with_capacity(texts.len());
                for text in texts {
                    let (tokens, hashes) = preprocess::encode_text_named(
                        &state.observers.metrics,
                        Arc::clone(tokenizer),
                        text.clone(),
                        sessions.clone(),
                        max_prompt,
                        naming.clone(),
                    )
                    .await?;
                    out.push(Tokenized {
                        tokens,
                        hashes,
                        text: Some(text),
                    });
                }
                Ok(out)
            }
            PromptSource::Tokens(lists) => {
                span.record("input", "tokens");
                // Nothing to tokenize: hashed here, as routing would have.
                Ok(lists
                    .into_iter()
                    .map(|tokens| Tokenized {
                        hashes: naming.hash(&tokens),
                        tokens,
                        text: None,
                    })
                    .collect())
            }
        }
    }
    .instrument(preprocess_span.clone())
    .await
    // The request span follows HTTP's rule (only a 5xx is its failure); this step failed
    // whoever's fault it was, and the trace should show where.
    .inspect_err(|err: &ApiError| {
        switchyard_telemetry::record_error(&preprocess_span, err.to_string())
    })?;
    let total: usize = prompts.iter().map(|p| p.tokens.len()).sum();
    preprocess_span.record("prompt_tokens", total as i64);
    Ok(prompts)
}

/// A prompt's `max_tokens`: what was asked if prompt and completion fit the context, else a
/// 400; unset, what the context leaves (at most the configured default).
pub(super) fn settle_max_tokens(
    context: u64,
    prompt_len: u64,
    asked: Option<u32>,
    default: u32,
) -> Result<u32, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    if prompt_len >= context {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {context} tokens. However, your prompt has {prompt_len} tokens."
        )));
    }
    match asked {
        Some(asked) => {
            if prompt_len + u64::from(asked) > context {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {asked} for the completion).",
                        prompt_len + u64::from(asked)
                    ),
                ));
            }
            Ok(asked)
        }
        None => Ok((context - prompt_len).min(u64::from(default)) as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_is_what_was_asked_when_it_fits_else_what_the_context_leaves() {
        assert_eq!(settle_max_tokens(100, 10, Some(20), 16).unwrap(), 20);
        assert_eq!(settle_max_tokens(100, 10, None, 16).unwrap(), 16);
        assert_eq!(settle_max_tokens(100, 95, None, 16).unwrap(), 5);
        let over = settle_max_tokens(100, 90, Some(20), 16)
            .unwrap_err()
            .to_string();
        assert!(over.contains("you requested 110 tokens"), "{over}");
        let long = settle_max_tokens(100, 100, None, 16)
            .unwrap_err()
            .to_string();
        assert!(long.contains("your prompt has 100 tokens"), "{long}");
        assert!(settle_max_tokens(100, 0, None, 16).is_err());
    }
}
