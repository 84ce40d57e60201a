//! What a model's generated text means: plain content, reasoning, and tool calls.
//!
//! Chat models write their reasoning between markers (`<think>…</think>`) and their tool calls
//! in a format of their own (Hermes/Qwen `<tool_call>` JSON, Llama 3 bare JSON, Mistral
//! `[TOOL_CALLS]`, DeepSeek's `<｜tool▁calls▁begin｜>`, Qwen3-Coder's `<function=…>` XML). An
//! [`OutputParser`] takes the detokenized text as it streams and splits it into
//! [`OutputEvent`]s, holding back only what could still be the start of a marker, so the
//! streamed events concatenate to exactly what parsing the whole text at once gives.
//!
//! - [`reasoning`]: the reasoning splitter ([`ReasoningFormat`]).
//! - [`tools`]: the tool-call formats ([`ToolCallFormat`]).
//! - `markers`: the hold-back rule shared by both.
//!
//! A tool call that does not parse (invalid JSON, cut off by `max_tokens`) is not lost: its raw
//! text comes back as content, as vLLM does, and [`OutputParser::malformed_tool_calls`] counts it.

mod markers;
pub mod reasoning;
pub mod tools;

use serde_json::Value as Json;

pub use reasoning::ReasoningFormat;
pub use tools::ToolCallFormat;

/// One piece of a model's output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// Text for the answer's `content`.
    Content(String),
    /// Text for the answer's `reasoning_content`.
    Reasoning(String),
    /// A complete tool call (streamed whole, once its end is seen).
    ToolCall(ToolCall),
}

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Position among this output's tool calls (OpenAI's `tool_calls[].index`).
    pub index: usize,
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// Splits generated text into content, reasoning and tool calls as it streams.
#[derive(Debug)]
pub struct OutputParser {
    reasoning: Option<reasoning::ReasoningSplitter>,
    tools: Option<tools::ToolCallParser>,
}

impl OutputParser {
    /// A parser for one output. `starts_in_reasoning`: the prompt already opened the reasoning
    /// block (templates that end the generation prompt with `<think>`), so the output starts
    /// inside it. `tools` are the request's tool definitions (OpenAI shape), which some formats
    /// read to type the arguments.
    pub fn new(
        reasoning: Option<ReasoningFormat>,
        starts_in_reasoning: bool,
        tools: Option<(ToolCallFormat, &[Json])>,
    ) -> Self {
        Self {
            reasoning: reasoning.map(|f| reasoning::ReasoningSplitter::new(f, starts_in_reasoning)),
            tools: tools.map(|(format, defs)| tools::ToolCallParser::new(format, defs)),
        }
    }

    /// Whether this parser changes anything (without formats, all text is content).
    pub fn is_passthrough(&self) -> bool {
        self.reasoning.is_none() && self.tools.is_none()
    }

    /// Takes the next piece of text; returns what can be said about it now.
    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        match &mut self.reasoning {
            Some(splitter) => {
                let mut parts = Vec::new();
                splitter.push(text, &mut parts);
                self.route(parts, &mut out);
            }
            None => self.content(text, &mut out),
        }
        merge(out)
    }

    /// The output ended: returns everything still held back.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if let Some(splitter) = &mut self.reasoning {
            let mut parts = Vec::new();
            splitter.finish(&mut parts);
            self.route(parts, &mut out);
        }
        if let Some(tools) = &mut self.tools {
            tools.finish(&mut out);
        }
        merge(out)
    }

    /// Tool calls whose text did not parse and went back into the content.
    pub fn malformed_tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, |t| t.malformed())
    }

    /// Tool calls made so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, |t| t.calls())
    }

    fn route(&mut self, parts: Vec<OutputEvent>, out: &mut Vec<OutputEvent>) {
        for part in parts {
            match part {
                OutputEvent::Content(text) => self.content(&text, out),
                other => out.push(other),
            }
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        match &mut self.tools {
            Some(tools) => tools.push(text, out),
            None if text.is_empty() => {}
            None => out.push(OutputEvent::Content(text.to_owned())),
        }
    }
}

/// Joins neighbouring pieces of the same kind and drops empty ones.
fn merge(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
    let mut merged: Vec<OutputEvent> = Vec::with_capacity(events.len());
    for event in events {
        match (merged.last_mut(), event) {
            (_, OutputEvent::Content(t) | OutputEvent::Reasoning(t)) if t.is_empty() => {}
            (Some(OutputEvent::Content(a)), OutputEvent::Content(b))
            | (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(&b),
            (_, event) => merged.push(event),
        }
    }
    merged
}

#[cfg(test)]
mod tests;
