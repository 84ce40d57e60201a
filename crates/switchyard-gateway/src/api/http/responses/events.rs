//! The streamed form of a response: the chat pipeline's answer pieces become the Responses
//! events, in the order the API gives them. Each item opens (`response.output_item.added`),
//! streams (text, reasoning or arguments deltas) and closes (`….done`, then
//! `response.output_item.done`) before the next one opens; every event carries the next
//! `sequence_number`.

use std::sync::Arc;

use super::store::Sealer;
use serde_json::{Value as Json, json};

use super::output::{Item, item_id, message_shown, text_part};
use crate::api::chat_output::Piece;

/// One server-sent event: its `event:` name and its data (which repeats the name as `type`).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: &'static str,
    pub data: Json,
}

/// Turns a stream of answer pieces into events, and keeps the items for the final response.
#[derive(Debug)]
pub struct Writer {
    response_id: String,
    sequence: u64,
    /// Closed items, in output order.
    items: Vec<Item>,
    /// The reasoning or message item being streamed.
    open: Option<Item>,
    /// Whitespace not yet shown: it opens a message only with text after it, or when the answer
    /// has nothing else (as [`super::output::items`] decides for a whole answer).
    held: String,
    messages: u32,
    reasonings: u32,
    /// Seals finished reasoning items (`include: ["reasoning.encrypted_content"]`).
    sealer: Option<Arc<Sealer>>,
}

impl Writer {
    pub fn new(response_id: &str) -> Self {
        Self {
            response_id: response_id.to_owned(),
            sequence: 0,
            items: Vec::new(),
            open: None,
            held: String::new(),
            messages: 0,
            reasonings: 0,
            sealer: None,
        }
    }

    /// Finished reasoning items carry their text sealed by `sealer`.
    pub fn sealing(mut self, sealer: Option<Arc<Sealer>>) -> Self {
        self.sealer = sealer;
        self
    }

    /// The items so far (the open one included, as it stands).
    pub fn items(&self) -> Vec<Item> {
        self.items
            .iter()
            .chain(self.open.as_ref())
            .cloned()
            .collect()
    }

    fn event(&mut self, name: &'static str, mut data: Json) -> Event {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        Event { name, data }
    }

    /// Index of the open item (or of the next one).
    fn output_index(&self) -> usize {
        self.items.len()
    }

    /// `response.created` and `response.in_progress`, with the response as it starts.
    pub fn started(&mut self, response: &Json) -> Vec<Event> {
        vec![
            self.event("response.created", json!({ "response": response })),
            self.event("response.in_progress", json!({ "response": response })),
        ]
    }

    /// The closing event (`response.completed`, `response.incomplete` or `response.failed`)
    /// with the whole response.
    pub fn ended(&mut self, name: &'static str, response: &Json) -> Event {
        self.event(name, json!({ "response": response }))
    }

    /// The events of one answer piece.
    pub fn push(&mut self, piece: Piece) -> Vec<Event> {
        let mut out = Vec::new();
        match piece {
            Piece::Reasoning(text) => {
                if !matches!(self.open, Some(Item::Reasoning { .. })) {
                    out.extend(self.close_open("completed"));
                    let id = item_id("rs", &self.response_id, self.reasonings);
                    self.reasonings += 1;
                    out.extend(self.open_item(Item::Reasoning {
                        id,
                        text: String::new(),
                    }));
                }
                out.extend(self.delta(text));
            }
            Piece::Content(text) => {
                if !matches!(self.open, Some(Item::Message { .. })) {
                    self.held.push_str(&text);
                    if self.held.trim().is_empty() {
                        return out;
                    }
                    out.extend(self.close_open("completed"));
                    out.extend(self.open_message());
                    let text = std::mem::take(&mut self.held);
                    out.extend(self.delta(text));
                } else {
                    out.extend(self.delta(text));
                }
            }
            Piece::ToolCall(call) => {
                out.extend(self.close_open("completed"));
                let item = Item::call(&self.response_id, call);
                let arguments = match &item {
                    Item::FunctionCall { arguments, .. } => arguments.clone(),
                    _ => String::new(),
                };
                let (index, id) = (self.output_index(), item.id().to_owned());
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item.to_json("in_progress", self.sealer.as_deref())}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"output_index": index, "item_id": id, "delta": arguments}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"output_index": index, "item_id": id, "arguments": arguments}),
                ));
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item.to_json("completed", self.sealer.as_deref())}),
                ));
                self.items.push(item);
            }
        }
        out
    }

    /// The answer has ended (`incomplete`: at the token limit): close the open item (and show
    /// held whitespace when it is the whole answer).
    pub fn finish(&mut self, incomplete: bool) -> Vec<Event> {
        let mut out = Vec::new();
        let others = !self.items.is_empty() || self.open.is_some();
        if self.open.is_none() && message_shown(&self.held, others) {
            out.extend(self.open_message());
            let text = std::mem::take(&mut self.held);
            if !text.is_empty() {
                out.extend(self.delta(text));
            }
        }
        out.extend(self.close_open(if incomplete {
            "incomplete"
        } else {
            "completed"
        }));
        out
    }

    fn open_message(&mut self) -> Vec<Event> {
        let id = item_id("msg", &self.response_id, self.messages);
        self.messages += 1;
        self.open_item(Item::Message {
            id,
            text: String::new(),
        })
    }

    fn open_item(&mut self, item: Item) -> Vec<Event> {
        let index = self.output_index();
        let id = item.id().to_owned();
        let part = match &item {
            Item::Reasoning { .. } => json!({"type": "reasoning_text", "text": ""}),
            _ => text_part(""),
        };
        let added = self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item.to_json("in_progress", self.sealer.as_deref())}),
        );
        let part = self.event(
            "response.content_part.added",
            json!({"output_index": index, "item_id": id, "content_index": 0, "part": part}),
        );
        self.open = Some(item);
        vec![added, part]
    }

    /// A text or reasoning delta of the open item.
    fn delta(&mut self, delta: String) -> Vec<Event> {
        let index = self.output_index();
        let (name, id) = match self.open.as_mut() {
            Some(Item::Reasoning { id, text }) => {
                text.push_str(&delta);
                ("response.reasoning_text.delta", id.clone())
            }
            Some(Item::Message { id, text }) => {
                text.push_str(&delta);
                ("response.output_text.delta", id.clone())
            }
            _ => return Vec::new(),
        };
        let mut data = json!({"output_index": index, "item_id": id, "content_index": 0,
            "delta": delta});
        if name == "response.output_text.delta" {
            data["logprobs"] = json!([]);
        }
        vec![self.event(name, data)]
    }

    /// Closes the open item with `status`.
    fn close_open(&mut self, status: &str) -> Vec<Event> {
        let Some(item) = self.open.take() else {
            return Vec::new();
        };
        let index = self.output_index();
        let id = item.id().to_owned();
        let (done, data, part) = match &item {
            Item::Reasoning { text, .. } => (
                "response.reasoning_text.done",
                json!({"output_index": index, "item_id": id, "content_index": 0, "text": text}),
                json!({"type": "reasoning_text", "text": text}),
            ),
            Item::Message { text, .. } => (
                "response.output_text.done",
                json!({"output_index": index, "item_id": id, "content_index": 0, "text": text,
                    "logprobs": []}),
                text_part(text),
            ),
            Item::FunctionCall { .. } => return Vec::new(),
        };
        let out = vec![
            self.event(done, data),
            self.event(
                "response.content_part.done",
                json!({"output_index": index, "item_id": id, "content_index": 0, "part": part}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item.to_json(status, self.sealer.as_deref())}),
            ),
        ];
        self.items.push(item);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::chat_output::{FunctionCall, ToolCallOut};

    fn names(events: &[Event]) -> Vec<&'static str> {
        events.iter().map(|e| e.name).collect()
    }

    #[test]
    fn a_text_answer_streams_in_the_apis_order_with_rising_sequence_numbers() {
        let mut w = Writer::new("resp_1");
        let mut events = w.started(&json!({"id": "resp_1"}));
        events.extend(w.push(Piece::Content("Hel".into())));
        events.extend(w.push(Piece::Content("lo".into())));
        events.extend(w.finish(false));
        events.push(w.ended("response.completed", &json!({})));
        assert_eq!(
            names(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e.data["sequence_number"], i as u64);
            assert_eq!(e.data["type"], e.name);
        }
        assert_eq!(events[6].data["text"], "Hello");
        assert_eq!(events[8].data["item"]["content"][0]["text"], "Hello");
        assert_eq!(events[8].data["item"]["status"], "completed");
        assert_eq!(w.items().len(), 1);
    }

    #[test]
    fn reasoning_then_a_call_make_two_items_and_the_whitespace_between_is_no_message() {
        let mut w = Writer::new("resp_1");
        let mut events = w.push(Piece::Reasoning("think".into()));
        events.extend(w.push(Piece::Content("\n\n".into())));
        events.extend(w.push(Piece::ToolCall(ToolCallOut {
            index: 0,
            id: "call_x".into(),
            kind: "function",
            function: FunctionCall {
                name: "f".into(),
                arguments: "{\"a\":1}".into(),
            },
        })));
        events.extend(w.finish(false));
        assert_eq!(
            names(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(events[6].data["output_index"], 1);
        assert_eq!(events[6].data["item"]["arguments"], "");
        assert_eq!(events[8].data["arguments"], "{\"a\":1}");
        assert_eq!(events[9].data["item"]["call_id"], "call_x");
        let items = w.items();
        assert_eq!(items.len(), 2);
        assert!(matches!(&items[0], Item::Reasoning { text, .. } if text == "think"));
    }

    #[test]
    fn whitespace_alone_is_still_the_answer() {
        let mut w = Writer::new("resp_1");
        assert!(w.push(Piece::Content(" ".into())).is_empty());
        let events = w.finish(false);
        assert_eq!(events[2].data["delta"], " ");
        assert!(matches!(&w.items()[0], Item::Message { text, .. } if text == " "));
        // Nothing at all: an empty message.
        let mut empty = Writer::new("resp_2");
        let events = empty.finish(true);
        assert_eq!(names(&events).len(), 5);
        // Cut at the token limit: the item says so.
        assert_eq!(events[4].data["item"]["status"], "incomplete");
    }
}
