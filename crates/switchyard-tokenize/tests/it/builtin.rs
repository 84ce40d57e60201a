//! The offline default: `sim-8b` with `builtin:cl100k`.

use switchyard_tokenize::{ChatMessage, ChatRequest, ModelDir, Preprocessor};

use crate::support::builtin;

#[test]
fn round_trips_text() {
    let model = builtin();
    let tok = model.tokenizer();
    assert_eq!(tok.name(), "builtin:cl100k");
    assert_eq!(model.name(), "sim-8b");
    for text in [
        "Hello, world!",
        "",
        "数字 和中文 🦀🚀 👨‍👩‍👧",
        "  spaces\n\n\ttabs  ",
        "<|im_start|>x<|im_end|>",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Known cl100k_base ids (tiktoken: enc.encode("hello world") == [15339, 1917]).
    assert_eq!(tok.encode("hello world").unwrap(), vec![15339, 1917]);
}

#[test]
fn special_tokens_are_single_ids() {
    let tok = builtin().tokenizer().clone();
    assert_eq!(tok.encode("<|im_start|>").unwrap(), vec![100_264]);
    assert_eq!(tok.encode("<|im_end|>").unwrap(), vec![100_265]);
    assert_eq!(tok.encode("<|endoftext|>").unwrap(), vec![100_257]);
    assert_eq!(
        tok.encode("a<|im_start|>b<|im_end|><|").unwrap(),
        [vec![64, 100_264, 65, 100_265], tok.encode("<|").unwrap()].concat()
    );
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(100_265));
    assert!(tok.is_special(100_264));
    assert!(!tok.is_special(15339));
    assert_eq!(tok.decode(&[64, 100_264, 65], true).unwrap(), "ab");
    assert_eq!(tok.vocab_size(), 100_277);
    assert_eq!(builtin().eos_token_ids(), &[100_265, 100_257]);
    assert_eq!(builtin().context_length(), Some(131_072));
}

#[test]
fn unknown_ids_decode_to_nothing() {
    let tok = builtin().tokenizer().clone();
    assert_eq!(
        tok.decode(&[15339, 100_262, 9_999_999, 1917], false)
            .unwrap(),
        "hello world"
    );
}

#[test]
fn chatml_template_output() {
    let model = builtin();
    let request = ChatRequest::new(vec![
        ChatMessage::text("system", "Be brief."),
        ChatMessage::text("user", "Hi"),
    ]);
    let text = model.render_chat(&request).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = model.encode_chat(&request).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 100_264).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == 100_265).count(), 2);
    assert_eq!(
        &ids[ids.len() - 3..],
        &[100_264, 78191, 198],
        "ends with <|im_start|>assistant\\n"
    );

    let no_prompt = ChatRequest {
        add_generation_prompt: false,
        ..request
    };
    assert!(
        model
            .render_chat(&no_prompt)
            .unwrap()
            .ends_with("Hi<|im_end|>\n")
    );
}

#[test]
fn chatml_template_with_tools_and_tool_calls() {
    let request: ChatRequest = serde_json::from_value(serde_json::json!({
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "21C"}
        ],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    }))
    .unwrap();
    let text = builtin().render_chat(&request).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\n# Tools\n\nYou may call these functions:\n\
         {\"type\": \"function\", \"function\": {\"name\": \"w\", \"parameters\": {\"type\": \"object\"}}}\n<|im_end|>\n\
         <|im_start|>user\nWeather?<|im_end|>\n\
         <|im_start|>assistant\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
         <|im_start|>tool\n21C<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[tokio::test]
async fn preprocessor_works_on_a_current_thread_runtime() {
    let preprocessor =
        Preprocessor::new(std::sync::Arc::new(ModelDir::builtin()), 1).with_inline_max_bytes(0);
    let ids = preprocessor.encode("hello world".into()).await.unwrap();
    assert_eq!(ids, vec![15339, 1917]);
    let prompt = preprocessor
        .encode_chat(ChatRequest::new(vec![ChatMessage::text("user", "Hi")]))
        .await
        .unwrap();
    assert_eq!(
        prompt.text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        prompt.token_ids,
        builtin().tokenizer().encode(&prompt.text).unwrap()
    );
}
