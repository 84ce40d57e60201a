//! Reasoning between `<think>` and `</think>`, split from the answer.

use std::str::FromStr;

use super::OutputEvent;
use super::markers::safe_len;

const START: &str = "<think>";
const END: &str = "</think>";

/// How a model marks its reasoning. Names follow vLLM's `--reasoning-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Qwen3 and most `<think>` models: reasoning only when the output (or the prompt) opens a
    /// `<think>` block; without one, everything is content.
    Think,
    /// DeepSeek-R1: the output is reasoning until `</think>` even when no `<think>` opened it
    /// (its template opens the block in the prompt).
    DeepSeekR1,
}

impl ReasoningFormat {
    /// Every accepted name, for error messages and docs.
    pub const NAMES: &'static [&'static str] = &["qwen3", "think", "deepseek_r1"];
}

impl FromStr for ReasoningFormat {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "qwen3" | "think" => Ok(Self::Think),
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            other => Err(format!(
                "unknown reasoning parser {other:?} (known: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace (or part of `<think>`) seen: a `<think>` may still open the output.
    Start,
    Reasoning,
    /// Just after `</think>`: the newlines that separate it from the answer are dropped.
    AfterReasoning,
    Content,
}

#[derive(Debug)]
pub(crate) struct ReasoningSplitter {
    state: State,
    /// Where an output that does not open with `<think>` goes: reasoning when the prompt opened
    /// the block or the format assumes it, content otherwise.
    opened_by_prompt: bool,
    buf: String,
}

impl ReasoningSplitter {
    pub(crate) fn new(format: ReasoningFormat, starts_in_reasoning: bool) -> Self {
        Self {
            state: State::Start,
            opened_by_prompt: starts_in_reasoning || format == ReasoningFormat::DeepSeekR1,
            buf: String::new(),
        }
    }

    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        self.buf.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.buf.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(START) {
                        self.buf = rest.to_owned();
                        self.state = State::Reasoning;
                    } else if trimmed.is_empty() || START.starts_with(trimmed) {
                        return;
                    } else if self.opened_by_prompt {
                        self.state = State::Reasoning;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.buf.find(END) {
                        let reasoning: String = self.buf.drain(..at).collect();
                        self.buf.drain(..END.len());
                        out.push(OutputEvent::Reasoning(reasoning));
                        self.state = State::AfterReasoning;
                    } else {
                        let safe = safe_len(&self.buf, &[END]);
                        out.push(OutputEvent::Reasoning(self.buf.drain(..safe).collect()));
                        return;
                    }
                }
                State::AfterReasoning => {
                    let start = self.buf.len() - self.buf.trim_start_matches('\n').len();
                    self.buf.drain(..start);
                    if self.buf.is_empty() {
                        return;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    out.push(OutputEvent::Content(std::mem::take(&mut self.buf)));
                    return;
                }
            }
        }
    }

    pub(crate) fn finish(&mut self, out: &mut Vec<OutputEvent>) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            // An unclosed block (cut off by max_tokens) is reasoning all the same.
            State::Reasoning => out.push(OutputEvent::Reasoning(rest)),
            State::Start if self.opened_by_prompt => out.push(OutputEvent::Reasoning(rest)),
            State::Start | State::AfterReasoning | State::Content => {
                out.push(OutputEvent::Content(rest))
            }
        }
    }
}
