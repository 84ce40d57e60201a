//! A Responses request's input items (and the previous response's) as chat messages:
//! messages, function calls joined to the assistant turn before them, function outputs as tool
//! messages, reasoning (read back from its text, or from this deployment's seal) joined to the
//! assistant turn after it. Faults name the item (`input[2].role`).

use serde_json::{Map, Value as Json, json};

use super::store::Sealer;
use crate::api::http::fields::FieldNotes;
use crate::error::ApiError;

/// Roles an input message may have.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

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
pub(super) fn input_messages(
    items: Vec<Json>,
    previous: usize,
    sealer: &Sealer,
    notes: &mut FieldNotes,
) -> Result<Vec<Json>, ApiError> {
    let mut turns = Turns::default();
    for (i, item) in items.into_iter().enumerate() {
        // The previous response's items come first; a fault in them names that field.
        let place = match i.checked_sub(previous) {
            Some(j) => format!("input[{j}]"),
            None => format!("previous_response_id.items[{i}]"),
        };
        let at = |key: &str| format!("{place}.{key}");
        let Json::Object(item) = item else {
            return Err(ApiError::bad_param(
                place.clone(),
                "an input item is an object",
            ));
        };
        match item_kind(&item, &at, notes)? {
            "message" => turns.message(&item, &at, notes)?,
            "function_call" => turns.function_call(&item, &at)?,
            "function_call_output" => {
                let call_id = string_of(&item, "call_id", &at("call_id"))?;
                let output = content_text(item.get("output"), &at("output"), notes)?;
                turns
                    .messages
                    .push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            _ => {
                let text = reasoning_of(&item, &at, sealer, notes)?;
                turns.reasoning.get_or_insert_default().push_str(&text);
            }
        }
    }
    Ok(turns.finish())
}

/// An input item's type, checked: one the gateway reads, its keys noted when unknown.
fn item_kind<'a>(
    item: &'a Map<String, Json>,
    at: &dyn Fn(&str) -> String,
    notes: &mut FieldNotes,
) -> Result<&'a str, ApiError> {
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
    for key in item.keys().filter(|k| !allowed.contains(&k.as_str())) {
        notes.unknown(format!("input[].{key}"));
    }
    Ok(kind)
}

/// The chat messages so far, and reasoning waiting for the assistant turn it belongs to.
#[derive(Default)]
struct Turns {
    messages: Vec<Json>,
    reasoning: Option<String>,
}

impl Turns {
    /// A message item; an assistant's takes the reasoning before it.
    fn message(
        &mut self,
        item: &Map<String, Json>,
        at: &dyn Fn(&str) -> String,
        notes: &mut FieldNotes,
    ) -> Result<(), ApiError> {
        let role = string_of(item, "role", &at("role"))?;
        if !ROLES.contains(&role) {
            return Err(ApiError::bad_param(
                at("role"),
                format!("unknown role {role:?} (user, assistant, system or developer)"),
            ));
        }
        let content = content_text(item.get("content"), &at("content"), notes)?;
        // Chat templates know `system`; `developer` is its newer name.
        let role = if role == "developer" { "system" } else { role };
        let mut message = json!({"role": role, "content": content});
        if role == "assistant"
            && let Some(text) = self.reasoning.take()
        {
            message["reasoning_content"] = json!(text);
        }
        self.messages.push(message);
        Ok(())
    }

    /// A function call: it joins the assistant turn before it, unless reasoning came between.
    fn function_call(
        &mut self,
        item: &Map<String, Json>,
        at: &dyn Fn(&str) -> String,
    ) -> Result<(), ApiError> {
        let call = json!({
            "id": string_of(item, "call_id", &at("call_id"))?,
            "type": "function",
            "function": {
                "name": string_of(item, "name", &at("name"))?,
                "arguments": string_of(item, "arguments", &at("arguments"))?,
            },
        });
        let joins = self
            .messages
            .last()
            .is_some_and(|m| m["role"] == "assistant" && self.reasoning.is_none());
        if !joins {
            let mut turn = json!({"role": "assistant", "content": null, "tool_calls": []});
            if let Some(text) = self.reasoning.take() {
                turn["reasoning_content"] = json!(text);
            }
            self.messages.push(turn);
        }
        if let Some(last) = self.messages.last_mut() {
            match last.get_mut("tool_calls").and_then(Json::as_array_mut) {
                Some(calls) => calls.push(call),
                None => last["tool_calls"] = json!([call]),
            }
        }
        Ok(())
    }

    /// The messages, with reasoning that no assistant turn followed as one of its own.
    fn finish(mut self) -> Vec<Json> {
        if let Some(text) = self.reasoning {
            self.messages
                .push(json!({"role": "assistant", "content": "", "reasoning_content": text}));
        }
        self.messages
    }
}

/// A reasoning item's text: its summary or content, else its sealed text when this deployment
/// sealed it.
fn reasoning_of(
    item: &Map<String, Json>,
    at: &dyn Fn(&str) -> String,
    sealer: &Sealer,
    notes: &mut FieldNotes,
) -> Result<String, ApiError> {
    let mut text = reasoning_text(item.get("content"), &at("content"))?;
    match item.get("encrypted_content") {
        None | Some(Json::Null) => {}
        // Sealed by this deployment: its text, when the item carries no other.
        Some(Json::String(sealed)) => match sealer.open(sealed) {
            Some(opened) if text.is_empty() => text = opened,
            Some(_) => {}
            // Sealed elsewhere (another deployment, OpenAI, a key since changed): the turn's
            // reasoning is left out, as most templates leave out past reasoning anyway, and the
            // request says so in its decisions.
            None => notes.advisory("input[].encrypted_content:unreadable"),
        },
        Some(_) => {
            return Err(ApiError::bad_param(
                at("encrypted_content"),
                "`encrypted_content` is a string",
            ));
        }
    }
    Ok(text)
}

fn string_of<'a>(item: &'a Map<String, Json>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| ApiError::bad_param(at, format!("`{key}` is required and is a string")))
}

/// A message's or a function output's text: a string, or text parts (`input_text`,
/// `output_text`) joined.
fn content_text(
    content: Option<&Json>,
    at: &str,
    notes: &mut FieldNotes,
) -> Result<String, ApiError> {
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
        for key in fields.keys().filter(|k| !allowed.contains(&k.as_str())) {
            notes.unknown(format!("content[].{key}"));
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
