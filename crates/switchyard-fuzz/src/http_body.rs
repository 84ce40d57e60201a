//! `http_chat_body`: a request body as the gateway's completion endpoints parse and validate it
//! before admission (`switchyard_gateway::api::http::completions::parse_*_request`, and
//! `switchyard_gateway::api::http::responses::parse_responses_request`, and
//! `http::anthropic::parse_messages_request` for Anthropic's Messages API).
//!
//! The input is the body, tried as each endpoint's body. A refusal must be a client error
//! (4xx) with an OpenAI error object; an accepted request must hold what the handler relies on.

use axum::response::IntoResponse;
use switchyard_gateway::api::http::anthropic::parse_messages_request;
use switchyard_gateway::api::http::completions::{
    ParsedRequest, PromptSource, parse_chat_request, parse_completion_request,
};
use switchyard_gateway::api::http::responses::parse_responses_request;
use switchyard_gateway::error::ApiError;

/// Runs one input.
pub fn run(data: &[u8]) {
    check(parse_chat_request(data), Endpoint::Chat);
    check(parse_completion_request(data), Endpoint::Text);
    check(parse_responses_request(data), Endpoint::Responses);
    // Anthropic's Messages body becomes a chat request.
    check(parse_messages_request(data), Endpoint::Chat);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
    Responses,
}

fn check(parsed: Result<ParsedRequest, ApiError>, endpoint: Endpoint) {
    match parsed {
        Ok(request) => accepted(&request, endpoint),
        Err(err) => refused(err),
    }
}

fn accepted(request: &ParsedRequest, endpoint: Endpoint) {
    match (&request.source, endpoint) {
        (PromptSource::Chat { messages, .. }, Endpoint::Chat | Endpoint::Responses) => {
            assert!(
                !messages.is_empty(),
                "a chat request without messages was accepted"
            );
        }
        (PromptSource::Texts(_) | PromptSource::Tokens(_), Endpoint::Text) => {
            assert!(
                request.source.count() > 0,
                "a completion without a prompt was accepted"
            );
        }
        (prompt, endpoint) => panic!("{endpoint:?} body parsed to the other endpoint's {prompt:?}"),
    }
    if let Some(n) = request.sampling.n {
        assert!((1..=128).contains(&n), "n = {n} was accepted");
    }
}

fn refused(err: ApiError) {
    let status = err.status();
    assert!(
        status.is_client_error(),
        "a body was refused with {status}, not a client error: {err}"
    );
    let body = err.to_json();
    let message = body
        .pointer("/error/message")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default();
    assert!(
        !message.is_empty(),
        "error object without a message: {body}"
    );
    let response = err.into_response();
    assert_eq!(response.status(), status);
}
