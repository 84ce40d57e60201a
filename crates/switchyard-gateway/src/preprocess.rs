//! Preprocessing glue: which tokenizer serves which model, and running it off the reactor.
//!
//! Rendering a chat template and tokenizing a long prompt are CPU work; they run on tokio's
//! blocking pool so a 100k-token prompt cannot stall every other request on the reactor.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use switchyard_core::TokenId;
use switchyard_tokenize::{ChatMessage, ChatRequest, Fault, ModelDir, TokenizeError};

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

async fn off_reactor<T: Send + 'static>(
    metrics: &Metrics,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let started = Instant::now();
    let result = tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?;
    metrics.tokenize.observe(started.elapsed().as_secs_f64());
    result
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
    off_reactor(metrics, move || {
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
    off_reactor(metrics, move || {
        model.tokenizer().encode(&text).map_err(tokenize_error)
    })
    .await
}
