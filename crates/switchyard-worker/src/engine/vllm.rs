//! The real-engine adapter: an [`Engine`] in front of a vLLM or SGLang server (and, started by
//! [`trtllm`](super::trtllm), a TensorRT-LLM one).
//!
//! Generation goes over the engine's HTTP API ([`openai_http`](super::openai_http)); the
//! engine's KV events come over ZMQ ([`zmq_events`](super::zmq_events)), are rehashed into our
//! chained block hashes ([`kv_relay`](super::kv_relay)) and published into the worker's
//! [`EventLog`]; load comes from the engine's Prometheus `/metrics`
//! ([`engine_metrics`](super::engine_metrics)), scraped periodically. At start the adapter
//! waits for the engine to answer and reads its block size, device blocks and context length
//! (each can be overridden by configuration). What every adapter's start shares (URL, client,
//! event log, counters, task owners) is [`adapter_base`](super::adapter_base).
//!
//! Disaggregated serving goes through the engines' own KV transfer ([`pd`](super::pd)): the
//! prefill answer carries the engine's transfer parameters and the decode side hands them to its
//! engine: it offers [`EngineTransfer`], not [`KvExport`](super::KvExport), so a `PullKv` from
//! it answers `UNIMPLEMENTED`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Map, Value};
use switchyard_core::{BlockSize, EngineKind, LoadStats, WorkerId};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::adapter_base::{AdapterBase, EngineParts};
use super::config::EngineConfig;
use super::engine_metrics::Scrape;
use super::openai_http::{self, Dialect};
use super::stats::{AdapterCounters, AdapterStats, EngineScrapeCounters, EngineTelemetry};
use super::zmq_events::{RankEndpoints, RelayShared, follow_rank, rank_endpoint};
use super::{
    DropGuard, Engine, EngineError, EngineSpec, EngineTransfer, GenerateParams, GenerationStream,
    PrefillOutcome, PrefillParams,
};
use crate::event_log::EventLog;

/// How often the relay counters are logged when they changed.
const STATS_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Why the adapter could not start.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error(
        "the {kind} engine at {url} did not tell its {what} within {secs}s (last problem: {last}); set it with a flag"
    )]
    Unknown {
        kind: EngineKind,
        url: String,
        what: &'static str,
        secs: u64,
        last: String,
    },
}

/// The cache facts the registration needs.
#[derive(Debug, Clone, Copy, Default)]
struct Facts {
    block_size: Option<u32>,
    kv_blocks: Option<u64>,
    max_context: Option<u64>,
}

/// A vLLM, SGLang or TensorRT-LLM engine behind the worker.
#[derive(Debug)]
pub struct VllmEngine {
    pub(super) spec: EngineSpec,
    pub(super) dialect: Dialect,
    pub(super) http: reqwest::Client,
    pub(super) base_url: String,
    pub(super) model: String,
    /// SGLang: where decode engines reach this engine's bootstrap server (host, port).
    pub(super) bootstrap: (String, u16),
    pub(super) load_rx: watch::Receiver<LoadStats>,
    pub(super) events: Arc<EventLog>,
    pub(super) counters: Arc<AdapterCounters>,
    pub(super) scrapes: Arc<EngineScrapeCounters>,
    pub(super) shared: Option<Arc<RelayShared>>,
    /// The LoRA adapters `/v1/models` lists, followed while the engine runs.
    pub(super) adapters_rx: Option<watch::Receiver<Vec<String>>>,
    pub(super) tasks: TaskTracker,
    pub(super) cancel: CancellationToken,
    /// The engine was started scheduling by priority: requests carry theirs.
    pub(super) priority_scheduling: bool,
    /// SGLang evicts by request priority: every request carries its keep-until time
    /// ([`super::sglang_retention`]).
    pub(super) retention_priority: bool,
}

impl VllmEngine {
    /// Waits for the engine, reads its cache facts and starts following its events and load.
    pub async fn start(
        worker: WorkerId,
        incarnation: u64,
        model: &str,
        adapters: &[String],
        config: &EngineConfig,
        kv_bytes_per_token: u64,
        event_buffer: usize,
    ) -> Result<Self, AdapterError> {
        let kind = config.kind;
        let base = AdapterBase::new(worker, incarnation, config, event_buffer)?;
        let dialect = match kind {
            EngineKind::Sglang => Dialect::Sglang,
            _ => Dialect::Vllm(config.vllm_token_ids),
        };
        let bootstrap = (
            super::pd::bootstrap_host(config.bootstrap_host.as_deref(), &base.base_url)
                .map_err(AdapterError::Config)?,
            config.bootstrap_port,
        );
        let (http, base_url) = (&base.http, base.base_url.as_str());
        let facts = discover(http, kind, base_url, config).await?;
        let adapters_rx = if kind == EngineKind::Sglang
            && !sglang_lists_adapters(http, base_url).await
        {
            if !adapters.is_empty() {
                tracing::warn!(
                    url = %base_url,
                    "this SGLang (before 0.5.5) does not list its LoRA adapters: the configured \
                     ones are registered unchecked, and adapters loaded or unloaded at run time \
                     are not followed"
                );
            }
            None
        } else {
            let served = served_adapters(http, base_url).await.map_err(|e| {
                AdapterError::Config(format!("cannot list the engine's LoRA adapters: {e}"))
            })?;
            check_adapters(kind, base_url, adapters, &served)?;
            Some(served)
        };
        let block_size = facts.block_size.unwrap_or(16);
        let block_size =
            BlockSize::new(block_size).map_err(|e| AdapterError::Config(e.to_string()))?;
        let kv_blocks = facts.kv_blocks.unwrap_or(1);
        let spec = EngineSpec {
            kind,
            block_size,
            kv_capacity_blocks: kv_blocks,
            max_context_tokens: facts.max_context.unwrap_or(1),
            kv_bytes_per_token,
        };
        tracing::info!(%kind, url = %base_url, block_size = block_size.get(), kv_blocks, max_context = spec.max_context_tokens, "engine found");

        let shared = match &config.kv_events {
            Some(endpoint) => {
                let shared = base.relay(block_size, config.dp_ranks, kv_blocks);
                for rank in 0..config.dp_ranks.max(1) {
                    let endpoints = RankEndpoints {
                        rank,
                        events: rank_endpoint(endpoint, rank)
                            .map_err(|e| AdapterError::Config(e.to_string()))?,
                        replay: match &config.kv_replay {
                            Some(r) => Some(
                                rank_endpoint(r, rank)
                                    .map_err(|e| AdapterError::Config(e.to_string()))?,
                            ),
                            None => None,
                        },
                    };
                    base.tasks.spawn(follow_rank(
                        endpoints,
                        config.kv_events_topic.clone(),
                        Arc::clone(&shared),
                        base.cancel.clone(),
                    ));
                }
                Some(shared)
            }
            None => {
                tracing::warn!("no --kv-events: the router will not see this engine's cache");
                None
            }
        };
        let (load_tx, load_rx) = watch::channel(LoadStats {
            capacity_blocks: kv_blocks,
            ..LoadStats::default()
        });
        base.tasks.spawn(scrape_load(
            LoadSource {
                http: http.clone(),
                url: format!("{base_url}/metrics"),
                kind,
                capacity: kv_blocks,
                every: Duration::from_millis(config.metrics_interval_ms),
            },
            load_tx,
            Arc::clone(&base.scrapes),
            base.cancel.clone(),
        ));
        let adapters_rx = adapters_rx.map(|served| {
            let (tx, rx) = watch::channel(served);
            base.tasks.spawn(follow_adapters(
                http.clone(),
                base_url.to_owned(),
                Duration::from_millis(config.adapters_interval_ms),
                tx,
                base.cancel.clone(),
            ));
            rx
        });
        let model = config
            .served_model_name
            .clone()
            .unwrap_or_else(|| model.to_owned());
        Ok(base.finish(EngineParts {
            spec,
            dialect,
            model,
            bootstrap,
            load_rx,
            shared,
            adapters_rx,
        }))
    }

    /// The KV event relay's counters.
    pub fn stats(&self) -> AdapterStats {
        self.counters.snapshot()
    }

    /// Blocks (per tier) the relay believes the engine holds, over all ranks.
    pub fn relayed_blocks(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| {
            s.relay
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .block_count()
        })
    }
}

impl VllmEngine {
    /// With `--engine-retention-priority` (SGLang only, checked at start): the request's
    /// keep-until time as its eviction priority, a retention hint extending it.
    pub(super) fn set_eviction_priority(
        &self,
        body: &mut Value,
        retention: &switchyard_core::Retention,
    ) {
        if self.retention_priority && self.dialect == Dialect::Sglang {
            super::sglang_retention::set_eviction_priority(body, retention);
        }
    }

    /// Posts `body` to the engine. The request id goes as `X-Request-Id` (and in the body), as
    /// vLLM's disaggregation proxy does, so both halves of a disaggregated request carry the
    /// same id. An unreachable engine, or one that refuses the request, is the engine's error.
    pub(super) async fn post(
        &self,
        path: &str,
        request_id: &str,
        body: &Value,
    ) -> Result<reqwest::Response, EngineError> {
        let response = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header("X-Request-Id", request_id)
            .json(body)
            .send()
            .await
            .map_err(|e| EngineError::Unavailable(format!("engine unreachable: {e}")))?;
        if !response.status().is_success() {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            return Err(openai_http::http_error(status, &text));
        }
        Ok(response)
    }

    /// Posts one generation and streams the engine's answer back.
    pub(super) async fn stream_request(
        &self,
        path: &str,
        body: Value,
        params: &GenerateParams,
    ) -> Result<GenerationStream, EngineError> {
        if self.cancel.is_cancelled() {
            return Err(EngineError::Stopped);
        }
        let prompt_tokens = u32::try_from(params.prompt.len()).unwrap_or(u32::MAX);
        let response = self.post(path, &params.request_id, &body).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let dialect = self.dialect;
        let logprobs = params.sampling.logprobs;
        let cancel = self.cancel.clone();
        let pump = self.tasks.spawn(async move {
            tokio::select! {
                _ = openai_http::pump(response, dialect, prompt_tokens, logprobs, tx.clone()) => {}
                _ = cancel.cancelled() => {
                    let _ = tx.send(Err(EngineError::Stopped));
                }
            }
        });
        let abort = pump.abort_handle();
        // Dropping the stream aborts the reader, which drops the response: the engine sees the
        // connection close and aborts the request.
        Ok(GenerationStream::new(
            rx,
            DropGuard::new(move || abort.abort()),
        ))
    }
}

/// Polls the engine until it tells every fact not set by configuration, or the timeout.
async fn discover(
    http: &reqwest::Client,
    kind: EngineKind,
    base: &str,
    config: &EngineConfig,
) -> Result<Facts, AdapterError> {
    let mut facts = Facts {
        block_size: config.block_size,
        kv_blocks: config.kv_blocks,
        max_context: config.max_context,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(config.startup_timeout_secs);
    let mut last = String::from("no answer yet");
    loop {
        let complete =
            |f: &Facts| f.block_size.is_some() && f.kv_blocks.is_some() && f.max_context.is_some();
        if complete(&facts) {
            return Ok(facts);
        }
        match get_text(http, &format!("{base}/metrics")).await {
            Ok(text) => {
                let (bs, blocks) = Scrape::from_text(&text).cache_facts(kind);
                facts.block_size = facts.block_size.or(bs);
                facts.kv_blocks = facts.kv_blocks.or(blocks);
            }
            Err(err) => last = err,
        }
        if kind == EngineKind::Sglang
            && (facts.block_size.is_none() || facts.kv_blocks.is_none())
            && let Ok(info) = get_json(http, &format!("{base}/get_server_info")).await
        {
            let page = info.get("page_size").and_then(Value::as_u64);
            let tokens = info.get("max_total_num_tokens").and_then(Value::as_u64);
            facts.block_size = facts
                .block_size
                .or(page.and_then(|p| u32::try_from(p).ok()));
            if let (None, Some(p), Some(t)) = (facts.kv_blocks, page, tokens) {
                facts.kv_blocks = Some(t / p.max(1));
            }
        }
        if facts.max_context.is_none() {
            match get_json(http, &format!("{base}/v1/models")).await {
                Ok(models) => {
                    facts.max_context = models
                        .pointer("/data/0/max_model_len")
                        .and_then(Value::as_u64);
                }
                Err(err) => last = err,
            }
        }
        if complete(&facts) {
            return Ok(facts);
        }
        if tokio::time::Instant::now() >= deadline {
            let what = if facts.block_size.is_none() {
                "block size"
            } else if facts.kv_blocks.is_none() {
                "KV cache size in blocks"
            } else {
                "maximum context length"
            };
            return Err(AdapterError::Unknown {
                kind,
                url: base.to_owned(),
                what,
                secs: config.startup_timeout_secs,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The LoRA adapters a vLLM or SGLang engine serves: the entries of its `/v1/models` with a
/// `parent`. Both list the adapters they were started with (vLLM's `--lora-modules`, SGLang's
/// `--lora-paths`) and those loaded since (vLLM's `/v1/load_lora_adapter`, SGLang's
/// `/load_lora_adapter`), each under its own name with the base model as parent.
async fn served_adapters(http: &reqwest::Client, base: &str) -> Result<Vec<String>, String> {
    let models = get_json(http, &format!("{base}/v1/models")).await?;
    let mut adapters: Vec<String> = models
        .get("data")
        .and_then(Value::as_array)
        .map(|data| {
            data.iter()
                .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
                .filter_map(|m| Some(m.get("id")?.as_str()?.to_owned()))
                .collect()
        })
        .unwrap_or_default();
    adapters.sort();
    adapters.dedup();
    Ok(adapters)
}

/// Whether the SGLang engine lists its LoRA adapters in `/v1/models` (from 0.5.5 on), by the
/// version its `/get_server_info` reports; an engine that reports none is taken to (the
/// stand-ins and any later release).
async fn sglang_lists_adapters(http: &reqwest::Client, base: &str) -> bool {
    let version = get_json(http, &format!("{base}/get_server_info"))
        .await
        .ok()
        .and_then(|info| info.get("version")?.as_str().map(str::to_owned));
    version.is_none_or(|v| lists_adapters_from(&v))
}

/// Whether SGLang `version` (`0.5.4`, `0.5.5.post1`, `0.5.10rc0`) is 0.5.5 or later; a version
/// that does not parse is taken to be.
fn lists_adapters_from(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u64>().ok()
    });
    let mut next = || parts.next().flatten();
    match (next(), next(), next()) {
        (Some(major), Some(minor), patch) => (major, minor, patch.unwrap_or(0)) >= (0, 5, 5),
        _ => true,
    }
}

/// Checks that the engine serves every LoRA adapter the worker was told it does (the names
/// themselves are checked with the registration). A missing one is a configuration error naming
/// it, rather than requests routed here and refused by the engine.
fn check_adapters(
    kind: EngineKind,
    base: &str,
    configured: &[String],
    served: &[String],
) -> Result<(), AdapterError> {
    let Some(missing) = configured.iter().find(|a| !served.contains(a)) else {
        return Ok(());
    };
    let (engine, start) = match kind {
        EngineKind::Sglang => (
            "SGLang",
            format!("--enable-lora --lora-paths {missing}=<path>"),
        ),
        _ => (
            "vLLM",
            format!("--enable-lora --lora-modules {missing}=<path>"),
        ),
    };
    Err(AdapterError::Config(format!(
        "lora_adapters names {missing:?}, which the {engine} engine at {base} does not serve \
         (its /v1/models lists {}); start it with {start} or drop the name",
        if served.is_empty() {
            "no adapter".to_owned()
        } else {
            served.join(", ")
        }
    )))
}

/// Re-reads the engine's adapters every `every` and publishes the list when it changes (an
/// adapter loaded or unloaded at run time); a failed read keeps the last list.
async fn follow_adapters(
    http: reqwest::Client,
    base: String,
    every: Duration,
    tx: watch::Sender<Vec<String>>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match served_adapters(&http, &base).await {
            Ok(served) if *tx.borrow() != served => {
                tracing::info!(url = %base, adapters = ?served, "the engine's LoRA adapters changed");
                tx.send_replace(served);
            }
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(url = %base, error = %err, "cannot list the engine's LoRA adapters")
            }
        }
    }
}

pub(super) async fn get_text(http: &reqwest::Client, url: &str) -> Result<String, String> {
    let response = http
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("{url} answered {}", response.status()));
    }
    response.text().await.map_err(|e| e.to_string())
}

pub(super) async fn get_json(http: &reqwest::Client, url: &str) -> Result<Value, String> {
    let text = get_text(http, url).await?;
    serde_json::from_str(&text).map_err(|e| format!("{url}: {e}"))
}

/// Where and how often the engine's load is read.
struct LoadSource {
    http: reqwest::Client,
    url: String,
    kind: EngineKind,
    capacity: u64,
    every: Duration,
}

async fn scrape_load(
    source: LoadSource,
    load_tx: watch::Sender<LoadStats>,
    scrapes: Arc<EngineScrapeCounters>,
    cancel: CancellationToken,
) {
    let LoadSource {
        http,
        url,
        kind,
        capacity,
        every,
    } = source;
    let mut failing = false;
    loop {
        match get_text(&http, &url).await {
            Ok(text) => {
                load_tx.send_replace(Scrape::from_text(&text).load(kind, capacity));
                scrapes.ok.fetch_add(1, Ordering::Relaxed);
                scrapes.up.store(1, Ordering::Relaxed);
                failing = false;
            }
            Err(err) => {
                scrapes.failed.fetch_add(1, Ordering::Relaxed);
                scrapes.up.store(0, Ordering::Relaxed);
                // Logged once per outage; the metrics count every failure.
                if !failing {
                    tracing::warn!(%url, error = %err, "engine metrics scrape failed; keeping the last load");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

pub(super) async fn log_stats(counters: Arc<AdapterCounters>, cancel: CancellationToken) {
    let mut logged = AdapterStats::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(STATS_LOG_INTERVAL) => {}
        }
        let now = counters.snapshot();
        if now != logged {
            tracing::info!(stats = ?now, "engine kv event relay");
            logged = now;
        }
    }
    tracing::info!(stats = ?counters.snapshot(), "engine kv event relay (final)");
}

#[async_trait::async_trait]
impl EngineTransfer for VllmEngine {
    async fn generate_with_transfer(
        &self,
        params: GenerateParams,
        transfer: Map<String, Value>,
    ) -> Result<GenerationStream, EngineError> {
        self.generate_transfer(params, transfer).await
    }
}

#[async_trait::async_trait]
impl Engine for VllmEngine {
    fn spec(&self) -> &EngineSpec {
        &self.spec
    }

    async fn generate(&self, params: GenerateParams) -> Result<GenerationStream, EngineError> {
        if self.dialect == Dialect::Trtllm {
            super::trtllm::check_request(&params)?;
        }
        let (path, mut body) = openai_http::request_body(self.dialect, &self.model, &params);
        self.set_eviction_priority(&mut body, &params.retention);
        self.stream_request(path, body, &params).await
    }

    async fn prefill(&self, params: PrefillParams) -> Result<PrefillOutcome, EngineError> {
        if self.cancel.is_cancelled() {
            return Err(EngineError::Stopped);
        }
        match self.dialect {
            Dialect::Vllm(_) => self.prefill_vllm(params).await,
            Dialect::Sglang => self.prefill_sglang(params).await,
            Dialect::Trtllm => self.prefill_trtllm(params).await,
        }
    }

    fn engine_transfer(&self) -> Option<&dyn EngineTransfer> {
        Some(self)
    }

    fn honours_retention(&self) -> bool {
        self.retention_priority
    }

    fn schedules_by_priority(&self) -> bool {
        self.priority_scheduling
    }

    fn load(&self) -> LoadStats {
        *self.load_rx.borrow()
    }

    fn adapters(&self) -> Option<watch::Receiver<Vec<String>>> {
        self.adapters_rx.clone()
    }

    fn telemetry(&self) -> EngineTelemetry {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        EngineTelemetry {
            // Without --kv-events there is no relay, and no zeros that look like a healthy one.
            relay_ranks: if self.shared.is_some() {
                self.counters.per_rank()
            } else {
                Vec::new()
            },
            engine_scrapes: Some((
                get(&self.scrapes.ok),
                get(&self.scrapes.failed),
                get(&self.scrapes.up) == 1,
            )),
            ..EngineTelemetry::default()
        }
    }

    fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    fn shutdown(&self) {
        tracing::info!(stats = ?self.stats(), "engine adapter stopping");
        self.cancel.cancel();
        self.tasks.close();
    }
}

#[cfg(test)]
mod tests {
    use super::lists_adapters_from;

    #[test]
    fn sglang_lists_adapters_from_0_5_5_on() {
        for old in ["0.4.9", "0.4.10.post2", "0.5.1", "0.5.4.post3", "0.5.0rc2"] {
            assert!(!lists_adapters_from(old), "{old}");
        }
        for new in [
            "0.5.5",
            "0.5.5.post1",
            "0.5.10rc0",
            "0.5.23",
            "0.6",
            "1.0.0",
        ] {
            assert!(lists_adapters_from(new), "{new}");
        }
        // A version that does not parse is taken to be recent.
        assert!(lists_adapters_from("dev"));
    }
}
