//! Answering a dispatched request: detokenize incrementally, apply stop strings, count, and
//! write the result as one JSON body or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use switchyard_core::TokenId;
use switchyard_tokenize::IncrementalDecoder;
use tokio::sync::mpsc;

use super::completions::{Kind, Prepared, fail, record};
use super::{AppState, unix_now};
use crate::admission::Admitted;
use crate::chat_output::{Piece, Shaper, ToolCallOut, prompt_tail};
use crate::dispatch::{self, DispatchEvent, Finish, GenerateJob};
use crate::error::ApiError;
use crate::metrics::RequestLabels;
use crate::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessageOut,
    Completion, CompletionChoice, Usage,
};
use crate::stop::{StopMatcher, StopOutcome};

/// Turns dispatch events into text: incremental detokenization, stop strings, counts.
struct TextAssembler {
    /// Taken when the generation finishes and the decoder flushes.
    decoder: Option<IncrementalDecoder>,
    stop: StopMatcher,
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    finish: Option<&'static str>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// Chat answers: reasoning and tool calls read from the text.
    shaper: Option<Shaper>,
}

impl TextAssembler {
    fn new(p: &Prepared) -> Self {
        Self {
            decoder: Some(IncrementalDecoder::new(
                Arc::clone(p.model_dir.tokenizer()),
                p.sampling.skip_special_tokens.unwrap_or(true),
            )),
            stop: StopMatcher::new(p.sampling.stop.clone())
                .including_the_stop(p.sampling.include_stop_str_in_output.unwrap_or(false)),
            prompt_tokens: p.prompt.len() as u32,
            cached_tokens: 0,
            completion_tokens: 0,
            finish: None,
            first_token_at: None,
            last_token_at: None,
            shaper: (p.kind == Kind::Chat).then(|| {
                Shaper::new(
                    &p.output,
                    &p.request_id,
                    &prompt_tail(&p.model_dir, &p.prompt),
                )
            }),
        }
    }

    /// The answer pieces of new `text`; `done`: the text has ended, flush what was held.
    fn shape(&mut self, text: String, done: bool) -> Vec<Piece> {
        let Some(shaper) = self.shaper.as_mut() else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Piece::Content(text)]
            };
        };
        let mut pieces = if text.is_empty() {
            Vec::new()
        } else {
            shaper.push(&text)
        };
        if done {
            pieces.extend(shaper.finish());
        }
        pieces
    }

    /// The finish reason the client sees (`tool_calls` when the model called a tool).
    fn finish_reason(&self) -> &'static str {
        let finish = self.finish.unwrap_or("length");
        self.shaper
            .as_ref()
            .map_or(finish, |s| s.finish_reason(finish))
    }

    /// Counts the answer's tool calls.
    fn count_tool_calls(&self, state: &AppState) {
        if let Some(shaper) = &self.shaper {
            state
                .metrics
                .tool_calls
                .inc_by(u64::from(shaper.tool_calls()));
            state
                .metrics
                .tool_calls_malformed
                .inc_by(shaper.malformed_tool_calls() as u64);
        }
    }

    /// New text from `tokens`; sets `finish` when a stop string matched.
    fn tokens(&mut self, state: &AppState, arrived: Instant, tokens: &[TokenId]) -> String {
        let now = Instant::now();
        match self.last_token_at {
            None => state.metrics.ttft.observe((now - arrived).as_secs_f64()),
            Some(prev) => state
                .metrics
                .inter_token
                .observe((now - prev).as_secs_f64()),
        }
        self.first_token_at.get_or_insert(now);
        self.last_token_at = Some(now);
        self.completion_tokens += tokens.len() as u32;
        let mut text = String::new();
        if let Some(decoder) = self.decoder.as_mut() {
            for &t in tokens {
                match decoder.push(t) {
                    Ok(piece) => text.push_str(&piece),
                    Err(err) => {
                        tracing::warn!(token = t, error = %err, "cannot detokenize; skipping")
                    }
                }
            }
        }
        match self.stop.push(&text) {
            StopOutcome::Continue(out) => out,
            StopOutcome::Stopped(out) => {
                self.finish = Some("stop");
                out
            }
        }
    }

    /// Generation ended by itself: flush what the decoder and the stop matcher held.
    fn finished(&mut self, finish: Finish) -> String {
        let mut tail = self
            .decoder
            .take()
            .map(|d| d.finish().unwrap_or_default())
            .unwrap_or_default();
        let outcome = self.stop.push(&tail);
        tail = match outcome {
            StopOutcome::Continue(out) => out + &self.stop.finish(),
            StopOutcome::Stopped(out) => {
                self.finish = Some("stop");
                return out;
            }
        };
        self.finish = Some(match finish {
            Finish::Length => "length",
            Finish::Stop => "stop",
        });
        tail
    }

    fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
        )
    }
}

pub(super) async fn respond(state: Arc<AppState>, p: Prepared, permit: Admitted) -> Response {
    let mut sampling = p.sampling.clone();
    if !sampling.ignore_eos {
        // The model's end-of-sequence tokens, as the tokenizer names them, end the generation
        // on any engine (the simulator has no model of its own to know them).
        for eos in p.model_dir.eos_token_ids() {
            if !sampling.stop_token_ids.contains(eos) {
                sampling.stop_token_ids.push(*eos);
            }
        }
    }
    let job = GenerateJob {
        request_id: p.request_id.clone(),
        routes: Arc::clone(&p.routes),
        prompt: p.prompt.clone(),
        sampling,
        session: p.session.clone().or_else(|| p.user.clone()),
        deadline: tokio::time::Instant::from_std(p.arrived + state.config.request_timeout()),
        max_retries: state.config.max_retries,
        max_migrations: state.config.max_migrations,
        disagg: state.config.disagg(),
        span: p.span.clone(),
    };
    state.metrics.in_flight.inc();
    let in_flight = InFlight {
        state: Arc::clone(&state),
        _permit: permit,
    };
    let mut rx = dispatch::start(&state.pool, job);
    let mut text = TextAssembler::new(&p);
    // The first event decides the status code.
    match rx.recv().await {
        Some(DispatchEvent::Started {
            cached_prompt_tokens,
            ..
        }) => text.cached_tokens = cached_prompt_tokens,
        Some(DispatchEvent::Failed(err)) => return fail(&state, p.kind, err),
        Some(other) => {
            return fail(
                &state,
                p.kind,
                ApiError::Internal(format!("dispatch began with {other:?}")),
            );
        }
        None => {
            return fail(
                &state,
                p.kind,
                ApiError::Internal("dispatch ended without an answer".into()),
            );
        }
    }
    if p.stream {
        record(&state, p.kind, "ok");
        let events = sse_events(state, p, rx, text, in_flight);
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        let mut answer = Answer::default();
        loop {
            match rx.recv().await {
                Some(DispatchEvent::Tokens(tokens)) => {
                    let piece = text.tokens(&state, p.arrived, &tokens);
                    let done = text.finish.is_some();
                    answer.extend(text.shape(piece, done));
                    if done {
                        break;
                    }
                }
                Some(DispatchEvent::Finished(finish)) => {
                    let tail = text.finished(finish);
                    answer.extend(text.shape(tail, true));
                    break;
                }
                Some(DispatchEvent::Failed(err)) => return fail(&state, p.kind, err),
                Some(DispatchEvent::Started { .. }) => {}
                None => {
                    return fail(
                        &state,
                        p.kind,
                        ApiError::Internal("dispatch ended early".into()),
                    );
                }
            }
        }
        drop(rx);
        drop(in_flight);
        let usage = text.usage();
        count_tokens(&state, &usage);
        text.count_tool_calls(&state);
        record(&state, p.kind, "ok");
        let finish = text.finish_reason();
        match p.kind {
            Kind::Chat => axum::Json(ChatCompletion {
                id: p.request_id,
                object: "chat.completion",
                created: unix_now(),
                model: p.model,
                choices: vec![ChatChoice {
                    index: 0,
                    message: answer.message(),
                    finish_reason: finish,
                    logprobs: None,
                }],
                usage,
            })
            .into_response(),
            Kind::Text => axum::Json(Completion {
                id: p.request_id,
                object: "text_completion",
                created: unix_now(),
                model: p.model,
                choices: vec![CompletionChoice {
                    index: 0,
                    text: answer.content,
                    finish_reason: Some(finish),
                    logprobs: None,
                }],
                usage: Some(usage),
            })
            .into_response(),
        }
    }
}

fn count_tokens(state: &AppState, usage: &Usage) {
    state
        .metrics
        .prompt_tokens
        .inc_by(u64::from(usage.prompt_tokens));
    state
        .metrics
        .completion_tokens
        .inc_by(u64::from(usage.completion_tokens));
    let m = &state.metrics;
    m.request_prompt_tokens
        .observe(f64::from(usage.prompt_tokens));
    m.request_completion_tokens
        .observe(f64::from(usage.completion_tokens));
    m.cached_prompt_tokens
        .inc_by(u64::from(usage.prompt_tokens_details.cached_tokens));
}

/// Holds a concurrency slot and the in-flight gauge for as long as the response is produced.
struct InFlight {
    state: Arc<AppState>,
    _permit: Admitted,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.metrics.in_flight.dec();
    }
}

/// One chunk of a stream, in the request's API shape.
fn chunk(
    p: &Prepared,
    created: u64,
    delta: ChatDelta,
    finish: Option<&'static str>,
    usage: Option<Usage>,
) -> String {
    let empty = delta == ChatDelta::default();
    let json = match p.kind {
        Kind::Chat => serde_json::to_string(&ChatCompletionChunk {
            id: p.request_id.clone(),
            object: "chat.completion.chunk",
            created,
            model: p.model.clone(),
            choices: if usage.is_some() && empty && finish.is_none() {
                Vec::new()
            } else {
                vec![ChatChunkChoice {
                    index: 0,
                    delta,
                    finish_reason: finish,
                    logprobs: None,
                }]
            },
            usage,
        }),
        Kind::Text => serde_json::to_string(&Completion {
            id: p.request_id.clone(),
            object: "text_completion",
            created,
            model: p.model.clone(),
            choices: if usage.is_some() && empty && finish.is_none() {
                Vec::new()
            } else {
                vec![CompletionChoice {
                    index: 0,
                    text: delta.content.unwrap_or_default(),
                    finish_reason: finish,
                    logprobs: None,
                }]
            },
            usage,
        }),
    };
    json.unwrap_or_else(|e| ApiError::Internal(e.to_string()).to_json().to_string())
}

/// The server-sent events of a streamed answer. The stream owns the dispatch receiver: when
/// the client disconnects, axum drops the stream, the receiver goes, and the worker is told
/// to stop.
fn sse_events(
    state: Arc<AppState>,
    p: Prepared,
    rx: mpsc::Receiver<DispatchEvent>,
    text: TextAssembler,
    in_flight: InFlight,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    struct S {
        state: Arc<AppState>,
        p: Prepared,
        rx: Option<mpsc::Receiver<DispatchEvent>>,
        text: TextAssembler,
        created: u64,
        queue: std::collections::VecDeque<String>,
        done: bool,
        _in_flight: InFlight,
    }
    let created = unix_now();
    let mut queue = std::collections::VecDeque::new();
    if p.kind == Kind::Chat {
        let role = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..ChatDelta::default()
        };
        queue.push_back(chunk(&p, created, role, None, None));
    }
    let s = S {
        state,
        p,
        rx: Some(rx),
        text,
        created,
        queue,
        done: false,
        _in_flight: in_flight,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(data) = s.queue.pop_front() {
                return Some((Ok(Event::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            let event = match s.rx.as_mut() {
                Some(rx) => rx.recv().await,
                None => None,
            };
            match event {
                Some(DispatchEvent::Tokens(tokens)) => {
                    let piece = s.text.tokens(&s.state, s.p.arrived, &tokens);
                    let done = s.text.finish.is_some();
                    for piece in s.text.shape(piece, done) {
                        s.queue
                            .push_back(chunk(&s.p, s.created, delta_of(piece), None, None));
                    }
                    if done {
                        // A stop string matched: stop the worker now.
                        s.rx = None;
                        end_stream(&mut s.queue, &s.state, &s.p, &s.text, s.created);
                        s.done = true;
                    }
                }
                Some(DispatchEvent::Finished(finish)) => {
                    let tail = s.text.finished(finish);
                    for piece in s.text.shape(tail, true) {
                        s.queue
                            .push_back(chunk(&s.p, s.created, delta_of(piece), None, None));
                    }
                    s.rx = None;
                    end_stream(&mut s.queue, &s.state, &s.p, &s.text, s.created);
                    s.done = true;
                }
                Some(DispatchEvent::Failed(err)) => {
                    s.rx = None;
                    // The 200 went out with the first chunk; the trace still shows the failure.
                    switchyard_telemetry::record_error(&s.p.span, err.to_string());
                    s.state
                        .metrics
                        .requests
                        .get_or_create(&RequestLabels {
                            endpoint: s.p.kind.endpoint(),
                            status: "stream_error",
                        })
                        .inc();
                    s.queue.push_back(err.to_json().to_string());
                    s.queue.push_back("[DONE]".to_owned());
                    s.done = true;
                }
                Some(DispatchEvent::Started { .. }) => {}
                None => {
                    switchyard_telemetry::record_error(
                        &s.p.span,
                        "the generation ended unexpectedly",
                    );
                    s.queue.push_back(
                        ApiError::Internal("the generation ended unexpectedly".into())
                            .to_json()
                            .to_string(),
                    );
                    s.queue.push_back("[DONE]".to_owned());
                    s.done = true;
                }
            }
        }
    })
}

fn end_stream(
    queue: &mut std::collections::VecDeque<String>,
    state: &AppState,
    p: &Prepared,
    text: &TextAssembler,
    created: u64,
) {
    let finish = text.finish_reason();
    queue.push_back(chunk(p, created, ChatDelta::default(), Some(finish), None));
    let usage = text.usage();
    count_tokens(state, &usage);
    text.count_tool_calls(state);
    if p.include_usage {
        queue.push_back(chunk(p, created, ChatDelta::default(), None, Some(usage)));
    }
    queue.push_back("[DONE]".to_owned());
}

/// A whole (not streamed) answer, gathered from its pieces.
#[derive(Default)]
struct Answer {
    content: String,
    reasoning: Option<String>,
    tool_calls: Vec<ToolCallOut>,
}

impl Answer {
    fn extend(&mut self, pieces: Vec<Piece>) {
        for piece in pieces {
            match piece {
                Piece::Content(text) => self.content.push_str(&text),
                Piece::Reasoning(text) => self.reasoning.get_or_insert_default().push_str(&text),
                Piece::ToolCall(call) => self.tool_calls.push(call),
            }
        }
    }

    fn message(self) -> ChatMessageOut {
        let called = !self.tool_calls.is_empty();
        ChatMessageOut {
            role: "assistant",
            // OpenAI's shape: no content (null) when the model only called tools.
            content: (!called || !self.content.trim().is_empty()).then_some(self.content),
            reasoning_content: self.reasoning.clone(),
            reasoning: self.reasoning,
            tool_calls: called.then_some(self.tool_calls),
        }
    }
}

/// The streamed delta of one answer piece.
fn delta_of(piece: Piece) -> ChatDelta {
    match piece {
        Piece::Content(text) => ChatDelta {
            content: Some(text),
            ..ChatDelta::default()
        },
        Piece::Reasoning(text) => ChatDelta {
            reasoning_content: Some(text.clone()),
            reasoning: Some(text),
            ..ChatDelta::default()
        },
        Piece::ToolCall(call) => ChatDelta {
            tool_calls: Some(vec![call]),
            ..ChatDelta::default()
        },
    }
}
