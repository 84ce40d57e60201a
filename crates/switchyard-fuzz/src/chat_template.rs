//! `chat_template`: chat-template rendering (`switchyard_tokenize::ChatTemplate`) of arbitrary
//! conversations, and of arbitrary templates.
//!
//! Input: one mode byte, then
//!
//! - even mode: a chat request as JSON (`ChatRequest`: messages, tools, template kwargs),
//!   rendered with the built-in ChatML template (and tokenized with the built-in tokenizer, as
//!   the gateway does) and with Qwen3's template (`switchyard-tokenize/tests/fixtures/qwen3_chat_template.jinja`, from Qwen3's
//!   `tokenizer_config.json`);
//! - odd mode: a template source, a NUL byte, then the request JSON (a two-message
//!   conversation when it is absent or not a request). Chat templates come from model
//!   directories, so they are operator input, not client input, but a template that loops or
//!   builds huge strings must still end with an error within the render's fuel budget
//!   ([`switchyard_tokenize::chat::render_fuel`]) rather than hang the gateway or exhaust its
//!   memory.
//!
//! Checks: nothing panics and every render ends (libFuzzer's `-timeout` and `-rss_limit_mb`
//! catch a render that does not); a refusal is the request's fault or, for a template that
//! does not compile or uses up its budget, the model files'; never an internal error.

use std::sync::OnceLock;

use switchyard_tokenize::{ChatMessage, ChatRequest, ChatTemplate, Fault, ModelDir, TokenizeError};

/// Qwen3's chat template, as its `tokenizer_config.json` ships it.
pub const QWEN3_TEMPLATE: &str =
    include_str!("../../switchyard-tokenize/tests/fixtures/qwen3_chat_template.jinja");

/// Most prompt tokens a render is tokenized to (the gateway stops at the context the same way).
const MAX_TOKENS: usize = 1 << 16;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Some(request) = request_of(rest) {
            fixed_templates(&request);
        }
    } else {
        let (source, request) = match rest.iter().position(|&b| b == 0) {
            Some(nul) => (&rest[..nul], request_of(&rest[nul + 1..])),
            None => (rest, None),
        };
        let Ok(source) = std::str::from_utf8(source) else {
            return;
        };
        let request = request.unwrap_or_else(default_request);
        any_template(source, &request);
    }
}

fn request_of(json: &[u8]) -> Option<ChatRequest> {
    serde_json::from_slice(json).ok()
}

fn default_request() -> ChatRequest {
    ChatRequest::new(vec![
        ChatMessage::text("system", "You are a helpful assistant."),
        ChatMessage::text("user", "Hello!"),
    ])
}

fn builtin() -> &'static ModelDir {
    static BUILTIN: OnceLock<ModelDir> = OnceLock::new();
    BUILTIN.get_or_init(ModelDir::builtin)
}

fn qwen3() -> Option<&'static ChatTemplate> {
    static QWEN3: OnceLock<Option<ChatTemplate>> = OnceLock::new();
    QWEN3
        .get_or_init(|| ChatTemplate::new(QWEN3_TEMPLATE, None, Some("<|im_end|>".to_owned())).ok())
        .as_ref()
}

fn fixed_templates(request: &ChatRequest) {
    match builtin().render_chat(request) {
        Ok(text) => match builtin().tokenizer().encode_within(&text, MAX_TOKENS) {
            Ok(_) | Err(TokenizeError::TooManyTokens { .. }) => {}
            Err(err) => panic!("the built-in tokenizer failed on a rendered prompt: {err}"),
        },
        Err(err) => request_fault(&err),
    }
    let qwen3 = qwen3().unwrap_or_else(|| panic!("Qwen3's chat template does not compile"));
    if let Err(err) = qwen3.render(request) {
        request_fault(&err);
    }
}

/// A known-good template refuses a conversation only as the request's fault.
fn request_fault(err: &TokenizeError) {
    assert_eq!(
        err.fault(),
        Fault::Request,
        "a known-good template failed other than for the request: {err}"
    );
}

fn any_template(source: &str, request: &ChatRequest) {
    let template = match ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) {
        Ok(template) => template,
        Err(err) => {
            assert_eq!(err.fault(), Fault::ModelFiles, "{err}");
            return;
        }
    };
    if let Err(err) = template.render(request) {
        assert_ne!(err.fault(), Fault::Internal, "{err}");
    }
}
