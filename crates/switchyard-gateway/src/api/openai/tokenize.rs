//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /tokenize`: a prompt, or chat messages rendered by the model's chat template.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct TokenizeRequest {
    pub model: String,
    pub prompt: Option<String>,
    pub messages: Option<Vec<serde_json::Value>>,
    /// With `messages`: end with the assistant's turn opener (default true, as vLLM).
    pub add_generation_prompt: Option<bool>,
    /// With `messages`: variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<serde_json::Value>,
    /// Fields the gateway does not take: refused with a 400 naming the first.
    #[serde(flatten)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u64,
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct DetokenizeRequest {
    pub model: String,
    pub tokens: Vec<u32>,
    /// Fields the gateway does not take: refused with a 400 naming the first.
    #[serde(flatten)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
