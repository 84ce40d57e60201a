//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Both share one path: parse and validate, admit, tokenize off the reactor, check the context,
//! dispatch, then answer as one JSON body or as server-sent events. The HTTP status is decided
//! by the first dispatch event, so a request no worker could start gets a real error status,
//! not a 200 with an error inside.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde::de::DeserializeOwned;
use switchyard_core::TokenId;
use switchyard_tokenize::{IncrementalDecoder, ModelDir};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::{AppState, unix_now};
use crate::dispatch::{self, DispatchEvent, Finish, GenerateJob};
use crate::error::ApiError;
use crate::metrics::RequestLabels;
use crate::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatDelta, ChatMessageOut, Completion, CompletionChoice, CompletionRequest, PromptInput,
    SamplingFields, Usage,
};
use crate::pool::ModelRoutes;
use crate::preprocess;
use crate::stop::{StopMatcher, StopOutcome};

/// Which API shape to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat_completions",
            Kind::Text => "completions",
        }
    }
}

/// The body, or the error a client should see when it could not be read (too large, cut off).
pub(crate) fn read_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(state.config.max_body_bytes)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {rejection}"))
        }
    })
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad_request("request body is not valid UTF-8"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

fn session_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

fn record(state: &AppState, kind: Kind, status: &'static str) {
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            endpoint: kind.endpoint(),
            status,
        })
        .inc();
}

fn fail(state: &AppState, kind: Kind, err: ApiError) -> Response {
    record(state, kind, err.metric_label());
    err.into_response()
}

/// Everything decided before dispatch.
struct Prepared {
    kind: Kind,
    request_id: String,
    model: String,
    model_dir: Arc<ModelDir>,
    routes: Arc<ModelRoutes>,
    prompt: Vec<TokenId>,
    max_tokens: u32,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    sampling: SamplingFields,
    session: Option<String>,
    arrived: Instant,
}

/// Checks the sampling fields the gateway honours, refusing what it cannot do.
fn validate_sampling(s: &SamplingFields) -> Result<(), ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_param("n", "only n = 1 is supported"));
    }
    if let Some(t) = s.temperature
        && !(t.is_finite() && (0.0..=2.0).contains(&t))
    {
        return Err(ApiError::bad_param(
            "temperature",
            "temperature must be between 0 and 2",
        ));
    }
    if let Some(p) = s.top_p
        && !(p.is_finite() && p > 0.0 && p <= 1.0)
    {
        return Err(ApiError::bad_param("top_p", "top_p must be in (0, 1]"));
    }
    if s.max_tokens == Some(0) || s.max_completion_tokens == Some(0) {
        return Err(ApiError::bad_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    if let Some(stop) = &s.stop {
        let stops = stop.clone().into_vec();
        if stops.len() > 4 {
            return Err(ApiError::bad_param(
                "stop",
                "at most 4 stop sequences are allowed",
            ));
        }
    }
    Ok(())
}

fn model_routes(state: &AppState, model: &str) -> Result<Arc<ModelRoutes>, ApiError> {
    match state.pool.model(model) {
        Some(routes) => Ok(routes),
        None => Err(ApiError::ModelNotFound(model.to_owned())),
    }
}

/// POST /v1/chat/completions
pub async fn chat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let request: ChatCompletionRequest = match read_body(&state, body).and_then(|b| parse_body(&b))
    {
        Ok(r) => r,
        Err(err) => return fail(&state, Kind::Chat, err),
    };
    let prepared = async {
        validate_sampling(&request.sampling)?;
        let routes = model_routes(&state, &request.model)?;
        let messages = preprocess::parse_messages(request.messages)?;
        let permit = state.admission.admit(&state.metrics).await?;
        let model_dir = state.tokenizers.for_model(&request.model);
        let prompt = preprocess::encode_chat(
            &state.metrics,
            Arc::clone(&model_dir),
            messages,
            request.tools,
        )
        .await?;
        Ok::<_, ApiError>((
            permit,
            prepare(
                &state,
                Kind::Chat,
                request.model,
                model_dir,
                routes,
                prompt,
                request.sampling,
                session_of(&headers),
                arrived,
            )?,
        ))
    }
    .await;
    match prepared {
        Ok((permit, prepared)) => respond(state, prepared, permit).await,
        Err(err) => fail(&state, Kind::Chat, err),
    }
}

/// POST /v1/completions
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let request: CompletionRequest = match read_body(&state, body).and_then(|b| parse_body(&b)) {
        Ok(r) => r,
        Err(err) => return fail(&state, Kind::Text, err),
    };
    let prepared = async {
        validate_sampling(&request.sampling)?;
        if request.echo {
            return Err(ApiError::bad_param("echo", "echo is not supported"));
        }
        let routes = model_routes(&state, &request.model)?;
        let permit = state.admission.admit(&state.metrics).await?;
        let model_dir = state.tokenizers.for_model(&request.model);
        let prompt = match request.prompt {
            PromptInput::Text(text) => {
                preprocess::encode_text(&state.metrics, Arc::clone(&model_dir), text).await?
            }
            PromptInput::Tokens(tokens) => tokens,
            PromptInput::TextBatch(_) | PromptInput::TokenBatch(_) => {
                return Err(ApiError::bad_param(
                    "prompt",
                    "only one prompt per request is supported",
                ));
            }
        };
        Ok((
            permit,
            prepare(
                &state,
                Kind::Text,
                request.model,
                model_dir,
                routes,
                prompt,
                request.sampling,
                session_of(&headers),
                arrived,
            )?,
        ))
    }
    .await;
    match prepared {
        Ok((permit, prepared)) => respond(state, prepared, permit).await,
        Err(err) => fail(&state, Kind::Text, err),
    }
}

#[allow(clippy::too_many_arguments)]
fn prepare(
    state: &AppState,
    kind: Kind,
    model: String,
    model_dir: Arc<ModelDir>,
    routes: Arc<ModelRoutes>,
    prompt: Vec<TokenId>,
    sampling: SamplingFields,
    session: Option<String>,
    arrived: Instant,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    let context = routes.max_context_tokens;
    let prompt_len = prompt.len() as u64;
    if prompt_len >= context {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {context} tokens. However, your prompt has {prompt_len} tokens."
        )));
    }
    let max_tokens = match sampling.max_completion_tokens.or(sampling.max_tokens) {
        Some(asked) => {
            if prompt_len + u64::from(asked) > context {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {asked} for the completion).",
                        prompt_len + u64::from(asked)
                    ),
                ));
            }
            asked
        }
        None => (context - prompt_len).min(u64::from(state.config.default_max_tokens)) as u32,
    };
    let stops = sampling
        .stop
        .clone()
        .map(|s| s.into_vec())
        .unwrap_or_default();
    Ok(Prepared {
        kind,
        request_id: format!(
            "{}-{:016x}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            rand_id()
        ),
        model,
        model_dir,
        routes,
        prompt,
        max_tokens,
        stops,
        stream: sampling.stream,
        include_usage: sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        sampling,
        session,
        arrived,
    })
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

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
}

impl TextAssembler {
    fn new(p: &Prepared) -> Self {
        Self {
            decoder: Some(IncrementalDecoder::new(
                Arc::clone(p.model_dir.tokenizer()),
                true,
            )),
            stop: StopMatcher::new(p.stops.clone()),
            prompt_tokens: p.prompt.len() as u32,
            cached_tokens: 0,
            completion_tokens: 0,
            finish: None,
            first_token_at: None,
            last_token_at: None,
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

async fn respond(state: Arc<AppState>, p: Prepared, permit: OwnedSemaphorePermit) -> Response {
    let stop_token_ids = if p.sampling.ignore_eos {
        Vec::new()
    } else {
        p.model_dir.eos_token_ids().to_vec()
    };
    let job = GenerateJob {
        request_id: p.request_id.clone(),
        routes: Arc::clone(&p.routes),
        prompt: p.prompt.clone(),
        max_tokens: p.max_tokens,
        temperature: p.sampling.temperature.unwrap_or(1.0),
        seed: p.sampling.seed,
        ignore_eos: p.sampling.ignore_eos,
        stop_token_ids,
        session: p.session.clone().or_else(|| p.sampling.user.clone()),
        deadline: tokio::time::Instant::from_std(p.arrived + state.config.request_timeout()),
        max_retries: state.config.max_retries,
        max_migrations: state.config.max_migrations,
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
        let mut content = String::new();
        loop {
            match rx.recv().await {
                Some(DispatchEvent::Tokens(tokens)) => {
                    content.push_str(&text.tokens(&state, p.arrived, &tokens));
                    if text.finish.is_some() {
                        break;
                    }
                }
                Some(DispatchEvent::Finished(finish)) => {
                    content.push_str(&text.finished(finish));
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
        record(&state, p.kind, "ok");
        let finish = text.finish.unwrap_or("length");
        match p.kind {
            Kind::Chat => axum::Json(ChatCompletion {
                id: p.request_id,
                object: "chat.completion",
                created: unix_now(),
                model: p.model,
                choices: vec![ChatChoice {
                    index: 0,
                    message: ChatMessageOut {
                        role: "assistant",
                        content,
                    },
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
                    text: content,
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
}

/// Holds a concurrency slot and the in-flight gauge for as long as the response is produced.
struct InFlight {
    state: Arc<AppState>,
    _permit: OwnedSemaphorePermit,
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
    content: Option<String>,
    role: bool,
    finish: Option<&'static str>,
    usage: Option<Usage>,
) -> String {
    let json = match p.kind {
        Kind::Chat => serde_json::to_string(&ChatCompletionChunk {
            id: p.request_id.clone(),
            object: "chat.completion.chunk",
            created,
            model: p.model.clone(),
            choices: if usage.is_some() && content.is_none() && finish.is_none() && !role {
                Vec::new()
            } else {
                vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta {
                        role: role.then_some("assistant"),
                        content,
                    },
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
            choices: if usage.is_some() && content.is_none() && finish.is_none() {
                Vec::new()
            } else {
                vec![CompletionChoice {
                    index: 0,
                    text: content.unwrap_or_default(),
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
        queue.push_back(chunk(&p, created, Some(String::new()), true, None, None));
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
                    if !piece.is_empty() {
                        s.queue
                            .push_back(chunk(&s.p, s.created, Some(piece), false, None, None));
                    }
                    if s.text.finish.is_some() {
                        // A stop string matched: stop the worker now.
                        s.rx = None;
                        end_stream(&mut s.queue, &s.state, &s.p, &s.text, s.created);
                        s.done = true;
                    }
                }
                Some(DispatchEvent::Finished(finish)) => {
                    let tail = s.text.finished(finish);
                    if !tail.is_empty() {
                        s.queue
                            .push_back(chunk(&s.p, s.created, Some(tail), false, None, None));
                    }
                    s.rx = None;
                    end_stream(&mut s.queue, &s.state, &s.p, &s.text, s.created);
                    s.done = true;
                }
                Some(DispatchEvent::Failed(err)) => {
                    s.rx = None;
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
    let finish = text.finish.unwrap_or("length");
    queue.push_back(chunk(p, created, None, false, Some(finish), None));
    let usage = text.usage();
    count_tokens(state, &usage);
    if p.include_usage {
        queue.push_back(chunk(p, created, None, false, None, Some(usage)));
    }
    queue.push_back("[DONE]".to_owned());
}
