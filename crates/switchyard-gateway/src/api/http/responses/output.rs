//! The response object: output items from the chat pipeline's answer (reasoning, the message,
//! function calls), its status, usage, and the request's settings repeated as the SDK's
//! `Response` model expects them.

use super::store::Sealer;
use serde_json::{Value as Json, json};

use super::request::Echo;
use crate::api::chat_output::ToolCallOut;

/// One output item.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

impl Item {
    pub fn id(&self) -> &str {
        match self {
            Item::Reasoning { id, .. }
            | Item::Message { id, .. }
            | Item::FunctionCall { id, .. } => id,
        }
    }

    /// A function call item of a chat tool call.
    pub fn call(response_id: &str, call: ToolCallOut) -> Item {
        Item::FunctionCall {
            id: item_id("fc", response_id, call.index),
            call_id: call.id,
            name: call.function.name,
            arguments: call.function.arguments,
        }
    }

    /// The item as the API writes it with `status`: `in_progress` while it streams (its
    /// content comes in the deltas), else `completed` or `incomplete` (cut at the token limit).
    ///
    /// With a `sealer` (the request asked for `reasoning.encrypted_content`), a finished
    /// reasoning item also carries its text sealed, for a client that stores nothing to send
    /// back.
    pub fn to_json(&self, status: &str, sealer: Option<&Sealer>) -> Json {
        let done = status != "in_progress";
        match self {
            Item::Reasoning { id, text } => {
                let mut item = json!({
                    "type": "reasoning", "id": id, "summary": [], "status": status,
                    "content": if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) },
                });
                if let Some(sealer) = sealer {
                    item["encrypted_content"] = if done {
                        json!(sealer.seal(text))
                    } else {
                        Json::Null
                    };
                }
                item
            }
            Item::Message { id, text } => json!({
                "type": "message", "id": id, "role": "assistant", "status": status,
                "content": if done { json!([text_part(text)]) } else { json!([]) },
            }),
            Item::FunctionCall {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": if done { arguments.as_str() } else { "" }, "status": status,
            }),
        }
    }
}

/// An `output_text` content part.
pub fn text_part(text: &str) -> Json {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// An item's id, from the response's: `msg_<hex>`, `rs_<hex>`, `fc_<hex>_<n>`.
pub fn item_id(prefix: &str, response_id: &str, n: u32) -> String {
    let hex = response_id.strip_prefix("resp_").unwrap_or(response_id);
    format!("{prefix}_{hex}_{n}")
}

/// The output items of a whole answer: reasoning, then the message, then the calls. A message
/// with nothing but whitespace beside reasoning or calls is not an item (the text between them).
pub fn items(
    response_id: &str,
    reasoning: Option<String>,
    content: String,
    calls: Vec<ToolCallOut>,
) -> Vec<Item> {
    let mut out = Vec::new();
    let reasoned = reasoning.is_some();
    if let Some(text) = reasoning {
        out.push(Item::Reasoning {
            id: item_id("rs", response_id, 0),
            text,
        });
    }
    if message_shown(&content, reasoned || !calls.is_empty()) {
        out.push(Item::Message {
            id: item_id("msg", response_id, 0),
            text: content,
        });
    }
    out.extend(calls.into_iter().map(|c| Item::call(response_id, c)));
    out
}

/// Whether text is a message item: anything but whitespace is; whitespace alone only when there
/// is no other item.
pub fn message_shown(content: &str, other_items: bool) -> bool {
    !content.trim().is_empty() || !other_items
}

/// Token counts of an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tokens {
    pub input: u32,
    pub cached: u32,
    pub output: u32,
    pub reasoning: u32,
}

/// How the answer ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    InProgress,
    Completed,
    /// Ended at `max_output_tokens`.
    Incomplete,
    Failed(String),
}

impl Status {
    /// The status of a chat finish reason.
    pub fn of_finish(finish: &str) -> Status {
        if finish == "length" {
            Status::Incomplete
        } else {
            Status::Completed
        }
    }
}

/// What a response object is made of besides the request's settings.
pub struct Outcome<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub created_at: u64,
    pub status: Status,
    pub output: &'a [Item],
    pub tokens: Option<Tokens>,
}

/// The response object.
pub fn response(a: &Outcome<'_>, echo: &Echo, sealer: Option<&Sealer>) -> Json {
    let (status, incomplete, error) = match &a.status {
        Status::InProgress => ("in_progress", Json::Null, Json::Null),
        Status::Completed => ("completed", Json::Null, Json::Null),
        Status::Incomplete => (
            "incomplete",
            json!({"reason": "max_output_tokens"}),
            Json::Null,
        ),
        Status::Failed(message) => (
            "failed",
            Json::Null,
            json!({"code": "server_error", "message": message}),
        ),
    };
    let usage = a.tokens.map_or(Json::Null, |t| {
        json!({
            "input_tokens": t.input,
            "input_tokens_details": {"cached_tokens": t.cached},
            "output_tokens": t.output,
            "output_tokens_details": {"reasoning_tokens": t.reasoning},
            "total_tokens": t.input + t.output,
        })
    });
    let last = a.output.len().saturating_sub(1);
    let item_status = |i: usize| match a.status {
        Status::InProgress => "in_progress",
        Status::Incomplete if i == last => "incomplete",
        _ => "completed",
    };
    json!({
        "id": a.id,
        "object": "response",
        "created_at": a.created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": a.model,
        "output": a.output.iter().enumerate().map(|(i, item)| item.to_json(item_status(i), sealer)).collect::<Vec<_>>(),
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": {"effort": null, "summary": null},
        "store": echo.store,
        "temperature": echo.temperature,
        "text": {"format": echo.text_format},
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": echo.user,
        "metadata": echo.metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::chat_output::FunctionCall;

    fn echo() -> Echo {
        Echo {
            instructions: Some("be brief".into()),
            max_output_tokens: Some(5),
            tools: vec![],
            tool_choice: json!("auto"),
            parallel_tool_calls: true,
            temperature: None,
            top_p: None,
            text_format: json!({"type": "text"}),
            metadata: [("k".to_owned(), "v".to_owned())].into(),
            user: None,
            store: true,
            previous_response_id: None,
            seal_reasoning: false,
            input: vec![],
            previous: vec![],
        }
    }

    fn call(index: u32) -> ToolCallOut {
        ToolCallOut {
            index,
            id: format!("call_{index}"),
            kind: "function",
            function: FunctionCall {
                name: "f".into(),
                arguments: "{}".into(),
            },
        }
    }

    #[test]
    fn items_are_reasoning_message_then_calls_without_whitespace_between() {
        let got = items(
            "resp_ab",
            Some("think".into()),
            "\n\n".into(),
            vec![call(0), call(1)],
        );
        let ids: Vec<&str> = got.iter().map(Item::id).collect();
        assert_eq!(ids, ["rs_ab_0", "fc_ab_0", "fc_ab_1"]);
        let plain = items("resp_ab", None, "hello".into(), vec![]);
        assert_eq!(
            plain,
            [Item::Message {
                id: "msg_ab_0".into(),
                text: "hello".into()
            }]
        );
        // An empty answer is still a message.
        assert_eq!(items("resp_ab", None, String::new(), vec![]).len(), 1);
        let json = got[1].to_json("completed", None);
        assert_eq!(json["call_id"], "call_0");
        assert_eq!(json["arguments"], "{}");
        assert_eq!(json["status"], "completed");
    }

    #[test]
    fn the_response_says_how_it_ended_and_counts_tokens() {
        let output = items("resp_1", None, "hi".into(), vec![]);
        let tokens = Tokens {
            input: 10,
            cached: 4,
            output: 5,
            reasoning: 0,
        };
        let r = response(
            &Outcome {
                id: "resp_1",
                model: "m",
                created_at: 7,
                status: Status::of_finish("length"),
                output: &output,
                tokens: Some(tokens),
            },
            &echo(),
            None,
        );
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["usage"]["total_tokens"], 15);
        assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(r["output"][0]["content"][0]["text"], "hi");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["metadata"]["k"], "v");
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(Status::of_finish("tool_calls"), Status::Completed);
        let failed = response(
            &Outcome {
                id: "resp_1",
                model: "m",
                created_at: 7,
                status: Status::Failed("boom".into()),
                output: &[],
                tokens: None,
            },
            &echo(),
            None,
        );
        assert_eq!(failed["status"], "failed");
        assert_eq!(failed["error"]["message"], "boom");
        assert!(failed["usage"].is_null());
        assert_eq!(r["store"], true);
        assert!(r["previous_response_id"].is_null());
    }

    /// Asked for (`include: ["reasoning.encrypted_content"]`), a finished reasoning item
    /// carries its text sealed; one still streaming does not yet.
    #[test]
    fn reasoning_items_carry_their_text_sealed_when_asked() {
        let sealer = Sealer::from_secret(b"k");
        let item = Item::Reasoning {
            id: "rs_1".into(),
            text: "think".into(),
        };
        let plain = item.to_json("completed", None);
        assert!(plain.get("encrypted_content").is_none());
        let sealed = item.to_json("completed", Some(&sealer));
        let carried = sealed["encrypted_content"].as_str().unwrap();
        assert_eq!(sealer.open(carried).as_deref(), Some("think"));
        assert!(item.to_json("in_progress", Some(&sealer))["encrypted_content"].is_null());
    }
}
