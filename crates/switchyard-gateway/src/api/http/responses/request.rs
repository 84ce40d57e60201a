//! A `/v1/responses` body read and translated into the chat pipeline's request: `input` items
//! become chat messages (function calls and their outputs become assistant `tool_calls` and
//! `tool` messages), `instructions` the first system message, the flat function tools chat's
//! nested ones, `text.format` chat's `response_format`. Each other field has its outcome in the
//! field policy ([`crate::api::http::fields`]): `reasoning.effort` sets the model's template switch,
//! `prompt_cache_key` names the session, what cannot change the tokens is advisory, and only
//! what the client would miss is a 400 naming the field. The settings the answer repeats are
//! kept in an [`Echo`].

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value as Json, json};
use switchyard_tokenize::ChatMessage;

use super::items::input_messages;
use super::store::Sealer;
use crate::api::http::fields::{FieldNotes, Reasoning, SessionSource, session_key};
use crate::api::http::pipeline::ParsedRequest;
use crate::api::http::prompts::PromptSource;
use crate::api::openai::SamplingFields;
use crate::error::ApiError;
use crate::serving::preprocess;

/// `POST /v1/responses`, the fields the gateway reads itself; everything else lands in `other`
/// and gets its outcome from [`note_other`].
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
    /// Keep the response (`GET /v1/responses/{id}`, `previous_response_id`); OpenAI's default
    /// is true.
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    pub include: Option<Vec<Json>>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Json>,
}

/// What a request continues from and how reasoning is read back: the conversation of its
/// `previous_response_id` (fetched by the caller) and the deployment's sealer.
pub struct Context<'a> {
    pub previous: Option<Vec<Json>>,
    pub sealer: &'a Sealer,
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
    /// Whether the response is kept.
    pub store: bool,
    pub previous_response_id: Option<String>,
    /// `include: ["reasoning.encrypted_content"]`: reasoning items carry their text sealed.
    pub seal_reasoning: bool,
    /// This request's input as items (a string input as one user message item).
    pub input: Vec<Json>,
    /// The conversation before this input (the previous response's), as items.
    pub previous: Vec<Json>,
}

/// Takes a Responses body apart into the chat pipeline's request and the settings to echo.
pub fn split(
    request: ResponsesRequest,
    context: Context<'_>,
) -> Result<(ParsedRequest, Echo), ApiError> {
    let mut notes = FieldNotes::default();
    note_other(&request.other, &mut notes)?;
    note_reasoning(request.reasoning.as_ref(), &mut notes)?;
    let seal_reasoning = note_include(request.include.as_deref(), &mut notes)?;
    if request.metadata.as_ref().is_some_and(|m| !m.is_empty()) {
        notes.advisory("metadata");
    }
    let store = request.store.unwrap_or(true);
    let Conversation {
        messages,
        input,
        previous,
    } = conversation(
        request.instructions.as_deref(),
        request.input,
        context,
        &mut notes,
    )?;
    let tools = request
        .tools
        .as_deref()
        .map(|tools| chat_tools(tools, &mut notes))
        .transpose()?;
    let tool_choice = request
        .tool_choice
        .as_ref()
        .map(chat_tool_choice)
        .transpose()?;
    let text_format = text_format(request.text.as_ref(), &mut notes)?;
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
        store,
        previous_response_id: request.previous_response_id,
        seal_reasoning,
        input,
        previous,
    };
    let parsed = ParsedRequest {
        model: request.model,
        sampling,
        source: PromptSource::Chat {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls: request.parallel_tool_calls,
        },
        echo: false,
        notes,
    };
    Ok((parsed, echo))
}

/// A request's conversation: the chat messages it renders to, and its input and the previous
/// response's conversation as items (which the stored response keeps).
struct Conversation {
    messages: Vec<ChatMessage>,
    input: Vec<Json>,
    previous: Vec<Json>,
}

/// The instructions, the previous response's conversation and this input as chat messages.
fn conversation(
    instructions: Option<&str>,
    input: Option<Json>,
    context: Context<'_>,
    notes: &mut FieldNotes,
) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    if let Some(instructions) = &instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    let input = match input {
        Some(Json::String(text)) => vec![json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]})],
        Some(Json::Array(items)) => items,
        None | Some(Json::Null) => {
            return Err(ApiError::bad_param("input", "`input` is required"));
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "input",
                "`input` is a string or a list of input items",
            ));
        }
    };
    if input.is_empty() {
        return Err(ApiError::bad_param("input", "`input` must not be empty"));
    }
    let previous = context.previous.unwrap_or_default();
    let items: Vec<Json> = previous.iter().chain(&input).cloned().collect();
    messages.extend(input_messages(
        items,
        previous.len(),
        context.sealer,
        notes,
    )?);
    if messages.is_empty() {
        return Err(ApiError::bad_param("input", "`input` must not be empty"));
    }
    let messages = preprocess::parse_messages(messages)
        .map_err(|e| ApiError::bad_param("input", e.to_string()))?;
    Ok(Conversation {
        messages,
        input,
        previous,
    })
}

/// Fields outside [`ResponsesRequest`] that cannot change the tokens: accepted and counted.
const ADVISORY: [&str; 8] = [
    "service_tier",
    "safety_identifier",
    "max_tool_calls",
    "client_metadata",
    "prompt_cache_retention",
    "stream_options",
    "user_id",
    "parallel_tool_calls_hint",
];

/// Fields outside [`ResponsesRequest`]: `prompt_cache_key` names the session; the neutral
/// value of a stateful field is what the gateway does anyway (advisory); a stateful value or a
/// setting that would change the answer is a 400 naming the field; [`ADVISORY`] fields are
/// noted; anything else is unknown.
fn note_other(other: &BTreeMap<String, Json>, notes: &mut FieldNotes) -> Result<(), ApiError> {
    for (field, value) in other.iter().filter(|(_, v)| !v.is_null()) {
        let refuse = |why: String| Err(ApiError::bad_param(field.clone(), why));
        match (field.as_str(), value) {
            ("prompt_cache_key", Json::String(key)) => {
                if let Some(key) = session_key(key) {
                    notes.session = Some((SessionSource::PromptCacheKey, key));
                }
            }
            // vLLM's Responses request takes a scheduling priority as its chat request does.
            ("priority", _) => notes.note_priority(field, value)?,
            ("background", Json::Bool(false)) => notes.advisory(field.clone()),
            ("background", _) => {
                return refuse(
                    "background responses are not run: the answer comes on this connection; `background` must be false"
                        .into(),
                );
            }
            ("conversation", _) => {
                return refuse(
                    "conversations are not kept; continue with `previous_response_id` or send the whole conversation in `input`"
                        .into(),
                );
            }
            ("truncation", Json::String(s)) if s == "disabled" => {}
            ("truncation", _) => {
                return refuse(
                    "only `truncation: \"disabled\"` is served (a prompt over the context is a 400)"
                        .into(),
                );
            }
            ("top_logprobs", Json::Number(n)) if n.as_u64() == Some(0) => {}
            ("top_logprobs", _) => {
                return refuse("log probabilities are not served on /v1/responses".into());
            }
            ("n", Json::Number(n)) if n.as_u64() == Some(1) => {}
            (name, _) if CHAT_ONLY.contains(&name) => {
                return refuse(format!(
                    "`{field}` is a chat completions field that /v1/responses does not take, and ignoring it would change the answer (use /v1/chat/completions)"
                ));
            }
            (name, _) if ADVISORY.contains(&name) => notes.advisory(field.clone()),
            _ => notes.unknown(field.clone()),
        }
    }
    Ok(())
}

/// Chat sampling fields sent to `/v1/responses` (through an SDK's `extra_body`): the client
/// relies on each, and Responses has no place for them.
const CHAT_ONLY: [&str; 12] = [
    "n",
    "stop",
    "seed",
    "logit_bias",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "response_format",
];

/// `include`: `reasoning.encrypted_content` seals reasoning items for the client to carry
/// (returns whether it was asked); log probabilities are not served; anything else asks for
/// data of hosted tools, which do not run here (advisory).
fn note_include(include: Option<&[Json]>, notes: &mut FieldNotes) -> Result<bool, ApiError> {
    let mut seal = false;
    for item in include.unwrap_or_default() {
        match item.as_str() {
            Some("reasoning.encrypted_content") => seal = true,
            Some("message.output_text.logprobs") => {
                return Err(ApiError::bad_param(
                    "include",
                    "log probabilities are not served on /v1/responses",
                ));
            }
            Some(name) => notes.advisory(format!("include.{name}")),
            None => {
                return Err(ApiError::bad_param(
                    "include",
                    "`include` is a list of strings",
                ));
            }
        }
    }
    Ok(seal)
}

/// `reasoning`: `effort` is mapped onto the model's template switch (see
/// [`crate::api::http::fields::Reasoning`]); `summary` is advisory (the reasoning comes back whole
/// as a reasoning item when the model's parser finds any; no summary is written).
fn note_reasoning(reasoning: Option<&Json>, notes: &mut FieldNotes) -> Result<(), ApiError> {
    let Some(Json::Object(fields)) = reasoning else {
        return match reasoning {
            None | Some(Json::Null) => Ok(()),
            Some(_) => Err(ApiError::bad_param("reasoning", "`reasoning` is an object")),
        };
    };
    for (key, value) in fields.iter().filter(|(_, v)| !v.is_null()) {
        match key.as_str() {
            "effort" => {
                let reasoning = value.as_str().and_then(Reasoning::of_effort).ok_or_else(|| {
                    ApiError::bad_param(
                        "reasoning.effort",
                        "`reasoning.effort` must be \"none\", \"minimal\", \"low\", \"medium\", \"high\" or \"xhigh\"",
                    )
                })?;
                notes.ask_reasoning(reasoning, "reasoning.effort");
            }
            "summary" | "generate_summary" => notes.advisory(format!("reasoning.{key}")),
            _ => notes.unknown(format!("reasoning.{key}")),
        }
    }
    Ok(())
}

/// The request's tools as chat's nested function tools: function tools as they are, the
/// function tools of a `namespace` (Codex groups some of its tools so) flattened beside them,
/// and hosted tools (`web_search`, `file_search`, ...), which run on OpenAI's servers and which
/// the model behind this gateway cannot call, left out and noted as advisory (the model answers
/// without them).
fn chat_tools(tools: &[Json], notes: &mut FieldNotes) -> Result<Vec<Json>, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(fields) = tool.as_object() else {
            return Err(ApiError::bad_param(at, "a tool is an object"));
        };
        match fields.get("type").and_then(Json::as_str) {
            Some("function") => out.push(chat_tool(&at, fields, notes)?),
            Some("namespace") => {
                let inner = fields
                    .get("tools")
                    .and_then(Json::as_array)
                    .ok_or_else(|| {
                        ApiError::bad_param(format!("{at}.tools"), "a namespace lists its `tools`")
                    })?;
                for (j, tool) in inner.iter().enumerate() {
                    let at = format!("{at}.tools[{j}]");
                    match tool.as_object() {
                        Some(f) if f.get("type").and_then(Json::as_str) == Some("function") => {
                            out.push(chat_tool(&at, f, notes)?);
                        }
                        _ => {
                            return Err(ApiError::bad_param(
                                at,
                                "a namespace holds function tools",
                            ));
                        }
                    }
                }
            }
            Some(kind) => notes.advisory(format!("tools.{kind}")),
            None => {
                return Err(ApiError::bad_param(
                    format!("{at}.type"),
                    "a tool needs a `type`",
                ));
            }
        }
    }
    Ok(out)
}

/// A flat Responses function tool as chat's nested one.
fn chat_tool(
    at: &str,
    fields: &Map<String, Json>,
    notes: &mut FieldNotes,
) -> Result<Json, ApiError> {
    const KEYS: [&str; 5] = ["type", "name", "description", "parameters", "strict"];
    for key in fields.keys().filter(|k| !KEYS.contains(&k.as_str())) {
        notes.unknown(format!("tools[].{key}"));
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
fn text_format(text: Option<&Json>, notes: &mut FieldNotes) -> Result<Json, ApiError> {
    let default = json!({"type": "text"});
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok(default);
    };
    let Some(fields) = text.as_object() else {
        return Err(ApiError::bad_param("text", "`text` is an object"));
    };
    for (key, _) in fields
        .iter()
        .filter(|(k, v)| *k != "format" && !v.is_null())
    {
        // `verbosity` steers OpenAI's own models; the models here write as they were trained.
        if key == "verbosity" {
            notes.advisory("text.verbosity");
        } else {
            notes.unknown(format!("text.{key}"));
        }
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
