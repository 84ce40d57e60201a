//! Bad model files and bad requests give clear errors, never panics.

use std::path::Path;

use switchyard_tokenize::{ChatMessage, ChatRequest, ChatTemplate, Fault, ModelDir, TokenizeError};

use crate::support::{builtin, qwen3_dir};

fn model_dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, body) in files {
        std::fs::write(dir.path().join(name), body).unwrap();
    }
    dir
}

fn copy_qwen3_tokenizer(to: &Path) {
    std::fs::copy(
        qwen3_dir().join("tokenizer.json"),
        to.join("tokenizer.json"),
    )
    .unwrap();
}

#[test]
fn missing_directory_or_tokenizer_json() {
    let err = ModelDir::load(Path::new("/nonexistent/model")).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::MissingFile {
                file: "tokenizer.json",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "model directory /nonexistent/model has no tokenizer.json"
    );
    assert_eq!(err.fault(), Fault::ModelFiles);
}

#[test]
fn malformed_tokenizer_json() {
    let dir = model_dir_with(&[("tokenizer.json", "{\"model\": 42")]);
    let err = ModelDir::load(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizeError::InvalidTokenizer { .. }),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("tokenizer.json is not a tokenizer"),
        "{message}"
    );
}

#[test]
fn malformed_tokenizer_config_json() {
    let dir = model_dir_with(&[("tokenizer_config.json", "{not json")]);
    copy_qwen3_tokenizer(dir.path());
    let err = ModelDir::load(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizeError::InvalidJson { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn wrongly_typed_config_fields() {
    for (config, expect) in [
        (r#"{"chat_template": 7}"#, "chat_template must be a string"),
        (
            r#"{"chat_template": [{"name": "default"}]}"#,
            "needs string \"name\" and \"template\"",
        ),
        (
            r#"{"eos_token": 5}"#,
            "eos_token must be a string or an AddedToken",
        ),
    ] {
        let dir = model_dir_with(&[("tokenizer_config.json", config)]);
        copy_qwen3_tokenizer(dir.path());
        let err = ModelDir::load(dir.path()).unwrap_err();
        assert!(err.to_string().contains(expect), "{config}: {err}");
    }
}

#[test]
fn template_that_does_not_compile() {
    let dir = model_dir_with(&[(
        "tokenizer_config.json",
        r#"{"chat_template": "{% for m in messages %}"}"#,
    )]);
    copy_qwen3_tokenizer(dir.path());
    let err = ModelDir::load(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateSyntax { .. }), "{err}");
    assert!(
        err.to_string()
            .starts_with("chat template \"default\" does not compile"),
        "{err}"
    );
}

#[test]
fn named_templates_and_no_template() {
    let config = r#"{
        "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
        "chat_template": [
            {"name": "default", "template": "plain:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"}
        ]}"#;
    let dir = model_dir_with(&[("tokenizer_config.json", config)]);
    copy_qwen3_tokenizer(dir.path());
    let model = ModelDir::load(dir.path()).unwrap();
    assert_eq!(model.eos_token_ids(), &[151_645]);
    let mut request = ChatRequest::new(vec![ChatMessage::text("user", "x")]);
    assert_eq!(model.render_chat(&request).unwrap(), "plain:x");
    request.tools = Some(vec![serde_json::json!({"type": "function"})]);
    assert_eq!(model.render_chat(&request).unwrap(), "tools:1");

    let bare = model_dir_with(&[]);
    copy_qwen3_tokenizer(bare.path());
    let model = ModelDir::load(bare.path()).unwrap();
    let err = model.render_chat(&request).unwrap_err();
    assert!(matches!(err, TokenizeError::NoChatTemplate { .. }), "{err}");
    assert_eq!(err.fault(), Fault::Request);
}

#[test]
fn raise_exception_and_runtime_errors_are_request_errors() {
    let template = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user turn') }}{% endif %}ok",
        None,
        None,
    )
    .unwrap();
    let err = template
        .render(&ChatRequest::new(vec![ChatMessage::text("assistant", "x")]))
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Request);
    assert!(
        err.to_string()
            .contains("Conversation must start with a user turn"),
        "{err}"
    );

    let template = ChatTemplate::new("{{ messages[0].content + 1 }}", None, None).unwrap();
    let err = template
        .render(&ChatRequest::new(vec![ChatMessage::text("user", "x")]))
        .unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateRender { .. }), "{err}");
}

#[test]
fn unsupported_content_parts() {
    let request: ChatRequest = serde_json::from_value(serde_json::json!({
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    }))
    .unwrap();
    let err = builtin().render_chat(&request).unwrap_err();
    assert_eq!(
        err.to_string(),
        "message 0 has a content part of type \"image_url\"; only \"text\" parts are supported"
    );
    assert_eq!(err.fault(), Fault::Request);
}

#[test]
fn python_string_methods_and_loop_controls() {
    let template = ChatTemplate::new(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
         {{ m.content.strip().upper() }}|{{ 'y' if m.content.startswith(' a') else 'n' }}|{{ m.content.split(',')[-1] }};{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let request = ChatRequest::new(
        ["  a,b ", " a,c", "skipped"]
            .iter()
            .map(|t| ChatMessage::text("user", *t))
            .collect(),
    );
    assert_eq!(template.render(&request).unwrap(), "A,B|n|b ;A,C|y|c;");
}

/// What a template reads: each message's keys in `transformers`' order (absent ones not
/// defined), text parts joined, tool-call arguments parsed, `reasoning` under its
/// `reasoning_content` name; kwargs beside the request's own variables, which win over a kwarg
/// of the same name.
#[test]
fn the_template_sees_messages_and_variables_as_transformers_gives_them() {
    let template = ChatTemplate::new(
        "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v | tojson }};{% endfor %}\
         {{ m.tool_call_id is defined }}|{% endfor %}\
         {{ add_generation_prompt }} {{ enable_thinking }} {{ bos_token }} {{ eos_token }} {{ tools | length }}",
        Some("<s>".into()),
        None,
    )
    .unwrap();
    let assistant: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "assistant",
        "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
        "name": "bot",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}],
        "reasoning": "think",
    }))
    .unwrap();
    let tool: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "tool", "content": "42", "tool_call_id": "c1",
    }))
    .unwrap();
    let mut request = ChatRequest::new(vec![assistant, tool]);
    request.tools = Some(vec![serde_json::json!({"type": "function"})]);
    request.template_kwargs = serde_json::from_value(serde_json::json!({
        "add_generation_prompt": false, "enable_thinking": false,
    }))
    .unwrap();
    assert_eq!(
        template.render(&request).unwrap(),
        "role=\"assistant\";content=\"x\\ny\";name=\"bot\";\
         tool_calls=[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"b\": 1, \"a\": [2]}}}];\
         reasoning_content=\"think\";False|\
         role=\"tool\";content=\"42\";tool_call_id=\"c1\";True|\
         True False <s> None 1"
    );
}

#[test]
fn optional_config_files_supply_eos_ids_and_context_length() {
    let dir = model_dir_with(&[
        (
            "tokenizer_config.json",
            r#"{"eos_token": "<|im_end|>", "model_max_length": 1000000000000000019884624838656}"#,
        ),
        (
            "generation_config.json",
            r#"{"eos_token_id": [151645, 151643]}"#,
        ),
        (
            "config.json",
            r#"{"eos_token_id": 151643, "max_position_embeddings": 40960}"#,
        ),
        ("chat_template.jinja", "jinja:{{ messages | length }}"),
    ]);
    copy_qwen3_tokenizer(dir.path());
    let model = ModelDir::load(dir.path()).unwrap();
    assert_eq!(model.eos_token_ids(), &[151_645, 151_643]);
    assert_eq!(model.context_length(), Some(40_960));
    let request = ChatRequest::new(vec![ChatMessage::text("user", "x")]);
    assert_eq!(model.render_chat(&request).unwrap(), "jinja:1");

    // transformers' "no limit" sentinel is not a context length.
    let dir = model_dir_with(&[(
        "tokenizer_config.json",
        r#"{"model_max_length": 1000000000000000019884624838656}"#,
    )]);
    copy_qwen3_tokenizer(dir.path());
    assert_eq!(ModelDir::load(dir.path()).unwrap().context_length(), None);
}

#[test]
fn template_list_without_default_uses_the_first() {
    let template = ChatTemplate::named(
        vec![
            ("rag".into(), "first".into()),
            ("other".into(), "second".into()),
        ],
        None,
        None,
    )
    .unwrap();
    let request = ChatRequest::new(vec![ChatMessage::text("user", "x")]);
    assert_eq!(template.render(&request).unwrap(), "first");
    let err = ChatTemplate::named(vec![("rag".into(), "{% if %}".into())], None, None).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("chat template \"rag\" does not compile"),
        "{err}"
    );
}
