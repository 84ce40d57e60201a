//! Answering a prepared request: one driver for every API over the [`Renderer`] each API
//! implements. The driver starts the request's choices ([`super::choices`]), turns each
//! choice's dispatch events into its answer ([`super::assemble`]: detokenized text, stop
//! strings, reasoning and tool calls, log probabilities, counts) and tells the renderer what
//! happened, in order: a choice started, new pieces of its answer, it finished, every choice
//! finished (with the request's usage), or the generation failed. The renderer writes that in
//! its API's shape: server-sent events as it goes, or one body at the end. The first event
//! decides the status, so a request no worker could start gets a real error status, not a 200
//! with an error inside.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use switchyard_tokenize::Tokenizer;

use super::assemble::{ChoiceText, Gathered, request_usage};
use super::choices::{Choices, scheduled_turn};
use super::pipeline::prepared::{Prepared, fail, record};
use super::state::AppState;
use crate::access::admission::Admitted;
use crate::api::chat_output::Piece;
use crate::api::openai::{LogprobsOut, Usage};
use crate::error::ApiError;
use crate::observe::audit::tags::SessionHold;
use crate::observe::metrics::ModelLabels;
use crate::serving::dispatch::DispatchEvent;
use crate::serving::sessions::ScheduledTurn;

/// One server-sent event of a streamed answer: an `event:` name when the API names its events,
/// and the data.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Frame {
    pub(crate) name: Option<&'static str>,
    pub(crate) data: String,
}

impl Frame {
    /// An unnamed event (the OpenAI APIs' chunks).
    pub(crate) fn data(data: impl Into<String>) -> Self {
        Self {
            name: None,
            data: data.into(),
        }
    }

    /// A named event whose data is `data`.
    pub(crate) fn named(name: &'static str, data: &serde_json::Value) -> Self {
        Self {
            name: Some(name),
            data: data.to_string(),
        }
    }

    /// The event as axum writes it.
    pub(crate) fn event(&self) -> Event {
        let event = match self.name {
            Some(name) => Event::default().event(name),
            None => Event::default(),
        };
        event.data(&self.data)
    }
}

/// What a renderer reads of the request it answers.
pub(crate) struct Answering {
    /// The answer's id (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`).
    pub(crate) id: String,
    pub(crate) model: String,
    /// Choices per prompt.
    pub(crate) n: u32,
    /// A stream ends with the request's usage (`stream_options.include_usage`).
    pub(crate) include_usage: bool,
    /// Per prompt: the text its choices start with (text completions' `echo`).
    pub(crate) echoes: Vec<Option<String>>,
    /// The API key's tenant: who may read a stored answer.
    pub(crate) tenant: Option<String>,
    /// The model's tokenizer, for counts an API reports beyond the generation's own.
    pub(crate) tokenizer: Arc<Tokenizer>,
}

impl Answering {
    fn of(p: &Prepared) -> Self {
        Self {
            id: p.completion_id.clone(),
            model: p.model.clone(),
            n: p.asks.n,
            include_usage: p.include_usage,
            echoes: p.prompts.iter().map(|prompt| prompt.echo.clone()).collect(),
            tenant: p.tenant.clone(),
            tokenizer: Arc::clone(p.model_dir.tokenizer()),
        }
    }

    /// The echoed prompt choice `index` starts with, when it has one.
    pub(crate) fn echo_of(&self, index: u32) -> Option<&str> {
        self.echoes
            .get((index / self.n.max(1)) as usize)?
            .as_deref()
    }
}

/// New pieces of one choice's answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Delta {
    /// Text, reasoning and tool calls, in the order the model wrote them.
    pub(crate) pieces: Vec<Piece>,
    /// The log probabilities of the tokens they came from (streams that asked for them).
    pub(crate) logprobs: Option<LogprobsOut>,
}

/// One choice of a whole answer.
pub(crate) struct WholeChoice {
    /// Its text (an echoed prompt first), reasoning and tool calls.
    pub(crate) answer: Gathered,
    pub(crate) logprobs: Option<LogprobsOut>,
    /// The finish reason the client sees (`stop`, `length`, `tool_calls`).
    pub(crate) finish: &'static str,
}

/// A whole answer: every choice, in index order, and the request's usage.
pub(crate) struct Whole {
    pub(crate) choices: Vec<WholeChoice>,
    pub(crate) usage: Usage,
}

/// How one API writes the answer. The driver calls a streamed answer's methods in order:
/// [`open`](Renderer::open); per choice [`started`](Renderer::started), any number of
/// [`delta`](Renderer::delta)s and [`finished`](Renderer::finished); then
/// [`ended`](Renderer::ended) once every choice finished, or [`failed`](Renderer::failed)
/// instead, after which nothing more is called. A whole answer is one call to
/// [`whole`](Renderer::whole).
pub(crate) trait Renderer: Send + 'static {
    /// A stream's first events, before any choice's.
    fn open(&mut self, _a: &Answering) -> Vec<Frame> {
        Vec::new()
    }

    /// Choice `index` started on a worker; `prompt` is its prompt's usage (the cached tokens
    /// as the worker reported them so far).
    fn started(&mut self, a: &Answering, index: u32, prompt: &Usage) -> Vec<Frame>;

    /// New pieces of choice `index`'s answer.
    fn delta(&mut self, a: &Answering, index: u32, delta: Delta) -> Vec<Frame>;

    /// Choice `index` ended; `finish` is the finish reason the client sees.
    fn finished(&mut self, a: &Answering, index: u32, finish: &'static str) -> Vec<Frame>;

    /// Every choice ended; `usage` is the request's.
    fn ended(&mut self, a: &Answering, usage: &Usage) -> impl Future<Output = Vec<Frame>> + Send;

    /// The generation failed after the answer's status went out.
    fn failed(&mut self, a: &Answering, err: &ApiError) -> Vec<Frame>;

    /// What keeps a quiet stream's connection open.
    fn keep_alive(&self) -> KeepAlive {
        KeepAlive::default()
    }

    /// The whole answer, not streamed.
    fn whole(self, a: Answering, answer: Whole) -> impl Future<Output = Response> + Send;
}

/// Answers `p` through `renderer`: its choices run on `permit` (the first) and on their own
/// admissions.
pub(crate) async fn respond<R: Renderer>(
    state: Arc<AppState>,
    p: Prepared,
    permit: Admitted,
    renderer: R,
) -> Response {
    let in_flight = InFlight::new(&state);
    // Session scheduling may hold the turn here, between turns, before it is routed; never
    // past the request's deadline (dropping the wait withdraws the turn).
    let deadline = tokio::time::Instant::from_std(p.arrived + state.config.request_timeout());
    let turn = match tokio::time::timeout_at(deadline, scheduled_turn(&state, &p)).await {
        Ok(turn) => turn,
        Err(_) => {
            let err = ApiError::Timeout(state.config.request_timeout_secs.max(1));
            return fail(&state, p.api, &p.model, err);
        }
    };
    let mut run = Run::start(state, p, permit, turn);
    // The first event decides the status code.
    let first = match run.choices.next().await {
        Some(first @ (_, DispatchEvent::Started { .. })) => first,
        Some((_, DispatchEvent::Failed(err))) => return run.fail(err),
        Some(other) => {
            return run.fail(ApiError::Internal(format!("dispatch began with {other:?}")));
        }
        None => {
            return run.fail(ApiError::Internal(
                "dispatch ended without an answer".into(),
            ));
        }
    };
    if run.p.stream {
        record(&run.state, run.p.api, &run.p.model, "ok");
        let keep_alive = renderer.keep_alive();
        let events = stream(run, renderer, first, in_flight);
        return Sse::new(events).keep_alive(keep_alive).into_response();
    }
    whole(run, renderer, first, in_flight).await
}

/// The in-flight gauge, up for as long as the response is produced.
struct InFlight {
    state: Arc<AppState>,
}

impl InFlight {
    fn new(state: &Arc<AppState>) -> Self {
        state.observers.metrics.in_flight.inc();
        Self {
            state: Arc::clone(state),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.observers.metrics.in_flight.dec();
    }
}

/// A request's choices in progress. It owns the choices' events: when it is dropped (the
/// client went away), the choices go, and their workers are told to stop.
struct Run {
    state: Arc<AppState>,
    p: Prepared,
    answering: Answering,
    labels: ModelLabels,
    choices: Choices,
    texts: Vec<ChoiceText>,
    /// The session's turn as session scheduling counts it: ends when the run is dropped.
    turn: ScheduledTurn,
}

/// What one dispatch event came to for its choice.
enum Applied {
    /// Nothing the client sees (cached tokens reported, an event after the choice ended).
    Quiet,
    /// The choice started on a worker: its prompt's usage.
    Started(Usage),
    /// New pieces; with the finish reason when the choice ended with them.
    Delta(Delta, Option<&'static str>),
    Failed(ApiError),
}

impl Run {
    fn start(state: Arc<AppState>, p: Prepared, permit: Admitted, turn: ScheduledTurn) -> Self {
        let hold = turn.held().map(|(held, release)| SessionHold {
            held_ms: u64::try_from(held.as_millis()).unwrap_or(u64::MAX),
            released: release.as_str(),
        });
        let choices = Choices::start(&state, &p, permit, hold);
        let texts = p
            .prompts
            .iter()
            .flat_map(|prompt| (0..p.asks.n).map(move |_| prompt))
            .map(|prompt| ChoiceText::new(&p, prompt))
            .collect();
        Self {
            labels: ModelLabels {
                model: p.model.clone(),
            },
            answering: Answering::of(&p),
            state,
            p,
            choices,
            texts,
            turn,
        }
    }

    /// Refuses the request before its answer began.
    fn fail(&self, err: ApiError) -> Response {
        fail(&self.state, self.p.api, &self.p.model, err)
    }

    /// Applies one event to its choice. `streamed`: log probabilities go out with each delta
    /// (a whole answer takes them when the choice ends).
    fn apply(&mut self, index: u32, event: DispatchEvent, streamed: bool) -> Applied {
        let Some(text) = self.texts.get_mut(index as usize) else {
            return Applied::Quiet;
        };
        if text.finish.is_some() {
            // Sent before the choice was stopped.
            return Applied::Quiet;
        }
        let (pieces, logprobs) = match event {
            DispatchEvent::Started {
                cached_prompt_tokens,
                worker,
                ..
            } => {
                self.turn.routed(&worker);
                text.cached_tokens = text.cached_tokens.max(cached_prompt_tokens);
                return Applied::Started(Usage::new(text.prompt_tokens, 0, text.cached_tokens));
            }
            DispatchEvent::Cached(cached) => {
                // Reported with the last message (vLLM): the request's usage says it.
                text.cached_tokens = text.cached_tokens.max(cached);
                return Applied::Quiet;
            }
            DispatchEvent::Tokens { ids, logprobs } => {
                let p = &self.p;
                let content = text.tokens(&self.state, &self.labels, p.arrived, &ids, &logprobs);
                let logprobs = if streamed { text.take_logprobs() } else { None };
                let stopped = text.finish.is_some();
                if stopped {
                    // A stop string matched: stop this choice's worker now.
                    self.choices.stop(index);
                }
                (text.shape(content, stopped), logprobs)
            }
            DispatchEvent::Finished(finish) => {
                let tail = text.finished(finish);
                (text.shape(tail, true), None)
            }
            DispatchEvent::Failed(err) => return Applied::Failed(err),
        };
        let finish = text.finish.map(|_| text.finish_reason());
        if finish.is_some() {
            text.count(&self.state, &self.labels);
        }
        Applied::Delta(Delta { pieces, logprobs }, finish)
    }

    /// Whether every choice has finished.
    fn all_finished(&self) -> bool {
        self.texts.iter().all(|t| t.finish.is_some())
    }

    fn usage(&self) -> Usage {
        request_usage(&self.texts, self.p.asks.n)
    }

    fn observe_duration(&self) {
        self.state
            .observers
            .metrics
            .request_duration
            .get_or_create(&self.labels)
            .observe(self.p.arrived.elapsed().as_secs_f64());
    }
}

/// Gathers the whole answer, then has the renderer write it.
async fn whole<R: Renderer>(
    mut run: Run,
    renderer: R,
    first: (u32, DispatchEvent),
    in_flight: InFlight,
) -> Response {
    // An echoed prompt starts each of its choices' text.
    let mut answers: Vec<Gathered> = (0..run.texts.len() as u32)
        .map(|i| Gathered::starting_with(run.answering.echo_of(i).unwrap_or_default().into()))
        .collect();
    let mut logprobs: Vec<Option<LogprobsOut>> = vec![None; run.texts.len()];
    let mut pending = Some(first);
    while !run.all_finished() {
        let next = match pending.take() {
            Some(first) => Some(first),
            None => run.choices.next().await,
        };
        let Some((index, event)) = next else {
            return run.fail(ApiError::Internal("dispatch ended early".into()));
        };
        match run.apply(index, event, false) {
            Applied::Quiet | Applied::Started(_) => {}
            Applied::Delta(delta, finish) => {
                let i = index as usize;
                if let Some(answer) = answers.get_mut(i) {
                    answer.extend(delta.pieces);
                }
                if finish.is_some()
                    && let (Some(slot), Some(text)) = (logprobs.get_mut(i), run.texts.get_mut(i))
                {
                    *slot = text.take_logprobs();
                }
            }
            Applied::Failed(err) => return run.fail(err),
        }
    }
    let Run {
        state,
        p,
        answering,
        choices,
        texts,
        ..
    } = run;
    drop(choices);
    drop(in_flight);
    let usage = request_usage(&texts, p.asks.n);
    record(&state, p.api, &p.model, "ok");
    state
        .observers
        .metrics
        .request_duration
        .get_or_create(&ModelLabels {
            model: p.model.clone(),
        })
        .observe(p.arrived.elapsed().as_secs_f64());
    let choices = answers
        .into_iter()
        .zip(logprobs)
        .zip(&texts)
        .map(|((answer, logprobs), text)| WholeChoice {
            answer,
            logprobs,
            finish: text.finish_reason(),
        })
        .collect();
    renderer.whole(answering, Whole { choices, usage }).await
}

/// A streamed answer in progress.
struct Streamed<R> {
    run: Run,
    renderer: R,
    /// The event that decided the status, handled first.
    first: Option<(u32, DispatchEvent)>,
    queue: VecDeque<Frame>,
    done: bool,
    /// Held for as long as the answer streams.
    _in_flight: InFlight,
}

/// The server-sent events of a streamed answer.
fn stream<R: Renderer>(
    run: Run,
    mut renderer: R,
    first: (u32, DispatchEvent),
    in_flight: InFlight,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let queue = renderer.open(&run.answering).into();
    let s = Streamed {
        run,
        renderer,
        first: Some(first),
        queue,
        done: false,
        _in_flight: in_flight,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(frame) = s.queue.pop_front() {
                return Some((Ok(frame.event()), s));
            }
            if s.done {
                return None;
            }
            let next = match s.first.take() {
                Some(first) => Some(first),
                None => s.run.choices.next().await,
            };
            match next {
                Some((index, event)) => s.on_event(index, event).await,
                None => s.fail(ApiError::Internal(
                    "the generation ended unexpectedly".into(),
                )),
            }
        }
    })
}

impl<R: Renderer> Streamed<R> {
    /// Renders one choice event; the end of the answer once every choice finished.
    async fn on_event(&mut self, index: u32, event: DispatchEvent) {
        let applied = self.run.apply(index, event, true);
        let a = &self.run.answering;
        match applied {
            Applied::Quiet => {}
            Applied::Started(prompt) => {
                let frames = self.renderer.started(a, index, &prompt);
                self.queue.extend(frames);
            }
            Applied::Delta(delta, finish) => {
                self.queue.extend(self.renderer.delta(a, index, delta));
                if let Some(finish) = finish {
                    self.queue.extend(self.renderer.finished(a, index, finish));
                }
            }
            Applied::Failed(err) => return self.fail(err),
        }
        if !self.run.all_finished() {
            return;
        }
        let usage = self.run.usage();
        self.run.observe_duration();
        let frames = self.renderer.ended(&self.run.answering, &usage).await;
        self.queue.extend(frames);
        self.done = true;
    }

    /// The generation failed after the 200 went out: the trace and the metrics say so, and the
    /// renderer writes its error.
    fn fail(&mut self, err: ApiError) {
        let run = &self.run;
        switchyard_telemetry::record_error(&run.p.span, err.to_string());
        record(&run.state, run.p.api, &run.p.model, "stream_error");
        let frames = self.renderer.failed(&run.answering, &err);
        self.queue.extend(frames);
        self.done = true;
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
