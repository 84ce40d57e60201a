//! A `/v1/responses` body read and translated into the chat pipeline's request: `input` items
//! become chat messages (function calls and their outputs become assistant `tool_calls` and
//! `tool` messages), `instructions` the first system message, the flat function tools chat's
//! nested ones, `text.format` chat's `response_format`. What the gateway cannot honour is a 400
//! naming the field; the settings the answer repeats are kept in an [`Echo`].

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value as Json, json};

use crate::error::ApiError;
use crate::http::completions::{ParsedRequest, PromptSource};
use crate::openai::SamplingFields;
use crate::preprocess;

/// `POST /v1/responses`, the fields the gateway takes; everything else lands in `other` and is
/// refused by name unless it is the field's neutral value (`store: false`, `include: []`).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    pub input: Option<Json>,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    pub text: Option<Json>,
    pub reasoning: Option<Json>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub user: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Json>,
}

/// The request's settings as the response object repeats them.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    /// As given: the flat Responses shape.
    pub tools: Vec<Json>,
    pub tool_choice: Json,
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub text_format: Json,
    pub metadata: BTreeMap<String, String>,
    pub user: Option<String>,
}

/// Roles an input message may have.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// Takes a Responses body apart into the chat pipeline's request and the settings to echo.
pub fn split(request: ResponsesRequest) -> Result<ParsedRequest, ApiError> {
    refuse_other(&request.other)?;
    refuse_reasoning(request.reasoning.as_ref())?;
    let mut messages = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.input {
        Some(Json::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Json::Array(items)) => messages.extend(input_messages(items)?),
        None | Some(Json::Null) => {
            return Err(ApiError::bad_param("input", "`input` is required"));
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "input",
                "`input` is a string or a list of input items",
            ));
        }
    }
    if messages.is_empty() {
        return Err(ApiError::bad_param("input", "`input` must not be empty"));
    }
    let messages = preprocess::parse_messages(messages)
        .map_err(|e| ApiError::bad_param("input", e.to_string()))?;
    let tools = request
        .tools
        .clone()
        .map(|tools| tools.iter().enumerate().map(chat_tool).collect())
        .transpose()?;
    let tool_choice = request
        .tool_choice
        .as_ref()
        .map(chat_tool_choice)
        .transpose()?;
    let text_format = text_format(request.text.as_ref())?;
    let response_format = match text_format.get("type").and_then(Json::as_str) {
        Some("json_schema") => Some(json!({"type": "json_schema", "json_schema": {
            "name": text_format.get("name").cloned().unwrap_or(Json::Null),
            "schema": text_format.get("schema").cloned().unwrap_or(Json::Null),
            "strict": text_format.get("strict").cloned().unwrap_or(Json::Null),
        }})),
        Some("json_object") => Some(json!({"type": "json_object"})),
        _ => None,
    };
    let sampling = SamplingFields {
        max_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        stream: request.stream.unwrap_or(false),
        user: request.user.clone(),
        response_format,
        ..SamplingFields::default()
    };
    let echo = Echo {
        instructions: request.instructions,
        max_output_tokens: request.max_output_tokens,
        tools: request.tools.unwrap_or_default(),
        tool_choice: request.tool_choice.unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        temperature: request.temperature,
        top_p: request.top_p,
        text_format,
        metadata: request.metadata.unwrap_or_default(),
        user: request.user,
    };
    Ok(ParsedRequest {
        model: request.model,
        sampling,
        source: PromptSource::Chat {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls: request.parallel_tool_calls,
        },
        echo: false,
        responses: Some(Arc::new(echo)),
    })
}

/// Fields outside [`ResponsesRequest`]: their neutral value is what the gateway does anyway;
/// anything else is a 400 naming the field.
fn refuse_other(other: &BTreeMap<String, Json>) -> Result<(), ApiError> {
    for (field, value) in other {
        let neutral = match (field.as_str(), value) {
            (_, Json::Null) => true,
            ("store" | "background", Json::Bool(false)) => true,
            ("include", Json::Array(a)) => a.is_empty(),
            ("truncation", Json::String(s)) => s == "disabled",
            ("top_logprobs", Json::Number(n)) => n.as_u64() == Some(0),
            _ => false,
        };
        if neutral {
            continue;
        }
        let why = match field.as_str() {
            "store" => {
                "the gateway keeps no responses (stateless): `store` must be false or unset".into()
            }
            "previous_response_id" | "conversation" => format!(
                "the gateway keeps no responses (stateless): `{field}` cannot be honoured; send the whole conversation in `input`"
            ),
            "background" => {
                "background responses need stored state; `background` must be false".into()
            }
            "include" => "no extra output data can be included; `include` must be empty".into(),
            "truncation" => {
                "only `truncation: \"disabled\"` is served (a prompt over the context is a 400)"
                    .into()
            }
            "top_logprobs" => "log probabilities are not served on /v1/responses".into(),
            _ => format!(
                "unsupported field `{field}` (docs/openai-api.md lists the fields /v1/responses takes)"
            ),
        };
        return Err(ApiError::bad_param(field.clone(), why));
    }
    Ok(())
}

/// `reasoning`: a model reasons as it was trained to; the gateway cannot set its effort or
/// write summaries, so only an empty `reasoning` is taken.
fn refuse_reasoning(reasoning: Option<&Json>) -> Result<(), ApiError> {
    let Some(Json::Object(fields)) = reasoning else {
        return match reasoning {
            None | Some(Json::Null) => Ok(()),
            Some(_) => Err(ApiError::bad_param("reasoning", "`reasoning` is an object")),
        };
    };
    match fields.iter().find(|(_, v)| !v.is_null()) {
        None => Ok(()),
        Some((key, _)) => Err(ApiError::bad_param(
            format!("reasoning.{key}"),
            format!(
                "`reasoning.{key}` cannot be honoured: the gateway does not steer a model's reasoning (its reasoning, when a reasoning parser is configured, comes back as a reasoning item)"
            ),
        )),
    }
}

/// The fields an input item of `kind` may carry.
fn allowed_keys(kind: &str) -> &'static [&'static str] {
    match kind {
        "message" => &["type", "role", "content", "id", "status"],
        "function_call" => &["type", "call_id", "name", "arguments", "id", "status"],
        "function_call_output" => &["type", "call_id", "output", "id", "status"],
        "reasoning" => &[
            "type",
            "id",
            "summary",
            "content",
            "encrypted_content",
            "status",
        ],
        _ => &[],
    }
}

/// The chat messages of a list of input items, in order. Function calls join the assistant
/// turn before them; a reasoning item joins the assistant turn after it.
fn input_messages(items: Vec<Json>) -> Result<Vec<Json>, ApiError> {
    let mut messages: Vec<Json> = Vec::new();
    let mut reasoning: Option<String> = None;
    for (i, item) in items.into_iter().enumerate() {
        let at = |key: &str| format!("input[{i}].{key}");
        let Json::Object(item) = item else {
            return Err(ApiError::bad_param(
                format!("input[{i}]"),
                "an input item is an object",
            ));
        };
        let kind = match item.get("type") {
            None => "message",
            Some(Json::String(kind)) => kind.as_str(),
            Some(_) => return Err(ApiError::bad_param(at("type"), "`type` is a string")),
        };
        let allowed = allowed_keys(kind);
        if allowed.is_empty() {
            return Err(ApiError::bad_param(
                at("type"),
                format!(
                    "input items of type {kind:?} are not supported (message, function_call, function_call_output and reasoning are)"
                ),
            ));
        }
        if let Some(key) = item.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(ApiError::bad_param(
                at(key),
                format!("unsupported field `{key}` in a {kind} input item"),
            ));
        }
        match kind {
            "message" => {
                let role = string_of(&item, "role", &at("role"))?;
                if !ROLES.contains(&role) {
                    return Err(ApiError::bad_param(
                        at("role"),
                        format!("unknown role {role:?} (user, assistant, system or developer)"),
                    ));
                }
                let content = content_text(item.get("content"), &at("content"))?;
                // Chat templates know `system`; `developer` is its newer name.
                let role = if role == "developer" { "system" } else { role };
                let mut message = json!({"role": role, "content": content});
                if role == "assistant"
                    && let Some(text) = reasoning.take()
                {
                    message["reasoning_content"] = json!(text);
                }
                messages.push(message);
            }
            "function_call" => {
                let call = json!({
                    "id": string_of(&item, "call_id", &at("call_id"))?,
                    "type": "function",
                    "function": {
                        "name": string_of(&item, "name", &at("name"))?,
                        "arguments": string_of(&item, "arguments", &at("arguments"))?,
                    },
                });
                let joins = messages
                    .last()
                    .is_some_and(|m| m["role"] == "assistant" && reasoning.is_none());
                if !joins {
                    let mut turn = json!({"role": "assistant", "content": null, "tool_calls": []});
                    if let Some(text) = reasoning.take() {
                        turn["reasoning_content"] = json!(text);
                    }
                    messages.push(turn);
                }
                if let Some(last) = messages.last_mut() {
                    match last.get_mut("tool_calls").and_then(Json::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                }
            }
            "function_call_output" => {
                let call_id = string_of(&item, "call_id", &at("call_id"))?;
                let output = content_text(item.get("output"), &at("output"))?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            _ => {
                if item.get("encrypted_content").is_some_and(|v| !v.is_null()) {
                    return Err(ApiError::bad_param(
                        at("encrypted_content"),
                        "encrypted reasoning cannot be read back by this gateway",
                    ));
                }
                let text = reasoning_text(item.get("content"), &at("content"))?;
                reasoning.get_or_insert_default().push_str(&text);
            }
        }
    }
    if let Some(text) = reasoning {
        messages.push(json!({"role": "assistant", "content": "", "reasoning_content": text}));
    }
    Ok(messages)
}

fn string_of<'a>(item: &'a Map<String, Json>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| ApiError::bad_param(at, format!("`{key}` is required and is a string")))
}

/// A message's or a function output's text: a string, or text parts (`input_text`,
/// `output_text`) joined.
fn content_text(content: Option<&Json>, at: &str) -> Result<String, ApiError> {
    let parts = match content {
        Some(Json::String(text)) => return Ok(text.clone()),
        Some(Json::Array(parts)) => parts,
        _ => {
            return Err(ApiError::bad_param(
                at,
                "content is a string or a list of input_text/output_text parts",
            ));
        }
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Json::as_str).unwrap_or_default();
        let allowed: &[&str] = match kind {
            "input_text" => &["type", "text"],
            "output_text" => &["type", "text", "annotations", "logprobs"],
            _ => {
                return Err(ApiError::bad_param(
                    format!("{at}[{j}].type"),
                    format!(
                        "content parts of type {kind:?} are not supported (input_text and output_text are)"
                    ),
                ));
            }
        };
        let Some(fields) = part.as_object() else {
            continue;
        };
        if let Some(key) = fields.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(ApiError::bad_param(
                format!("{at}[{j}].{key}"),
                format!("unsupported field `{key}` in an {kind} part"),
            ));
        }
        if fields
            .get("annotations")
            .is_some_and(|a| !a.is_null() && a.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(ApiError::bad_param(
                format!("{at}[{j}].annotations"),
                "annotations cannot be given back to a model",
            ));
        }
        match fields.get("text").and_then(Json::as_str) {
            Some(part_text) => text.push_str(part_text),
            None => {
                return Err(ApiError::bad_param(
                    format!("{at}[{j}].text"),
                    "a text part needs `text`",
                ));
            }
        }
    }
    Ok(text)
}

/// A reasoning item's text: its `reasoning_text` parts (its summary is what was shown of it,
/// not what the model thought, so it is not rendered; none is ever written by this gateway).
fn reasoning_text(content: Option<&Json>, at: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in content
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        match (
            part.get("type").and_then(Json::as_str),
            part.get("text").and_then(Json::as_str),
        ) {
            (Some("reasoning_text"), Some(t)) => text.push_str(t),
            _ => {
                return Err(ApiError::bad_param(
                    format!("{at}[{j}]"),
                    "reasoning content parts are {\"type\": \"reasoning_text\", \"text\": …}",
                ));
            }
        }
    }
    Ok(text)
}

/// A flat Responses function tool as chat's nested one.
fn chat_tool((i, tool): (usize, &Json)) -> Result<Json, ApiError> {
    let at = format!("tools[{i}]");
    let Some(fields) = tool.as_object() else {
        return Err(ApiError::bad_param(at, "a tool is an object"));
    };
    match fields.get("type").and_then(Json::as_str) {
        Some("function") => {}
        other => {
            return Err(ApiError::bad_param(
                format!("{at}.type"),
                format!("tools of type {other:?} are not supported (only function tools are)"),
            ));
        }
    }
    const KEYS: [&str; 5] = ["type", "name", "description", "parameters", "strict"];
    if let Some(key) = fields.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(ApiError::bad_param(
            format!("{at}.{key}"),
            format!("unsupported field `{key}` in a function tool"),
        ));
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(value) = fields.get(key).filter(|v| !v.is_null()) {
            function.insert(key.to_owned(), value.clone());
        }
    }
    if !function.get("name").is_some_and(Json::is_string) {
        return Err(ApiError::bad_param(
            format!("{at}.name"),
            "a function tool needs a `name`",
        ));
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice`: `auto`, `none`, `required`, or `{"type": "function", "name"}`.
fn chat_tool_choice(choice: &Json) -> Result<Json, ApiError> {
    match choice {
        Json::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(choice.clone()),
        Json::Object(o) if o.get("type").and_then(Json::as_str) == Some("function") => {
            match o.get("name").and_then(Json::as_str) {
                Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
                None => Err(ApiError::bad_param(
                    "tool_choice",
                    "a function tool_choice needs a `name`",
                )),
            }
        }
        _ => Err(ApiError::bad_param(
            "tool_choice",
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": …}",
        )),
    }
}

/// `text.format`, checked: `text` (the default), `json_object`, or `json_schema` with a
/// `schema`.
fn text_format(text: Option<&Json>) -> Result<Json, ApiError> {
    let default = json!({"type": "text"});
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok(default);
    };
    let Some(fields) = text.as_object() else {
        return Err(ApiError::bad_param("text", "`text` is an object"));
    };
    if let Some((key, _)) = fields.iter().find(|(k, v)| *k != "format" && !v.is_null()) {
        return Err(ApiError::bad_param(
            format!("text.{key}"),
            format!("`text.{key}` is not supported (only `text.format` is)"),
        ));
    }
    let Some(format) = fields.get("format").filter(|f| !f.is_null()) else {
        return Ok(default);
    };
    let bad = |m: &str| ApiError::bad_param("text.format", m.to_owned());
    match format.get("type").and_then(Json::as_str) {
        Some("text" | "json_object") => Ok(format.clone()),
        Some("json_schema") => {
            if !format.get("schema").is_some_and(Json::is_object) {
                return Err(bad("a json_schema format needs a `schema` object"));
            }
            if !format.get("name").is_some_and(Json::is_string) {
                return Err(bad("a json_schema format needs a `name`"));
            }
            Ok(format.clone())
        }
        Some(other) => Err(bad(&format!(
            "`text.format.type` {other:?} is not text, json_object or json_schema"
        ))),
        None => Err(bad("`text.format` needs a `type`")),
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
