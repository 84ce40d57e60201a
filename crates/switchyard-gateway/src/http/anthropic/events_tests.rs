#![allow(clippy::unwrap_used)]

use super::*;

fn chunk(delta: Json, finish: Option<&str>) -> String {
    json!({"id": "msg_9", "model": "m", "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    .to_string()
}

fn usage_chunk(prompt: u32, completion: u32, cached: u32) -> String {
    json!({"id": "msg_9", "model": "m", "choices": [],
           "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                     "prompt_tokens_details": {"cached_tokens": cached}}})
    .to_string()
}

/// Runs a whole stream of chunk data through a writer.
fn run(stops: &[&str], datas: &[String]) -> Vec<Event> {
    let mut writer = EventWriter::new(stops.iter().map(|s| (*s).to_owned()).collect());
    let mut events = Vec::new();
    for data in datas {
        events.extend(writer.push(data));
    }
    events.extend(writer.end());
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
        &[
            usage_chunk(30, 0, 16),
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"content": "Hello"}), None),
            chunk(json!({"content": " world"}), None),
            chunk(json!({}), Some("length")),
            usage_chunk(30, 2, 16),
            "[DONE]".into(),
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
    let call = json!({"index": 0, "id": "call_x0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}});
    let events = run(
        &[],
        &[
            usage_chunk(10, 0, 0),
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"reasoning_content": "Hm", "reasoning": "Hm"}), None),
            chunk(json!({"reasoning_content": "m."}), None),
            chunk(json!({"content": "Looking."}), None),
            chunk(json!({"tool_calls": [call]}), None),
            chunk(json!({}), Some("tool_calls")),
            usage_chunk(10, 9, 0),
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
        &[
            usage_chunk(5, 0, 0),
            chunk(json!({"content": "one two S"}), None),
            chunk(json!({"content": "TO"}), None),
            chunk(json!({"content": "P"}), None),
            chunk(json!({}), Some("stop")),
            usage_chunk(5, 4, 0),
        ],
    );
    assert_eq!(text_of(&events), "one two ");
    let delta = events.iter().find(|e| e.name == "message_delta").unwrap();
    assert_eq!(delta.data["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta.data["delta"]["stop_sequence"], "STOP");
    // Ended by itself: the held text comes out whole.
    let events = run(
        &["STOP"],
        &[
            usage_chunk(5, 0, 0),
            chunk(json!({"content": "naïve ST"}), None),
            chunk(json!({}), Some("stop")),
            usage_chunk(5, 3, 0),
        ],
    );
    assert_eq!(text_of(&events), "naïve ST");
    let delta = events.iter().find(|e| e.name == "message_delta").unwrap();
    assert_eq!(delta.data["delta"]["stop_reason"], "end_turn");
    assert!(delta.data["delta"]["stop_sequence"].is_null());
}

#[test]
fn errors_and_cut_streams_end_with_an_error_event() {
    let error = json!({"error": {"message": "worker lost", "type": "server_error",
        "param": null, "code": "upstream_error"}})
    .to_string();
    let events = run(
        &[],
        &[
            usage_chunk(5, 0, 0),
            chunk(json!({"content": "par"}), None),
            error,
            "[DONE]".into(),
        ],
    );
    let last = events.last().unwrap();
    assert_eq!(last.name, "error");
    assert_eq!(
        last.data,
        json!({"type": "error", "error": {"type": "api_error", "message": "worker lost"}})
    );
    assert_eq!(events.iter().filter(|e| e.name == "error").count(), 1);
    // The pipeline's stream stopped before the usage chunk.
    let events = run(
        &[],
        &[usage_chunk(5, 0, 0), chunk(json!({"content": "x"}), None)],
    );
    assert_eq!(events.last().unwrap().name, "error");
    assert!(!names(&events).contains(&"message_stop"));
}
