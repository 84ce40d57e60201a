#![allow(clippy::unwrap_used)]

use super::*;

use crate::api::chat_output::{FunctionCall, ToolCallOut};

/// What the renderer is told, in order.
enum Step {
    /// The choice started: prompt and cached tokens.
    Start(u32, u32),
    Piece(Piece),
    Finish(&'static str),
    /// Every choice ended: prompt, completion and cached tokens of the request.
    End(u32, u32, u32),
    Fail(ApiError),
}

fn content(text: &str) -> Step {
    Step::Piece(Piece::Content(text.to_owned()))
}

fn reasoning(text: &str) -> Step {
    Step::Piece(Piece::Reasoning(text.to_owned()))
}

/// Runs a whole stream of steps through a writer.
fn run(stops: &[&str], steps: Vec<Step>) -> Vec<Event> {
    let mut writer = EventWriter::new(stops.iter().map(|s| (*s).to_owned()).collect());
    let mut events = Vec::new();
    for step in steps {
        events.extend(match step {
            Step::Start(prompt, cached) => {
                writer.start("msg_9", "m", &Usage::new(prompt, 0, cached))
            }
            Step::Piece(piece) => writer.piece(piece),
            Step::Finish(finish) => writer.finish(finish),
            Step::End(prompt, completion, cached) => {
                writer.end(&Usage::new(prompt, completion, cached))
            }
            Step::Fail(err) => vec![Event::error(&err)],
        });
    }
    events
}

fn names(events: &[Event]) -> Vec<&'static str> {
    events.iter().map(|e| e.name).collect()
}

/// The text of every `text_delta`.
fn text_of(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|e| e.data["delta"]["text"].as_str())
        .collect()
}

#[test]
fn a_text_answer_is_one_text_block_between_start_and_stop() {
    let events = run(
        &[],
        vec![
            Step::Start(30, 16),
            content(""),
            content("Hello"),
            content(" world"),
            Step::Finish("length"),
            Step::End(30, 2, 16),
        ],
    );
    assert_eq!(
        names(&events),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &events[0].data["message"];
    assert_eq!(start["id"], "msg_9");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["usage"]["input_tokens"], 14);
    assert_eq!(start["usage"]["cache_read_input_tokens"], 16);
    assert_eq!(start["usage"]["output_tokens"], 0);
    assert_eq!(
        events[2].data["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(text_of(&events), "Hello world");
    let end = &events[6].data;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end["usage"]["output_tokens"], 2);
    // Every event's data names its own type.
    for event in &events {
        assert_eq!(event.data["type"], event.name);
    }
    assert!(
        events[3]
            .to_sse()
            .starts_with("event: content_block_delta\ndata: {")
    );
}

#[test]
fn thinking_text_and_tool_calls_are_blocks_in_order() {
    let call = ToolCallOut {
        index: 0,
        id: "call_x0".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into(),
        },
    };
    let events = run(
        &[],
        vec![
            Step::Start(10, 0),
            reasoning("Hm"),
            reasoning("m."),
            content("Looking."),
            Step::Piece(Piece::ToolCall(call)),
            Step::Finish("tool_calls"),
            Step::End(10, 9, 0),
        ],
    );
    let blocks: Vec<(u64, &Json)> = events
        .iter()
        .filter(|e| e.name == "content_block_start")
        .map(|e| (e.data["index"].as_u64().unwrap(), &e.data["content_block"]))
        .collect();
    assert_eq!(blocks.len(), 3);
    assert_eq!(blocks[0].0, 0);
    assert_eq!(blocks[0].1["type"], "thinking");
    assert_eq!(blocks[1], (1, &json!({"type": "text", "text": ""})));
    assert_eq!(
        blocks[2],
        (
            2,
            &json!({"type": "tool_use", "id": "toolu_x0", "name": "get_weather", "input": {}})
        )
    );
    let thinking: String = events
        .iter()
        .filter_map(|e| e.data["delta"]["thinking"].as_str())
        .collect();
    assert_eq!(thinking, "Hmm.");
    let json: Vec<&str> = events
        .iter()
        .filter_map(|e| e.data["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(json, ["{\"city\":\"Paris\"}"]);
    // Each block is stopped before the next starts, with its own index.
    let order: Vec<(&str, u64)> = events
        .iter()
        .filter(|e| e.name.starts_with("content_block"))
        .map(|e| (e.name, e.data["index"].as_u64().unwrap()))
        .collect();
    let stops: Vec<u64> = order
        .iter()
        .filter(|(n, _)| *n == "content_block_stop")
        .map(|(_, i)| *i)
        .collect();
    assert_eq!(stops, [0, 1, 2]);
    let delta = events.iter().find(|e| e.name == "message_delta").unwrap();
    assert_eq!(delta.data["delta"]["stop_reason"], "tool_use");
    assert_eq!(events.last().unwrap().name, "message_stop");
}

#[test]
fn a_stop_sequence_split_across_chunks_is_cut_and_named() {
    let events = run(
        &["STOP"],
        vec![
            Step::Start(5, 0),
            content("one two S"),
            content("TO"),
            content("P"),
            Step::Finish("stop"),
            Step::End(5, 4, 0),
        ],
    );
    assert_eq!(text_of(&events), "one two ");
    let delta = events.iter().find(|e| e.name == "message_delta").unwrap();
    assert_eq!(delta.data["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta.data["delta"]["stop_sequence"], "STOP");
    // Ended by itself: the held text comes out whole.
    let events = run(
        &["STOP"],
        vec![
            Step::Start(5, 0),
            content("naïve ST"),
            Step::Finish("stop"),
            Step::End(5, 3, 0),
        ],
    );
    assert_eq!(text_of(&events), "naïve ST");
    let delta = events.iter().find(|e| e.name == "message_delta").unwrap();
    assert_eq!(delta.data["delta"]["stop_reason"], "end_turn");
    assert!(delta.data["delta"]["stop_sequence"].is_null());
}

#[test]
fn a_failure_ends_the_stream_with_an_error_event() {
    let events = run(
        &[],
        vec![
            Step::Start(5, 0),
            content("par"),
            Step::Fail(ApiError::Upstream("worker lost".into())),
        ],
    );
    let last = events.last().unwrap();
    assert_eq!(last.name, "error");
    assert_eq!(
        last.data,
        json!({"type": "error", "error": {"type": "api_error", "message": "worker lost"}})
    );
    assert_eq!(events.iter().filter(|e| e.name == "error").count(), 1);
    assert!(!names(&events).contains(&"message_stop"));
    // A refusal mid-stream keeps its Anthropic type.
    let events = run(
        &[],
        vec![
            Step::Start(5, 0),
            Step::Fail(ApiError::Saturated {
                retry_after_secs: 1,
            }),
        ],
    );
    assert_eq!(
        events.last().unwrap().data["error"]["type"],
        "rate_limit_error"
    );
}

#[test]
fn the_message_starts_once() {
    let mut writer = EventWriter::new(Vec::new());
    assert_eq!(writer.start("msg_1", "m", &Usage::new(3, 0, 0)).len(), 2);
    assert!(writer.start("msg_1", "m", &Usage::new(3, 0, 0)).is_empty());
}
