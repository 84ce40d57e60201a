//! Anthropic content blocks as chat messages: `system` and each turn's text, `tool_use`,
//! `tool_result` and `thinking` blocks become the messages the model's chat template renders,
//! and what cannot be honoured (images, documents, redacted thinking, unknown roles or keys) is
//! refused with a 400 naming its path (`messages.1.content.0.type`), as Anthropic names fields
//! in its own errors. The helpers that check and name fields serve [`super::request`] too.

use serde_json::{Map, Value as Json, json};
use switchyard_tokenize::{ChatMessage, ContentPart, MessageContent};

use crate::error::ApiError;

pub(super) fn bad(param: impl Into<String>, message: impl std::fmt::Display) -> ApiError {
    let param = param.into();
    ApiError::bad_param(param.clone(), format!("{param}: {message}"))
}

/// The first key of `object` not in `allowed` is refused, named by its path.
pub(super) fn only(
    object: &Map<String, Json>,
    path: &str,
    allowed: &[&str],
) -> Result<(), ApiError> {
    match object.keys().find(|k| !allowed.contains(&k.as_str())) {
        None => Ok(()),
        Some(key) => Err(bad(
            format!("{path}.{key}"),
            "this field is not supported by this gateway (docs/anthropic-api.md lists the fields it takes)",
        )),
    }
}

pub(super) fn object<'a>(value: &'a Json, path: &str) -> Result<&'a Map<String, Json>, ApiError> {
    value
        .as_object()
        .ok_or_else(|| bad(path, "expected an object"))
}

pub(super) fn string<'a>(
    object: &'a Map<String, Json>,
    path: &str,
    key: &str,
) -> Result<&'a str, ApiError> {
    object
        .get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| bad(format!("{path}.{key}"), "Field required (a string)"))
}

/// `cache_control` is taken on any block: prefix caching is always on (every prompt prefix a
/// worker holds is reused, and routing goes where it lives), so a breakpoint asks for nothing
/// more. Only Anthropic's own form is taken.
pub(super) fn cache_control(block: &Map<String, Json>, path: &str) -> Result<(), ApiError> {
    let Some(value) = block.get("cache_control") else {
        return Ok(());
    };
    let path = if path.is_empty() {
        "cache_control".to_owned()
    } else {
        format!("{path}.cache_control")
    };
    if value.is_null() {
        return Ok(());
    }
    let control = object(value, &path)?;
    only(control, &path, &["type", "ttl"])?;
    if control.get("type").and_then(Json::as_str) != Some("ephemeral") {
        return Err(bad(format!("{path}.type"), "must be \"ephemeral\""));
    }
    Ok(())
}

/// Text blocks (`system`, a tool result's content): a string or a list of text blocks.
fn text_blocks(value: &Json, path: &str) -> Result<Vec<ContentPart>, ApiError> {
    match value {
        Json::String(text) => Ok(vec![text_part(text)]),
        Json::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, block)| {
                let path = format!("{path}.{j}");
                let block = object(block, &path)?;
                match block.get("type").and_then(Json::as_str) {
                    Some("text") => {
                        only(
                            block,
                            &path,
                            &["type", "text", "cache_control", "citations"],
                        )?;
                        cache_control(block, &path)?;
                        Ok(text_part(string(block, &path, "text")?))
                    }
                    other => Err(unsupported_block(&path, other)),
                }
            })
            .collect(),
        _ => Err(bad(path, "expected a string or a list of text blocks")),
    }
}

fn text_part(text: &str) -> ContentPart {
    ContentPart {
        kind: "text".into(),
        text: Some(text.to_owned()),
    }
}

fn unsupported_block(path: &str, kind: Option<&str>) -> ApiError {
    match kind {
        Some("image") => bad(
            path,
            "image blocks are not supported: the models behind this gateway read text",
        ),
        Some(kind) => bad(
            format!("{path}.type"),
            format!("content blocks of type `{kind}` are not supported here"),
        ),
        None => bad(format!("{path}.type"), "Field required"),
    }
}

fn parts(parts: Vec<ContentPart>) -> Option<MessageContent> {
    Some(MessageContent::Parts(parts))
}

fn message(role: &str, content: Option<MessageContent>) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content,
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning_content: None,
        reasoning: None,
    }
}

/// A user turn: text blocks make one user message; each `tool_result` block a `tool` message
/// (in the order given, so results answer the calls the assistant made).
fn user_turn(content: &Json, path: &str, out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let blocks = match content {
        Json::String(text) => {
            out.push(message("user", Some(MessageContent::Text(text.clone()))));
            return Ok(());
        }
        Json::Array(blocks) => blocks,
        _ => return Err(bad(path, "expected a string or a list of content blocks")),
    };
    let mut texts = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let path = format!("{path}.{j}");
        let block = object(block, &path)?;
        match block.get("type").and_then(Json::as_str) {
            Some("text") => {
                only(
                    block,
                    &path,
                    &["type", "text", "cache_control", "citations"],
                )?;
                cache_control(block, &path)?;
                texts.push(text_part(string(block, &path, "text")?));
            }
            Some("tool_result") => {
                only(
                    block,
                    &path,
                    &[
                        "type",
                        "tool_use_id",
                        "content",
                        "is_error",
                        "cache_control",
                    ],
                )?;
                cache_control(block, &path)?;
                if !texts.is_empty() {
                    out.push(message("user", parts(std::mem::take(&mut texts))));
                }
                let id = string(block, &path, "tool_use_id")?;
                let mut result: String = match block.get("content") {
                    None | Some(Json::Null) => String::new(),
                    Some(content) => text_blocks(content, &format!("{path}.content"))?
                        .into_iter()
                        .filter_map(|p| p.text)
                        .collect::<Vec<_>>()
                        .join("\n"),
                };
                match block.get("is_error") {
                    None | Some(Json::Null) | Some(Json::Bool(false)) => {}
                    // The template has no notion of a failed call: the model reads it in the text.
                    Some(Json::Bool(true)) => result = format!("Error: {result}"),
                    Some(_) => return Err(bad(format!("{path}.is_error"), "expected a boolean")),
                }
                let mut tool = message("tool", Some(MessageContent::Text(result)));
                tool.tool_call_id = Some(id.to_owned());
                out.push(tool);
            }
            other => return Err(unsupported_block(&path, other)),
        }
    }
    if !texts.is_empty() {
        out.push(message("user", parts(texts)));
    }
    Ok(())
}

/// An assistant turn: text, `tool_use` blocks (OpenAI `tool_calls`, arguments as JSON text) and
/// `thinking` blocks (the turn's reasoning, which the template renders or leaves out as the
/// model's own chat format does).
fn assistant_turn(content: &Json, path: &str) -> Result<ChatMessage, ApiError> {
    let blocks = match content {
        Json::String(text) => {
            return Ok(message(
                "assistant",
                Some(MessageContent::Text(text.clone())),
            ));
        }
        Json::Array(blocks) => blocks,
        _ => return Err(bad(path, "expected a string or a list of content blocks")),
    };
    let mut text = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<String> = None;
    for (j, block) in blocks.iter().enumerate() {
        let path = format!("{path}.{j}");
        let block = object(block, &path)?;
        match block.get("type").and_then(Json::as_str) {
            Some("text") => {
                only(
                    block,
                    &path,
                    &["type", "text", "cache_control", "citations"],
                )?;
                cache_control(block, &path)?;
                text.push(text_part(string(block, &path, "text")?));
            }
            Some("tool_use") => {
                only(
                    block,
                    &path,
                    &["type", "id", "name", "input", "cache_control", "caller"],
                )?;
                cache_control(block, &path)?;
                // The SDK echoes `caller`; only a client's own direct call is one of ours.
                match block.get("caller") {
                    None | Some(Json::Null) => {}
                    Some(caller) if caller == &json!({"type": "direct"}) => {}
                    Some(_) => {
                        return Err(bad(
                            format!("{path}.caller"),
                            "only direct calls (`{\"type\": \"direct\"}`) are taken",
                        ));
                    }
                }
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                if !input.is_object() {
                    return Err(bad(format!("{path}.input"), "expected an object"));
                }
                calls.push(json!({
                    "id": string(block, &path, "id")?,
                    "type": "function",
                    "function": {"name": string(block, &path, "name")?, "arguments": input.to_string()},
                }));
            }
            Some("thinking") => {
                only(block, &path, &["type", "thinking", "signature"])?;
                reasoning
                    .get_or_insert_default()
                    .push_str(string(block, &path, "thinking")?);
            }
            Some("redacted_thinking") => {
                return Err(bad(
                    format!("{path}.type"),
                    "redacted thinking cannot be read back by these models",
                ));
            }
            other => return Err(unsupported_block(&path, other)),
        }
    }
    let mut turn = message(
        "assistant",
        (!text.is_empty()).then_some(MessageContent::Parts(text)),
    );
    turn.tool_calls = (!calls.is_empty()).then_some(calls);
    turn.reasoning_content = reasoning;
    Ok(turn)
}

/// `system` and `messages` as chat messages.
pub fn chat_messages(
    system: Option<&Json>,
    messages: &[Json],
) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(bad("messages", "at least one message is required"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system.filter(|s| !s.is_null()) {
        out.push(message("system", parts(text_blocks(system, "system")?)));
    }
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages.{i}");
        let m = object(m, &path)?;
        only(m, &path, &["role", "content"])?;
        let content = m
            .get("content")
            .ok_or_else(|| bad(format!("{path}.content"), "Field required"))?;
        let content_path = format!("{path}.content");
        match m.get("role").and_then(Json::as_str) {
            Some("user") => user_turn(content, &content_path, &mut out)?,
            Some("assistant") => out.push(assistant_turn(content, &content_path)?),
            // A system turn in the conversation (Claude Code's mid-conversation instructions):
            // rendered where it stands, as the model's template renders system messages.
            Some("system") => out.push(message(
                "system",
                parts(text_blocks(content, &content_path)?),
            )),
            Some(role) => {
                return Err(bad(
                    format!("{path}.role"),
                    format!(
                        "unknown role `{role}`: roles are \"user\", \"assistant\" and \"system\""
                    ),
                ));
            }
            None => return Err(bad(format!("{path}.role"), "Field required")),
        }
    }
    if out.last().is_some_and(|m| m.role == "assistant") {
        // The chat template opens a new assistant turn after the last message; continuing a
        // given one (Anthropic's prefill) would need the template to leave it open.
        return Err(bad(
            format!("messages.{}", messages.len() - 1),
            "the last message must be the user's: continuing an assistant message (prefill) is not supported",
        ));
    }
    Ok(out)
}
