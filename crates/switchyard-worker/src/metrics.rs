//! The worker's Prometheus metrics (`switchyard_worker_*`, OpenMetrics text at `/metrics` on
//! `--metrics-listen`).
//!
//! Two kinds live here. What happens on the request path (requests and their outcome, tokens,
//! time to first token, inter-token latency, KV pulls and their transfers) is counted where it
//! happens, through [`WorkerMetrics`] and its [`RequestRecord`] guard. What the worker already
//! keeps elsewhere (the engine's load, role and drain state, the KV event log, held handles, the
//! vLLM/SGLang adapter's relay counters) is read at each scrape by [`scrape::ScrapeCollector`],
//! so it is never counted twice nor goes stale. Every series carries the worker id as a
//! constant `worker` label; other labels take a handful of fixed values.

mod http;
mod scrape;

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::time::Instant;

pub use http::{MetricsAccess, serve};

use crate::engine::Engine;
use crate::state::WorkerState;

/// What a request asked the worker to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Generate,
    Prefill,
    /// A decode worker pulling a prefill's KV blocks from this worker.
    Pull,
}

impl RequestKind {
    const ALL: [RequestKind; 3] = [Self::Generate, Self::Prefill, Self::Pull];

    fn as_str(self) -> &'static str {
        match self {
            Self::Generate => "generate",
            Self::Prefill => "prefill",
            Self::Pull => "pull",
        }
    }
}

/// Why a decode worker's KV pull from a prefill worker failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullFailure {
    /// The prefill worker could not be reached.
    Connect,
    /// No answer or no next chunk within `kv_pull_timeout_ms`.
    Timeout,
    /// The prefill worker refused or failed the pull (handle expired or already pulled, engine
    /// stopped).
    Source,
    /// The stream ended before its last chunk (the prefill worker went away mid-way).
    Truncated,
    /// The blocks were not the prompt's (another block size, a wrong handle).
    Mismatch,
    /// The prefill worker announced a KV layout of another model shape.
    Layout,
    /// This worker's engine could not take the blocks.
    Import,
    /// An engine that moves KV itself aborted the request before its first token.
    EngineTransfer,
}

impl PullFailure {
    const ALL: [PullFailure; 8] = [
        Self::Connect,
        Self::Timeout,
        Self::Source,
        Self::Truncated,
        Self::Mismatch,
        Self::Layout,
        Self::Import,
        Self::EngineTransfer,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Source => "source_error",
            Self::Truncated => "truncated",
            Self::Mismatch => "block_mismatch",
            Self::Layout => "layout_mismatch",
            Self::Import => "import",
            Self::EngineTransfer => "engine_transfer",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    kind: &'static str,
    /// The gRPC status code, snake case (`ok`, `invalid_argument`, `unavailable`, …); a
    /// caller that went away before the end is `cancelled`.
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    /// `served` (this prefill worker sent them) or `received` (this decode worker pulled them).
    direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    /// `planned` (one per strided fragment) or `issued` (after coalescing).
    stage: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HintLabels {
    /// `passed` (handed to an engine that honours it) or `unhonoured` (the engine has no such
    /// control and ignores it).
    outcome: &'static str,
}

/// Every metric a worker exports.
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Family<KindLabels, Counter>,
    cached_prompt_tokens: Family<KindLabels, Counter>,
    completion_tokens: Counter,
    ttft: Histogram,
    inter_token: Histogram,
    prefill_duration: Histogram,
    kv_pulls: Family<DirectionLabels, Counter>,
    kv_pull_failures: Family<ReasonLabels, Counter>,
    kv_blocks: Family<DirectionLabels, Counter>,
    kv_bytes: Family<DirectionLabels, Counter>,
    kv_descriptors: Family<StageLabels, Counter>,
    kv_transfer: Histogram,
    retention_hints: Family<HintLabels, Counter>,
    priorities: Family<HintLabels, Counter>,
    kv_events_sent: Family<SinkLabels, Counter>,
    plane_publish_failures: Counter,
    plane_oversized: Counter,
}

/// Where KV events went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventSink {
    /// A gateway's gRPC `KvEvents` stream: once per subscribed gateway.
    Grpc,
    /// The event plane: once, whatever the number of gateways.
    Plane,
}

impl EventSink {
    fn as_str(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::Plane => "plane",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SinkLabels {
    /// `grpc` or `plane`.
    sink: &'static str,
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~100 s, as the gateway's, so the two sides' figures line up.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

impl WorkerMetrics {
    /// The metrics of worker `worker_id`, reading `engine` and `state` at each scrape.
    pub fn new(worker_id: &str, engine: Arc<dyn Engine>, state: WorkerState) -> Self {
        let mut registry = Registry::with_prefix_and_labels(
            "switchyard_worker",
            [("worker".into(), worker_id.to_owned().into())].into_iter(),
        );
        let m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            prompt_tokens: Family::default(),
            cached_prompt_tokens: Family::default(),
            completion_tokens: Counter::default(),
            ttft: latency_histogram(),
            inter_token: latency_histogram(),
            prefill_duration: latency_histogram(),
            kv_pulls: Family::default(),
            kv_pull_failures: Family::default(),
            kv_blocks: Family::default(),
            kv_bytes: Family::default(),
            kv_descriptors: Family::default(),
            kv_transfer: latency_histogram(),
            retention_hints: Family::default(),
            priorities: Family::default(),
            kv_events_sent: Family::default(),
            plane_publish_failures: Counter::default(),
            plane_oversized: Counter::default(),
        };
        // Series that exist from the start, at 0, so `rate()` and alerts see them before the
        // first occurrence.
        for kind in RequestKind::ALL {
            let _ = m.requests.get_or_create(&RequestLabels {
                kind: kind.as_str(),
                code: "ok",
            });
        }
        for reason in PullFailure::ALL {
            let _ = m.kv_pull_failures.get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            });
        }
        for kind in [RequestKind::Generate, RequestKind::Prefill] {
            let labels = KindLabels {
                kind: kind.as_str(),
            };
            let _ = m.prompt_tokens.get_or_create(&labels);
            let _ = m.cached_prompt_tokens.get_or_create(&labels);
        }
        for outcome in ["passed", "unhonoured"] {
            let _ = m.retention_hints.get_or_create(&HintLabels { outcome });
            let _ = m.priorities.get_or_create(&HintLabels { outcome });
        }
        for sink in [EventSink::Grpc, EventSink::Plane] {
            let _ = m.kv_events_sent.get_or_create(&SinkLabels {
                sink: sink.as_str(),
            });
        }
        for stage in ["planned", "issued"] {
            let _ = m.kv_descriptors.get_or_create(&StageLabels { stage });
        }
        for direction in ["served", "received"] {
            let labels = DirectionLabels { direction };
            let _ = m.kv_pulls.get_or_create(&labels);
            let _ = m.kv_blocks.get_or_create(&labels);
            let _ = m.kv_bytes.get_or_create(&labels);
        }
        let r = &mut registry;
        r.register(
            "requests",
            "gRPC requests by kind (generate, prefill, pull) and status code, counted when they end",
            m.requests.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests, by kind",
            m.prompt_tokens.clone(),
        );
        r.register(
            "cached_prompt_tokens",
            "Prompt tokens found in the prefix cache (or pulled from a prefill worker), by kind",
            m.cached_prompt_tokens.clone(),
        );
        r.register(
            "completion_tokens",
            "Tokens generated",
            m.completion_tokens.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Generate: from the call's arrival at the worker to its first token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Generate: time between consecutive tokens (a chunk of n tokens after a gap counts n gaps of 1/n)",
            m.inter_token.clone(),
        );
        r.register(
            "prefill_duration_seconds",
            "Prefill: from the call's arrival to its answer (pipelined prefills answer when admitted)",
            m.prefill_duration.clone(),
        );
        r.register(
            "kv_pulls",
            "KV pulls started: served to decode workers, or received from prefill workers",
            m.kv_pulls.clone(),
        );
        r.register(
            "kv_pull_failures",
            "Failed KV pulls of this decode worker, by reason",
            m.kv_pull_failures.clone(),
        );
        r.register(
            "kv_transfer_blocks",
            "KV blocks sent to decode workers (served) or imported from prefill workers (received)",
            m.kv_blocks.clone(),
        );
        r.register(
            "kv_transfer_bytes",
            "KV bytes sent (served) or imported (received)",
            m.kv_bytes.clone(),
        );
        r.register(
            "kv_transfer_descriptors",
            "Copy descriptors of KV imports: planned (strided fragments) and issued (after coalescing)",
            m.kv_descriptors.clone(),
        );
        r.register(
            "kv_transfer_seconds",
            "Decode side: from the first pull call to the last block imported, per request",
            m.kv_transfer.clone(),
        );
        r.register(
            "retention_hints",
            "Requests that carried a retention hint: passed to the engine, or unhonoured (it has no such control)",
            m.retention_hints.clone(),
        );
        r.register(
            "request_priorities",
            "Requests that carried a non-default scheduling priority: passed to the engine, or unhonoured (it was not started scheduling by priority)",
            m.priorities.clone(),
        );
        r.register(
            "kv_events_sent",
            "KV events sent, by sink: gRPC streams (once per subscribed gateway, replays included) or the event plane (once)",
            m.kv_events_sent.clone(),
        );
        r.register(
            "event_plane_publish_failures",
            "Publishes to the event plane that failed (retried; the plane's readers resynchronise if history was lost)",
            m.plane_publish_failures.clone(),
        );
        r.register(
            "event_plane_oversized_messages",
            "KV events and snapshots larger than the event plane takes (its max_payload), left out of the plane: its readers find the gap and take the worker's snapshot over gRPC",
            m.plane_oversized.clone(),
        );
        r.register_collector(Box::new(scrape::ScrapeCollector::new(engine, state)));
        Self { registry, ..m }
    }

    /// Counts `events` KV events sent to `sink`.
    pub fn kv_events_sent(&self, sink: EventSink, events: u64) {
        self.kv_events_sent
            .get_or_create(&SinkLabels {
                sink: sink.as_str(),
            })
            .inc_by(events);
    }

    /// Counts `n` messages left out of the event plane for their size.
    pub fn plane_oversized(&self, n: u64) {
        self.plane_oversized.inc_by(n);
    }

    /// Counts a failed publish to the event plane.
    pub fn plane_publish_failed(&self) {
        self.plane_publish_failures.inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %err, "cannot encode metrics");
        }
        out
    }

    /// Starts recording one request; it is counted when [`RequestRecord::finish`] is called or
    /// the record dropped (as `cancelled`).
    pub fn request(self: &Arc<Self>, kind: RequestKind) -> RequestRecord {
        RequestRecord {
            metrics: Arc::clone(self),
            kind,
            started: Instant::now(),
            last_token: None,
            done: false,
        }
    }

    /// Counts a request refused or failed before it started.
    pub fn refused(&self, kind: RequestKind, code: tonic::Code) {
        self.count_request(kind, code);
    }

    fn count_request(&self, kind: RequestKind, code: tonic::Code) {
        self.requests
            .get_or_create(&RequestLabels {
                kind: kind.as_str(),
                code: code_name(code),
            })
            .inc();
    }

    /// Token counts of a finished generate or prefill.
    pub fn tokens(&self, kind: RequestKind, prompt: u32, cached: u32, completion: u32) {
        let labels = KindLabels {
            kind: kind.as_str(),
        };
        self.prompt_tokens
            .get_or_create(&labels)
            .inc_by(u64::from(prompt));
        self.cached_prompt_tokens
            .get_or_create(&labels)
            .inc_by(u64::from(cached));
        self.completion_tokens.inc_by(u64::from(completion));
    }

    /// A request carried a non-default priority, which its engine schedules by or not.
    pub fn request_priority(&self, honoured: bool) {
        let outcome = if honoured { "passed" } else { "unhonoured" };
        self.priorities.get_or_create(&HintLabels { outcome }).inc();
    }

    /// A request carried a retention hint, which its engine honours or not.
    pub fn retention_hint(&self, honoured: bool) {
        let outcome = if honoured { "passed" } else { "unhonoured" };
        self.retention_hints
            .get_or_create(&HintLabels { outcome })
            .inc();
    }

    /// A prefill worker starts serving a pull.
    pub fn pull_served(&self) {
        self.direction(&self.kv_pulls, "served").inc();
    }

    /// Blocks and bytes sent to a decode worker.
    pub fn blocks_served(&self, blocks: u64, bytes: u64) {
        self.direction(&self.kv_blocks, "served").inc_by(blocks);
        self.direction(&self.kv_bytes, "served").inc_by(bytes);
    }

    /// A decode worker starts pulling from a prefill worker.
    pub fn pull_received(&self) {
        self.direction(&self.kv_pulls, "received").inc();
    }

    /// A decode worker's pull failed.
    pub fn pull_failed(&self, reason: PullFailure) {
        self.kv_pull_failures
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// A decode worker's finished import: blocks and bytes received, descriptors before and
    /// after coalescing, and how long the pull and import took.
    pub fn import_done(
        &self,
        blocks: u64,
        stats: switchyard_engine_sim::PlanStats,
        elapsed: std::time::Duration,
    ) {
        self.direction(&self.kv_blocks, "received").inc_by(blocks);
        self.direction(&self.kv_bytes, "received")
            .inc_by(stats.bytes);
        let stage = |stage| self.kv_descriptors.get_or_create(&StageLabels { stage });
        stage("planned").inc_by(stats.raw_descriptors);
        stage("issued").inc_by(stats.descriptors);
        self.kv_transfer.observe(elapsed.as_secs_f64());
    }

    fn direction(
        &self,
        family: &Family<DirectionLabels, Counter>,
        direction: &'static str,
    ) -> Counter {
        family.get_or_create_owned(&DirectionLabels { direction })
    }
}

/// One request in progress: observes its first token and the gaps between tokens, and counts
/// it once with its outcome. Dropped unfinished (the caller went away) it counts as
/// `cancelled`.
#[derive(Debug)]
pub struct RequestRecord {
    metrics: Arc<WorkerMetrics>,
    kind: RequestKind,
    started: Instant,
    last_token: Option<Instant>,
    done: bool,
}

impl RequestRecord {
    /// `n` tokens just went out.
    pub fn tokens_sent(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            // Tokens that came with the first one have no gap of their own to measure.
            None => self
                .metrics
                .ttft
                .observe(now.duration_since(self.started).as_secs_f64()),
            Some(last) => {
                let each = now.duration_since(last).as_secs_f64() / n as f64;
                for _ in 0..n {
                    self.metrics.inter_token.observe(each);
                }
            }
        }
        self.last_token = Some(now);
    }

    /// The request ended with `code`.
    pub fn finish(mut self, code: tonic::Code) {
        self.done = true;
        if self.kind == RequestKind::Prefill {
            self.metrics
                .prefill_duration
                .observe(self.started.elapsed().as_secs_f64());
        }
        self.metrics.count_request(self.kind, code);
    }

    /// The metrics this record counts into.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.metrics
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        if !self.done {
            self.metrics
                .count_request(self.kind, tonic::Code::Cancelled);
        }
    }
}

/// The value of the series `name` whose labels include `labels`, in an exposition `text` (for
/// tests and tools reading a scrape).
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    switchyard_core::promtext::parse(text)
        .into_iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .map(|s| s.value)
}

/// A gRPC code as a label value.
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}
