//! OpenAI API bodies: what clients send and what the gateway answers.
//!
//! Nothing a client sends is dropped silently: every field is carried to the engine (the
//! sampling fields, in `switchyard_core::Sampling`), honoured by the gateway (stop strings,
//! `user`, streaming, template switches), advisory (accepted, recorded and counted), or refused
//! with a 400 naming it ([`fields`]; `docs/openai-api.md` lists every field and its outcome).
//!
//! [`logprobs`] holds the log-probability shapes of answers; [`tokenize`] the bodies of
//! `/tokenize` and `/detokenize`.

pub mod fields;
pub mod logprobs;
pub mod tokenize;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::api::chat_output::ToolCallOut;
pub use logprobs::LogprobsOut;

/// `stop`: one string or a list of up to four.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by chat and text completions (OpenAI's, and vLLM's sampling extensions).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SamplingFields {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stop: Option<StopSpec>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's form) → bias.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// Choices per prompt (each its own routed request).
    pub n: Option<u32>,
    /// Only `n` (or unset) is taken: the gateway does not rank extra candidates.
    pub best_of: Option<u32>,
    /// vLLM extension: keep generating past end-of-sequence.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM extensions.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub min_tokens: Option<u32>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// Chat: `true`/`false`; text completions: how many alternatives (0 to 5). Read per
    /// endpoint (`http::completions`).
    pub logprobs: Option<serde_json::Value>,
    /// Chat only: alternatives per token (0 to 20), with `logprobs: true`.
    pub top_logprobs: Option<u32>,
    /// Structured output (`http::guided`): OpenAI's, and vLLM's current and older forms.
    pub response_format: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// vLLM's and SGLang's cache salt: the request's KV is shared only with requests of the
    /// same salt (routing hashes its blocks under it; the engine receives it).
    pub cache_salt: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `none`, `auto` (the default with tools); `required` and named functions are refused
    /// until guided decoding reaches the engines.
    pub tool_choice: Option<serde_json::Value>,
    /// `false`: only the model's first tool call is returned.
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Every other field, each given its outcome by [`fields::notes_of`].
    #[serde(flatten)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

/// `prompt` of a text completion: text or token ids.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokenBatch(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptInput,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Every other field, each given its outcome by [`fields::notes_of`].
    #[serde(flatten)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }

    /// This and `other` together (several prompts or choices of one request).
    pub fn plus(&self, other: &Usage) -> Usage {
        Usage::new(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.prompt_tokens_details.cached_tokens + other.prompt_tokens_details.cached_tokens,
        )
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the model only called tools.
    pub content: Option<String>,
    /// The model's reasoning, under both names clients read: `reasoning_content` (DeepSeek,
    /// SGLang, Dynamo) and `reasoning` (vLLM since 0.16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub finish_reason: &'static str,
    pub logprobs: Option<LogprobsOut>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The model's reasoning, under both names clients read: `reasoning_content` (DeepSeek,
    /// SGLang, Dynamo) and `reasoning` (vLLM since 0.16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<LogprobsOut>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<LogprobsOut>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Longest prompt plus output, in tokens (vLLM reports the same field).
    pub max_model_len: u64,
    /// A LoRA adapter's base model (vLLM's `parent`); absent for a base model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_keeps_unknown_fields_apart_and_takes_both_stop_forms() {
        let req: ChatCompletionRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],
                "stop":"x","frequency_penalty":0.5,"stream":true,"top_k":5,
                "stream_options":{"include_usage":true},"store":true}"#,
        )
        .unwrap();
        assert_eq!(req.sampling.frequency_penalty, Some(0.5));
        assert_eq!(req.sampling.top_k, Some(5));
        assert_eq!(req.unknown.keys().collect::<Vec<_>>(), ["store"]);
        assert_eq!(req.sampling.stop, Some(StopSpec::One("x".into())));
        assert!(req.sampling.stream);
        assert!(req.sampling.stream_options.unwrap().include_usage);
        let req: ChatCompletionRequest =
            serde_json::from_str(r#"{"model":"m","messages":[],"stop":["a","b"]}"#).unwrap();
        assert_eq!(req.sampling.stop.unwrap().into_vec(), vec!["a", "b"]);
    }

    #[test]
    fn completion_prompt_is_text_or_tokens() {
        let r: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":"hello"}"#).unwrap();
        assert_eq!(r.prompt, PromptInput::Text("hello".into()));
        let r: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        let r: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":[[1],[2]]}"#).unwrap();
        assert!(matches!(r.prompt, PromptInput::TokenBatch(_)));
    }
}
