//! Closed-loop client load for the chaos and soak tests: `clients` tasks each send one chat
//! after another to a gateway until stopped, half of them streamed, and check every answer
//! (status 200, `[DONE]`, no error event, exactly `max_tokens` completion tokens).
//!
//! Clients behave like the OpenAI SDKs: a request whose connection fails (refused, reset, the
//! body cut short) is sent again after 100 ms, and so is a 503 when the spec says so, until
//! [`REQUEST_DEADLINE`] passes. A request is *lost* when it never gets a complete answer; the
//! report lists every such request with the reason, so a test can assert there are none.
//!
//! Options for the soak: multi-turn sessions (`x-session-id`, each turn resending the growing
//! history) and streams abandoned after their first chunk.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long one request may take, retries included, before it counts as lost.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(90);
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// What the clients send.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub clients: usize,
    /// Completion tokens of every request (`ignore_eos`).
    pub max_tokens: u32,
    /// Send a 503 again (as the SDKs do) instead of counting the request lost.
    pub retry_unavailable: bool,
    /// Every n-th streamed request is dropped after its first chunk (a client going away).
    pub abandon_one_in: Option<u64>,
    /// Each client runs sessions of this many turns, each turn resending the history.
    pub session_turns: Option<u32>,
}

impl LoadSpec {
    pub fn new(clients: usize, max_tokens: u32) -> Self {
        Self {
            clients,
            max_tokens,
            retry_unavailable: false,
            abandon_one_in: None,
            session_turns: None,
        }
    }
}

/// What happened to the requests, summed over the clients.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub ok: u64,
    pub streamed: u64,
    pub abandoned: u64,
    /// Requests that never got a complete answer, with why.
    pub lost: Vec<String>,
    /// Attempts sent again after a connection error.
    pub transport_retries: u64,
    /// Attempts sent again after a 503.
    pub unavailable_retries: u64,
    /// HTTP 5xx answers seen (retried or not).
    pub server_errors: u64,
    /// When each successful request completed, in order.
    pub completions: Vec<Instant>,
}

impl LoadReport {
    /// The longest time without a completed request between `from` and the last completion
    /// (the outage the clients saw, retries included).
    pub fn longest_gap_after(&self, from: Instant) -> Duration {
        let mut last = from;
        let mut longest = Duration::ZERO;
        for &done in self.completions.iter().filter(|&&t| t >= from) {
            longest = longest.max(done - last);
            last = done;
        }
        longest
    }

    /// Requests completed at or after `from`.
    pub fn completed_after(&self, from: Instant) -> usize {
        self.completions.iter().filter(|&&t| t >= from).count()
    }

    fn absorb(&mut self, other: LoadReport) {
        self.ok += other.ok;
        self.streamed += other.streamed;
        self.abandoned += other.abandoned;
        self.lost.extend(other.lost);
        self.transport_retries += other.transport_retries;
        self.unavailable_retries += other.unavailable_retries;
        self.server_errors += other.server_errors;
        self.completions.extend(other.completions);
    }
}

/// Running clients; [`stop`](Load::stop) ends them and returns the report.
#[derive(Debug)]
pub struct Load {
    stop: CancellationToken,
    clients: JoinSet<LoadReport>,
    completed: Arc<AtomicU64>,
}

impl Load {
    /// Starts the clients against the gateway at `base` (`http://host:port`).
    pub fn start(base: &str, spec: LoadSpec) -> Load {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_DEADLINE)
            .build()
            .expect("http client");
        let stop = CancellationToken::new();
        let completed = Arc::new(AtomicU64::new(0));
        let mut clients = JoinSet::new();
        for index in 0..spec.clients {
            let client = Client {
                index,
                base: base.to_owned(),
                http: http.clone(),
                spec: spec.clone(),
                completed: Arc::clone(&completed),
                report: LoadReport::default(),
            };
            clients.spawn(client.run(stop.clone()));
        }
        Load {
            stop,
            clients,
            completed,
        }
    }

    /// Requests completed so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Waits (bounded by `limit`) until `more` requests have completed after this call.
    pub async fn wait_for(&self, more: u64, limit: Duration) -> bool {
        let target = self.completed() + more;
        super::eventually(limit, || async { self.completed() >= target }).await
    }

    /// Lets each client finish the request it is on (bounded by [`REQUEST_DEADLINE`]) and
    /// returns what happened.
    pub async fn stop(mut self) -> LoadReport {
        self.stop.cancel();
        let mut report = LoadReport::default();
        while let Some(client) = self.clients.join_next().await {
            report.absorb(client.expect("a load client panicked"));
        }
        report.completions.sort();
        report
    }
}

/// Why one attempt at a request did not give a complete answer.
enum Failure {
    /// The connection failed or the answer was cut short: send it again.
    Transport(String),
    /// 503 from the gateway.
    Unavailable(String),
    /// Anything else: the request is lost.
    Wrong(String),
}

struct Client {
    index: usize,
    base: String,
    http: reqwest::Client,
    spec: LoadSpec,
    completed: Arc<AtomicU64>,
    report: LoadReport,
}

impl Client {
    async fn run(mut self, stop: CancellationToken) -> LoadReport {
        let mut sent: u64 = 0;
        let mut session = 0u64;
        let mut history: Vec<Value> = Vec::new();
        while !stop.is_cancelled() {
            let turns = self.spec.session_turns.unwrap_or(1).max(1);
            if history.len() >= 2 * turns as usize {
                history.clear();
                session += 1;
            }
            history.push(json!({
                "role": "user",
                "content": format!("client {} session {session} turn {}", self.index, history.len() / 2),
            }));
            let stream = (sent + self.index as u64).is_multiple_of(2);
            let abandon = stream
                && self
                    .spec
                    .abandon_one_in
                    .is_some_and(|n| n > 0 && (sent / 2) % n == n - 1);
            let mut body = json!({
                "model": "sim-8b",
                "messages": history,
                "max_tokens": self.spec.max_tokens,
                "ignore_eos": true,
            });
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            let session_id = format!("load-{}-{session}", self.index);
            match self.request(&body, &session_id, stream, abandon).await {
                Ok(()) => {
                    if abandon {
                        self.report.abandoned += 1;
                    } else {
                        self.report.ok += 1;
                        self.report.streamed += u64::from(stream);
                        self.report.completions.push(Instant::now());
                        self.completed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(why) => self
                    .report
                    .lost
                    .push(format!("client {} request {sent}: {why}", self.index)),
            }
            history.push(json!({"role": "assistant", "content": "answer"}));
            sent += 1;
        }
        self.report
    }

    /// One request, sent again after transport failures (and 503s if asked) until it gets a
    /// complete answer or the deadline passes.
    async fn request(
        &mut self,
        body: &Value,
        session_id: &str,
        stream: bool,
        abandon: bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + REQUEST_DEADLINE;
        loop {
            let why = match self.attempt(body, session_id, stream, abandon).await {
                Ok(()) => return Ok(()),
                Err(Failure::Wrong(why)) => return Err(why),
                Err(Failure::Unavailable(why)) if !self.spec.retry_unavailable => {
                    return Err(why);
                }
                Err(Failure::Unavailable(why)) => {
                    self.report.unavailable_retries += 1;
                    why
                }
                Err(Failure::Transport(why)) => {
                    self.report.transport_retries += 1;
                    why
                }
            };
            if Instant::now() >= deadline {
                return Err(format!(
                    "no answer within {REQUEST_DEADLINE:?}; last: {why}"
                ));
            }
            tokio::time::sleep(RETRY_DELAY).await;
        }
    }

    async fn attempt(
        &mut self,
        body: &Value,
        session_id: &str,
        stream: bool,
        abandon: bool,
    ) -> Result<(), Failure> {
        let mut response = self
            .http
            .post(format!("{}/v1/chat/completions", self.base))
            .header("x-session-id", session_id)
            .json(body)
            .send()
            .await
            .map_err(|e| Failure::Transport(format!("send: {e}")))?;
        let status = response.status().as_u16();
        if status >= 500 {
            self.report.server_errors += 1;
        }
        if status != 200 {
            let text = response.text().await.unwrap_or_default();
            let why = format!("status {status}: {text}");
            return Err(if status == 503 {
                Failure::Unavailable(why)
            } else {
                Failure::Wrong(why)
            });
        }
        if abandon {
            // The first chunk, then the client goes away (dropping the response).
            return match response.chunk().await {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err(Failure::Wrong("an empty stream".into())),
                Err(e) => Err(Failure::Transport(format!("first chunk: {e}"))),
            };
        }
        let text = response
            .text()
            .await
            .map_err(|e| Failure::Transport(format!("body: {e}")))?;
        let usage = if stream {
            let events = switchyard_core::sse::events(&text);
            if events.last().map(String::as_str) != Some("[DONE]") {
                return Err(Failure::Transport(format!("a stream cut short: {text}")));
            }
            let parsed: Vec<Value> = events
                .iter()
                .filter_map(|e| serde_json::from_str(e).ok())
                .collect();
            if let Some(error) = parsed.iter().find(|e| e.get("error").is_some()) {
                return Err(Failure::Wrong(format!("an error event: {error}")));
            }
            parsed
                .iter()
                .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
        } else {
            serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.get("usage").cloned())
        };
        let tokens = usage.as_ref().and_then(|u| u["completion_tokens"].as_u64());
        if tokens != Some(u64::from(self.spec.max_tokens)) {
            return Err(Failure::Wrong(format!(
                "{tokens:?} completion tokens instead of {}: {text}",
                self.spec.max_tokens
            )));
        }
        Ok(())
    }
}
