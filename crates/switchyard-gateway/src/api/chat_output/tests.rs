use serde_json::json;

use super::*;

fn hermes() -> OutputFormats {
    OutputFormats {
        tool_call: Some(ToolCallFormat::Hermes),
        reasoning: None,
    }
}

fn tool(name: &str) -> Json {
    json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
}

fn param_of(err: ApiError) -> Option<String> {
    match err {
        ApiError::BadRequest { param, .. } => param,
        other => panic!("expected a 400, got {other:?}"),
    }
}

#[test]
fn tool_choice_settles_what_is_rendered_and_parsed() {
    // auto (explicit or implied) renders the tools and parses calls.
    for choice in [None, Some(json!("auto"))] {
        let (output, render) =
            ChatOutput::resolve(hermes(), "m", Some(vec![tool("f")]), choice, None).unwrap();
        assert_eq!(render.map(|t| t.len()), Some(1));
        assert!(output.tools.is_some());
    }
    // none: neither.
    let (output, render) = ChatOutput::resolve(
        hermes(),
        "m",
        Some(vec![tool("f")]),
        Some(json!("none")),
        None,
    )
    .unwrap();
    assert!(render.is_none() && output.tools.is_none());
    // No tools: nothing to parse whatever the choice.
    let (output, render) = ChatOutput::resolve(hermes(), "m", None, None, None).unwrap();
    assert!(render.is_none() && output.tools.is_none());
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let no_parser = OutputFormats::default();
    let err = ChatOutput::resolve(no_parser, "m", Some(vec![tool("f")]), None, None).unwrap_err();
    assert!(err.to_string().contains("--tool-call-parser m="), "{err}");
    assert_eq!(param_of(err).as_deref(), Some("tools"));
    for choice in [
        json!({"type": "function", "function": {"name": "g"}}),
        json!("sometimes"),
        json!(3),
    ] {
        let err = ChatOutput::resolve(hermes(), "m", Some(vec![tool("f")]), Some(choice), None)
            .unwrap_err();
        assert_eq!(param_of(err).as_deref(), Some("tool_choice"));
    }
    let err = ChatOutput::resolve(hermes(), "m", None, Some(json!("required")), None).unwrap_err();
    assert_eq!(param_of(err).as_deref(), Some("tool_choice"));
    for bad in [
        json!({"type": "retrieval"}),
        json!({"type": "function", "function": {}}),
    ] {
        let err = ChatOutput::resolve(hermes(), "m", Some(vec![bad]), None, None).unwrap_err();
        assert_eq!(param_of(err).as_deref(), Some("tools"));
    }
}

#[test]
fn the_shaper_numbers_calls_names_the_finish_and_honours_parallel_false() {
    let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
    let (output, _) =
        ChatOutput::resolve(hermes(), "m", Some(vec![tool("a"), tool("b")]), None, None).unwrap();
    let mut shaper = Shaper::new(&output, "chatcmpl-0123456789abcdef0123456789", "");
    let mut pieces = shaper.push(text);
    pieces.extend(shaper.finish());
    let calls: Vec<_> = pieces
        .iter()
        .filter_map(|p| match p {
            Piece::ToolCall(c) => Some((c.index, c.function.name.clone(), c.id.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].0, calls[0].1.as_str()), (0, "a"));
    assert_eq!((calls[1].0, calls[1].1.as_str()), (1, "b"));
    assert_ne!(calls[0].2, calls[1].2, "ids differ");
    assert!(calls[0].2.starts_with("call_"));
    assert_eq!(shaper.finish_reason("stop"), "tool_calls");

    let (single, _) =
        ChatOutput::resolve(hermes(), "m", Some(vec![tool("a")]), None, Some(false)).unwrap();
    let mut shaper = Shaper::new(&single, "r", "");
    let mut pieces = shaper.push(text);
    pieces.extend(shaper.finish());
    assert_eq!(
        pieces
            .iter()
            .filter(|p| matches!(p, Piece::ToolCall(_)))
            .count(),
        1
    );

    let (plain, _) = ChatOutput::resolve(hermes(), "m", None, None, None).unwrap();
    let mut shaper = Shaper::new(&plain, "r", "");
    assert_eq!(shaper.push(text), vec![Piece::Content(text.into())]);
    assert_eq!(shaper.finish_reason("length"), "length");
}

#[test]
fn a_prompt_that_opens_the_reasoning_block_starts_the_output_in_it() {
    let formats = OutputFormats {
        tool_call: None,
        reasoning: Some(ReasoningFormat::Think),
    };
    let (output, _) = ChatOutput::resolve(formats, "m", None, None, None).unwrap();
    let mut opened = Shaper::new(&output, "r", "<|im_start|>assistant\n<think>\n");
    let mut pieces = opened.push("why</think>answer");
    pieces.extend(opened.finish());
    assert_eq!(
        pieces,
        vec![
            Piece::Reasoning("why".into()),
            Piece::Content("answer".into())
        ]
    );
    let mut closed = Shaper::new(&output, "r", "<|im_start|>assistant\n");
    let mut pieces = closed.push("why</think>answer");
    pieces.extend(closed.finish());
    assert_eq!(pieces, vec![Piece::Content("why</think>answer".into())]);
}

#[test]
fn configured_parsers_win_over_the_template_and_are_validated() {
    let dir = ModelDir::builtin();
    let mut config = OutputConfig::default();
    assert_eq!(
        config.formats("sim-8b", &dir).tool_call,
        Some(ToolCallFormat::Hermes),
        "the built-in template writes <tool_call>"
    );
    config
        .tool_call_parsers
        .insert("sim-8b".into(), "none".into());
    config
        .reasoning_parsers
        .insert("sim-8b".into(), "deepseek_r1".into());
    let formats = config.formats("sim-8b", &dir);
    assert_eq!(formats.tool_call, None);
    assert_eq!(formats.reasoning, Some(ReasoningFormat::DeepSeekR1));
    assert!(config.validate().is_ok());
    config.tool_call_parsers.insert("x".into(), "hermès".into());
    let err = config.validate().unwrap_err();
    assert!(err.contains("output.tool_call_parsers.x"), "{err}");
}

#[test]
fn a_compulsory_call_constrains_the_engine_and_reads_the_answer_as_the_call() {
    let named = json!({"type": "function", "function": {"name": "f"}});
    let (output, render) = ChatOutput::resolve(
        OutputFormats::default(),
        "m",
        Some(vec![tool("f"), tool("g")]),
        Some(named),
        None,
    )
    .expect("no tool parser needed: the answer is JSON");
    assert_eq!(render.map(|t| t.len()), Some(2));
    assert_eq!(
        output.guided(),
        Some(Guided::JsonSchema(json!({"type": "object"}).to_string()))
    );
    let mut shaper = Shaper::new(&output, "r", "");
    let mut pieces = shaper.push("{\"city\": ");
    pieces.extend(shaper.push("\"Paris\"}"));
    pieces.extend(shaper.finish());
    assert_eq!(pieces.len(), 1, "{pieces:?}");
    let Piece::ToolCall(call) = &pieces[0] else {
        panic!("{pieces:?}")
    };
    assert_eq!(call.function.name, "f");
    assert_eq!(call.function.arguments, r#"{"city":"Paris"}"#);
    assert_eq!(shaper.finish_reason("stop"), "tool_calls");

    let (required, _) = ChatOutput::resolve(
        OutputFormats::default(),
        "m",
        Some(vec![tool("f"), tool("g")]),
        Some(json!("required")),
        None,
    )
    .unwrap();
    let Some(Guided::JsonSchema(schema)) = required.guided() else {
        panic!("a schema")
    };
    let schema: Json = serde_json::from_str(&schema).unwrap();
    assert_eq!(schema["type"], "array");
    assert_eq!(schema["items"]["anyOf"].as_array().unwrap().len(), 2);
    let mut shaper = Shaper::new(&required, "r", "");
    let mut pieces =
        shaper.push(r#"[{"name": "g", "parameters": {"a": 1}}, {"name": "f", "parameters": {}}]"#);
    pieces.extend(shaper.finish());
    let names: Vec<_> = pieces
        .iter()
        .filter_map(|p| match p {
            Piece::ToolCall(c) => Some(c.function.name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(names, ["g", "f"]);

    // An answer that is not the call is the content, counted as malformed.
    let mut shaper = Shaper::new(&required, "r", "");
    let mut pieces = shaper.push("sorry");
    pieces.extend(shaper.finish());
    assert_eq!(pieces, vec![Piece::Content("sorry".into())]);
    assert_eq!(shaper.malformed_tool_calls(), 1);
}
