#![allow(clippy::unwrap_used)]

use serde_json::json;

use switchyard_tokenize::MessageContent;

use super::*;

fn request(body: Json) -> MessagesRequest {
    serde_json::from_value(body).unwrap()
}

fn ask(body: Json) -> Result<ChatAsk, ApiError> {
    chat_ask(request(body))
}

/// The field a refusal names, and its message.
fn refused(body: Json) -> (String, String) {
    match ask(body) {
        Err(ApiError::BadRequest {
            param: Some(param),
            message,
        }) => (param, message),
        other => panic!("expected a 400 naming a field, got {other:?}"),
    }
}

fn base() -> Json {
    json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]})
}

fn with(extra: Json) -> Json {
    let mut body = base();
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn texts(message: &ChatMessage) -> String {
    match &message.content {
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => parts.iter().filter_map(|p| p.text.clone()).collect(),
        None => String::new(),
    }
}

#[test]
fn sampling_fields_map_onto_the_chat_fields() {
    let ask = ask(with(json!({
        "system": "Be brief.", "temperature": 0.0, "top_p": 0.9, "top_k": 5,
        "stop_sequences": ["END"], "stream": true, "metadata": {"user_id": "u-7"},
    })))
    .unwrap();
    let s = &ask.sampling;
    assert_eq!(s.max_tokens, Some(64));
    assert_eq!(s.temperature, Some(0.0));
    assert_eq!(s.top_p, Some(0.9));
    assert_eq!(s.top_k, Some(5));
    assert_eq!(s.stop, Some(StopSpec::Many(vec!["END".into()])));
    assert_eq!(s.include_stop_str_in_output, Some(true));
    assert!(s.stream);
    assert!(s.stream_options.as_ref().unwrap().include_usage);
    assert_eq!(s.user.as_deref(), Some("u-7"));
    assert_eq!(ask.stop_sequences, ["END"]);
    assert_eq!(ask.messages.len(), 2);
    assert_eq!(ask.messages[0].role, "system");
    assert_eq!(texts(&ask.messages[0]), "Be brief.");
    assert_eq!(ask.messages[1].role, "user");
    assert_eq!(ask.thinking, Thinking::Unset);
}

#[test]
fn tool_use_and_tool_result_become_tool_calls_and_tool_messages() {
    let ask = ask(with(json!({
        "system": [{"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "no such city"}]},
                {"type": "text", "text": "Thanks"},
            ]},
        ],
        "tools": [{"name": "get_weather", "description": "Weather now",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
    })))
    .unwrap();
    let roles: Vec<&str> = ask.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user"]
    );
    let assistant = &ask.messages[2];
    assert_eq!(texts(assistant), "Checking.");
    assert_eq!(
        assistant.reasoning_content.as_deref(),
        Some("Need the tool.")
    );
    let call = &assistant.tool_calls.as_ref().unwrap()[0];
    assert_eq!(call["id"], "toolu_1");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Json =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    assert_eq!(ask.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(texts(&ask.messages[3]), "18 C");
    assert_eq!(texts(&ask.messages[4]), "Error: no such city");
    assert_eq!(texts(&ask.messages[5]), "Thanks");
    assert_eq!(
        ask.tools.unwrap(),
        vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
        ]
    );
    assert_eq!(ask.tool_choice, Some(json!("auto")));
    assert_eq!(ask.parallel_tool_calls, Some(false));
}

#[test]
fn tool_choice_forms_map_onto_openai_ones() {
    let choice = |c: Json| chat_tool_choice(Some(&c)).unwrap();
    assert_eq!(
        choice(json!({"type": "any"})),
        (Some(json!("required")), None)
    );
    assert_eq!(choice(json!({"type": "none"})), (Some(json!("none")), None));
    assert_eq!(
        choice(json!({"type": "tool", "name": "f", "disable_parallel_tool_use": false})),
        (
            Some(json!({"type": "function", "function": {"name": "f"}})),
            Some(true)
        )
    );
    assert!(chat_tool_choice(Some(&json!({"type": "tool"}))).is_err());
    assert!(chat_tool_choice(Some(&json!({"type": "sometimes"}))).is_err());
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let cases = [
        (json!({"max_tokens": null}), "max_tokens"),
        (json!({"temperature": 1.5}), "temperature"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
            "messages.0.content.0",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            "messages.0.content.0.type",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "The answer is"}]}),
            "messages.1",
        ),
        (json!({"tools": [{"name": "f"}]}), "tools.0.input_schema"),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 512}}),
            "thinking.budget_tokens",
        ),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}),
            "thinking.budget_tokens",
        ),
        (
            json!({"stop_sequences": ["a", "b", "c", "d", "e"]}),
            "stop_sequences",
        ),
        (
            json!({"system": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}),
            "system.0.cache_control.type",
        ),
        (
            json!({"cache_control": {"type": "ephemeral", "scope": "org"}}),
            "cache_control.scope",
        ),
        (
            json!({"output_config": {"format": {"type": "regex", "schema": {}}}}),
            "output_config.format.type",
        ),
        (
            json!({"thinking": {"type": "between_tools"}}),
            "thinking.type",
        ),
        (
            json!({"thinking": {"type": "adaptive", "display": "hidden"}}),
            "thinking.display",
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages.0.role",
        ),
        (
            json!({"output_config": {"effort": "extreme"}}),
            "output_config.effort",
        ),
        (
            json!({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}),
            "context_management.edits.0.type",
        ),
        (json!({"container": "c_1"}), "container"),
        (json!({"mcp_servers": []}), "mcp_servers"),
    ];
    for (extra, param) in cases {
        let (named, message) = refused(with(extra.clone()));
        assert_eq!(named, param, "{extra}: {message}");
        assert!(message.starts_with(param), "{message}");
    }
    // Thinking within Anthropic's bounds is taken.
    let enabled = ask(with(
        json!({"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048}}),
    ))
    .unwrap();
    assert_eq!(enabled.thinking, Thinking::Enabled);
    let disabled = ask(with(json!({"thinking": {"type": "disabled"}}))).unwrap();
    assert_eq!(disabled.thinking, Thinking::Disabled);
}

#[test]
fn output_config_cache_control_and_adaptive_thinking_are_taken() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let ask = ask(with(json!({
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
        "thinking": {"type": "adaptive", "display": "summarized"},
    })))
    .unwrap();
    assert_eq!(
        ask.sampling.response_format,
        Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}))
    );
    assert_eq!(ask.thinking, Thinking::Adaptive);
}

/// What Claude Code 2.1.332 sends on its first turn (captured from the client): every field is
/// taken; the session and the user come from `metadata.user_id`; server tools and tool options
/// that cannot change the tokens are noted; a system turn inside `messages` is rendered there.
#[test]
fn claude_code_first_turn_is_taken_with_its_advisory_fields_noted() {
    let user_id = json!({"device_id": "dev-1", "account_uuid": "", "session_id": "sess-9"});
    let ask = ask(json!({
        "model": "m", "max_tokens": 32000, "stream": true,
        "system": [{"type": "text", "text": "billing"},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
            {"role": "system", "content": [{"type": "text", "text": "reminder",
                                            "cache_control": {"type": "ephemeral"}}]}
        ],
        "tools": [
            {"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
            {"name": "Cron", "description": "later", "input_schema": {"type": "object"},
             "defer_loading": true},
            {"type": "web_search_20250305", "name": "web_search"}
        ],
        "metadata": {"user_id": user_id.to_string()},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "service_tier": "auto"
    }))
    .unwrap();
    assert_eq!(ask.thinking, Thinking::Adaptive);
    assert!(ask.omit_thinking);
    assert_eq!(ask.sampling.user.as_deref(), Some("dev-1"));
    assert_eq!(
        ask.notes.session,
        Some((
            crate::api::http::fields::SessionSource::MetadataSession,
            "sess-9".to_owned()
        ))
    );
    assert_eq!(ask.notes.reasoning(), Reasoning::of_effort("high"));
    let roles: Vec<_> = ask.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "system"]);
    assert_eq!(texts(&ask.messages[2]), "reminder");
    assert_eq!(ask.tools.as_ref().unwrap().len(), 2);
    assert_eq!(
        ask.notes.ignored(),
        [
            "service_tier",
            "tools.defer_loading",
            "tools.web_search_20250305"
        ]
    );
}

#[test]
fn clear_thinking_keeps_the_thinking_of_the_latest_turns_only() {
    let turn = |thought: &str| {
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": ""},
            {"type": "text", "text": "ok"}]})
    };
    let user = json!({"role": "user", "content": "go"});
    let body = |keep: Json| {
        with(json!({
            "messages": [user, turn("a"), user, turn("b"), user, turn("c"), user],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
        }))
    };
    let thoughts = |ask: ChatAsk| -> Vec<Option<String>> {
        ask.messages
            .iter()
            .filter(|m| m.role == "assistant")
            .map(|m| m.reasoning_content.clone())
            .collect()
    };
    let all = thoughts(ask(body(json!("all"))).unwrap());
    assert_eq!(all, [Some("a".into()), Some("b".into()), Some("c".into())]);
    let two = thoughts(ask(body(json!({"type": "thinking_turns", "value": 2}))).unwrap());
    assert_eq!(two, [None, Some("b".into()), Some("c".into())]);
}

#[test]
fn betas_are_advisory_and_unheard_of_ones_unknown() {
    let mut notes = FieldNotes::default();
    note_betas(
        Some("claude-code-20250219, effort-2025-11-24,brand-new-2027-01-01"),
        &mut notes,
    );
    assert_eq!(
        notes.ignored(),
        [
            "anthropic-beta:brand-new-2027-01-01",
            "anthropic-beta:claude-code-20250219",
            "anthropic-beta:effort-2025-11-24"
        ]
    );
    assert_eq!(
        notes.unknown_names().collect::<Vec<_>>(),
        ["anthropic-beta:brand-new-2027-01-01"]
    );
}
