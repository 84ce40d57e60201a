//! Preprocessing glue: which tokenizer serves which model, and running it off the reactor.
//!
//! Rendering a chat template and tokenizing a long prompt are CPU work; they run on tokio's
//! blocking pool so a 100k-token prompt cannot stall every other request on the reactor. Tiny
//! inputs (a few hundred bytes) are encoded inline: the hop would cost more than the work.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use switchyard_core::TokenId;
use switchyard_tokenize::{
    ChatMessage, ChatRequest, Fault, MessageContent, ModelDir, TokenizeError,
};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// Tokenizers by model name, with a default for models not named.
#[derive(Debug, Clone)]
pub struct Tokenizers {
    default: Arc<ModelDir>,
    per_model: BTreeMap<String, Arc<ModelDir>>,
}

fn load_spec(spec: &str) -> Result<ModelDir, String> {
    match spec {
        "builtin" | "builtin:cl100k" => Ok(ModelDir::builtin()),
        path => ModelDir::load(Path::new(path)).map_err(|e| e.to_string()),
    }
}

impl Tokenizers {
    /// Loads the default and the per-model tokenizers; an error names the one that failed.
    pub fn load(default: &str, per_model: &BTreeMap<String, String>) -> Result<Self, String> {
        let default =
            Arc::new(load_spec(default).map_err(|e| format!("tokenizer {default}: {e}"))?);
        let mut models = BTreeMap::new();
        for (model, spec) in per_model {
            let dir = load_spec(spec)
                .map_err(|e| format!("tokenizer for model {model} ({spec}): {e}"))?;
            models.insert(model.clone(), Arc::new(dir));
        }
        Ok(Self {
            default,
            per_model: models,
        })
    }

    pub fn for_model(&self, model: &str) -> Arc<ModelDir> {
        self.per_model
            .get(model)
            .cloned()
            .unwrap_or_else(|| Arc::clone(&self.default))
    }

    /// Models configured explicitly.
    pub fn configured_models(&self) -> impl Iterator<Item = &String> {
        self.per_model.keys()
    }
}

/// A request the template or tokenizer refuses is the client's fault (400); broken model files
/// or a failed tokenizer task are ours (500).
fn tokenize_error(err: TokenizeError) -> ApiError {
    match err.fault() {
        Fault::Request => ApiError::bad_request(err.to_string()),
        Fault::ModelFiles | Fault::Internal => ApiError::Internal(err.to_string()),
    }
}

/// Inputs up to this many bytes are tokenized on the reactor: a trip to the blocking pool (a
/// thread wake-up and two context switches) costs more than encoding them, as in
/// `switchyard_tokenize::Preprocessor`.
const INLINE_MAX_BYTES: usize = 512;

async fn off_reactor<T: Send + 'static>(
    metrics: &Metrics,
    size: usize,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let started = Instant::now();
    let result = if size <= INLINE_MAX_BYTES {
        work()
    } else {
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
    };
    metrics.tokenize.observe(started.elapsed().as_secs_f64());
    result
}

/// Text bytes of the messages; a request with tools always goes to the blocking pool.
fn chat_size(messages: &[ChatMessage], tools: &Option<Vec<serde_json::Value>>) -> usize {
    if tools.is_some() {
        return usize::MAX;
    }
    messages
        .iter()
        .map(|m| match &m.content {
            Some(MessageContent::Text(t)) => t.len(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .map(|p| p.text.as_deref().map_or(0, str::len))
                .sum(),
            None => 0,
        } + m.role.len())
        .sum()
}

/// Turns OpenAI message objects into chat messages, naming the first bad one.
pub fn parse_messages(messages: Vec<serde_json::Value>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            serde_json::from_value::<ChatMessage>(m).map_err(|e| {
                ApiError::bad_param("messages", format!("messages[{i}] is invalid: {e}"))
            })
        })
        .collect()
}

/// Renders the chat template and tokenizes the result.
pub async fn encode_chat(
    metrics: &Metrics,
    model: Arc<ModelDir>,
    messages: Vec<ChatMessage>,
    tools: Option<Vec<serde_json::Value>>,
) -> Result<Vec<TokenId>, ApiError> {
    let size = chat_size(&messages, &tools);
    off_reactor(metrics, size, move || {
        let mut request = ChatRequest::new(messages);
        request.tools = tools;
        model.encode_chat(&request).map_err(tokenize_error)
    })
    .await
}

/// Tokenizes plain text (a completion prompt).
pub async fn encode_text(
    metrics: &Metrics,
    model: Arc<ModelDir>,
    text: String,
) -> Result<Vec<TokenId>, ApiError> {
    off_reactor(metrics, text.len(), move || {
        model.tokenizer().encode(&text).map_err(tokenize_error)
    })
    .await
}
