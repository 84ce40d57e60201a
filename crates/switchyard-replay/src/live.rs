//! Live mode: the same workloads against any OpenAI-compatible endpoint, in wall-clock time.
//!
//! Each request is a streaming `POST {endpoint}/completions` with the synthetic prompt as
//! token ids, `max_tokens`, `ignore_eos` and `stream_options.include_usage`. TTFT is the time
//! to the first chunk carrying a choice, TPOT the time from there to the last one divided by
//! the remaining output tokens; token counts and cached prompt tokens come from the final usage
//! chunk. This is the only module with network code.

use std::collections::BinaryHeap;
use std::time::Duration;
use switchyard_core::sse::SseDecoder;

use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::ReplayError;
use crate::metrics::RequestRecord;
use crate::workload::{Micros, Outbox, RequestSpec, Workload};

/// Where and how to send.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveConfig {
    /// Base URL including the version, e.g. `http://127.0.0.1:8000/v1`.
    pub endpoint: String,
    /// Served model name; `None` asks `{endpoint}/models` and takes the first.
    pub model: Option<String>,
    /// Per-request limit, from send to the last byte.
    pub request_timeout: Duration,
    /// More base URLs of the same deployment (gateway replicas): request `id` goes to
    /// `[endpoint, spread..][id mod n]`, as a Service spreads connections over its pods.
    pub spread: Vec<String>,
}

#[derive(Debug, PartialEq, Eq)]
struct Pending {
    at: Micros,
    seq: u64,
    spec: RequestSpec,
}

impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

fn micros_since(start: Instant) -> Micros {
    start.elapsed().as_micros() as Micros
}

/// Asks the endpoint which model it serves.
pub async fn first_model(client: &reqwest::Client, endpoint: &str) -> Result<String, ReplayError> {
    let url = format!("{}/models", endpoint.trim_end_matches('/'));
    let body: Value = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| ReplayError::Http(format!("GET {url}: {e}")))?
        .json()
        .await
        .map_err(|e| ReplayError::Http(format!("GET {url}: {e}")))?;
    body["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ReplayError::Http(format!("GET {url}: no model listed")))
}

/// Runs `workload` against the endpoint; returns one record per request, ordered by id.
pub async fn replay_live(
    workload: &mut dyn Workload,
    config: &LiveConfig,
    progress: &ProgressBar,
) -> Result<Vec<RequestRecord>, ReplayError> {
    let client = reqwest::Client::builder()
        .timeout(config.request_timeout)
        .build()
        .map_err(|e| ReplayError::Http(e.to_string()))?;
    let model = match &config.model {
        Some(m) => m.clone(),
        None => first_model(&client, &config.endpoint).await?,
    };
    let urls: Vec<String> = std::iter::once(&config.endpoint)
        .chain(&config.spread)
        .map(|endpoint| format!("{}/completions", endpoint.trim_end_matches('/')))
        .collect();
    let start = Instant::now();
    let mut pending = BinaryHeap::new();
    let mut seq = 0u64;
    let mut out = Outbox::default();
    let mut tasks: JoinSet<RequestRecord> = JoinSet::new();
    let mut records = Vec::new();
    workload.start(&mut out);
    loop {
        for (at, spec) in out.drain() {
            seq += 1;
            pending.push(Pending { at, seq, spec });
        }
        // The endpoint schedules its own sessions: an ended one means nothing here.
        out.drain_ended().for_each(drop);
        let next_at = pending.peek().map(|p: &Pending| p.at);
        if next_at.is_none() && tasks.is_empty() {
            break;
        }
        let wake = start + Duration::from_micros(next_at.unwrap_or(0));
        tokio::select! {
            () = tokio::time::sleep_until(wake), if next_at.is_some() => {
                let now = micros_since(start);
                while pending.peek().is_some_and(|p| p.at <= now) {
                    let Some(p) = pending.pop() else { break };
                    let url = urls[(p.spec.id % urls.len() as u64) as usize].clone();
                    let (client, model) = (client.clone(), model.clone());
                    tasks.spawn(send_one(client, url, model, p.spec, start));
                }
            }
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                let record = joined.map_err(|e| ReplayError::Http(format!("request task: {e}")))?;
                progress.inc(1);
                workload.on_finished(record.id, record.ok, micros_since(start), &mut out);
                records.push(record);
            }
        }
    }
    records.sort_by_key(|r| r.id);
    Ok(records)
}

async fn send_one(
    client: reqwest::Client,
    url: String,
    model: String,
    spec: RequestSpec,
    start: Instant,
) -> RequestRecord {
    let prompt = spec.prompt.tokens();
    let mut record = RequestRecord {
        id: spec.id,
        worker: 0,
        arrival: micros_since(start),
        first_token: None,
        finished: None,
        prompt_tokens: prompt.len() as u64,
        cached_tokens: 0,
        output_tokens: 0,
        ok: false,
    };
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(session) = &spec.session {
        body["user"] = json!(session);
    }
    let mut request = client.post(&url).json(&body);
    if let Some(session) = &spec.session {
        request = request.header("x-session-id", session);
    }
    let Ok(response) = request.send().await else {
        return record;
    };
    if !response.status().is_success() {
        return record;
    }
    let mut stream = response.bytes_stream();
    let mut events = SseDecoder::new();
    let mut last_token = None;
    let mut chunks = 0u64;
    let mut done = false;
    while let Some(Ok(bytes)) = stream.next().await {
        for data in events.push(&bytes) {
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if chunk["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = micros_since(start);
                record.first_token.get_or_insert(now);
                last_token = Some(now);
                chunks += 1;
            }
            if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                record.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
                record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                if let Some(p) = usage["prompt_tokens"].as_u64() {
                    record.prompt_tokens = p;
                }
            }
        }
    }
    if record.output_tokens == 0 {
        record.output_tokens = chunks;
    }
    record.finished = last_token;
    record.ok = done && record.first_token.is_some();
    record
}
