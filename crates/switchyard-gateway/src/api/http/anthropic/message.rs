//! A whole answer as an Anthropic message: reasoning as a `thinking` block, the text as a
//! `text` block, each tool call as a `tool_use` block; the finish reason as `stop_reason`, and
//! the usage in Anthropic's terms. Errors in Anthropic's shape, with the error's status kept.

use axum::http::StatusCode;
use serde_json::{Value as Json, json};

use crate::api::chat_output::ToolCallOut;
use crate::api::http::assemble::Gathered;
use crate::api::http::render::WholeChoice;
use crate::api::openai::Usage;

/// Anthropic's name of a tool call's id (`toolu_…`) for the chat answer's (`call_…`).
pub fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// A `tool_use` block's input: the call's arguments, a JSON object. Arguments that are not
/// one (a parser's odd output) are kept whole under `arguments` rather than lost.
pub fn tool_input(arguments: &str) -> Json {
    match serde_json::from_str::<Json>(arguments) {
        Ok(value @ Json::Object(_)) => value,
        _ => json!({ "arguments": arguments }),
    }
}

/// The stop sequence `text` ends with, when a stop string ended the answer (the pipeline keeps
/// it in the text for this; Anthropic's text leaves it out, so it is cut off).
pub fn matched_stop(text: &mut String, stops: &[String]) -> Option<String> {
    let matched = stops
        .iter()
        .filter(|s| text.ends_with(s.as_str()))
        .max_by_key(|s| s.len())?
        .clone();
    text.truncate(text.len() - matched.len());
    Some(matched)
}

/// `stop_reason` of a chat `finish_reason`; `stopped_by` is the stop sequence that ended it.
pub fn stop_reason(finish: &str, stopped_by: Option<&str>) -> &'static str {
    match (finish, stopped_by) {
        ("tool_calls", _) => "tool_use",
        ("length", _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic's usage: `input_tokens` are the prompt tokens not read from the KV cache,
/// `cache_read_input_tokens` those that were; the cache is filled by every prompt with no
/// separate charge, so `cache_creation_input_tokens` is 0.
pub fn usage(usage: &Usage) -> Json {
    let prompt = usage.prompt_tokens;
    let cached = usage.prompt_tokens_details.cached_tokens.min(prompt);
    json!({
        "input_tokens": prompt - cached,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    })
}

/// A whole answer as an Anthropic message: reasoning as a `thinking` block, the text as a
/// `text` block (less a stop sequence that ended it), each tool call as a `tool_use` block.
/// With `omit_thinking` (`thinking.display: "omitted"`) a thinking block keeps its place and
/// loses its text.
pub fn message(
    id: &str,
    model: &str,
    choice: WholeChoice,
    usage_of: &Usage,
    stops: &[String],
    omit_thinking: bool,
) -> Json {
    let Gathered {
        content: text,
        reasoning,
        tool_calls,
    } = choice.answer;
    let mut content = Vec::new();
    if let Some(thinking) = reasoning.filter(|t| !t.is_empty()) {
        let shown = if omit_thinking { "" } else { &thinking };
        content.push(json!({"type": "thinking", "thinking": shown, "signature": ""}));
    }
    // A model that only called tools has no text, whatever whitespace it wrote.
    let mut text = if !tool_calls.is_empty() && text.trim().is_empty() {
        String::new()
    } else {
        text
    };
    let stopped_by = if choice.finish == "stop" {
        matched_stop(&mut text, stops)
    } else {
        None
    };
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in &tool_calls {
        content.push(tool_use_block(call, true));
    }
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.finish, stopped_by.as_deref()),
        "stop_sequence": stopped_by,
        "usage": usage(usage_of),
    })
}

/// A `tool_use` block of a tool call; `with_input: false` leaves the input empty (streamed, it
/// follows as an `input_json_delta`).
pub fn tool_use_block(call: &ToolCallOut, with_input: bool) -> Json {
    json!({
        "type": "tool_use",
        "id": tool_use_id(&call.id),
        "name": call.function.name,
        "input": if with_input { tool_input(&call.function.arguments) } else { json!({}) },
    })
}

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 408 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// Anthropic's error type for an OpenAI error object's `type` (inside a stream, where there
/// is no status).
pub fn error_type_of_openai(kind: &str) -> &'static str {
    match kind {
        "invalid_request_error" => "invalid_request_error",
        "authentication_error" => "authentication_error",
        "rate_limit_error" => "rate_limit_error",
        "service_unavailable_error" => "overloaded_error",
        _ => "api_error",
    }
}

/// An Anthropic error body from an OpenAI one (`{"error": {"message", "type", "param"}}`);
/// `status` gives the type, else the OpenAI type does.
pub fn error_body(openai: &Json, status: Option<StatusCode>) -> Json {
    let error = &openai["error"];
    let message = error["message"].as_str().unwrap_or("request failed");
    let kind = match status {
        Some(status) => error_type(status),
        None => error_type_of_openai(error["type"].as_str().unwrap_or_default()),
    };
    // Name the field the way Anthropic's messages do (`max_tokens: Field required`).
    let message = match error["param"].as_str() {
        Some(param) if !message.contains(param) => format!("{param}: {message}"),
        _ => message.to_owned(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::api::chat_output::FunctionCall;

    fn choice(
        content: &str,
        reasoning: Option<&str>,
        calls: Vec<ToolCallOut>,
        finish: &'static str,
    ) -> WholeChoice {
        WholeChoice {
            answer: Gathered {
                content: content.to_owned(),
                reasoning: reasoning.map(str::to_owned),
                tool_calls: calls,
            },
            logprobs: None,
            finish,
        }
    }

    fn weather_call() -> ToolCallOut {
        ToolCallOut {
            index: 0,
            id: "call_abc0".into(),
            kind: "function",
            function: FunctionCall {
                name: "get_weather".into(),
                arguments: "{\"city\": \"Paris\"}".into(),
            },
        }
    }

    #[test]
    fn an_answer_becomes_thinking_text_and_tool_use_blocks() {
        let answer = || {
            choice(
                "Let me look.",
                Some("Weather?"),
                vec![weather_call()],
                "tool_calls",
            )
        };
        let usage = Usage::new(40, 12, 32);
        let m = message("msg_1", "m", answer(), &usage, &[], false);
        assert_eq!(m["type"], "message");
        assert_eq!(m["id"], "msg_1");
        assert_eq!(m["model"], "m");
        assert_eq!(m["stop_reason"], "tool_use");
        assert!(m["stop_sequence"].is_null());
        let content = m["content"].as_array().unwrap();
        assert_eq!(
            content[0],
            json!({"type": "thinking", "thinking": "Weather?", "signature": ""})
        );
        assert_eq!(content[1], json!({"type": "text", "text": "Let me look."}));
        // `thinking.display: "omitted"`: the block stays, its text does not.
        let omitted = message("msg_1", "m", answer(), &usage, &[], true);
        assert_eq!(
            omitted["content"][0],
            json!({"type": "thinking", "thinking": "", "signature": ""})
        );
        assert_eq!(
            content[2],
            json!({"type": "tool_use", "id": "toolu_abc0", "name": "get_weather",
                   "input": {"city": "Paris"}})
        );
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 8, "output_tokens": 12, "cache_read_input_tokens": 32,
                   "cache_creation_input_tokens": 0})
        );
        // Whitespace beside tool calls is no text block.
        let m = message(
            "msg_1",
            "m",
            choice(" \n", None, vec![weather_call()], "tool_calls"),
            &usage,
            &[],
            false,
        );
        assert_eq!(m["content"].as_array().unwrap().len(), 1);
        assert_eq!(m["content"][0]["type"], "tool_use");
    }

    #[test]
    fn a_stop_sequence_is_named_and_cut_from_the_text() {
        let usage = Usage::new(3, 4, 0);
        let stops = ["END".to_owned(), "D".to_owned()];
        let m = |text: &str, finish| {
            message(
                "msg_2",
                "m",
                choice(text, None, Vec::new(), finish),
                &usage,
                &stops,
                false,
            )
        };
        let stopped = m("one two END", "stop");
        assert_eq!(stopped["stop_reason"], "stop_sequence");
        assert_eq!(stopped["stop_sequence"], "END");
        assert_eq!(
            stopped["content"],
            json!([{"type": "text", "text": "one two "}])
        );
        let ended = m("one two", "stop");
        assert_eq!(ended["stop_reason"], "end_turn");
        assert!(ended["stop_sequence"].is_null());
        let cut = m("cut off mid-END", "length");
        assert_eq!(cut["stop_reason"], "max_tokens");
        assert_eq!(cut["content"][0]["text"], "cut off mid-END");
        // No text: no text block at all.
        assert_eq!(m("", "stop")["content"], json!([]));
    }

    #[test]
    fn arguments_that_are_not_an_object_are_kept() {
        assert_eq!(tool_input("{\"a\": 1}"), json!({"a": 1}));
        assert_eq!(tool_input("[1, 2"), json!({"arguments": "[1, 2"}));
    }

    #[test]
    fn errors_take_anthropic_types_and_name_their_field() {
        let openai = json!({"error": {"message": "Field required", "type": "invalid_request_error",
            "param": "max_tokens", "code": null}});
        assert_eq!(
            error_body(&openai, Some(StatusCode::BAD_REQUEST)),
            json!({"type": "error", "error": {"type": "invalid_request_error",
                   "message": "max_tokens: Field required"}})
        );
        let not_found = json!({"error": {"message": "the model `x` does not exist",
            "type": "invalid_request_error", "param": "model"}});
        assert_eq!(
            error_body(&not_found, Some(StatusCode::NOT_FOUND))["error"]["type"],
            "not_found_error"
        );
        for (status, kind) in [
            (401, "authentication_error"),
            (429, "rate_limit_error"),
            (503, "overloaded_error"),
            (500, "api_error"),
            (502, "api_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
        let stream = json!({"error": {"message": "worker gone", "type": "server_error"}});
        assert_eq!(error_body(&stream, None)["error"]["type"], "api_error");
    }
}
