//! Answering a prepared request: start its choices ([`super::choices`]), turn each choice's
//! events into text ([`super::assemble`]), and write the result as one JSON body or as
//! server-sent events (one chunk per choice event, tagged with the choice's index).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;

use super::assemble::{ChoiceText, Gathered, request_usage};
use super::choices::Choices;
use super::completions::{Kind, Prepared, fail, record};
use super::{AppState, unix_now};
use crate::admission::Admitted;
use crate::chat_output::{Piece as OutputPiece, ToolCallOut};
use crate::dispatch::DispatchEvent;
use crate::error::ApiError;
use crate::metrics::ModelLabels;
use crate::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, Completion,
    CompletionChoice, LogprobsOut, Usage,
};

pub(super) async fn respond(state: Arc<AppState>, p: Prepared, permit: Admitted) -> Response {
    let in_flight = InFlight::new(&state);
    let labels = ModelLabels {
        model: p.model.clone(),
    };
    let mut choices = Choices::start(&state, &p, permit);
    let mut texts: Vec<ChoiceText> = p
        .prompts
        .iter()
        .flat_map(|prompt| (0..p.asks.n).map(move |_| prompt))
        .map(|prompt| ChoiceText::new(&p, prompt))
        .collect();
    // The first event decides the status code.
    let first = match choices.next().await {
        Some(first @ (_, DispatchEvent::Started { .. })) => first,
        Some((_, DispatchEvent::Failed(err))) => return fail(&state, p.kind, &p.model, err),
        Some(other) => {
            return fail(
                &state,
                p.kind,
                &p.model,
                ApiError::Internal(format!("dispatch began with {other:?}")),
            );
        }
        None => {
            return fail(
                &state,
                p.kind,
                &p.model,
                ApiError::Internal("dispatch ended without an answer".into()),
            );
        }
    };
    if p.stream {
        record(&state, p.kind, &p.model, "ok");
        let answer = Answer {
            state,
            p,
            labels,
            choices,
            texts,
            _in_flight: in_flight,
            first: Some(first),
        };
        if answer.p.kind == Kind::Responses {
            return super::responses::stream(answer);
        }
        let events = sse_events(answer);
        return Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    // An echoed prompt starts each of its choices' text.
    let mut contents: Vec<Gathered> = p
        .prompts
        .iter()
        .flat_map(|prompt| {
            std::iter::repeat_n(prompt.echo.clone().unwrap_or_default(), p.asks.n as usize)
        })
        .map(Gathered::starting_with)
        .collect();
    let mut logprobs: Vec<Option<LogprobsOut>> = vec![None; texts.len()];
    let mut pending = Some(first);
    loop {
        if texts.iter().all(|t| t.finish.is_some()) {
            break;
        }
        let (index, event) = match pending.take() {
            Some(first) => first,
            None => match choices.next().await {
                Some(next) => next,
                None => {
                    return fail(
                        &state,
                        p.kind,
                        &p.model,
                        ApiError::Internal("dispatch ended early".into()),
                    );
                }
            },
        };
        let i = index as usize;
        let (Some(text), Some(content)) = (texts.get_mut(i), contents.get_mut(i)) else {
            continue;
        };
        if text.finish.is_some() {
            // Sent before the choice was stopped.
            continue;
        }
        match event {
            DispatchEvent::Started {
                cached_prompt_tokens,
                ..
            } => text.cached_tokens = cached_prompt_tokens,
            DispatchEvent::Cached(cached) => text.cached_tokens = text.cached_tokens.max(cached),
            DispatchEvent::Tokens { ids, logprobs } => {
                let piece = text.tokens(&state, &labels, p.arrived, &ids, &logprobs);
                let done = text.finish.is_some();
                content.extend(text.shape(piece, done));
                if done {
                    choices.stop(index);
                }
            }
            DispatchEvent::Finished(finish) => {
                let tail = text.finished(finish);
                content.extend(text.shape(tail, true));
            }
            DispatchEvent::Failed(err) => return fail(&state, p.kind, &p.model, err),
        }
        if text.finish.is_some() {
            logprobs[i] = text.take_logprobs();
            text.count(&state, &labels);
        }
    }
    drop(choices);
    drop(in_flight);
    let usage = request_usage(&texts, p.asks.n);
    record(&state, p.kind, &p.model, "ok");
    state
        .metrics
        .request_duration
        .get_or_create(&labels)
        .observe(p.arrived.elapsed().as_secs_f64());
    let finishes = texts.iter().map(ChoiceText::finish_reason);
    let mut choices = contents.into_iter().zip(logprobs).zip(finishes).enumerate();
    match p.kind {
        Kind::Chat | Kind::Messages => axum::Json(ChatCompletion {
            id: p.completion_id,
            object: "chat.completion",
            created: unix_now(),
            model: p.model,
            choices: choices
                .map(|(index, ((content, logprobs), finish))| ChatChoice {
                    index: index as u32,
                    message: content.message(),
                    finish_reason: finish,
                    logprobs,
                })
                .collect(),
            usage,
        })
        .into_response(),
        Kind::Text => axum::Json(Completion {
            id: p.completion_id,
            object: "text_completion",
            created: unix_now(),
            model: p.model,
            choices: choices
                .map(|(index, ((text, logprobs), finish))| CompletionChoice {
                    index: index as u32,
                    text: text.content,
                    finish_reason: Some(finish),
                    logprobs,
                })
                .collect(),
            usage: Some(usage),
        })
        .into_response(),
        Kind::Responses => {
            // One prompt, one choice.
            let answer = choices
                .next()
                .map(|(_, ((content, _), finish))| (content, finish));
            super::responses::whole(&state, &p, answer, &usage).await
        }
    }
}

/// The in-flight gauge, up for as long as the response is produced.
struct InFlight {
    state: Arc<AppState>,
}

impl InFlight {
    fn new(state: &Arc<AppState>) -> Self {
        state.metrics.in_flight.inc();
        Self {
            state: Arc::clone(state),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.metrics.in_flight.dec();
    }
}

/// What one streamed chunk says about one choice.
#[derive(Default)]
struct Piece {
    content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Vec<ToolCallOut>>,
    role: bool,
    finish: Option<&'static str>,
    logprobs: Option<LogprobsOut>,
}

impl Piece {
    /// The chunk of one answer piece.
    fn of(piece: OutputPiece) -> Self {
        match piece {
            OutputPiece::Content(text) => Self {
                content: Some(text),
                ..Self::default()
            },
            OutputPiece::Reasoning(text) => Self {
                reasoning: Some(text),
                ..Self::default()
            },
            OutputPiece::ToolCall(call) => Self {
                tool_calls: Some(vec![call]),
                ..Self::default()
            },
        }
    }
}

/// One chunk of a stream, in the request's API shape: about choice `index`, or (with `usage`)
/// the final usage chunk with no choice. (A Responses stream has events of its own, written by
/// `super::responses`.)
fn chunk(p: &Prepared, created: u64, index: u32, piece: Piece, usage: Option<Usage>) -> String {
    let json = match p.kind {
        Kind::Chat | Kind::Responses | Kind::Messages => {
            serde_json::to_string(&ChatCompletionChunk {
                id: p.completion_id.clone(),
                object: "chat.completion.chunk",
                created,
                model: p.model.clone(),
                choices: if usage.is_some() {
                    Vec::new()
                } else {
                    vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: piece.role.then_some("assistant"),
                            content: piece.content,
                            reasoning_content: piece.reasoning.clone(),
                            reasoning: piece.reasoning,
                            tool_calls: piece.tool_calls,
                        },
                        finish_reason: piece.finish,
                        logprobs: piece.logprobs,
                    }]
                },
                usage,
            })
        }
        Kind::Text => serde_json::to_string(&Completion {
            id: p.completion_id.clone(),
            object: "text_completion",
            created,
            model: p.model.clone(),
            choices: if usage.is_some() {
                Vec::new()
            } else {
                vec![CompletionChoice {
                    index,
                    text: piece.content.unwrap_or_default(),
                    finish_reason: piece.finish,
                    logprobs: piece.logprobs,
                }]
            },
            usage,
        }),
    };
    json.unwrap_or_else(|e| ApiError::Internal(e.to_string()).to_json().to_string())
}

/// A streamed answer in progress. It owns the choices' events: when the client disconnects,
/// axum drops the stream, the choices go, and their workers are told to stop.
pub(super) struct Answer {
    pub(super) state: Arc<AppState>,
    pub(super) p: Prepared,
    pub(super) labels: ModelLabels,
    pub(super) choices: Choices,
    pub(super) texts: Vec<ChoiceText>,
    /// Held for as long as the answer streams.
    _in_flight: InFlight,
    /// The event that decided the status, handled first.
    pub(super) first: Option<(u32, DispatchEvent)>,
}

/// The server-sent events of a streamed answer.
fn sse_events(answer: Answer) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    struct S {
        a: Answer,
        created: u64,
        queue: VecDeque<String>,
        done: bool,
    }
    let s = S {
        a: answer,
        created: unix_now(),
        queue: VecDeque::new(),
        done: false,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(data) = s.queue.pop_front() {
                return Some((Ok(Event::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            let next = match s.a.first.take() {
                Some(first) => Some(first),
                None => s.a.choices.next().await,
            };
            let Some((index, event)) = next else {
                fail_stream(&mut s.queue, &s.a, "the generation ended unexpectedly");
                s.done = true;
                continue;
            };
            s.done = on_event(&mut s.a, s.created, &mut s.queue, index, event);
        }
    })
}

/// Handles one choice event of a stream; whether the stream is over.
fn on_event(
    a: &mut Answer,
    created: u64,
    queue: &mut VecDeque<String>,
    index: u32,
    event: DispatchEvent,
) -> bool {
    let Answer {
        state,
        p,
        labels,
        choices,
        texts,
        ..
    } = a;
    let Some(text) = texts.get_mut(index as usize) else {
        return false;
    };
    if text.finish.is_some() {
        // Sent before the choice was stopped.
        return false;
    }
    let mut ended = false;
    match event {
        DispatchEvent::Started {
            cached_prompt_tokens,
            ..
        } => {
            text.cached_tokens = text.cached_tokens.max(cached_prompt_tokens);
            if p.kind == Kind::Messages {
                // Anthropic's `message_start` carries the prompt's usage: a usage chunk first.
                let usage = Usage::new(text.prompt_tokens, 0, text.cached_tokens);
                queue.push_back(chunk(p, created, index, Piece::default(), Some(usage)));
            }
            // The role chunk opens a chat stream; a Responses stream opens with its own events.
            if matches!(p.kind, Kind::Chat | Kind::Messages) {
                let piece = Piece {
                    content: Some(String::new()),
                    role: true,
                    ..Piece::default()
                };
                queue.push_back(chunk(p, created, index, piece, None));
            }
            let prompt = &p.prompts[(index / p.asks.n.max(1)) as usize];
            if let Some(echo) = prompt.echo.clone().filter(|e| !e.is_empty()) {
                let piece = Piece {
                    content: Some(echo),
                    ..Piece::default()
                };
                queue.push_back(chunk(p, created, index, piece, None));
            }
        }
        DispatchEvent::Cached(cached) => {
            // Reported with the last message (vLLM): the final usage chunk says it.
            text.cached_tokens = text.cached_tokens.max(cached);
        }
        DispatchEvent::Tokens { ids, logprobs } => {
            let content = text.tokens(state, labels, p.arrived, &ids, &logprobs);
            let mut logprobs = text.take_logprobs();
            let pieces = text.shape(content, text.finish.is_some());
            if pieces.is_empty() && logprobs.is_some() {
                let piece = Piece {
                    content: Some(String::new()),
                    logprobs,
                    ..Piece::default()
                };
                queue.push_back(chunk(p, created, index, piece, None));
            } else {
                for piece in pieces {
                    let mut piece = Piece::of(piece);
                    piece.logprobs = logprobs.take();
                    queue.push_back(chunk(p, created, index, piece, None));
                }
            }
            if text.finish.is_some() {
                // A stop string matched: stop this choice's worker now.
                choices.stop(index);
                ended = true;
            }
        }
        DispatchEvent::Finished(finish) => {
            let tail = text.finished(finish);
            for piece in text.shape(tail, true) {
                queue.push_back(chunk(p, created, index, Piece::of(piece), None));
            }
            ended = true;
        }
        DispatchEvent::Failed(err) => {
            // The 200 went out with the first chunk; the trace still shows the failure.
            switchyard_telemetry::record_error(&p.span, err.to_string());
            record(state, p.kind, &p.model, "stream_error");
            queue.push_back(err.to_json().to_string());
            queue.push_back("[DONE]".to_owned());
            return true;
        }
    }
    if ended {
        let piece = Piece {
            finish: Some(text.finish_reason()),
            ..Piece::default()
        };
        queue.push_back(chunk(p, created, index, piece, None));
        text.count(state, labels);
    }
    if !texts.iter().all(|t| t.finish.is_some()) {
        return false;
    }
    if p.include_usage {
        let usage = request_usage(texts, p.asks.n);
        queue.push_back(chunk(p, created, 0, Piece::default(), Some(usage)));
    }
    state
        .metrics
        .request_duration
        .get_or_create(labels)
        .observe(p.arrived.elapsed().as_secs_f64());
    queue.push_back("[DONE]".to_owned());
    true
}

fn fail_stream(queue: &mut VecDeque<String>, a: &Answer, message: &str) {
    switchyard_telemetry::record_error(&a.p.span, message);
    record(&a.state, a.p.kind, &a.p.model, "stream_error");
    queue.push_back(ApiError::Internal(message.into()).to_json().to_string());
    queue.push_back("[DONE]".to_owned());
}
