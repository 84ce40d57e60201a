//! Every renderer fed the same answer: the same pieces come out in each API's own shape, in
//! order, streamed and whole, and a failure ends each stream in its API's error form.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Value as Json, json};
use switchyard_tokenize::ModelDir;

use super::*;
use crate::api::chat_output::{FunctionCall, ToolCallOut};
use crate::api::http::anthropic::MessagesRenderer;
use crate::api::http::completions::{ChatRenderer, TextRenderer};
use crate::api::http::responses::{Echo, ResponsesConfig, ResponsesRenderer, ResponsesState};

fn tokenizer() -> Arc<Tokenizer> {
    static DIR: OnceLock<ModelDir> = OnceLock::new();
    Arc::clone(
        DIR.get_or_init(|| ModelDir::from_builtin_spec("builtin").unwrap())
            .tokenizer(),
    )
}

fn answering(include_usage: bool) -> Answering {
    Answering {
        id: "id-1".into(),
        model: "m".into(),
        n: 1,
        include_usage,
        echoes: vec![None],
        tenant: None,
        tokenizer: tokenizer(),
    }
}

/// What the driver tells a renderer, in order.
enum Step {
    Started(Usage),
    Delta(Vec<Piece>),
    Finished(&'static str),
    Ended(Usage),
    Failed(ApiError),
}

fn call() -> ToolCallOut {
    ToolCallOut {
        index: 0,
        id: "call_w0".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into(),
        },
    }
}

/// A chat answer: reasoning, text, then a tool call.
fn chat_answer() -> Vec<Step> {
    vec![
        Step::Started(Usage::new(12, 0, 8)),
        Step::Delta(vec![Piece::Reasoning("Paris?".into())]),
        Step::Delta(vec![Piece::Content("Checking.".into())]),
        Step::Delta(vec![Piece::ToolCall(call())]),
        Step::Finished("tool_calls"),
        Step::Ended(Usage::new(12, 7, 8)),
    ]
}

/// A text answer that fails mid-stream.
fn failing() -> Vec<Step> {
    vec![
        Step::Started(Usage::new(5, 0, 0)),
        Step::Delta(vec![Piece::Content("par".into())]),
        Step::Failed(ApiError::Upstream("worker lost".into())),
    ]
}

async fn feed<R: Renderer>(renderer: &mut R, a: &Answering, steps: Vec<Step>) -> Vec<Frame> {
    let mut frames = renderer.open(a);
    for step in steps {
        frames.extend(match step {
            Step::Started(prompt) => renderer.started(a, 0, &prompt),
            Step::Delta(pieces) => renderer.delta(
                a,
                0,
                Delta {
                    pieces,
                    logprobs: None,
                },
            ),
            Step::Finished(finish) => renderer.finished(a, 0, finish),
            Step::Ended(usage) => renderer.ended(a, &usage).await,
            Step::Failed(err) => renderer.failed(a, &err),
        });
    }
    frames
}

fn json_of(frame: &Frame) -> Json {
    serde_json::from_str(&frame.data).unwrap()
}

fn names(frames: &[Frame]) -> Vec<&'static str> {
    frames.iter().map(|f| f.name.unwrap_or("-")).collect()
}

async fn body_of(response: Response) -> Json {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn whole_answer(content: &str, finish: &'static str) -> Whole {
    Whole {
        choices: vec![WholeChoice {
            answer: Gathered {
                content: content.into(),
                reasoning: Some("Paris?".into()),
                tool_calls: vec![call()],
            },
            logprobs: None,
            finish,
        }],
        usage: Usage::new(12, 7, 8),
    }
}

fn echo(store: bool) -> Echo {
    Echo {
        instructions: None,
        max_output_tokens: None,
        tools: Vec::new(),
        tool_choice: json!("auto"),
        parallel_tool_calls: true,
        temperature: None,
        top_p: None,
        text_format: json!({"type": "text"}),
        metadata: BTreeMap::new(),
        user: None,
        store,
        previous_response_id: None,
        seal_reasoning: false,
        input: vec![json!({"type": "message", "role": "user", "content": "hi"})],
        previous: Vec::new(),
    }
}

fn responses_state() -> Arc<ResponsesState> {
    Arc::new(ResponsesState::new(&ResponsesConfig::default(), None).unwrap())
}

#[tokio::test]
async fn chat_streams_one_chunk_per_piece_between_role_and_finish() {
    let a = answering(true);
    let frames = feed(&mut ChatRenderer::default(), &a, chat_answer()).await;
    assert!(frames.iter().all(|f| f.name.is_none()));
    assert_eq!(frames.last().unwrap().data, "[DONE]");
    let chunks: Vec<Json> = frames[..frames.len() - 1].iter().map(json_of).collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == "id-1" && c["model"] == "m")
    );
    let delta = |i: usize| &chunks[i]["choices"][0]["delta"];
    assert_eq!(*delta(0), json!({"role": "assistant", "content": ""}));
    assert_eq!(
        *delta(1),
        json!({"reasoning_content": "Paris?", "reasoning": "Paris?"})
    );
    assert_eq!(*delta(2), json!({"content": "Checking."}));
    assert_eq!(delta(3)["tool_calls"][0]["id"], "call_w0");
    assert_eq!(
        delta(3)["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Paris\"}"
    );
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(*delta(4), json!({}));
    // The usage chunk names no choice.
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 7);
    assert_eq!(
        chunks[5]["usage"]["prompt_tokens_details"]["cached_tokens"],
        8
    );
    assert_eq!(chunks.len(), 6);
    // Without `include_usage`, no usage chunk.
    let frames = feed(
        &mut ChatRenderer::default(),
        &answering(false),
        chat_answer(),
    )
    .await;
    assert_eq!(frames.len(), 6);
}

#[tokio::test]
async fn log_probabilities_of_held_back_text_go_out_alone() {
    let a = answering(false);
    let mut chat = ChatRenderer::default();
    let alone = Delta {
        pieces: Vec::new(),
        logprobs: Some(LogprobsOut::new(true)),
    };
    let frames = chat.delta(&a, 0, alone);
    assert_eq!(frames.len(), 1);
    let chunk = json_of(&frames[0]);
    assert_eq!(chunk["choices"][0]["delta"], json!({"content": ""}));
    assert!(chunk["choices"][0]["logprobs"].is_object());
    // Nothing at all: no chunk.
    assert!(chat.delta(&a, 0, Delta::default()).is_empty());
    // With pieces, the first carries them.
    let two = Delta {
        pieces: vec![Piece::Content("a".into()), Piece::Content("b".into())],
        logprobs: Some(LogprobsOut::new(true)),
    };
    let frames: Vec<Json> = chat.delta(&a, 0, two).iter().map(json_of).collect();
    assert!(frames[0]["choices"][0]["logprobs"].is_object());
    assert!(frames[1]["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn text_completions_stream_their_echo_then_the_text() {
    let mut a = answering(true);
    a.echoes = vec![Some("Say: ".into())];
    let steps = vec![
        Step::Started(Usage::new(3, 0, 0)),
        Step::Delta(vec![Piece::Content("Hello".into())]),
        Step::Delta(vec![Piece::Content(" world".into())]),
        Step::Finished("length"),
        Step::Ended(Usage::new(3, 2, 0)),
    ];
    let frames = feed(&mut TextRenderer::default(), &a, steps).await;
    let chunks: Vec<Json> = frames[..frames.len() - 1].iter().map(json_of).collect();
    let texts: Vec<&str> = chunks[..4]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["Say: ", "Hello", " world", ""]);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["usage"]["total_tokens"], 5);
    assert_eq!(frames.last().unwrap().data, "[DONE]");
}

#[tokio::test]
async fn messages_stream_the_same_answer_as_blocks() {
    let a = answering(true);
    let mut renderer = MessagesRenderer::new(Vec::new(), false);
    let frames = feed(&mut renderer, &a, chat_answer()).await;
    assert_eq!(
        names(&frames),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let data: Vec<Json> = frames.iter().map(json_of).collect();
    assert_eq!(data[0]["message"]["id"], "id-1");
    assert_eq!(
        data[0]["message"]["usage"],
        json!({"input_tokens": 4, "output_tokens": 0, "cache_read_input_tokens": 8,
               "cache_creation_input_tokens": 0})
    );
    assert_eq!(data[3]["delta"]["thinking"], "Paris?");
    assert_eq!(data[6]["delta"]["text"], "Checking.");
    assert_eq!(data[8]["content_block"]["id"], "toolu_w0");
    assert_eq!(data[9]["delta"]["partial_json"], "{\"city\":\"Paris\"}");
    assert_eq!(data[11]["delta"]["stop_reason"], "tool_use");
    assert_eq!(data[11]["usage"]["output_tokens"], 7);
    // Every event's data names its own type.
    for (frame, data) in frames.iter().zip(&data) {
        assert_eq!(Some(data["type"].as_str().unwrap()), frame.name);
    }
}

#[tokio::test]
async fn responses_stream_the_same_answer_as_items_and_store_it_first() {
    let a = answering(false);
    let state = responses_state();
    let mut renderer = ResponsesRenderer::new(echo(true), Arc::clone(&state));
    let frames = feed(&mut renderer, &a, chat_answer()).await;
    let names = names(&frames);
    assert_eq!(names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(*names.last().unwrap(), "response.completed");
    let data: Vec<Json> = frames.iter().map(json_of).collect();
    let sequence: Vec<u64> = data
        .iter()
        .map(|d| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..frames.len() as u64).collect::<Vec<_>>());
    let last = &data.last().unwrap()["response"];
    assert_eq!(last["id"], "id-1");
    assert_eq!(last["status"], "completed");
    let kinds: Vec<&str> = last["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(last["output"][2]["call_id"], "call_w0");
    assert_eq!(last["usage"]["input_tokens"], 12);
    assert_eq!(last["usage"]["output_tokens"], 7);
    let stored = state.store.get("id-1").await.unwrap().unwrap();
    assert_eq!(&stored.response, last);
}

#[tokio::test]
async fn a_failure_ends_every_stream_in_its_apis_error_form() {
    let a = answering(true);
    for frames in [
        feed(&mut ChatRenderer::default(), &a, failing()).await,
        feed(&mut TextRenderer::default(), &a, failing()).await,
    ] {
        let n = frames.len();
        assert_eq!(json_of(&frames[n - 2])["error"]["message"], "worker lost");
        assert_eq!(frames[n - 1].data, "[DONE]");
    }
    let frames = feed(&mut MessagesRenderer::new(Vec::new(), false), &a, failing()).await;
    let last = frames.last().unwrap();
    assert_eq!(last.name, Some("error"));
    assert_eq!(
        json_of(last),
        json!({"type": "error", "error": {"type": "api_error", "message": "worker lost"}})
    );
    let state = responses_state();
    let mut responses = ResponsesRenderer::new(echo(true), Arc::clone(&state));
    let frames = feed(&mut responses, &a, failing()).await;
    let last = frames.last().unwrap();
    assert_eq!(last.name, Some("response.failed"));
    let response = &json_of(last)["response"];
    assert_eq!(response["status"], "failed");
    assert_eq!(response["error"]["message"], "worker lost");
    // What was written before the failure stays in the output.
    assert_eq!(response["output"][0]["content"][0]["text"], "par");
    // A failed response is not stored.
    assert!(state.store.get("id-1").await.unwrap().is_none());
}

#[tokio::test]
async fn every_api_writes_the_same_whole_answer() {
    let a = || answering(false);
    let chat = body_of(
        ChatRenderer::default()
            .whole(a(), whole_answer("Checking.", "tool_calls"))
            .await,
    )
    .await;
    let message = &chat["choices"][0]["message"];
    assert_eq!(message["content"], "Checking.");
    assert_eq!(message["reasoning_content"], "Paris?");
    assert_eq!(message["tool_calls"][0]["id"], "call_w0");
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(chat["usage"]["prompt_tokens"], 12);

    let text = body_of(
        TextRenderer::default()
            .whole(a(), whole_answer("Checking.", "length"))
            .await,
    )
    .await;
    assert_eq!(text["choices"][0]["text"], "Checking.");
    assert_eq!(text["choices"][0]["finish_reason"], "length");

    let messages = body_of(
        MessagesRenderer::new(Vec::new(), false)
            .whole(a(), whole_answer("Checking.", "tool_calls"))
            .await,
    )
    .await;
    let blocks: Vec<&str> = messages["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(blocks, ["thinking", "text", "tool_use"]);
    assert_eq!(messages["content"][2]["input"], json!({"city": "Paris"}));
    assert_eq!(messages["stop_reason"], "tool_use");
    assert_eq!(messages["usage"]["input_tokens"], 4);

    let state = responses_state();
    let response = body_of(
        ResponsesRenderer::new(echo(true), Arc::clone(&state))
            .whole(a(), whole_answer("Checking.", "tool_calls"))
            .await,
    )
    .await;
    let kinds: Vec<&str> = response["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(response["status"], "completed");
    assert_eq!(
        state.store.get("id-1").await.unwrap().unwrap().response,
        response
    );
}

#[tokio::test]
async fn frames_go_on_the_wire_as_server_sent_events() {
    let frames = [
        Frame::named("ping", &json!({"type": "ping"})),
        Frame::data("[DONE]"),
    ];
    let events: Vec<Result<Event, Infallible>> = frames.iter().map(|f| Ok(f.event())).collect();
    let response = Sse::new(futures::stream::iter(events)).into_response();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(
        std::str::from_utf8(&bytes).unwrap(),
        "event: ping\ndata: {\"type\":\"ping\"}\n\ndata: [DONE]\n\n"
    );
}
