//! Reading the body of a tool call in each format: (function name, arguments as JSON text).

use serde_json::{Map, Value as Json};

use super::ToolCallFormat;

type Calls = Vec<(String, String)>;

pub(super) fn parse(format: ToolCallFormat, body: &str, tools: &[Json]) -> Result<Calls, String> {
    match format {
        ToolCallFormat::Hermes => json_call(body.trim()).map(|call| vec![call]),
        ToolCallFormat::Llama3Json => json_calls(body),
        ToolCallFormat::Mistral => mistral(body),
        ToolCallFormat::DeepSeekV3 => deepseek(body),
        ToolCallFormat::Qwen3Coder => qwen3_coder(body, tools),
    }
}

/// `{"name": …, "arguments" | "parameters": {…} | "…"}`.
fn json_call(text: &str) -> Result<(String, String), String> {
    let value: Json = serde_json::from_str(text).map_err(|e| e.to_string())?;
    call_from(value)
}

fn call_from(value: Json) -> Result<(String, String), String> {
    let Json::Object(mut object) = value else {
        return Err("a tool call is not a JSON object".into());
    };
    let Some(Json::String(name)) = object.remove("name") else {
        return Err("a tool call has no name".into());
    };
    let arguments = object
        .remove("arguments")
        .or_else(|| object.remove("parameters"))
        .unwrap_or_else(|| Json::Object(Map::new()));
    Ok((name, arguments_text(arguments)?))
}

/// Arguments as JSON text: an object is written compactly; a string is taken as the JSON text
/// it should hold.
fn arguments_text(arguments: Json) -> Result<String, String> {
    match arguments {
        Json::Object(_) => Ok(arguments.to_string()),
        Json::String(text) => match serde_json::from_str::<Json>(&text) {
            Ok(Json::Object(_)) => Ok(text),
            _ => Err("tool call arguments are not a JSON object".into()),
        },
        _ => Err("tool call arguments are not a JSON object".into()),
    }
}

/// One or more JSON calls, separated by `;` or whitespace (Llama 3).
fn json_calls(body: &str) -> Result<Calls, String> {
    let mut calls = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Json>();
        let value = values
            .next()
            .ok_or("no JSON value")?
            .map_err(|e| e.to_string())?;
        calls.push(call_from(value)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    Ok(calls)
}

/// `[{"name": …, "arguments": {…}}, …]`, or `name[ARGS]{…}` (v11+, optionally
/// `name[CALL_ID]id[ARGS]{…}`), repeated after further `[TOOL_CALLS]` markers.
fn mistral(body: &str) -> Result<Calls, String> {
    let mut calls = Vec::new();
    for part in body.split("[TOOL_CALLS]") {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        if part.starts_with('[') {
            let list: Vec<Json> = serde_json::from_str(part).map_err(|e| e.to_string())?;
            for value in list {
                calls.push(call_from(value)?);
            }
            continue;
        }
        let (head, arguments) = part
            .split_once("[ARGS]")
            .ok_or("a Mistral tool call has no [ARGS]")?;
        let name = head.split("[CALL_ID]").next().unwrap_or(head).trim();
        if name.is_empty() {
            return Err("a Mistral tool call has no name".into());
        }
        let mut values = serde_json::Deserializer::from_str(arguments).into_iter::<Json>();
        let value = values
            .next()
            .ok_or("a Mistral tool call has no arguments")?
            .map_err(|e| e.to_string())?;
        if !arguments[values.byte_offset()..].trim().is_empty() {
            return Err("text after a Mistral tool call's arguments".into());
        }
        calls.push((name.to_owned(), arguments_text(value)?));
    }
    Ok(calls)
}

const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

/// V3: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{…}\n```<｜tool▁call▁end｜>`;
/// V3.1: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{…}<｜tool▁call▁end｜>`.
fn deepseek(body: &str) -> Result<Calls, String> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(begin) = rest.find(CALL_BEGIN) {
        if !rest[..begin].trim().is_empty() {
            return Err("text between DeepSeek tool calls".into());
        }
        let after = &rest[begin + CALL_BEGIN.len()..];
        let end = after
            .find(CALL_END)
            .ok_or("a DeepSeek tool call has no end")?;
        let (left, right) = after[..end]
            .split_once(SEP)
            .ok_or("a DeepSeek tool call has no separator")?;
        let (name, arguments) = match right.split_once("```json") {
            Some((name, fenced)) => {
                let json = fenced.trim_end().strip_suffix("```").unwrap_or(fenced);
                (name.trim(), json.trim())
            }
            None => (left.trim(), right.trim()),
        };
        if name.is_empty() {
            return Err("a DeepSeek tool call has no name".into());
        }
        let value: Json = serde_json::from_str(arguments).map_err(|e| e.to_string())?;
        calls.push((name.to_owned(), arguments_text(value)?));
        rest = &after[end + CALL_END.len()..];
    }
    if !rest.trim().is_empty() {
        return Err("text after DeepSeek tool calls".into());
    }
    Ok(calls)
}

/// `<function=name>` then `<parameter=p>value</parameter>`s then `</function>`; each value is
/// typed by the tool's schema (a string parameter stays text; others are read as JSON when
/// they parse).
fn qwen3_coder(body: &str, tools: &[Json]) -> Result<Calls, String> {
    let body = body.trim();
    let inner = body
        .strip_prefix("<function=")
        .ok_or("a Qwen3-Coder tool call has no <function=…>")?;
    let (name, rest) = inner
        .split_once('>')
        .ok_or("a Qwen3-Coder tool call's function tag is not closed")?;
    let name = name.trim();
    let rest = rest
        .trim_end()
        .strip_suffix("</function>")
        .ok_or("a Qwen3-Coder tool call has no </function>")?;
    let schema = parameter_types(tools, name);
    let mut arguments = Map::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let inner = rest
            .strip_prefix("<parameter=")
            .ok_or("text between Qwen3-Coder parameters")?;
        let (parameter, after) = inner
            .split_once('>')
            .ok_or("a Qwen3-Coder parameter tag is not closed")?;
        let (value, after) = after
            .split_once("</parameter>")
            .ok_or("a Qwen3-Coder parameter has no </parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let parameter = parameter.trim();
        let typed = match schema.get(parameter).map(String::as_str) {
            Some("string") | None => Json::String(value.to_owned()),
            Some(_) => serde_json::from_str(value).unwrap_or_else(|_| Json::String(value.into())),
        };
        arguments.insert(parameter.to_owned(), typed);
        rest = after.trim();
    }
    if name.is_empty() {
        return Err("a Qwen3-Coder tool call has no name".into());
    }
    Ok(vec![(name.to_owned(), Json::Object(arguments).to_string())])
}

/// The declared JSON type of each parameter of tool `name` (OpenAI tool definitions).
fn parameter_types(tools: &[Json], name: &str) -> std::collections::HashMap<String, String> {
    tools
        .iter()
        .filter_map(|tool| tool.get("function"))
        .find(|function| function.get("name").and_then(Json::as_str) == Some(name))
        .and_then(|function| function.pointer("/parameters/properties"))
        .and_then(Json::as_object)
        .map(|properties| {
            properties
                .iter()
                .filter_map(|(p, schema)| {
                    let kind = schema.get("type").and_then(Json::as_str)?;
                    Some((p.clone(), kind.to_owned()))
                })
                .collect()
        })
        .unwrap_or_default()
}
