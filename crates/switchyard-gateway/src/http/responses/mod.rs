//! `POST /v1/responses`, OpenAI's Responses API, stateless: a thin translation onto the chat
//! path. [`request`] turns the body into a chat request (so routing, sessions, admission,
//! tenants and metrics apply unchanged, under the `responses` endpoint label); the chat
//! pipeline generates and parses reasoning and tool calls as for `/v1/chat/completions`;
//! [`output`] writes the answer as a response object and [`events`] as the Responses event
//! stream.

mod events;
mod output;
mod request;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};

use super::answer::Answer;
use super::assemble::{Gathered, request_usage};
use super::completions::{self, Kind, Peer, Prepared, record};
use super::{ApiTenant, AppState, unix_now};
use crate::dispatch::DispatchEvent;
use crate::error::ApiError;
use crate::openai::Usage;
use events::{Event, Writer};
use output::{Item, Outcome, Status, Tokens, response};
pub use request::{Echo, ResponsesRequest};

/// POST /v1/responses
pub async fn create(
    State(state): State<Arc<AppState>>,
    peer: Peer,
    tenant: Option<Extension<ApiTenant>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    completions::handle(
        state,
        tenant.map(|Extension(t)| t),
        Kind::Responses,
        peer,
        headers,
        body,
        request::split,
    )
    .await
}

/// Parses, translates and checks a `/v1/responses` body as the handler does before admission.
/// Public so that the fuzz targets (`crates/switchyard-fuzz`) drive exactly this code.
pub fn parse_responses_request(body: &[u8]) -> Result<completions::ParsedRequest, ApiError> {
    request::split(completions::parse_body(body)?)
        .and_then(|r| completions::checked(Kind::Responses, r))
}

/// Tokens of the reasoning items, as the model's tokenizer counts their text.
fn reasoning_tokens(p: &Prepared, items: &[Item]) -> u32 {
    items
        .iter()
        .filter_map(|item| match item {
            Item::Reasoning { text, .. } => p.model_dir.tokenizer().encode(text).ok(),
            _ => None,
        })
        .map(|tokens| tokens.len() as u32)
        .sum()
}

fn tokens_of(p: &Prepared, usage: &Usage, items: &[Item]) -> Tokens {
    Tokens {
        input: usage.prompt_tokens,
        cached: usage.prompt_tokens_details.cached_tokens,
        output: usage.completion_tokens,
        reasoning: reasoning_tokens(p, items),
    }
}

fn missing_echo() -> Response {
    ApiError::Internal("a /v1/responses request without its settings".into()).into_response()
}

/// A whole answer (its one choice, with its finish reason) as a response object.
pub(super) fn whole(
    p: &Prepared,
    answer: Option<(Gathered, &'static str)>,
    usage: &Usage,
) -> Response {
    let (Some(echo), Some((gathered, finish))) = (&p.responses, answer) else {
        return missing_echo();
    };
    let items = output::items(
        &p.completion_id,
        gathered.reasoning,
        gathered.content,
        gathered.tool_calls,
    );
    let outcome = Outcome {
        id: &p.completion_id,
        model: &p.model,
        created_at: unix_now(),
        status: Status::of_finish(finish),
        tokens: Some(tokens_of(p, usage, &items)),
        output: &items,
    };
    axum::Json(response(&outcome, echo)).into_response()
}

/// A streamed answer as Responses events.
pub(super) fn stream(answer: Answer) -> Response {
    let Some(echo) = answer.p.responses.clone() else {
        return missing_echo();
    };
    let created_at = unix_now();
    let mut writer = Writer::new(&answer.p.completion_id);
    let start = response(
        &Outcome {
            id: &answer.p.completion_id,
            model: &answer.p.model,
            created_at,
            status: Status::InProgress,
            output: &[],
            tokens: None,
        },
        &echo,
    );
    let queue = writer.started(&start).into();
    let s = Streamed {
        a: answer,
        echo,
        writer,
        created_at,
        queue,
        done: false,
    };
    let events = futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                let sse = SseEvent::default()
                    .event(event.name)
                    .data(event.data.to_string());
                return Some((Ok::<_, Infallible>(sse), s));
            }
            if s.done {
                return None;
            }
            let next = match s.a.first.take() {
                Some(first) => Some(first),
                None => s.a.choices.next().await,
            };
            match next {
                Some((index, event)) => s.on_event(index, event),
                None => s.fail("the generation ended unexpectedly".into()),
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A Responses stream in progress. It owns the choice's events: when the client disconnects,
/// axum drops the stream and the worker is told to stop.
struct Streamed {
    a: Answer,
    echo: Arc<Echo>,
    writer: Writer,
    created_at: u64,
    queue: VecDeque<Event>,
    done: bool,
}

impl Streamed {
    fn on_event(&mut self, index: u32, event: DispatchEvent) {
        let Answer {
            state,
            p,
            labels,
            choices,
            texts,
            ..
        } = &mut self.a;
        let Some(text) = texts.get_mut(index as usize) else {
            return;
        };
        if text.finish.is_some() {
            // Sent before the choice was stopped.
            return;
        }
        let pieces = match event {
            DispatchEvent::Started {
                cached_prompt_tokens,
                ..
            } => {
                text.cached_tokens = text.cached_tokens.max(cached_prompt_tokens);
                return;
            }
            DispatchEvent::Cached(cached) => {
                text.cached_tokens = text.cached_tokens.max(cached);
                return;
            }
            DispatchEvent::Tokens { ids, logprobs } => {
                let content = text.tokens(state, labels, p.arrived, &ids, &logprobs);
                if text.finish.is_some() {
                    // A stop string matched: stop the worker now.
                    choices.stop(index);
                }
                text.shape(content, text.finish.is_some())
            }
            DispatchEvent::Finished(finish) => {
                let tail = text.finished(finish);
                text.shape(tail, true)
            }
            DispatchEvent::Failed(err) => return self.fail(err.to_string()),
        };
        let ended = text.finish.is_some();
        for piece in pieces {
            self.queue.extend(self.writer.push(piece));
        }
        if ended {
            self.end();
        }
    }

    /// The answer is whole: close its items and send the final response.
    fn end(&mut self) {
        let a = &self.a;
        let Some(text) = a.texts.first() else {
            return self.fail("a response without its choice".into());
        };
        let status = Status::of_finish(text.finish_reason());
        self.queue
            .extend(self.writer.finish(status == Status::Incomplete));
        text.count(&a.state, &a.labels);
        a.state
            .metrics
            .request_duration
            .get_or_create(&a.labels)
            .observe(a.p.arrived.elapsed().as_secs_f64());
        let items = self.writer.items();
        let usage = request_usage(&a.texts, 1);
        let name = match status {
            Status::Incomplete => "response.incomplete",
            _ => "response.completed",
        };
        let outcome = Outcome {
            id: &a.p.completion_id,
            model: &a.p.model,
            created_at: self.created_at,
            status,
            tokens: Some(tokens_of(&a.p, &usage, &items)),
            output: &items,
        };
        let last = self.writer.ended(name, &response(&outcome, &self.echo));
        self.queue.push_back(last);
        self.done = true;
    }

    /// The generation failed after the 200 went out: `response.failed`, with what was written.
    fn fail(&mut self, message: String) {
        let a = &self.a;
        switchyard_telemetry::record_error(&a.p.span, message.clone());
        record(&a.state, Kind::Responses, &a.p.model, "stream_error");
        let items = self.writer.items();
        let outcome = Outcome {
            id: &a.p.completion_id,
            model: &a.p.model,
            created_at: self.created_at,
            status: Status::Failed(message),
            tokens: None,
            output: &items,
        };
        let last = self
            .writer
            .ended("response.failed", &response(&outcome, &self.echo));
        self.queue.push_back(last);
        self.done = true;
    }
}
