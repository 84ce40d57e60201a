//! The TensorRT-LLM adapter: `switchyard worker --engine trtllm` in front of `trtllm-serve`.
//!
//! It is the same [`VllmEngine`] as for vLLM and SGLang, started differently, because
//! `trtllm-serve` speaks the same OpenAI completion stream ([`openai_http`], dialect
//! [`Dialect::Trtllm`]) but everything else is pulled from its HTTP API:
//!
//! - **Health and facts.** `GET /health` answers 200 once the model is loaded; `GET /v1/models`
//!   lists the served model (checked against `--served-model-name`/`--model`). The block size
//!   and device blocks come from its iteration stats (`kvCacheStats.tokensPerBlock`,
//!   `maxNumBlocks`), which exist only once the engine has run an iteration and only with
//!   `enable_iter_perf_stats`; the context length is not announced at all. Whatever the engine
//!   does not tell within a short wait after it is healthy must be set with a flag, and the
//!   error names it.
//! - **Load.** `GET /metrics` is not Prometheus text here but the iteration stats queue, drained
//!   by each read: the last entry gives running and queued requests and the KV blocks in use; an
//!   empty read means no iteration ran since the previous one (the engine is idle).
//! - **KV events.** `POST /kv_cache_events` drains the engine's event queue. A poller reads it
//!   every `kv_poll_ms` while events flow and backs off to 25 times that when none come or the
//!   engine does not answer; [`trtllm_events`](super::trtllm_events) finds lost events and turns
//!   the rest into the relay's batches.
//!
//! - **Disaggregation.** A prefill or decode worker splits requests through the engine's
//!   `disaggregated_params` ([`trtllm_pd`](super::trtllm_pd)).
//!
//! LoRA adapters, log probabilities and cache salts on `/v1/completions` are not supported yet:
//! the configuration refuses the first and a request asking for the others is refused with
//! `UNIMPLEMENTED`, so the gateway can say why.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_core::{BlockSize, EngineKind, Guided, LoadStats, WorkerId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::adapter_base::{AdapterBase, EngineParts};
use super::config::EngineConfig;
use super::openai_http::Dialect;
use super::stats::EngineScrapeCounters;
use super::trtllm_events::{Step, TrtllmEvents, parse_poll};
use super::vllm::{AdapterError, VllmEngine, get_json, get_text};
use super::zmq_events::RelayShared;
use super::{EngineError, EngineSpec, GenerateParams};

/// How many times the poll interval an idle or failing poller waits at most.
const BACKOFF_FACTOR: u32 = 25;
/// How long after the engine is healthy start-up waits for the facts only iteration stats give.
const STATS_WAIT: Duration = Duration::from_secs(3);

/// Refuses what `trtllm-serve`'s `/v1/completions` cannot be asked for (or its answer cannot be
/// read for): the engine's fault to lack it, so another worker may serve it.
pub(super) fn check_request(params: &GenerateParams) -> Result<(), EngineError> {
    if params.sampling.logprobs.is_some() {
        return Err(EngineError::Unsupported(
            "log probabilities are not supported on TensorRT-LLM workers yet",
        ));
    }
    check_identity(&params.identity)
}

/// Refuses a KV identity `trtllm-serve` cannot be given (a prefill has no sampling to check).
pub(super) fn check_identity(identity: &switchyard_core::KvIdentity) -> Result<(), EngineError> {
    if identity.adapter.is_some() {
        return Err(EngineError::Unsupported(
            "LoRA adapters are not supported on TensorRT-LLM workers yet",
        ));
    }
    if identity.salt.is_some() {
        return Err(EngineError::Unsupported(
            "trtllm-serve's /v1/completions takes no cache_salt",
        ));
    }
    Ok(())
}

/// `trtllm-serve`'s `CompletionRequest` (`tensorrt_llm/serve/openai_protocol.py`): the shared
/// sampling fields, `seed`, `min_tokens`, `response_format` for a constraint. The engine's own
/// defaults apply to what is unset. Log probabilities, LoRA adapters and cache salts are refused
/// before this ([`check_request`]).
pub(super) fn request_body(
    model: &str,
    p: &GenerateParams,
    sampling: serde_json::Map<String, Value>,
) -> Value {
    let s = &p.sampling;
    let mut body = json!({
        "model": model,
        "prompt": p.prompt,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": s.max_tokens,
        "detokenize": false,
    });
    if let Some(fields) = body.as_object_mut() {
        fields.extend(sampling);
        if let Some(seed) = s.seed {
            fields.insert("seed".into(), json!(seed));
        }
        if let Some(min) = s.min_tokens {
            fields.insert("min_tokens".into(), json!(min));
        }
        if let Some(guided) = &s.guided {
            fields.insert("response_format".into(), trtllm_response_format(guided));
        }
    }
    body
}

/// TensorRT-LLM's `response_format` for a constraint: `json` with a schema, `json_object`,
/// `regex` or `ebnf`; a choice list becomes a regular expression matching exactly one of them.
fn trtllm_response_format(guided: &Guided) -> Value {
    match guided {
        Guided::JsonObject => json!({"type": "json_object"}),
        Guided::JsonSchema(schema) => json!({
            "type": "json",
            "schema": serde_json::from_str::<Value>(schema).unwrap_or_else(|_| json!(schema))
        }),
        Guided::Regex(regex) => json!({"type": "regex", "regex": regex}),
        Guided::Choice(_) => {
            let (_, regex) = super::openai_http::sglang_constraint(guided);
            json!({"type": "regex", "regex": regex})
        }
        Guided::Grammar(grammar) => json!({"type": "ebnf", "ebnf": grammar}),
    }
}

/// The engine facts registration needs, as far as they are known.
#[derive(Debug, Default)]
struct Facts {
    block_size: Option<u32>,
    kv_blocks: Option<u64>,
    max_context: Option<u64>,
}

impl VllmEngine {
    /// Waits for `trtllm-serve`, reads its facts and starts following its events and load.
    pub async fn start_trtllm(
        worker: WorkerId,
        incarnation: u64,
        model: &str,
        config: &EngineConfig,
        kv_bytes_per_token: u64,
        event_buffer: usize,
    ) -> Result<Self, AdapterError> {
        let base = AdapterBase::new(worker, incarnation, config, event_buffer)?;
        let (http, base_url) = (&base.http, base.base_url.as_str());
        let served = config
            .served_model_name
            .clone()
            .unwrap_or_else(|| model.to_owned());
        let facts = discover(http, base_url, &served, config).await?;
        let (Some(block_size), Some(kv_blocks), Some(max_context)) =
            (facts.block_size, facts.kv_blocks, facts.max_context)
        else {
            let missing = [
                (
                    facts.block_size.is_none(),
                    "--engine-block-size (kv_cache_config.tokens_per_block)",
                ),
                (
                    facts.kv_blocks.is_none(),
                    "--engine-kv-blocks (the engine's device KV blocks)",
                ),
                (
                    facts.max_context.is_none(),
                    "--engine-max-context (its max_seq_len)",
                ),
            ]
            .into_iter()
            .filter_map(|(m, flag)| m.then_some(flag))
            .collect::<Vec<_>>()
            .join(", ");
            return Err(AdapterError::Config(format!(
                "the TensorRT-LLM engine at {base_url} is up but did not tell {missing} (its block \
                 facts are only in iteration stats, which need enable_iter_perf_stats and a first \
                 iteration; its context length is never announced); set them with those flags"
            )));
        };
        let block_size =
            BlockSize::new(block_size).map_err(|e| AdapterError::Config(e.to_string()))?;
        let spec = EngineSpec {
            kind: EngineKind::Trtllm,
            block_size,
            kv_capacity_blocks: kv_blocks,
            max_context_tokens: max_context,
            kv_bytes_per_token,
        };
        tracing::info!(url = %base_url, block_size = block_size.get(), kv_blocks, max_context, "TensorRT-LLM engine found");

        let shared = base.relay(block_size, config.dp_ranks, kv_blocks);
        base.tasks.spawn(poll_events(
            EventSource {
                http: http.clone(),
                url: format!("{base_url}/kv_cache_events"),
                every: Duration::from_millis(config.kv_poll_ms),
                events: TrtllmEvents::new(
                    block_size,
                    config.dp_ranks,
                    AdapterBase::relay_capacity(kv_blocks),
                ),
            },
            Arc::clone(&shared),
            base.cancel.clone(),
        ));
        let (load_tx, load_rx) = watch::channel(LoadStats {
            capacity_blocks: kv_blocks,
            ..LoadStats::default()
        });
        base.tasks.spawn(scrape_stats(
            StatsSource {
                http: http.clone(),
                url: format!("{base_url}/metrics"),
                block_size: block_size.get(),
                every: Duration::from_millis(config.metrics_interval_ms),
            },
            load_tx,
            Arc::clone(&base.scrapes),
            base.cancel.clone(),
        ));
        Ok(base.finish(EngineParts {
            spec,
            dialect: Dialect::Trtllm,
            model: served,
            bootstrap: (String::new(), 0),
            load_rx,
            shared: Some(shared),
            adapters_rx: None,
        }))
    }
}

/// Waits (up to the start-up timeout) until the engine is healthy and serves `served`, then
/// gives it a short while for the facts only its iteration stats carry.
async fn discover(
    http: &reqwest::Client,
    base: &str,
    served: &str,
    config: &EngineConfig,
) -> Result<Facts, AdapterError> {
    let mut facts = Facts {
        block_size: config.block_size,
        kv_blocks: config.kv_blocks,
        max_context: config.max_context,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(config.startup_timeout_secs);
    let models = loop {
        let last = match get_text(http, &format!("{base}/health")).await {
            Ok(_) => match get_json(http, &format!("{base}/v1/models")).await {
                Ok(models) => break models,
                Err(err) => err,
            },
            Err(err) => err,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(AdapterError::Unknown {
                kind: EngineKind::Trtllm,
                url: base.to_owned(),
                what: "health",
                secs: config.startup_timeout_secs,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let ids: Vec<&str> = models
        .get("data")
        .and_then(Value::as_array)
        .map(|d| d.iter().filter_map(|m| m.get("id")?.as_str()).collect())
        .unwrap_or_default();
    if !ids.contains(&served) {
        return Err(AdapterError::Config(format!(
            "the TensorRT-LLM engine at {base} serves {ids:?}, not {served:?}; set --served-model-name to the name it serves"
        )));
    }
    // trtllm-serve's model card has no max_model_len; a newer one may.
    facts.max_context = facts.max_context.or_else(|| {
        models
            .pointer("/data/0/max_model_len")
            .and_then(Value::as_u64)
    });
    let stats_deadline = tokio::time::Instant::now() + STATS_WAIT;
    while facts.block_size.is_none() || facts.kv_blocks.is_none() {
        if let Ok(Value::Array(stats)) = get_json(http, &format!("{base}/metrics")).await
            && let Some(kv) = stats.last().and_then(|s| s.get("kvCacheStats"))
        {
            let num = |k: &str| kv.get(k).and_then(Value::as_u64).filter(|n| *n > 0);
            facts.block_size = facts
                .block_size
                .or_else(|| num("tokensPerBlock").and_then(|b| u32::try_from(b).ok()));
            facts.kv_blocks = facts.kv_blocks.or_else(|| num("maxNumBlocks"));
        }
        if tokio::time::Instant::now() >= stats_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(facts)
}

/// Where and how the engine's KV events are polled.
struct EventSource {
    http: reqwest::Client,
    url: String,
    every: Duration,
    events: TrtllmEvents,
}

/// Polls `/kv_cache_events` until `cancel`, applying what comes. A failed poll (engine down, an
/// error status, a body that is not a JSON list) is counted and logged once per outage; events
/// it may have drained are lost, which the next poll's event ids reveal.
async fn poll_events(source: EventSource, shared: Arc<RelayShared>, cancel: CancellationToken) {
    let EventSource {
        http,
        url,
        every,
        mut events,
    } = source;
    let longest = every * BACKOFF_FACTOR;
    let mut wait = every;
    let mut failing = false;
    tracing::info!(%url, "polling TensorRT-LLM kv events");
    loop {
        let polled = match poll_once(&http, &url).await {
            Ok(body) => parse_poll(&body).map_err(|e| format!("{url}: {e}")),
            Err(err) => Err(err),
        };
        match polled {
            Ok((parsed, unreadable)) => {
                if failing {
                    tracing::info!(%url, "TensorRT-LLM kv events answer again");
                }
                failing = false;
                let c = shared.counters.rank(0);
                for why in unreadable {
                    c.add(&c.malformed, 1);
                    tracing::warn!(%url, why, "unreadable TensorRT-LLM kv event skipped");
                }
                let any = !parsed.is_empty();
                for step in events.ingest(parsed, &shared.counters) {
                    match step {
                        Step::Apply { rank, batch } => shared.apply_batch(rank, &batch),
                        Step::Reset { rank, .. } => shared.reset(rank),
                    }
                }
                wait = if any { every } else { (wait * 2).min(longest) };
            }
            Err(err) => {
                let c = shared.counters.rank(0);
                c.add(&c.poll_failures, 1);
                if !failing {
                    tracing::warn!(error = %err, "polling TensorRT-LLM kv events failed; retrying with back-off");
                }
                failing = true;
                wait = (wait * 2).min(longest);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

async fn poll_once(http: &reqwest::Client, url: &str) -> Result<String, String> {
    let response = http
        .post(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("{url} answered {}", response.status()));
    }
    response.text().await.map_err(|e| format!("{url}: {e}"))
}

/// Where and how often the iteration stats are read.
struct StatsSource {
    http: reqwest::Client,
    url: String,
    block_size: u32,
    every: Duration,
}

async fn scrape_stats(
    source: StatsSource,
    load_tx: watch::Sender<LoadStats>,
    scrapes: Arc<EngineScrapeCounters>,
    cancel: CancellationToken,
) {
    let mut failing = false;
    let mut reported_block_size = false;
    loop {
        let read = get_json(&source.http, &source.url)
            .await
            .and_then(|v| match v {
                Value::Array(stats) => Ok(stats),
                _ => Err(format!("{} is not a list of iteration stats", source.url)),
            });
        match read {
            Ok(stats) => {
                let previous = *load_tx.borrow();
                let load = load_from_stats(&stats, previous);
                let theirs = stats
                    .last()
                    .and_then(|s| s.pointer("/kvCacheStats/tokensPerBlock"))
                    .and_then(Value::as_u64);
                if let Some(theirs) = theirs
                    && theirs != u64::from(source.block_size)
                    && !reported_block_size
                {
                    reported_block_size = true;
                    tracing::error!(
                        engine_block_size = theirs,
                        worker_block_size = source.block_size,
                        "the TensorRT-LLM engine's tokens_per_block is not the worker's block size; its KV events cannot be indexed (set --engine-block-size {theirs})"
                    );
                }
                load_tx.send_replace(load);
                scrapes.ok.fetch_add(1, Ordering::Relaxed);
                scrapes.up.store(1, Ordering::Relaxed);
                failing = false;
            }
            Err(err) => {
                scrapes.failed.fetch_add(1, Ordering::Relaxed);
                scrapes.up.store(0, Ordering::Relaxed);
                if !failing {
                    tracing::warn!(url = %source.url, error = %err, "TensorRT-LLM iteration stats read failed; keeping the last load");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(source.every) => {}
        }
    }
}

/// The load the latest of `stats` (TensorRT-LLM's iteration stats, oldest first) describes. No
/// stats: no iteration ran since the last read, so nothing runs or waits; the blocks in use
/// stay as last seen. The prefix-cache counters (`reusedBlocks`, `missedBlocks`) are in blocks
/// and become tokens at `tokensPerBlock`.
pub fn load_from_stats(stats: &[Value], previous: LoadStats) -> LoadStats {
    let Some(last) = stats.last() else {
        return LoadStats {
            waiting_requests: 0,
            running_requests: 0,
            active_decode_sequences: 0,
            queued_prefill_tokens: 0,
            ..previous
        };
    };
    let num = |p: &str| last.pointer(p).and_then(Value::as_u64);
    let running = num("/numActiveRequests").unwrap_or(0);
    let waiting = num("/numQueuedRequests").unwrap_or(0)
        + num("/inflightBatchingStats/numPausedRequests").unwrap_or(0);
    let used = num("/kvCacheStats/usedNumBlocks").unwrap_or(previous.used_blocks);
    let per_block = num("/kvCacheStats/tokensPerBlock").unwrap_or(0);
    let reused = num("/kvCacheStats/reusedBlocks");
    let missed = num("/kvCacheStats/missedBlocks");
    LoadStats {
        queued_prefill_tokens: 0,
        waiting_requests: waiting,
        running_requests: running,
        active_decode_sequences: num("/inflightBatchingStats/numGenRequests").unwrap_or(running),
        active_blocks: used,
        used_blocks: used,
        capacity_blocks: num("/kvCacheStats/maxNumBlocks")
            .filter(|n| *n > 0)
            .unwrap_or(previous.capacity_blocks),
        preemptions_total: previous.preemptions_total,
        cached_prompt_tokens_total: reused
            .map_or(previous.cached_prompt_tokens_total, |r| r * per_block),
        prompt_tokens_total: match (reused, missed) {
            (Some(r), Some(m)) => (r + m) * per_block,
            _ => previous.prompt_tokens_total,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iteration_stats_become_load_and_an_empty_read_means_idle() {
        // The shape trtllm-serve's /metrics returns (its docs' example, trimmed).
        let stats = vec![
            json!({"iter": 153, "numActiveRequests": 9, "numQueuedRequests": 9}),
            json!({"iter": 154, "numActiveRequests": 3, "numQueuedRequests": 2,
                   "inflightBatchingStats": {"numPausedRequests": 1, "numGenRequests": 2},
                   "kvCacheStats": {"maxNumBlocks": 1000, "usedNumBlocks": 40, "tokensPerBlock": 32,
                                    "reusedBlocks": 4, "missedBlocks": 6, "freeNumBlocks": 960}}),
        ];
        let load = load_from_stats(&stats, LoadStats::default());
        assert_eq!((load.running_requests, load.waiting_requests), (3, 3));
        assert_eq!(load.active_decode_sequences, 2);
        assert_eq!((load.used_blocks, load.capacity_blocks), (40, 1000));
        assert_eq!(
            (load.cached_prompt_tokens_total, load.prompt_tokens_total),
            (128, 320)
        );
        let idle = load_from_stats(&[], load);
        assert_eq!((idle.running_requests, idle.waiting_requests), (0, 0));
        assert_eq!(idle.used_blocks, 40, "blocks in use stay as last seen");
        assert_eq!(idle.prompt_tokens_total, 320);
    }

    #[test]
    fn the_request_names_only_fields_trtllm_serve_declares() {
        // trtllm-serve's CompletionRequest (openai_protocol.py) forbids undeclared fields.
        let declared = [
            "model",
            "prompt",
            "stream",
            "stream_options",
            "max_tokens",
            "detokenize",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "seed",
            "min_tokens",
            "response_format",
        ];
        let with = |guided: Option<Guided>| GenerateParams {
            request_id: "r".into(),
            prompt: vec![1, 2],
            sampling: switchyard_core::Sampling {
                max_tokens: 3,
                temperature: Some(0.5),
                top_k: Some(4),
                seed: Some(9),
                min_tokens: Some(1),
                stop_token_ids: vec![7],
                guided,
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        };
        let body = |guided| {
            let (path, body) =
                super::super::openai_http::request_body(Dialect::Trtllm, "m", &with(guided));
            assert_eq!(path, "/v1/completions");
            body
        };
        let plain = body(None);
        for key in plain.as_object().unwrap().keys() {
            assert!(
                declared.contains(&key.as_str()),
                "{key} is not trtllm-serve's"
            );
        }
        assert_eq!(plain["detokenize"], false);
        assert_eq!((&plain["top_k"], &plain["seed"]), (&json!(4), &json!(9)));
        assert!(plain.get("top_p").is_none() && plain.get("response_format").is_none());
        let format = |g| body(Some(g))["response_format"].clone();
        assert_eq!(
            format(Guided::JsonSchema(r#"{"type":"object"}"#.into())),
            json!({"type": "json", "schema": {"type": "object"}})
        );
        assert_eq!(format(Guided::JsonObject), json!({"type": "json_object"}));
        assert_eq!(
            format(Guided::Grammar("root ::= x".into())),
            json!({"type": "ebnf", "ebnf": "root ::= x"})
        );
        assert_eq!(
            format(Guided::Choice(vec!["a".into(), "b.c".into()])),
            json!({"type": "regex", "regex": r"(a|b\.c)"})
        );
    }

    #[test]
    fn requests_the_completion_endpoint_cannot_take_are_refused() {
        let mut params = GenerateParams {
            request_id: "r".into(),
            prompt: vec![1],
            sampling: switchyard_core::Sampling {
                max_tokens: 1,
                ..Default::default()
            },
            identity: Default::default(),
            retention: Default::default(),
            priority: None,
        };
        assert!(check_request(&params).is_ok());
        params.sampling.logprobs = Some(1);
        assert!(matches!(
            check_request(&params),
            Err(EngineError::Unsupported(_))
        ));
        params.sampling.logprobs = None;
        params.identity = switchyard_core::KvIdentity::new(None, Some("s".into())).unwrap();
        assert!(matches!(
            check_request(&params),
            Err(EngineError::Unsupported(_))
        ));
    }
}
