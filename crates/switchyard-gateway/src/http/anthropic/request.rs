//! An Anthropic Messages request taken apart into the chat pipeline's request: the messages
//! become chat messages ([`super::blocks`]), the tools and `tool_choice` OpenAI's, the sampling
//! fields the chat fields. What cannot be honoured is refused with a 400 naming it, the path
//! included (`tools.0.type`), as Anthropic names fields in its own errors.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value as Json, json};
use switchyard_tokenize::ChatMessage;

pub use super::blocks::chat_messages;
use super::blocks::{bad, cache_control, object, only, string};
use crate::error::ApiError;
use crate::openai::{SamplingFields, StopSpec, StreamOptions};

/// `POST /v1/messages` (and, without `max_tokens`, `/v1/messages/count_tokens`).
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub messages: Option<Vec<Json>>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub metadata: Option<Json>,
    pub thinking: Option<Json>,
    /// `{"format": {"type": "json_schema", "schema"}}`: structured output.
    pub output_config: Option<Json>,
    /// Top-level cache control (a breakpoint on the last block): see [`cache_control`].
    pub cache_control: Option<Json>,
    /// Fields the gateway does not take: refused with a 400 naming the first.
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Json>,
}

/// The chat request a Messages request is.
#[derive(Debug)]
pub struct ChatAsk {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub sampling: SamplingFields,
    /// The stop sequences, to tell `stop_sequence` from `end_turn` in the answer.
    pub stop_sequences: Vec<String>,
    /// `thinking: {"type": "enabled"}`: the model must have a reasoning parser.
    pub thinking: Thinking,
}

/// What the request said about extended thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// Not asked: the model's reasoning, if its parser finds any, still comes back.
    Unset,
    /// Asked for: refused for a model without a reasoning parser.
    Enabled,
    /// The model decides: its reasoning comes back when its parser finds any.
    Adaptive,
    /// Switched off: refused for a model with a reasoning parser (it cannot be turned off).
    Disabled,
}

/// Anthropic's limits on the fields it checks itself.
const MIN_THINKING_BUDGET: u64 = 1024;
/// The stop matcher holds at most this many strings.
const MAX_STOP_SEQUENCES: usize = 4;

/// Anthropic tools (`name`, `description`, `input_schema`) as OpenAI function tools.
pub fn chat_tools(tools: Option<&[Json]>) -> Result<Option<Vec<Json>>, ApiError> {
    let Some(tools) = tools else {
        return Ok(None);
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let path = format!("tools.{i}");
            let tool = object(tool, &path)?;
            match tool.get("type").and_then(Json::as_str) {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(bad(
                        format!("{path}.type"),
                        format!("server tools (`{kind}`) are not supported: give client tools with `name` and `input_schema`"),
                    ));
                }
            }
            only(
                tool,
                &path,
                &["type", "name", "description", "input_schema", "cache_control"],
            )?;
            cache_control(tool, &path)?;
            let name = string(tool, &path, "name")?;
            let schema = tool
                .get("input_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| bad(format!("{path}.input_schema"), "Field required (a JSON schema object)"))?;
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
                function["description"] = description.clone();
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `tool_choice` as OpenAI's, and `disable_parallel_tool_use` as `parallel_tool_calls: false`.
pub fn chat_tool_choice(choice: Option<&Json>) -> Result<(Option<Json>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, None));
    };
    let path = "tool_choice";
    let choice = object(choice, path)?;
    only(choice, path, &["type", "name", "disable_parallel_tool_use"])?;
    let parallel = match choice.get("disable_parallel_tool_use") {
        None | Some(Json::Null) => None,
        Some(Json::Bool(disable)) => Some(!disable),
        Some(_) => {
            return Err(bad(
                "tool_choice.disable_parallel_tool_use",
                "expected a boolean",
            ));
        }
    };
    let kind = choice.get("type").and_then(Json::as_str);
    if kind != Some("tool") && choice.contains_key("name") {
        return Err(bad("tool_choice.name", "only a `tool` choice names a tool"));
    }
    let openai = match kind {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            json!({"type": "function", "function": {"name": string(choice, path, "name")?}})
        }
        _ => {
            return Err(bad(
                "tool_choice.type",
                "must be \"auto\", \"any\", \"tool\" or \"none\"",
            ));
        }
    };
    Ok((Some(openai), parallel))
}

/// `thinking`: `{"type": "enabled", "budget_tokens"}` or `{"type": "disabled"}`.
pub fn thinking_of(thinking: Option<&Json>, max_tokens: u32) -> Result<Thinking, ApiError> {
    let Some(thinking) = thinking.filter(|t| !t.is_null()) else {
        return Ok(Thinking::Unset);
    };
    let t = object(thinking, "thinking")?;
    // The reasoning is returned as the model wrote it; redacting it is not on offer.
    match t.get("display") {
        None | Some(Json::Null) => {}
        Some(display) if display == "summarized" => {}
        Some(_) => {
            return Err(bad(
                "thinking.display",
                "only \"summarized\" (the thinking returned) is supported",
            ));
        }
    }
    match t.get("type").and_then(Json::as_str) {
        Some("disabled") => {
            only(t, "thinking", &["type"])?;
            Ok(Thinking::Disabled)
        }
        Some("adaptive") => {
            only(t, "thinking", &["type", "display"])?;
            Ok(Thinking::Adaptive)
        }
        Some("enabled") => {
            only(t, "thinking", &["type", "budget_tokens", "display"])?;
            let budget = t
                .get("budget_tokens")
                .and_then(Json::as_u64)
                .ok_or_else(|| bad("thinking.budget_tokens", "Field required (an integer)"))?;
            if budget < MIN_THINKING_BUDGET {
                return Err(bad(
                    "thinking.budget_tokens",
                    format!("must be at least {MIN_THINKING_BUDGET}"),
                ));
            }
            if budget >= u64::from(max_tokens) {
                return Err(bad(
                    "thinking.budget_tokens",
                    "must be less than max_tokens",
                ));
            }
            Ok(Thinking::Enabled)
        }
        _ => Err(bad(
            "thinking.type",
            "must be \"enabled\", \"adaptive\" or \"disabled\"",
        )),
    }
}

/// `metadata.user_id`: the request's user, as OpenAI's `user` is (the fairness flow).
fn user_of(metadata: Option<&Json>) -> Result<Option<String>, ApiError> {
    let Some(metadata) = metadata.filter(|m| !m.is_null()) else {
        return Ok(None);
    };
    let m = object(metadata, "metadata")?;
    only(m, "metadata", &["user_id"])?;
    match m.get("user_id") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(user)) => Ok(Some(user.clone())),
        Some(_) => Err(bad("metadata.user_id", "expected a string")),
    }
}

/// `output_config.format` (a JSON schema) as OpenAI's `response_format`: the engine is
/// constrained to write an instance of it.
pub fn response_format(output_config: Option<&Json>) -> Result<Option<Json>, ApiError> {
    let Some(config) = output_config.filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    let config = object(config, "output_config")?;
    only(config, "output_config", &["format"])?;
    let Some(format) = config.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let format = object(format, "output_config.format")?;
    only(format, "output_config.format", &["type", "schema"])?;
    if format.get("type").and_then(Json::as_str) != Some("json_schema") {
        return Err(bad("output_config.format.type", "must be \"json_schema\""));
    }
    let schema = format
        .get("schema")
        .filter(|s| s.is_object())
        .ok_or_else(|| {
            bad(
                "output_config.format.schema",
                "Field required (a JSON schema object)",
            )
        })?;
    Ok(Some(json!({"type": "json_schema",
        "json_schema": {"name": "output", "schema": schema}})))
}

/// The request's own `cache_control`, checked as a block's is.
pub fn top_cache_control(control: Option<Json>) -> Result<(), ApiError> {
    let mut top = Map::new();
    if let Some(control) = control {
        top.insert("cache_control".into(), control);
    }
    cache_control(&top, "")
}

/// Refuses the first field the gateway does not take.
pub fn refuse_unknown(unknown: &BTreeMap<String, Json>) -> Result<(), ApiError> {
    match unknown.keys().next() {
        None => Ok(()),
        Some(field) => Err(bad(
            field.clone(),
            "this field is not supported by this gateway (docs/anthropic-api.md lists the fields it takes)",
        )),
    }
}

/// The chat request of a `/v1/messages` body.
pub fn chat_ask(r: MessagesRequest) -> Result<ChatAsk, ApiError> {
    refuse_unknown(&r.unknown)?;
    let max_tokens = r
        .max_tokens
        .ok_or_else(|| bad("max_tokens", "Field required"))?;
    if max_tokens == 0 {
        return Err(bad("max_tokens", "must be at least 1"));
    }
    let messages = r
        .messages
        .as_deref()
        .ok_or_else(|| bad("messages", "Field required"))?;
    let messages = chat_messages(r.system.as_ref(), messages)?;
    if let Some(t) = r.temperature
        && !(0.0..=1.0).contains(&t)
    {
        return Err(bad("temperature", "must be between 0 and 1"));
    }
    let stop_sequences = r.stop_sequences.unwrap_or_default();
    if stop_sequences.len() > MAX_STOP_SEQUENCES {
        return Err(bad(
            "stop_sequences",
            format!("at most {MAX_STOP_SEQUENCES} stop sequences are taken"),
        ));
    }
    if stop_sequences.iter().any(String::is_empty) {
        return Err(bad("stop_sequences", "a stop sequence must not be empty"));
    }
    let tools = chat_tools(r.tools.as_deref())?;
    let (tool_choice, parallel_tool_calls) = chat_tool_choice(r.tool_choice.as_ref())?;
    let thinking = thinking_of(r.thinking.as_ref(), max_tokens)?;
    top_cache_control(r.cache_control)?;
    let sampling = SamplingFields {
        response_format: response_format(r.output_config.as_ref())?,
        max_tokens: Some(max_tokens),
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        stop: (!stop_sequences.is_empty()).then(|| StopSpec::Many(stop_sequences.clone())),
        // Kept in the text so the answer can say which sequence ended it (and then drops it).
        include_stop_str_in_output: (!stop_sequences.is_empty()).then_some(true),
        stream: r.stream,
        stream_options: r.stream.then_some(StreamOptions {
            include_usage: true,
        }),
        user: user_of(r.metadata.as_ref())?,
        ..SamplingFields::default()
    };
    Ok(ChatAsk {
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        sampling,
        stop_sequences,
        thinking,
    })
}

/// `POST /v1/messages/count_tokens`: the fields that shape the prompt (the others of a
/// Messages request are refused by name, as Anthropic's endpoint takes only these).
#[derive(Debug, Clone, Deserialize)]
pub struct CountTokensRequest {
    pub model: String,
    pub messages: Option<Vec<Json>>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub thinking: Option<Json>,
    /// Checked as a Messages request's; a constraint does not change the prompt.
    pub output_config: Option<Json>,
    pub cache_control: Option<Json>,
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Json>,
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
