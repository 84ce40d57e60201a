use serde_json::json;

use super::*;

fn call(index: usize, name: &str, arguments: &str) -> OutputEvent {
    OutputEvent::ToolCall(ToolCall {
        index,
        name: name.into(),
        arguments: arguments.into(),
    })
}

fn content(text: &str) -> OutputEvent {
    OutputEvent::Content(text.into())
}

fn reasoning(text: &str) -> OutputEvent {
    OutputEvent::Reasoning(text.into())
}

/// Parses `text` whole, then streamed in every two-piece split and character by character, and
/// requires the same events each time (merged across pushes); returns them.
fn parse_all_ways(make: impl Fn() -> OutputParser, text: &str) -> Vec<OutputEvent> {
    let run = |pieces: &[&str]| {
        let mut parser = make();
        let mut events = Vec::new();
        for piece in pieces {
            events.extend(parser.push(piece));
        }
        events.extend(parser.finish());
        merge(events)
    };
    let whole = run(&[text]);
    for (at, _) in text.char_indices().skip(1) {
        assert_eq!(
            run(&[&text[..at], &text[at..]]),
            whole,
            "split at {at}: {text:?}"
        );
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&pieces), whole, "character by character: {text:?}");
    whole
}

fn tools(format: ToolCallFormat) -> impl Fn() -> OutputParser {
    move || OutputParser::new(None, false, Some((format, &[])))
}

#[test]
fn hermes_calls_come_out_between_the_content() {
    let text = "Let me look.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"src/a.rs\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Hermes), text),
        vec![
            content("Let me look.\n"),
            call(0, "read_file", r#"{"path":"src/a.rs"}"#),
            content("\n"),
            call(1, "ls", "{}"),
        ]
    );
}

#[test]
fn a_call_that_does_not_parse_or_is_cut_off_stays_content() {
    let broken = "ok <tool_call>{\"name\": \"x\", \"arguments\": {</tool_call> done";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Hermes), broken),
        vec![content(broken)]
    );
    let cut = "ok <tool_call>{\"name\": \"x\", \"argum";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Hermes), cut),
        vec![content(cut)]
    );
    let mut parser = tools(ToolCallFormat::Hermes)();
    parser.push(cut);
    parser.finish();
    assert_eq!(parser.malformed_tool_calls(), 1);
    assert_eq!(parser.tool_calls(), 0);
}

#[test]
fn string_arguments_holding_json_are_accepted_and_others_refused() {
    let text = r#"<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>"#;
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Hermes), text),
        vec![call(0, "f", r#"{"a": 1}"#)]
    );
    let text = r#"<tool_call>{"name": "f", "arguments": [1]}</tool_call>"#;
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Hermes), text),
        vec![content(text)]
    );
}

#[test]
fn llama3_json_is_the_whole_output_and_plain_text_passes() {
    let text = r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}"#;
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Llama3Json), text),
        vec![
            call(0, "get_weather", r#"{"city":"Paris"}"#),
            call(1, "time", "{}")
        ]
    );
    let text = "  {\"name\": \"f\", \"parameters\": {\"s\": \"a;b\"}}";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Llama3Json), text),
        vec![call(0, "f", r#"{"s":"a;b"}"#)]
    );
    // JSON that is not a call, and text, are content.
    for text in ["{\"answer\": 42}", "The answer is {42}.", "  "] {
        assert_eq!(
            parse_all_ways(tools(ToolCallFormat::Llama3Json), text),
            vec![content(text)]
        );
    }
}

#[test]
fn mistral_lists_and_v11_calls() {
    let text =
        r#"[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]"#;
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Mistral), text),
        vec![call(0, "a", r#"{"x":1}"#), call(1, "b", "{}")]
    );
    let text = r#"Sure.[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]abc123xyz[ARGS]{}"#;
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::Mistral), text),
        vec![
            content("Sure."),
            call(0, "a", r#"{"x":1}"#),
            call(1, "b", "{}")
        ]
    );
}

#[test]
fn deepseek_v3_and_v31_calls() {
    let v3 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::DeepSeekV3), v3),
        vec![call(0, "get_weather", r#"{"city":"Paris"}"#)]
    );
    let v31 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜><｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        parse_all_ways(tools(ToolCallFormat::DeepSeekV3), v31),
        vec![
            content("Checking."),
            call(0, "a", r#"{"x":1}"#),
            call(1, "b", "{}")
        ]
    );
}

#[test]
fn qwen3_coder_values_are_typed_by_the_tool_schema() {
    let defs = vec![
        json!({"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {
            "path": {"type": "string"}, "line": {"type": "integer"},
            "dry_run": {"type": "boolean"}, "code": {"type": "string"}}}}}),
    ];
    let text = "<tool_call>\n<function=edit>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=line>\n42\n</parameter>\n<parameter=dry_run>\nfalse\n</parameter>\n<parameter=code>\n123\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n</function>\n</tool_call>";
    let make = || OutputParser::new(None, false, Some((ToolCallFormat::Qwen3Coder, &defs)));
    assert_eq!(
        parse_all_ways(make, text),
        vec![call(
            0,
            "edit",
            r#"{"path":"src/main.rs","line":42,"dry_run":false,"code":"123","extra":"[1]"}"#
        )]
    );
}

#[test]
fn reasoning_is_split_from_the_answer() {
    let think = || OutputParser::new(Some(ReasoningFormat::Think), false, None);
    assert_eq!(
        parse_all_ways(think, "<think>\nWhich file?\n</think>\n\nThe answer."),
        vec![reasoning("\nWhich file?\n"), content("The answer.")]
    );
    // Without a <think>, Qwen3 output is all answer.
    assert_eq!(
        parse_all_ways(think, "No thinking here </think> at all"),
        vec![content("No thinking here </think> at all")]
    );
    // Cut off inside the block: reasoning all the same.
    assert_eq!(
        parse_all_ways(think, "<think>still going"),
        vec![reasoning("still going")]
    );
    // The prompt opened the block (DeepSeek-R1, or a template ending in <think>).
    let r1 = || OutputParser::new(Some(ReasoningFormat::DeepSeekR1), false, None);
    assert_eq!(
        parse_all_ways(r1, "Hmm, 2+2.</think>4"),
        vec![reasoning("Hmm, 2+2."), content("4")]
    );
    let opened = || OutputParser::new(Some(ReasoningFormat::Think), true, None);
    assert_eq!(
        parse_all_ways(opened, "<think>a</think>b"),
        vec![reasoning("a"), content("b")]
    );
}

#[test]
fn reasoning_then_tool_calls() {
    let make = || {
        OutputParser::new(
            Some(ReasoningFormat::Think),
            false,
            Some((ToolCallFormat::Hermes, &[])),
        )
    };
    let text = "<think>I need the file. <tool_call> is how I call.</think>\n\n<tool_call>\n{\"name\": \"cat\", \"arguments\": {\"p\": \"x\"}}\n</tool_call>";
    assert_eq!(
        parse_all_ways(make, text),
        vec![
            reasoning("I need the file. <tool_call> is how I call."),
            call(0, "cat", r#"{"p":"x"}"#)
        ]
    );
}

#[test]
fn unknown_format_names_are_refused_with_the_known_ones() {
    let err = "nope".parse::<ToolCallFormat>().unwrap_err();
    assert!(err.contains("hermes") && err.contains("nope"), "{err}");
    let err = "nope".parse::<ReasoningFormat>().unwrap_err();
    assert!(err.contains("deepseek_r1"), "{err}");
    assert_eq!("qwen".parse::<ToolCallFormat>(), Ok(ToolCallFormat::Hermes));
    assert!(OutputParser::new(None, false, None).is_passthrough());
}

mod streamed_equals_whole {
    use proptest::prelude::*;

    use super::*;

    /// Pieces that make markers, half-markers, JSON and text meet at every boundary.
    const PIECES: &[&str] = &[
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "</",
        "[TOOL_CALLS]",
        "[ARGS]",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<function=f>",
        "<parameter=p>",
        "</parameter>",
        "</function>",
        "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
        "{",
        "}",
        "\n",
        " ",
        "text",
        "é",
        "<|python_tag|>",
        ";",
    ];

    fn formats() -> impl Strategy<Value = (Option<ReasoningFormat>, bool, Option<ToolCallFormat>)> {
        (
            prop_oneof![
                Just(None),
                Just(Some(ReasoningFormat::Think)),
                Just(Some(ReasoningFormat::DeepSeekR1))
            ],
            any::<bool>(),
            prop_oneof![
                Just(None),
                Just(Some(ToolCallFormat::Hermes)),
                Just(Some(ToolCallFormat::Llama3Json)),
                Just(Some(ToolCallFormat::Mistral)),
                Just(Some(ToolCallFormat::DeepSeekV3)),
                Just(Some(ToolCallFormat::Qwen3Coder)),
            ],
        )
    }

    proptest! {
        #[test]
        fn any_chunking_gives_the_same_events(
            pieces in proptest::collection::vec(proptest::sample::select(PIECES), 0..24),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
            (reasoning, opened, tools) in formats(),
        ) {
            let text: String = pieces.concat();
            let make = || OutputParser::new(reasoning, opened, tools.map(|f| (f, &[][..])));
            let mut whole_parser = make();
            let mut whole = whole_parser.push(&text);
            whole.extend(whole_parser.finish());
            let whole = merge(whole);

            let mut bounds: Vec<usize> = cuts.iter().map(|i| i.index(text.len() + 1)).collect();
            bounds.retain(|&b| text.is_char_boundary(b));
            bounds.sort_unstable();
            let mut parser = make();
            let mut streamed = Vec::new();
            let mut from = 0;
            for b in bounds.into_iter().chain([text.len()]) {
                streamed.extend(parser.push(&text[from..b]));
                from = b;
            }
            streamed.extend(parser.finish());
            prop_assert_eq!(merge(streamed), whole.clone());

            // Nothing is lost: without tool calls, the text comes back whole (reasoning markers
            // aside).
            if tools.is_none() && reasoning.is_none() {
                let joined: String = whole.iter().map(|e| match e {
                    OutputEvent::Content(t) => t.as_str(),
                    _ => "",
                }).collect();
                prop_assert_eq!(joined, text);
            }
        }
    }
}
