use serde_json::{Value as Json, json};

use super::super::store::Sealer;
use super::*;

/// A split request: the chat request, and the settings its answer repeats.
#[derive(Debug)]
struct Split {
    parsed: ParsedRequest,
    responses: Option<Echo>,
}

impl std::ops::Deref for Split {
    type Target = ParsedRequest;
    fn deref(&self) -> &ParsedRequest {
        &self.parsed
    }
}

fn parse(body: Json) -> Result<Split, ApiError> {
    continued(body, None, &Sealer::from_secret(b"test"))
}

fn continued(body: Json, previous: Option<Vec<Json>>, sealer: &Sealer) -> Result<Split, ApiError> {
    split(
        serde_json::from_value(body).unwrap(),
        Context { previous, sealer },
    )
    .map(|(parsed, echo)| Split {
        parsed,
        responses: Some(echo),
    })
}

fn param(body: Json) -> String {
    match parse(body) {
        Err(ApiError::BadRequest { param, .. }) => param.unwrap_or_default(),
        other => panic!("expected a 400, got {other:?}"),
    }
}

fn messages(parsed: &ParsedRequest) -> Json {
    match &parsed.source {
        PromptSource::Chat { messages, .. } => serde_json::to_value(messages).unwrap(),
        other => panic!("not chat: {other:?}"),
    }
}

#[test]
fn a_string_input_with_instructions_is_a_system_and_a_user_message() {
    let parsed = parse(
        json!({"model": "m", "input": "hi", "instructions": "be brief",
        "max_output_tokens": 9, "temperature": 0.0, "top_p": 0.5, "user": "u", "stream": true}),
    )
    .unwrap();
    assert_eq!(
        messages(&parsed),
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    );
    assert_eq!(parsed.sampling.max_tokens, Some(9));
    assert_eq!(parsed.sampling.temperature, Some(0.0));
    assert_eq!(parsed.sampling.top_p, Some(0.5));
    assert_eq!(parsed.sampling.user.as_deref(), Some("u"));
    assert!(parsed.sampling.stream);
    let echo = parsed.responses.unwrap();
    assert_eq!(echo.instructions.as_deref(), Some("be brief"));
    assert_eq!(echo.tool_choice, json!("auto"));
    assert!(echo.parallel_tool_calls);
    assert_eq!(echo.text_format, json!({"type": "text"}));
}

#[test]
fn items_become_chat_turns_with_tool_calls_and_tool_messages() {
    let parsed = parse(json!({"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\":\"Paris\"}", "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 18 C.", "annotations": []}]},
    ]}))
    .unwrap();
    let call = |id: &str, name: &str, args: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}});
    assert_eq!(
        messages(&parsed),
        json!([
            {"role": "system", "content": "rules"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "reasoning_content": "look it up", "tool_calls": [
                call("call_1", "get_weather", "{\"city\":\"Paris\"}"),
                call("call_2", "get_time", "{}"),
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
            {"role": "assistant", "content": "It is 18 C."},
        ])
    );
}

#[test]
fn flat_function_tools_and_tool_choice_become_chats_nested_ones() {
    let parsed = parse(json!({"model": "m", "input": "x",
        "tools": [{"type": "function", "name": "f", "description": "d",
                   "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": false}))
    .unwrap();
    let PromptSource::Chat {
        tools,
        tool_choice,
        parallel_tool_calls,
        ..
    } = &parsed.source
    else {
        panic!("not chat");
    };
    assert_eq!(
        tools.as_deref(),
        Some(
            &[
                json!({"type": "function", "function": {"name": "f", "description": "d",
            "parameters": {"type": "object"}, "strict": true}})
            ][..]
        )
    );
    assert_eq!(
        tool_choice,
        &Some(json!({"type": "function", "function": {"name": "f"}}))
    );
    assert_eq!(parallel_tool_calls, &Some(false));
    let echo = parsed.responses.unwrap();
    assert_eq!(echo.tools[0]["name"], "f");
    assert!(!echo.parallel_tool_calls);
}

#[test]
fn text_format_reaches_the_guided_path_as_response_format() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let parsed = parse(json!({"model": "m", "input": "x", "text": {"format":
        {"type": "json_schema", "name": "n", "schema": schema, "strict": true}}}))
    .unwrap();
    assert_eq!(
        parsed.sampling.response_format,
        Some(
            json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}})
        )
    );
    let parsed =
        parse(json!({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}))
            .unwrap();
    assert_eq!(
        parsed.sampling.response_format,
        Some(json!({"type": "json_object"}))
    );
    let parsed =
        parse(json!({"model": "m", "input": "x", "text": {"format": {"type": "text"}}})).unwrap();
    assert_eq!(parsed.sampling.response_format, None);
}

#[test]
fn neutral_values_of_unserved_fields_are_taken() {
    parse(
        json!({"model": "m", "input": "x", "store": false, "include": [], "background": false,
        "truncation": "disabled", "top_logprobs": 0, "previous_response_id": null,
        "reasoning": {"effort": null}, "metadata": {"k": "v"}}),
    )
    .unwrap();
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let body = |extra: Json| {
        let mut b = json!({"model": "m", "input": "x"});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (extra, want) in [
        (json!({"conversation": "conv_1"}), "conversation"),
        (json!({"tools": [{"type": "function"}]}), "tools[0].name"),
        (
            json!({"tool_choice": {"type": "web_search"}}),
            "tool_choice",
        ),
        (json!({"text": {"format": {"type": "xml"}}}), "text.format"),
        (
            json!({"text": {"format": {"type": "json_schema", "name": "n"}}}),
            "text.format",
        ),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input[0].call_id",
        ),
        (json!({"input": []}), "input"),
        (json!({"input": null}), "input"),
        (
            json!({"include": ["message.output_text.logprobs"]}),
            "include",
        ),
        (
            json!({"reasoning": {"effort": "extreme"}}),
            "reasoning.effort",
        ),
        (json!({"background": true}), "background"),
        (json!({"n": 2}), "n"),
        (json!({"stop": ["x"]}), "stop"),
    ] {
        assert_eq!(param(body(extra.clone())), want, "{extra}");
    }
}

/// What Codex CLI 0.171.0 sends on its first turn (captured from the client): every field is
/// taken, the session comes from `prompt_cache_key`, and what cannot change the tokens is noted.
#[test]
fn codex_first_turn_is_taken_with_its_advisory_fields_noted() {
    let parsed = parse(json!({
        "model": "m", "stream": true, "tool_choice": "auto", "parallel_tool_calls": true,
        "reasoning": {"summary": "auto", "effort": "medium"}, "store": false,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "t"}, "service_tier": "auto",
        "text": {"verbosity": "low"}, "max_tool_calls": 4, "safety_identifier": "s",
        "input": [
            {"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "phase": "x",
             "content": [{"type": "input_text", "text": "hi"}]}
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "strict": false,
             "parameters": {"type": "object"}, "description": "run"},
            {"type": "namespace", "name": "multi_agent_v1", "tools": [
                {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
            ]},
            {"type": "web_search", "external_web_access": false}
        ],
        "brand_new": 1
    }))
    .unwrap();
    let PromptSource::Chat { tools, .. } = &parsed.source else {
        panic!("chat");
    };
    let names: Vec<_> = tools
        .iter()
        .flatten()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["exec_command", "spawn_agent"]);
    let notes = &parsed.notes;
    assert_eq!(
        notes.session,
        Some((
            crate::api::http::fields::SessionSource::PromptCacheKey,
            "thread-1".to_owned()
        ))
    );
    assert_eq!(notes.reasoning(), Reasoning::of_effort("medium"));
    assert_eq!(
        notes.ignored(),
        [
            "brand_new",
            "client_metadata",
            "input[].phase",
            "max_tool_calls",
            "reasoning.summary",
            "safety_identifier",
            "service_tier",
            "text.verbosity",
            "tools.web_search"
        ]
    );
    assert_eq!(
        notes.unknown_names().collect::<Vec<_>>(),
        ["brand_new", "input[].phase"]
    );
    // `store: false` and the sealed reasoning Codex asks for are honoured.
    let echo = parsed.responses.as_ref().unwrap();
    assert!(!echo.store);
    assert!(echo.seal_reasoning);
}

/// A turn continued from a stored conversation renders the earlier items first (a fault in
/// them names `previous_response_id`), and its echo keeps both for the next record.
#[test]
fn a_previous_conversation_is_rendered_before_the_new_input() {
    let sealer = Sealer::from_secret(b"test");
    let previous = vec![
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}),
        json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"}),
    ];
    let parsed = continued(
        json!({"model": "m", "previous_response_id": "resp_1", "store": false,
               "input": [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
        Some(previous.clone()),
        &sealer,
    )
    .unwrap();
    let roles: Vec<_> = messages(&parsed)
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool"]);
    let echo = parsed.responses.unwrap();
    assert!(!echo.store);
    assert_eq!(echo.previous_response_id.as_deref(), Some("resp_1"));
    assert_eq!(echo.previous, previous);
    assert_eq!(echo.input.len(), 1);
    let Err(ApiError::BadRequest { param, .. }) = continued(
        json!({"model": "m", "previous_response_id": "resp_1", "input": "again"}),
        Some(vec![json!("not an item")]),
        &sealer,
    ) else {
        panic!("a broken stored item is refused");
    };
    assert_eq!(param.as_deref(), Some("previous_response_id.items[0]"));
}

/// Reasoning a client carried sealed (Codex with `store: false`) is read back into the turn it
/// belongs to; one sealed elsewhere is left out, and the request says so.
#[test]
fn sealed_reasoning_is_read_back_and_a_foreign_one_is_left_out() {
    let sealer = Sealer::from_secret(b"test");
    let body = |sealed: String| {
        json!({"model": "m", "include": ["reasoning.encrypted_content"], "store": false, "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"}
        ]})
    };
    let parsed = continued(body(sealer.seal("look it up")), None, &sealer).unwrap();
    assert!(parsed.responses.as_ref().unwrap().seal_reasoning);
    assert_eq!(messages(&parsed)[1]["reasoning_content"], "look it up");
    assert!(parsed.notes.ignored().is_empty());
    let foreign = Sealer::from_secret(b"elsewhere").seal("secret");
    let parsed = continued(body(foreign), None, &sealer).unwrap();
    assert_eq!(messages(&parsed)[1]["reasoning_content"], "");
    assert_eq!(
        parsed.notes.ignored(),
        ["input[].encrypted_content:unreadable"]
    );
}

#[test]
fn a_priority_is_carried_and_a_non_integer_one_is_a_400_naming_it() {
    let parsed = parse(json!({"model": "m", "input": "x", "priority": -2})).unwrap();
    assert_eq!(parsed.notes.priority, Some(-2));
    assert!(!parsed.notes.ignored().contains(&"priority".to_owned()));
    let parsed = parse(json!({"model": "m", "input": "x"})).unwrap();
    assert_eq!(parsed.notes.priority, None);
    assert_eq!(
        param(json!({"model": "m", "input": "x", "priority": "low"})),
        "priority"
    );
    assert_eq!(
        param(json!({"model": "m", "input": "x", "priority": 0.5})),
        "priority"
    );
}
