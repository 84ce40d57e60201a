//! Qwen3's Hugging Face files against ids and renderings produced by Python (see
//! `tests/fixtures/gen_qwen3_fixtures.py`).

use switchyard_tokenize::{ChatMessage, ChatRequest, Preprocessor, TokenId};

use crate::support::{fixtures, qwen3};

fn ids(value: &serde_json::Value) -> Vec<TokenId> {
    serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("ids: {e}"))
}

#[test]
fn encode_matches_python_tokenizers() {
    let model = qwen3();
    let fixtures = fixtures();
    let cases = fixtures["encode"]
        .as_array()
        .unwrap_or_else(|| panic!("no encode cases"));
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let got = model
            .tokenizer()
            .encode(text)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got, ids(&case["ids"]), "encoding {text:?}");
    }
}

#[test]
fn special_tokens_are_single_ids() {
    let model = qwen3();
    let tok = model.tokenizer();
    let fixtures = fixtures();
    for (text, id) in fixtures["special"]
        .as_object()
        .unwrap_or_else(|| panic!("no special"))
    {
        let id = id.as_u64().unwrap() as TokenId;
        assert_eq!(tok.encode(text).unwrap(), vec![id], "{text}");
        assert_eq!(tok.token_to_id(text), Some(id));
    }
    assert!(tok.is_special(151_644), "<|im_start|> is special");
    assert!(!tok.is_special(9707), "an ordinary word is not special");
    assert_eq!(
        tok.vocab_size() as u64,
        fixtures["vocab_size"].as_u64().unwrap()
    );
}

#[test]
fn decode_round_trips() {
    let model = qwen3();
    let tok = model.tokenizer();
    for text in [
        "Hello, world!",
        "数字 和中文 🦀🚀",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn metadata_comes_from_the_config_files() {
    let model = qwen3();
    assert_eq!(model.name(), "qwen3");
    assert_eq!(model.eos_token_ids(), &[151_645], "eos_token <|im_end|>");
    // No config.json in the test files: model_max_length from tokenizer_config.json.
    assert_eq!(model.context_length(), Some(131_072));
}

#[test]
fn chat_template_matches_python_jinja() {
    let model = qwen3();
    let fixtures = fixtures();
    let cases = fixtures["chat"]
        .as_array()
        .unwrap_or_else(|| panic!("no chat cases"));
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let request: ChatRequest = serde_json::from_value(case["request"].clone())
            .unwrap_or_else(|e| panic!("{name}: request does not parse: {e}"));
        let text = model
            .render_chat(&request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name}: rendered text"
        );
        let got = model
            .encode_chat(&request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, ids(&case["ids"]), "{name}: ids");
    }
}

#[test]
fn system_user_prompt_reads_as_expected() {
    // Hand-checked against Qwen3's documented ChatML layout.
    let request = ChatRequest::new(vec![
        ChatMessage::text("system", "You are a helpful assistant."),
        ChatMessage::text("user", "Hi"),
    ]);
    let text = qwen3()
        .render_chat(&request)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// Qwen3's template reads `enable_thinking` (and not gpt-oss's `reasoning_effort`); switched
/// off, the assistant's turn opens with an empty think block, as vLLM renders it.
#[test]
fn enable_thinking_is_a_switch_the_template_reads() {
    let dir = qwen3();
    let template = dir.chat_template().unwrap();
    assert!(template.reads("enable_thinking"));
    assert!(!template.reads("reasoning_effort"));
    let mut request = ChatRequest::new(vec![ChatMessage::text("user", "Hi")]);
    let on = dir.render_chat(&request).unwrap();
    request
        .template_kwargs
        .insert("enable_thinking".into(), serde_json::Value::Bool(false));
    let off = dir.render_chat(&request).unwrap();
    assert_eq!(off, format!("{on}<think>\n\n</think>\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preprocessor_encodes_long_prompts_off_the_reactor() {
    let model = qwen3();
    let preprocessor = Preprocessor::new(model.clone(), 2);
    let long = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸。 ".repeat(600);
    let request = ChatRequest::new(vec![ChatMessage::text("user", long.clone())]);
    let (a, b) = tokio::join!(
        preprocessor.encode_chat(request.clone()),
        preprocessor.encode(long.clone())
    );
    let encoded = a.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(encoded.token_ids, model.encode_chat(&request).unwrap());
    assert_eq!(b.unwrap(), model.tokenizer().encode(&long).unwrap());
    assert!(
        encoded.token_ids.len() > 5_000,
        "long enough to go to the blocking pool"
    );
    assert_eq!(preprocessor.context_length(), Some(131_072));
    let mut decoder = preprocessor.decoder();
    let mut out = String::new();
    for &id in &encoded.token_ids[..50] {
        out.push_str(&decoder.push(id).unwrap());
    }
    out.push_str(&decoder.finish().unwrap());
    assert_eq!(
        out,
        model
            .tokenizer()
            .decode(&encoded.token_ids[..50], true)
            .unwrap()
    );
}

/// What Qwen3's own template writes for an assistant turn with reasoning and tool calls is what
/// the output parser it implies reads back: the reasoning, the answer and the calls.
#[test]
fn the_template_s_tool_calls_and_reasoning_parse_back() {
    use switchyard_tokenize::{OutputEvent, OutputParser, ReasoningFormat, ToolCallFormat};

    let model = qwen3();
    let template = model.chat_template().expect("Qwen3 has a chat template");
    let formats = template.output_formats();
    assert_eq!(formats.tool_call, Some(ToolCallFormat::Hermes));
    assert_eq!(formats.reasoning, Some(ReasoningFormat::Think));

    let tools = vec![serde_json::json!({"type": "function", "function": {
        "name": "read_file", "parameters": {"type": "object",
        "properties": {"path": {"type": "string"}}}}})];
    let assistant: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "assistant",
        "content": "Reading it.",
        "reasoning_content": "The user wants the file.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "read_file", "arguments": {"path": "src/lib.rs"}}}]
    }))
    .unwrap();
    let mut request = ChatRequest::new(vec![
        ChatMessage::text("user", "Open src/lib.rs"),
        assistant,
    ]);
    request.tools = Some(tools.clone());
    request.add_generation_prompt = false;
    let rendered = model.render_chat(&request).unwrap();
    let turn = rendered
        .rsplit("<|im_start|>assistant\n")
        .next()
        .and_then(|t| t.split("<|im_end|>").next())
        .unwrap();

    let mut parser = OutputParser::new(
        formats.reasoning,
        false,
        formats.tool_call.map(|f| (f, &tools[..])),
    );
    let mut events = parser.push(turn);
    events.extend(parser.finish());
    let reasoning: String = events
        .iter()
        .filter_map(|e| match e {
            OutputEvent::Reasoning(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let content: String = events
        .iter()
        .filter_map(|e| match e {
            OutputEvent::Content(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let calls: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            OutputEvent::ToolCall(c) => Some(c.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning.trim(), "The user wants the file.", "{turn:?}");
    assert_eq!(content.trim(), "Reading it.", "{turn:?}");
    assert_eq!(calls.len(), 1, "{turn:?}");
    assert_eq!(calls[0].name, "read_file");
    assert_eq!(calls[0].arguments, r#"{"path":"src/lib.rs"}"#);
}
