//! A streamed answer as Anthropic's stream events, written from the answer's pieces as the
//! dispatch events bring them: `message_start` (with the prompt's usage) and a `ping`, then for
//! each block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
//! `input_json_delta`) and `content_block_stop`, and at the end `message_delta` (stop reason,
//! usage) and `message_stop`. A failure becomes an `error` event.
//!
//! With stop sequences the last few bytes of text are held back until the next piece: when a
//! stop sequence ends the answer it is cut from the text (the pipeline keeps it there so that
//! the answer can name it), as Anthropic's text leaves it out.

use serde_json::{Value as Json, json};

use super::message::{error_body, matched_stop, stop_reason, tool_input, tool_use_block, usage};
use crate::api::chat_output::Piece;
use crate::api::openai::Usage;
use crate::error::ApiError;

/// One server-sent event: its `event:` name and its data.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: &'static str,
    pub data: Json,
}

impl Event {
    fn new(name: &'static str, data: Json) -> Self {
        Self { name, data }
    }

    /// The `error` event of a generation that failed mid-stream.
    pub fn error(err: &ApiError) -> Self {
        Self::new("error", error_body(&err.to_json(), None))
    }

    pub fn ping() -> Self {
        Self::new("ping", json!({"type": "ping"}))
    }

    /// The event as it goes on the wire.
    #[cfg(test)]
    pub fn to_sse(&self) -> String {
        format!("event: {}\ndata: {}\n\n", self.name, self.data)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
}

/// Turns one stream's answer into Anthropic events.
#[derive(Debug)]
pub struct EventWriter {
    stops: Vec<String>,
    /// Bytes of text held back: the longest stop sequence.
    hold: usize,
    held: String,
    started: bool,
    open: Option<Block>,
    /// The index of the next block (or of the open one).
    index: u32,
    /// The stop reason and sequence, once the choice finished.
    finish: Option<(&'static str, Option<String>)>,
    /// `thinking.display: "omitted"`: thinking blocks open and close, their text left out.
    omit_thinking: bool,
}

impl EventWriter {
    pub fn new(stops: Vec<String>) -> Self {
        let hold = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            hold,
            held: String::new(),
            started: false,
            open: None,
            index: 0,
            finish: None,
            omit_thinking: false,
        }
    }

    /// Thinking blocks without their text (`thinking.display: "omitted"`).
    pub fn omitting_thinking(mut self, omit: bool) -> Self {
        self.omit_thinking = omit;
        self
    }

    /// The message opens (once, with its first choice): `message_start`, with the prompt's
    /// usage, and a `ping`.
    pub fn start(&mut self, id: &str, model: &str, prompt: &Usage) -> Vec<Event> {
        if self.started {
            return Vec::new();
        }
        self.started = true;
        let mut message = json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": usage(prompt),
        });
        message["usage"]["output_tokens"] = json!(0);
        vec![
            Event::new(
                "message_start",
                json!({"type": "message_start", "message": message}),
            ),
            Event::ping(),
        ]
    }

    /// The events of one piece of the answer.
    pub fn piece(&mut self, piece: Piece) -> Vec<Event> {
        let mut out = Vec::new();
        match piece {
            Piece::Reasoning(thinking) if !thinking.is_empty() => {
                self.flush_text(false, &mut out);
                self.open(Block::Thinking, &mut out);
                if !self.omit_thinking {
                    out.push(self.delta(json!({"type": "thinking_delta", "thinking": thinking})));
                }
            }
            Piece::Content(text) if !text.is_empty() => self.text(&text, &mut out),
            Piece::ToolCall(call) => {
                self.flush_text(false, &mut out);
                self.close(&mut out);
                out.push(self.block_start(tool_use_block(&call, false)));
                let input = tool_input(&call.function.arguments).to_string();
                out.push(self.delta(json!({"type": "input_json_delta", "partial_json": input})));
                out.push(self.block_stop());
                self.index += 1;
            }
            Piece::Reasoning(_) | Piece::Content(_) => {}
        }
        out
    }

    /// The answer finished (`finish`: the chat finish reason): the held text comes out, less a
    /// stop sequence that ended it, and the open block closes.
    pub fn finish(&mut self, finish: &str) -> Vec<Event> {
        let mut out = Vec::new();
        let stopped_by = self.flush_text(finish == "stop", &mut out);
        self.close(&mut out);
        let reason = stop_reason(finish, stopped_by.as_deref());
        self.finish = Some((reason, stopped_by));
        out
    }

    /// The message ends: `message_delta` (stop reason and the request's usage), `message_stop`.
    pub fn end(&mut self, request: &Usage) -> Vec<Event> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (reason, sequence) = self.finish.take().unwrap_or(("end_turn", None));
        out.push(Event::new(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(request)}),
        ));
        out.push(Event::new("message_stop", json!({"type": "message_stop"})));
        out
    }

    fn text(&mut self, text: &str, out: &mut Vec<Event>) {
        self.held.push_str(text);
        if self.held.len() <= self.hold {
            return;
        }
        let mut cut = self.held.len() - self.hold;
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let ready: String = self.held.drain(..cut).collect();
        self.emit_text(ready, out);
    }

    /// Writes the held text; `stopped`: the answer ended on a stop, so a stop sequence at its
    /// end is cut off and returned.
    fn flush_text(&mut self, stopped: bool, out: &mut Vec<Event>) -> Option<String> {
        let mut rest = std::mem::take(&mut self.held);
        let matched = if stopped {
            matched_stop(&mut rest, &self.stops)
        } else {
            None
        };
        self.emit_text(rest, out);
        matched
    }

    fn emit_text(&mut self, text: String, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        self.open(Block::Text, out);
        out.push(self.delta(json!({"type": "text_delta", "text": text})));
    }

    fn open(&mut self, block: Block, out: &mut Vec<Event>) {
        if self.open == Some(block) {
            return;
        }
        self.close(out);
        let start = match block {
            Block::Text => json!({"type": "text", "text": ""}),
            Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
        };
        out.push(self.block_start(start));
        self.open = Some(block);
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        if self.open.take().is_some() {
            out.push(self.block_stop());
            self.index += 1;
        }
    }

    fn block_start(&self, block: Json) -> Event {
        Event::new(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        )
    }

    fn delta(&self, delta: Json) -> Event {
        Event::new(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        )
    }

    fn block_stop(&self) -> Event {
        Event::new(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.index}),
        )
    }
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
