//! Tool calls in a model's output, in each model family's own format.
//!
//! Every format but Llama 3's marks a call with a start marker; the text between markers passes
//! through as content, and a call is emitted once its body is complete (its end marker, or the
//! end of the output for formats without one). Llama 3 writes a call as the whole output, a bare
//! JSON object, so its output is held when it starts like one and judged at the end.
//! The bodies are read by `bodies`.

mod bodies;

use std::str::FromStr;

use serde_json::Value as Json;

use super::markers::{find_first, safe_len};
use super::{OutputEvent, ToolCall};

/// A model family's tool-call format. Names follow vLLM's `--tool-call-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// Hermes, Qwen2.5, Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
    /// Llama 3.1+: the output is `{"name": …, "parameters": {…}}` (optionally after
    /// `<|python_tag|>`, several separated by `;`).
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}]`, or from v11 tokenizers
    /// `[TOOL_CALLS]name[ARGS]{…}` per call.
    Mistral,
    /// DeepSeek V3 and V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>…<｜tool▁calls▁end｜>`.
    DeepSeekV3,
    /// Qwen3-Coder: `<tool_call><function=name><parameter=p>value</parameter></function></tool_call>`,
    /// values typed by the tool's JSON schema.
    Qwen3Coder,
}

impl ToolCallFormat {
    /// Every accepted name, for error messages and docs.
    pub const NAMES: &'static [&'static str] = &[
        "hermes",
        "qwen",
        "llama3_json",
        "mistral",
        "deepseek_v3",
        "deepseek_v31",
        "qwen3_coder",
    ];

    /// (start marker, end marker); `None` as end: the call runs to the end of the output.
    fn markers(self) -> (&'static str, Option<&'static str>) {
        match self {
            Self::Hermes | Self::Qwen3Coder => ("<tool_call>", Some("</tool_call>")),
            Self::Mistral => ("[TOOL_CALLS]", None),
            Self::DeepSeekV3 => ("<｜tool▁calls▁begin｜>", Some("<｜tool▁calls▁end｜>")),
            // Judged on the whole output instead.
            Self::Llama3Json => ("", None),
        }
    }
}

impl FromStr for ToolCallFormat {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "hermes" | "qwen" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            "mistral" => Ok(Self::Mistral),
            "deepseek_v3" | "deepseek_v31" => Ok(Self::DeepSeekV3),
            "qwen3_coder" => Ok(Self::Qwen3Coder),
            other => Err(format!(
                "unknown tool call parser {other:?} (known: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Llama 3 only: nothing but whitespace seen yet.
    Start,
    /// Passing content through, watching for a start marker.
    Content,
    /// Inside a call: collecting its body.
    Call,
    /// Llama 3 only: the output looked like a call; held to the end.
    Held,
}

#[derive(Debug)]
pub(crate) struct ToolCallParser {
    format: ToolCallFormat,
    tools: Vec<Json>,
    state: State,
    buf: String,
    calls: usize,
    malformed: usize,
}

impl ToolCallParser {
    pub(crate) fn new(format: ToolCallFormat, tools: &[Json]) -> Self {
        Self {
            format,
            tools: tools.to_vec(),
            state: if format == ToolCallFormat::Llama3Json {
                State::Start
            } else {
                State::Content
            },
            buf: String::new(),
            calls: 0,
            malformed: 0,
        }
    }

    pub(crate) fn calls(&self) -> usize {
        self.calls
    }

    pub(crate) fn malformed(&self) -> usize {
        self.malformed
    }

    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        self.buf.push_str(text);
        let (start, end) = self.format.markers();
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.buf.trim_start();
                    if trimmed.is_empty() || "<|python_tag|>".starts_with(trimmed) {
                        return;
                    }
                    self.state =
                        if trimmed.starts_with('{') || trimmed.starts_with("<|python_tag|>") {
                            State::Held
                        } else {
                            State::Content
                        };
                }
                State::Held => return,
                State::Content if self.format == ToolCallFormat::Llama3Json => {
                    out.push(OutputEvent::Content(std::mem::take(&mut self.buf)));
                    return;
                }
                State::Content => match find_first(&self.buf, &[start]) {
                    Some((at, _)) => {
                        out.push(OutputEvent::Content(self.buf.drain(..at).collect()));
                        self.state = State::Call;
                    }
                    None => {
                        let safe = safe_len(&self.buf, &[start]);
                        out.push(OutputEvent::Content(self.buf.drain(..safe).collect()));
                        return;
                    }
                },
                State::Call => {
                    // The buffer starts with the start marker.
                    let Some(end) = end else { return };
                    let Some(at) = self.buf[start.len()..].find(end) else {
                        return;
                    };
                    let whole: String = self.buf.drain(..start.len() + at + end.len()).collect();
                    let body = &whole[start.len()..start.len() + at];
                    self.emit(body, &whole, out);
                    self.state = State::Content;
                }
            }
        }
    }

    pub(crate) fn finish(&mut self, out: &mut Vec<OutputEvent>) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Start | State::Content => out.push(OutputEvent::Content(rest)),
            State::Held => {
                let body = rest.trim_start();
                let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
                self.emit(body, &rest, out);
            }
            State::Call => {
                let (start, end) = self.format.markers();
                match end {
                    // Runs to the end of the output: complete now.
                    None => self.emit(&rest[start.len()..], &rest, out),
                    // Cut off before its end marker.
                    Some(_) => {
                        self.malformed += 1;
                        tracing::debug!(format = ?self.format, "tool call cut off; kept as content");
                        out.push(OutputEvent::Content(rest));
                    }
                }
            }
        }
        self.state = State::Content;
    }

    /// Emits the calls in `body`, or `whole` as content when it does not parse.
    fn emit(&mut self, body: &str, whole: &str, out: &mut Vec<OutputEvent>) {
        match bodies::parse(self.format, body, &self.tools) {
            Ok(calls) if !calls.is_empty() => {
                for (name, arguments) in calls {
                    out.push(OutputEvent::ToolCall(ToolCall {
                        index: self.calls,
                        name,
                        arguments,
                    }));
                    self.calls += 1;
                }
            }
            Ok(_) | Err(_) => {
                // Llama 3 output that merely looks like JSON is content, not a malformed call.
                if self.format != ToolCallFormat::Llama3Json {
                    self.malformed += 1;
                    tracing::debug!(format = ?self.format, "tool call does not parse; kept as content");
                }
                out.push(OutputEvent::Content(whole.to_owned()));
            }
        }
    }
}
