//! What every real-engine adapter ([`VllmEngine`]: vLLM, SGLang, TensorRT-LLM) starts the same
//! way, whatever its engine tells and however its events arrive: the engine's URL and HTTP
//! client, the event log and relay counters its followers report into, the owners of its
//! background tasks, and the engine built from those once the engine's facts are known.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_core::{BlockSize, LoadStats, WorkerId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::EngineSpec;
use super::config::EngineConfig;
use super::kv_relay::KvRelay;
use super::openai_http::Dialect;
use super::stats::{AdapterCounters, EngineScrapeCounters};
use super::vllm::{AdapterError, VllmEngine, log_stats};
use super::zmq_events::RelayShared;
use crate::event_log::EventLog;

/// An adapter being started.
pub(super) struct AdapterBase {
    pub base_url: String,
    pub http: reqwest::Client,
    pub events: Arc<EventLog>,
    pub counters: Arc<AdapterCounters>,
    pub scrapes: Arc<EngineScrapeCounters>,
    pub cancel: CancellationToken,
    pub tasks: TaskTracker,
    /// The engine schedules by request priority (`EngineConfig::priority_scheduling`).
    pub priority_scheduling: bool,
    /// The engine evicts by request priority (`EngineConfig::retention_priority`).
    pub retention_priority: bool,
}

/// What only the engine kind knows, for [`AdapterBase::finish`].
pub(super) struct EngineParts {
    pub spec: EngineSpec,
    pub dialect: Dialect,
    /// The model name the engine serves (`--served-model-name`, else `--model`).
    pub model: String,
    pub bootstrap: (String, u16),
    pub load_rx: watch::Receiver<LoadStats>,
    pub shared: Option<Arc<RelayShared>>,
    pub adapters_rx: Option<watch::Receiver<Vec<String>>>,
}

impl AdapterBase {
    /// The engine's URL (from the configuration) and a client for it; an event log for
    /// `worker`'s `incarnation` keeping `event_buffer` events.
    pub fn new(
        worker: WorkerId,
        incarnation: u64,
        config: &EngineConfig,
        event_buffer: usize,
    ) -> Result<Self, AdapterError> {
        let base_url = config
            .url
            .clone()
            .ok_or_else(|| AdapterError::Config("no engine url".into()))?
            .trim_end_matches('/')
            .to_owned();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| AdapterError::Config(e.to_string()))?;
        Ok(Self {
            base_url,
            http,
            events: Arc::new(EventLog::new(worker, incarnation, event_buffer)),
            counters: Arc::new(AdapterCounters::new(config.dp_ranks)),
            scrapes: Arc::new(EngineScrapeCounters::default()),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            priority_scheduling: config.priority_scheduling,
            retention_priority: config.retention_priority,
        })
    }

    /// How many blocks the relay keeps per rank: above the engine's device capacity, with room
    /// for the offload tiers.
    pub fn relay_capacity(kv_blocks: u64) -> usize {
        usize::try_from(kv_blocks.saturating_mul(4))
            .unwrap_or(usize::MAX)
            .max(1 << 16)
    }

    /// The relay the event followers apply the engine's events to.
    pub fn relay(&self, block_size: BlockSize, dp_ranks: u32, kv_blocks: u64) -> Arc<RelayShared> {
        Arc::new(RelayShared {
            relay: Mutex::new(KvRelay::new(
                block_size,
                dp_ranks,
                Self::relay_capacity(kv_blocks),
            )),
            log: Arc::clone(&self.events),
            counters: Arc::clone(&self.counters),
        })
    }

    /// The engine, its relay counters logged while it runs.
    pub fn finish(self, parts: EngineParts) -> VllmEngine {
        self.tasks
            .spawn(log_stats(Arc::clone(&self.counters), self.cancel.clone()));
        VllmEngine {
            spec: parts.spec,
            dialect: parts.dialect,
            http: self.http,
            base_url: self.base_url,
            model: parts.model,
            bootstrap: parts.bootstrap,
            load_rx: parts.load_rx,
            events: self.events,
            counters: self.counters,
            scrapes: self.scrapes,
            shared: parts.shared,
            adapters_rx: parts.adapters_rx,
            tasks: self.tasks,
            cancel: self.cancel,
            priority_scheduling: self.priority_scheduling,
            retention_priority: self.retention_priority,
        }
    }
}
