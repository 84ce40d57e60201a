//! What a chat answer is made of besides text: the model's reasoning (`reasoning_content`) and
//! its tool calls (`tool_calls`), parsed from the generated text in the model family's format.
//!
//! [`OutputConfig`] names each model's parsers (vLLM's `--tool-call-parser` and
//! `--reasoning-parser` names); a model without an entry uses what its chat template implies
//! (`switchyard_tokenize::OutputFormats`). [`ChatOutput::resolve`] settles one request's
//! `tools`, `tool_choice` and `parallel_tool_calls` against them, refusing by name what cannot
//! be honoured, and [`Shaper`] turns the streamed text of one choice into the pieces of the
//! answer.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value as Json;
use switchyard_core::{Guided, TokenId};
use switchyard_tokenize::{
    ModelDir, OutputEvent, OutputFormats, OutputParser, ReasoningFormat, ToolCallFormat,
};

use crate::error::ApiError;

/// `[output]`: per-model output parsers.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// Model → tool-call parser (`hermes`, `llama3_json`, `mistral`, `deepseek_v3`,
    /// `qwen3_coder`, …) or `none`.
    pub tool_call_parsers: BTreeMap<String, String>,
    /// Model → reasoning parser (`qwen3`, `deepseek_r1`) or `none`.
    pub reasoning_parsers: BTreeMap<String, String>,
}

impl OutputConfig {
    /// Every name must be a known parser or `none`.
    pub fn validate(&self) -> Result<(), String> {
        for (model, name) in &self.tool_call_parsers {
            if name != "none" {
                name.parse::<ToolCallFormat>()
                    .map_err(|e| format!("output.tool_call_parsers.{model}: {e}"))?;
            }
        }
        for (model, name) in &self.reasoning_parsers {
            if name != "none" {
                name.parse::<ReasoningFormat>()
                    .map_err(|e| format!("output.reasoning_parsers.{model}: {e}"))?;
            }
        }
        Ok(())
    }

    /// The formats of `model`: the configured ones, else what its chat template implies.
    pub fn formats(&self, model: &str, dir: &ModelDir) -> OutputFormats {
        let implied = dir
            .chat_template()
            .map(|t| t.output_formats())
            .unwrap_or_default();
        OutputFormats {
            tool_call: match self.tool_call_parsers.get(model) {
                Some(name) => name.parse().ok(),
                None => implied.tool_call,
            },
            reasoning: match self.reasoning_parsers.get(model) {
                Some(name) => name.parse().ok(),
                None => implied.reasoning,
            },
        }
    }
}

/// How one chat request's output is read.
#[derive(Debug, Clone, Default)]
pub struct ChatOutput {
    reasoning: Option<ReasoningFormat>,
    tools: Option<(ToolCallFormat, Vec<Json>)>,
    /// `parallel_tool_calls: false`: only the first call is kept.
    single_call: bool,
    /// `tool_choice` required or named: the engine is constrained to write the call(s) as
    /// JSON, and the whole answer is read as them.
    forced: Option<Forced>,
}

/// A tool call the request made compulsory.
#[derive(Debug, Clone, PartialEq)]
enum Forced {
    /// `tool_choice: {"type": "function", "function": {"name"}}`: the answer is that
    /// function's arguments.
    Named { name: String, parameters: Json },
    /// `tool_choice: "required"`: the answer is a list of `{"name", "parameters"}`.
    Required { tools: Vec<Json> },
}

impl ChatOutput {
    /// Settles `tools`, `tool_choice` and `parallel_tool_calls`; returns the output spec and
    /// the tools the chat template should render (none with `tool_choice: "none"`).
    pub fn resolve(
        formats: OutputFormats,
        model: &str,
        tools: Option<Vec<Json>>,
        tool_choice: Option<Json>,
        parallel_tool_calls: Option<bool>,
    ) -> Result<(Self, Option<Vec<Json>>), ApiError> {
        let tools = tools.filter(|t| !t.is_empty());
        if let Some(tools) = &tools {
            check_tools(tools)?;
        }
        let choice = match &tool_choice {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.as_str()),
            Some(Json::Object(o)) if o.get("type").and_then(Json::as_str) == Some("function") => {
                Some("named")
            }
            Some(_) => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}",
                ));
            }
        };
        let output = |tools| Self {
            reasoning: formats.reasoning,
            tools,
            single_call: parallel_tool_calls == Some(false),
            forced: None,
        };
        let forced = |forced| Self {
            forced: Some(forced),
            ..output(None)
        };
        match (choice, tools) {
            (Some("none"), _) | (None | Some("auto"), None) => Ok((output(None), None)),
            (Some("auto") | None, Some(tools)) => match formats.tool_call {
                Some(format) => Ok((output(Some((format, tools.clone()))), Some(tools))),
                None => Err(ApiError::bad_param(
                    "tools",
                    format!(
                        "model `{model}` has no tool call parser: set output.tool_call_parsers (--tool-call-parser {model}=NAME; known: {})",
                        ToolCallFormat::NAMES.join(", ")
                    ),
                )),
            },
            (Some("required" | "named"), None) => Err(ApiError::bad_param(
                "tool_choice",
                "tool_choice names a tool but the request offers no `tools`",
            )),
            (Some("required"), Some(tools)) => {
                let required = Forced::Required {
                    tools: tools.clone(),
                };
                Ok((forced(required), Some(tools)))
            }
            (Some("named"), Some(tools)) => {
                let name = tool_choice
                    .as_ref()
                    .and_then(|c| c.pointer("/function/name"))
                    .and_then(Json::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let Some(tool) = tools
                    .iter()
                    .find(|t| t.pointer("/function/name").and_then(Json::as_str) == Some(&name))
                else {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        format!("tool_choice names function `{name}`, which is not in `tools`"),
                    ));
                };
                let parameters = tool
                    .pointer("/function/parameters")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({"type": "object"}));
                Ok((forced(Forced::Named { name, parameters }), Some(tools)))
            }
            (Some(other), _) => Err(ApiError::bad_param(
                "tool_choice",
                format!("unknown tool_choice {other:?}"),
            )),
        }
    }
}

impl ChatOutput {
    /// The constraint a compulsory tool call puts on the engine's output: the named
    /// function's parameters, or a non-empty list of calls to the offered functions (the
    /// schema vLLM uses for `required`).
    pub fn guided(&self) -> Option<Guided> {
        let schema = match self.forced.as_ref()? {
            Forced::Named { parameters, .. } => parameters.clone(),
            Forced::Required { tools } => {
                let calls: Vec<Json> = tools
                    .iter()
                    .filter_map(|t| t.get("function"))
                    .map(|f| {
                        serde_json::json!({
                            "properties": {
                                "name": {"type": "string", "enum": [f.get("name").cloned().unwrap_or_default()]},
                                "parameters": f.get("parameters").cloned().unwrap_or_else(|| serde_json::json!({"type": "object"})),
                            },
                            "required": ["name", "parameters"],
                        })
                    })
                    .collect();
                serde_json::json!({
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "object", "anyOf": calls},
                })
            }
        };
        Some(Guided::JsonSchema(schema.to_string()))
    }
}

/// Tools must be OpenAI function tools with a name.
fn check_tools(tools: &[Json]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let kind = tool.get("type").and_then(Json::as_str);
        let name = tool.pointer("/function/name").and_then(Json::as_str);
        if kind != Some("function") || name.is_none_or(str::is_empty) {
            return Err(ApiError::bad_param(
                "tools",
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                ),
            ));
        }
    }
    Ok(())
}

/// One piece of a chat answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCallOut),
}

/// A tool call as the answer carries it (`tool_calls[]`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ToolCallOut {
    /// Position in `tool_calls` (streamed deltas carry it).
    pub index: u32,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// Turns one choice's streamed text into answer pieces.
#[derive(Debug)]
pub struct Shaper {
    parser: OutputParser,
    single_call: bool,
    call_id_prefix: String,
    calls: u32,
    /// A compulsory call: the answer text, read as the call(s) at the end.
    forced: Option<(Forced, String)>,
    malformed_forced: usize,
}

impl Shaper {
    /// `prompt_tail`: the prompt's last tokens as text, to see whether the template opened the
    /// reasoning block itself (it ends with `<think>`).
    pub fn new(output: &ChatOutput, request_id: &str, prompt_tail: &str) -> Self {
        let opened = prompt_tail.trim_end().ends_with("<think>");
        let tools = output
            .tools
            .as_ref()
            .map(|(format, defs)| (*format, defs.as_slice()));
        let alnum: Vec<char> = request_id
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        let id: String = alnum[alnum.len().saturating_sub(20)..].iter().collect();
        Self {
            parser: OutputParser::new(output.reasoning, opened, tools),
            single_call: output.single_call,
            call_id_prefix: format!("call_{id}"),
            calls: 0,
            forced: output.forced.clone().map(|f| (f, String::new())),
            malformed_forced: 0,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let events = self.parser.push(text);
        self.pieces(events)
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let events = self.parser.finish();
        let mut pieces = self.pieces(events);
        if let Some((forced, text)) = self.forced.take() {
            match forced_calls(&forced, &text) {
                Some(calls) => {
                    let events = calls
                        .into_iter()
                        .enumerate()
                        .map(|(index, (name, arguments))| {
                            OutputEvent::ToolCall(switchyard_tokenize::ToolCall {
                                index,
                                name,
                                arguments,
                            })
                        })
                        .collect();
                    pieces.extend(self.pieces(events));
                }
                None => {
                    // Not what the constraint asked for (an engine that ignored it, or cut
                    // off by max_tokens): the text is the answer.
                    self.malformed_forced += 1;
                    pieces.push(Piece::Content(text));
                }
            }
        }
        pieces
    }

    /// Tool calls in the answer.
    pub fn tool_calls(&self) -> u32 {
        self.calls
    }

    /// Tool calls whose text did not parse and went to the content.
    pub fn malformed_tool_calls(&self) -> usize {
        self.parser.malformed_tool_calls() + self.malformed_forced
    }

    /// The finish reason the client sees: `tool_calls` when the model called a tool.
    pub fn finish_reason(&self, finish: &'static str) -> &'static str {
        if self.calls > 0 { "tool_calls" } else { finish }
    }

    fn pieces(&mut self, events: Vec<OutputEvent>) -> Vec<Piece> {
        let mut pieces = Vec::with_capacity(events.len());
        for event in events {
            match event {
                OutputEvent::Content(text) => match self.forced.as_mut() {
                    Some((_, held)) => held.push_str(&text),
                    None => pieces.push(Piece::Content(text)),
                },
                OutputEvent::Reasoning(text) => pieces.push(Piece::Reasoning(text)),
                OutputEvent::ToolCall(call) => {
                    if self.single_call && self.calls > 0 {
                        tracing::debug!(name = %call.name, "parallel_tool_calls is false; later call left out");
                        continue;
                    }
                    pieces.push(Piece::ToolCall(ToolCallOut {
                        index: self.calls,
                        id: format!("{}{}", self.call_id_prefix, call.index),
                        kind: "function",
                        function: FunctionCall {
                            name: call.name,
                            arguments: call.arguments,
                        },
                    }));
                    self.calls += 1;
                }
            }
        }
        pieces
    }
}

/// The calls a compulsory-call answer holds: (name, arguments as JSON text).
fn forced_calls(forced: &Forced, text: &str) -> Option<Vec<(String, String)>> {
    let value: Json = serde_json::from_str(text.trim()).ok()?;
    match forced {
        Forced::Named { name, .. } => value
            .is_object()
            .then(|| vec![(name.clone(), value.to_string())]),
        Forced::Required { .. } => {
            let calls = value.as_array()?;
            if calls.is_empty() {
                return None;
            }
            calls
                .iter()
                .map(|call| {
                    let name = call.get("name")?.as_str()?.to_owned();
                    let arguments = call.get("parameters").or_else(|| call.get("arguments"))?;
                    arguments.is_object().then(|| (name, arguments.to_string()))
                })
                .collect()
        }
    }
}

/// The prompt's last few tokens as text (enough to hold `<think>\n`).
pub fn prompt_tail(dir: &ModelDir, prompt: &[TokenId]) -> String {
    let tail = &prompt[prompt.len().saturating_sub(8)..];
    dir.tokenizer().decode(tail, false).unwrap_or_default()
}

#[cfg(test)]
mod tests;
