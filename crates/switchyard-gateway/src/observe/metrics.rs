//! Prometheus metrics of the gateway (text exposition at `/metrics`).
//!
//! Names follow Prometheus conventions: `switchyard_` prefix, base units (seconds), `_total` on
//! counters (added by the client library).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub use super::labels::WorkerLabels;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: &'static str,
    pub status: &'static str,
    /// A model the gateway serves, or empty before one is known (a client cannot make up
    /// label values).
    pub model: String,
}

/// The model a request-path figure is about (vLLM's `model_name`, Dynamo's `model`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

/// A histogram per model.
pub type ModelHistogram = Family<ModelLabels, Histogram>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefixLookupLabels {
    /// `hit` (reused at least one cached segment) or `miss`.
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LongTextLabels {
    /// `split` (cut over free cores) or `whole` (one pass: every core was busy).
    pub how: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SessionTurnLabels {
    /// `incremental` (reused an earlier turn's tokens) or `full`.
    pub tokenization: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    /// `pulled`: the decode worker generates from the KV its prefix's holder prefilled;
    /// `recomputed`: the holder could not hand it over and the decode worker computes it.
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvTransferLabels {
    /// `pipelined` or `after-prefill`: how the prefill worker answered.
    pub kv_transfer: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub policy: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IgnoredFieldLabels {
    /// `chat_completions`, `completions`, `responses` or `messages`.
    pub api: &'static str,
    /// The field (`metadata`, `anthropic-beta:NAME`, `tools.web_search`, ...); an unknown
    /// name past the first 64, or one that is not a plain name, counts as `(other)`.
    pub field: String,
}

/// Fields requests carried that could not change their tokens (advisory) or that the gateway
/// did not know (accepted under `unknown_fields = accept`).
#[derive(Debug, Default)]
pub struct FieldMetrics {
    ignored: Family<IgnoredFieldLabels, Counter>,
    /// Unknown names given their own label (each logged the first time).
    unknown_seen: parking_lot::Mutex<std::collections::HashSet<String>>,
}

/// Distinct unknown names given their own label; later ones count as `(other)`.
const MAX_UNKNOWN_LABELS: usize = 64;
/// Longest unknown name given its own label.
const MAX_LABEL_LEN: usize = 64;

impl FieldMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ignored_fields",
            "Request fields and headers accepted without effect: advisory ones, and unknown ones under unknown_fields = accept",
            self.ignored.clone(),
        );
    }

    /// An advisory field a request carried.
    pub fn advisory(&self, api: &'static str, field: &str) {
        self.ignored
            .get_or_create(&IgnoredFieldLabels {
                api,
                field: field.to_owned(),
            })
            .inc();
    }

    /// A field the gateway does not know: counted under its own name while the names stay
    /// few and plain (client-made label values are bounded), logged the first time.
    pub fn unknown(&self, api: &'static str, field: &str) {
        let plain = field.len() <= MAX_LABEL_LEN
            && field
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:[]".contains(&b));
        let label = {
            let mut seen = self.unknown_seen.lock();
            if seen.contains(field) {
                field
            } else if plain && seen.len() < MAX_UNKNOWN_LABELS {
                seen.insert(field.to_owned());
                tracing::info!(
                    api,
                    field,
                    "accepted a field the gateway does not know (counted in switchyard_ignored_fields_total)"
                );
                field
            } else {
                "(other)"
            }
        };
        self.advisory(api, label);
    }

    /// How many times `field` was counted for `api`.
    pub fn count(&self, api: &'static str, field: &str) -> u64 {
        self.ignored
            .get_or_create(&IgnoredFieldLabels {
                api,
                field: field.to_owned(),
            })
            .get()
    }
}

/// Every metric the gateway exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: ModelHistogram,
    pub inter_token: ModelHistogram,
    /// Arrival to the end of a successful answer (every choice, a whole stream).
    pub request_duration: ModelHistogram,
    pub routing_overhead: Histogram,
    pub tokenize: Histogram,
    pub admission_wait: Histogram,
    pub prompt_blocks_requested: Counter,
    pub prompt_blocks_cached: Counter,
    pub prompt_tokens: Family<ModelLabels, Counter>,
    pub completion_tokens: Family<ModelLabels, Counter>,
    /// Per finished generation (each choice): its prompt and generated lengths (the planner's
    /// load figures).
    pub request_prompt_tokens: ModelHistogram,
    pub request_completion_tokens: ModelHistogram,
    /// Prompt tokens the serving worker had cached (usage `cached_tokens`).
    pub cached_prompt_tokens: Counter,
    /// Tool calls parsed from chat answers, and those whose text did not parse (returned as
    /// content).
    pub tool_calls: Counter,
    pub tool_calls_malformed: Counter,
    pub decisions: Family<PolicyLabels, Counter>,
    pub kv_events_applied: Counter,
    /// From a live event entering its worker's log to this gateway applying it (per message:
    /// the oldest event of a batch), by the two machines' clocks.
    pub kv_event_lag: Histogram,
    pub kv_events_invalid: Counter,
    /// Load reports received from every worker (pushed on change or on the interval).
    pub load_reports: Counter,
    pub resyncs: Counter,
    pub retries: Counter,
    pub migrations: Counter,
    pub disagg_prefills: Family<KvTransferLabels, Counter>,
    /// Sub-agent placements (a prefix pulled from the peer holding it), by outcome.
    pub placements: Family<PlacementLabels, Counter>,
    pub in_flight: Gauge,
    pub queued: Gauge,
    pub workers: Gauge,
    /// Workers whose snapshot and first load report are in, and worker streams opening now
    /// ([`crate::cluster::pool::subscriptions`]).
    pub workers_subscribed: Gauge,
    pub subscriptions_opening: Gauge,
    pub session_cache_sessions: Gauge,
    pub session_cache_bytes: Gauge,
    pub session_turns: Family<SessionTurnLabels, Counter>,
    pub session_reused_tokens: Counter,
    pub session_verify_mismatches: Counter,
    /// The cross-request prefix cache: look-ups by result, tokens reused, what it holds.
    pub prefix_lookups: Family<PrefixLookupLabels, Counter>,
    pub prefix_reused_tokens: Counter,
    pub prefix_evictions: Counter,
    pub prefix_bytes: Gauge,
    pub prefix_segments: Gauge,
    pub tokenized_bytes: Counter,
    /// Long texts cut over free cores or taken whole, and the cores counted busy now.
    pub long_texts: Family<LongTextLabels, Counter>,
    pub tokenizer_cores_busy: Gauge,
    /// HTTP connections open, refused over the cap, and closed for a timeout (header or idle).
    pub connections_open: Gauge,
    pub connections_refused: Counter,
    pub connections_timed_out: Counter,
    /// Workers out of routing because they stopped answering, and how often one went out.
    pub worker_unresponsive: Family<WorkerLabels, Gauge>,
    pub unresponsive_transitions: Counter,
    /// Attempts given up on because their worker stopped answering mid-way.
    pub unresponsive_cuts: Counter,
    /// What the session counters were last exported at, to add only the difference.
    session_exported: std::sync::Mutex<switchyard_tokenize::SessionStats>,
    /// Likewise for the prefix cache.
    prefix_exported: parking_lot::Mutex<switchyard_tokenize::PrefixStats>,
    /// Likewise for the core budget's counts (split, whole).
    long_texts_exported: parking_lot::Mutex<(u64, u64)>,
    pub worker_queued_prefill_tokens: Family<WorkerLabels, Gauge>,
    pub worker_running_requests: Family<WorkerLabels, Gauge>,
    pub worker_active_blocks: Family<WorkerLabels, Gauge>,
    pub worker_indexed_blocks: Family<WorkerLabels, Gauge>,
    /// Decisions, predictions against realized hits, KV event health ([`crate::observe::audit`]).
    pub audit: crate::observe::audit::AuditMetrics,
    /// Turns forwarded between gateway replicas ([`crate::cluster::fleet`]).
    pub fleet: crate::observe::fleet_metrics::FleetMetrics,
    /// Quota refusals and store errors ([`crate::access::quota`]).
    pub quota: crate::observe::quota_metrics::QuotaMetrics,
    /// Session scheduling ([`crate::serving::sessions`]).
    pub sessions: crate::observe::session_metrics::SessionMetrics,
    /// Fields accepted without effect (`http::fields`).
    pub fields: FieldMetrics,
}

fn length_histogram() -> Histogram {
    // 1 to ~1M tokens.
    Histogram::new(exponential_buckets(1.0, 2.0, 21))
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~100 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchyard");
        let m = Self {
            requests: Family::default(),
            ttft: Family::new_with_constructor(latency_histogram),
            inter_token: Family::new_with_constructor(latency_histogram),
            request_duration: Family::new_with_constructor(latency_histogram),
            routing_overhead: Histogram::new(exponential_buckets(0.000_001, 2.0, 20)),
            tokenize: latency_histogram(),
            admission_wait: latency_histogram(),
            prompt_blocks_requested: Counter::default(),
            prompt_blocks_cached: Counter::default(),
            prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            request_prompt_tokens: Family::new_with_constructor(length_histogram),
            request_completion_tokens: Family::new_with_constructor(length_histogram),
            cached_prompt_tokens: Counter::default(),
            tool_calls: Counter::default(),
            tool_calls_malformed: Counter::default(),
            decisions: Family::default(),
            kv_events_applied: Counter::default(),
            kv_event_lag: latency_histogram(),
            kv_events_invalid: Counter::default(),
            load_reports: Counter::default(),
            resyncs: Counter::default(),
            retries: Counter::default(),
            migrations: Counter::default(),
            disagg_prefills: Family::default(),
            placements: Family::default(),
            in_flight: Gauge::default(),
            queued: Gauge::default(),
            workers: Gauge::default(),
            workers_subscribed: Gauge::default(),
            subscriptions_opening: Gauge::default(),
            session_cache_sessions: Gauge::default(),
            session_cache_bytes: Gauge::default(),
            session_turns: Family::default(),
            session_reused_tokens: Counter::default(),
            session_verify_mismatches: Counter::default(),
            prefix_lookups: Family::default(),
            prefix_reused_tokens: Counter::default(),
            prefix_evictions: Counter::default(),
            prefix_bytes: Gauge::default(),
            prefix_segments: Gauge::default(),
            tokenized_bytes: Counter::default(),
            long_texts: Family::default(),
            tokenizer_cores_busy: Gauge::default(),
            connections_open: Gauge::default(),
            connections_refused: Counter::default(),
            connections_timed_out: Counter::default(),
            worker_unresponsive: Family::default(),
            unresponsive_transitions: Counter::default(),
            unresponsive_cuts: Counter::default(),
            session_exported: std::sync::Mutex::default(),
            prefix_exported: parking_lot::Mutex::default(),
            long_texts_exported: parking_lot::Mutex::default(),
            worker_queued_prefill_tokens: Family::default(),
            worker_running_requests: Family::default(),
            worker_active_blocks: Family::default(),
            worker_indexed_blocks: Family::default(),
            audit: crate::observe::audit::AuditMetrics::default(),
            fleet: crate::observe::fleet_metrics::FleetMetrics::default(),
            quota: crate::observe::quota_metrics::QuotaMetrics::default(),
            sessions: crate::observe::session_metrics::SessionMetrics::default(),
            fields: FieldMetrics::default(),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "HTTP requests by endpoint, outcome and model",
            m.requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "End-to-end latency of successful requests: arrival to the answer's last byte",
            m.request_duration.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between consecutive streamed tokens",
            m.inter_token.clone(),
        );
        registry.register(
            "routing_overhead_seconds",
            "Time spent choosing a worker (tokenization excluded)",
            m.routing_overhead.clone(),
        );
        registry.register(
            "tokenize_seconds",
            "Chat-template rendering plus tokenization time per request",
            m.tokenize.clone(),
        );
        registry.register(
            "admission_wait_seconds",
            "Time admitted requests waited for a slot (0 when one was free)",
            m.admission_wait.clone(),
        );
        registry.register(
            "prompt_blocks_requested",
            "Full prompt blocks routed",
            m.prompt_blocks_requested.clone(),
        );
        registry.register(
            "prompt_blocks_cached",
            "Full prompt blocks the chosen worker already held (device tier)",
            m.prompt_blocks_cached.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens served",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Tokens generated",
            m.completion_tokens.clone(),
        );
        registry.register(
            "request_prompt_tokens",
            "Prompt length of each finished request, tokens",
            m.request_prompt_tokens.clone(),
        );
        registry.register(
            "request_completion_tokens",
            "Generated length of each finished request, tokens",
            m.request_completion_tokens.clone(),
        );
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens served from the serving worker's prefix cache",
            m.cached_prompt_tokens.clone(),
        );
        registry.register(
            "tool_calls",
            "Tool calls parsed from chat answers",
            m.tool_calls.clone(),
        );
        registry.register(
            "tool_calls_malformed",
            "Tool calls whose text did not parse; returned as content",
            m.tool_calls_malformed.clone(),
        );
        registry.register(
            "routing_decisions",
            "Routing decisions by policy",
            m.decisions.clone(),
        );
        registry.register(
            "kv_events_applied",
            "KV events applied to the prefix index",
            m.kv_events_applied.clone(),
        );
        registry.register(
            "kv_event_lag_seconds",
            "From a live KV event entering its worker's log to its application to the prefix index (the oldest event of each message; the worker's clock against the gateway's)",
            m.kv_event_lag.clone(),
        );
        registry.register(
            "kv_events_invalid",
            "KV events refused as invalid",
            m.kv_events_invalid.clone(),
        );
        registry.register(
            "load_reports",
            "Load reports received from the workers",
            m.load_reports.clone(),
        );
        registry.register(
            "kv_resyncs",
            "Worker snapshots applied to resynchronise the index",
            m.resyncs.clone(),
        );
        registry.register(
            "dispatch_retries",
            "Requests retried on another worker before their first token",
            m.retries.clone(),
        );
        registry.register(
            "disagg_prefills",
            "Prefills run on the prefill pool for disaggregated requests, by KV transfer mode",
            m.disagg_prefills.clone(),
        );
        registry.register(
            "placements",
            "Sub-agent placements: requests sent to a worker that pulls the prompt's prefix from the peer holding it, by outcome (pulled, or recomputed when the pair could not exchange the KV)",
            m.placements.clone(),
        );
        registry.register(
            "dispatch_migrations",
            "Streams moved to another worker mid-generation",
            m.migrations.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Requests being served",
            m.in_flight.clone(),
        );
        registry.register(
            "requests_queued",
            "Requests waiting for admission",
            m.queued.clone(),
        );
        registry.register("workers", "Workers known to the gateway", m.workers.clone());
        registry.register(
            "workers_subscribed",
            "Workers whose KV snapshot and first load report the gateway has",
            m.workers_subscribed.clone(),
        );
        registry.register(
            "subscriptions_opening",
            "Worker streams opening now (bounded by subscribe_concurrency)",
            m.subscriptions_opening.clone(),
        );
        registry.register(
            "tokenizer_sessions",
            "Sessions held by the incremental tokenization cache",
            m.session_cache_sessions.clone(),
        );
        registry.register(
            "tokenizer_session_bytes",
            "Bytes held by the incremental tokenization cache",
            m.session_cache_bytes.clone(),
        );
        registry.register(
            "tokenizer_turns",
            "Prompts tokenized, incrementally (reusing a session's earlier turn) or in full",
            m.session_turns.clone(),
        );
        registry.register(
            "tokenizer_reused_tokens",
            "Prompt tokens taken over from a session's earlier turn instead of re-tokenized",
            m.session_reused_tokens.clone(),
        );
        registry.register(
            "tokenizer_verify_mismatches",
            "Sampled incremental tokenizations that differed from a full one (0 unless a bug)",
            m.session_verify_mismatches.clone(),
        );
        registry.register(
            "tokenizer_prefix_lookups",
            "Prompts with no earlier turn of their own looked up in the prefix cache, by result",
            m.prefix_lookups.clone(),
        );
        registry.register(
            "tokenizer_prefix_reused_tokens",
            "Prompt tokens taken from the prefix cache (openings shared across sessions)",
            m.prefix_reused_tokens.clone(),
        );
        registry.register(
            "tokenizer_prefix_evictions",
            "Prefix-cache segments dropped to honour its byte bound",
            m.prefix_evictions.clone(),
        );
        registry.register(
            "tokenizer_prefix_bytes",
            "Bytes held by the prefix cache (text, token ids, offsets, bookkeeping)",
            m.prefix_bytes.clone(),
        );
        registry.register(
            "tokenizer_prefix_segments",
            "Segments held by the prefix cache",
            m.prefix_segments.clone(),
        );
        registry.register(
            "tokenizer_long_texts",
            "Texts long enough to cut: cut over free cores (split) or taken in one pass since \
             every core was busy (whole)",
            m.long_texts.clone(),
        );
        registry.register(
            "tokenizer_cores_busy",
            "Threads counted as tokenizing a long text now (against the process's cores)",
            m.tokenizer_cores_busy.clone(),
        );
        registry.register(
            "tokenizer_tokenized_bytes",
            "Prompt bytes run through a tokenizer (an over-long prompt stops early)",
            m.tokenized_bytes.clone(),
        );
        registry.register(
            "http_connections_open",
            "HTTP connections open",
            m.connections_open.clone(),
        );
        registry.register(
            "http_connections_refused",
            "HTTP connections answered 503 and closed because max_connections were open",
            m.connections_refused.clone(),
        );
        registry.register(
            "http_connections_timed_out",
            "HTTP connections closed for a header-read or idle timeout",
            m.connections_timed_out.clone(),
        );
        registry.register(
            "worker_unresponsive",
            "1 while a worker is out of routing because it stopped answering (lease still live)",
            m.worker_unresponsive.clone(),
        );
        registry.register(
            "worker_unresponsive_transitions",
            "Times a worker went out of routing because it stopped answering",
            m.unresponsive_transitions.clone(),
        );
        registry.register(
            "dispatch_unresponsive_cuts",
            "Attempts given up on (and retried or migrated) because their worker stopped answering",
            m.unresponsive_cuts.clone(),
        );
        registry.register(
            "worker_queued_prefill_tokens",
            "Prefill tokens queued on a worker (last report)",
            m.worker_queued_prefill_tokens.clone(),
        );
        registry.register(
            "worker_running_requests",
            "Requests running on a worker (last report)",
            m.worker_running_requests.clone(),
        );
        registry.register(
            "worker_active_blocks",
            "KV blocks referenced on a worker (last report)",
            m.worker_active_blocks.clone(),
        );
        registry.register(
            "worker_indexed_blocks",
            "Blocks the prefix index holds for a worker",
            m.worker_indexed_blocks.clone(),
        );
        m.audit.register(&mut registry);
        m.fleet.register(&mut registry);
        m.quota.register(&mut registry);
        m.sessions.register(&mut registry);
        m.fields.register(&mut registry);
        Self { registry, ..m }
    }

    /// A `/v1` request refused for its API key (`status` is the error's metric label).
    pub fn api_key_refused(&self, status: &'static str) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: "v1",
                status,
                model: String::new(),
            })
            .inc();
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %err, "cannot encode metrics");
        }
        out
    }

    /// Brings the session-cache series up to `stats` (cumulative figures from the tokenizers).
    pub fn observe_sessions(&self, stats: switchyard_tokenize::SessionStats) {
        self.session_cache_sessions.set(stats.sessions as i64);
        self.session_cache_bytes.set(stats.bytes as i64);
        let mut last = self
            .session_exported
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let turns = |tokenization| SessionTurnLabels { tokenization };
        self.session_turns
            .get_or_create(&turns("incremental"))
            .inc_by(stats.hits.saturating_sub(last.hits));
        self.session_turns
            .get_or_create(&turns("full"))
            .inc_by(stats.misses.saturating_sub(last.misses));
        self.session_reused_tokens
            .inc_by(stats.reused_tokens.saturating_sub(last.reused_tokens));
        self.session_verify_mismatches.inc_by(
            stats
                .verify_mismatches
                .saturating_sub(last.verify_mismatches),
        );
        self.tokenized_bytes
            .inc_by(stats.tokenized_bytes.saturating_sub(last.tokenized_bytes));
        *last = stats;
    }

    /// Brings the prefix-cache series up to `stats` (cumulative figures from the tokenizers).
    pub fn observe_prefix(&self, stats: switchyard_tokenize::PrefixStats) {
        self.prefix_bytes.set(stats.bytes as i64);
        self.prefix_segments.set(stats.segments as i64);
        let mut last = self.prefix_exported.lock();
        let lookups = |result| PrefixLookupLabels { result };
        self.prefix_lookups
            .get_or_create(&lookups("hit"))
            .inc_by(stats.hits.saturating_sub(last.hits));
        self.prefix_lookups
            .get_or_create(&lookups("miss"))
            .inc_by(stats.misses.saturating_sub(last.misses));
        self.prefix_reused_tokens
            .inc_by(stats.reused_tokens.saturating_sub(last.reused_tokens));
        self.prefix_evictions
            .inc_by(stats.evictions.saturating_sub(last.evictions));
        *last = stats;
    }

    /// The process's tokenization core budget (see `switchyard_tokenize::CoreBudget`).
    pub fn observe_cores(&self, budget: &switchyard_tokenize::CoreBudget) {
        self.tokenizer_cores_busy.set(budget.busy() as i64);
        let now = (budget.split_texts(), budget.whole_for_busy_cores());
        let mut last = self.long_texts_exported.lock();
        let how = |how| LongTextLabels { how };
        self.long_texts
            .get_or_create(&how("split"))
            .inc_by(now.0.saturating_sub(last.0));
        self.long_texts
            .get_or_create(&how("whole"))
            .inc_by(now.1.saturating_sub(last.1));
        *last = now;
    }

    /// Forgets a departed worker's labelled series.
    pub fn remove_worker(&self, worker: &str) {
        let labels = WorkerLabels {
            worker: worker.to_owned(),
        };
        self.worker_queued_prefill_tokens.remove(&labels);
        self.worker_running_requests.remove(&labels);
        self.worker_unresponsive.remove(&labels);
        self.worker_active_blocks.remove(&labels);
        self.worker_indexed_blocks.remove(&labels);
    }
}

#[cfg(test)]
mod field_tests {
    use super::*;

    #[test]
    fn unknown_field_labels_stay_bounded() {
        let m = FieldMetrics::default();
        m.unknown("chat_completions", "new_field");
        m.unknown("chat_completions", "bad name\n");
        for i in 0..MAX_UNKNOWN_LABELS {
            m.unknown("chat_completions", &format!("f{i}"));
        }
        m.unknown("chat_completions", "one_more");
        m.unknown("chat_completions", "new_field");
        assert_eq!(m.count("chat_completions", "new_field"), 2);
        // The bad name, the 65th distinct name and every one after it.
        assert_eq!(m.count("chat_completions", "(other)"), 3);
        assert_eq!(m.count("chat_completions", "one_more"), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_conventional_names_and_model_labels() {
        let m = Metrics::new();
        m.requests
            .get_or_create(&RequestLabels {
                endpoint: "chat",
                status: "ok",
                model: "m".into(),
            })
            .inc();
        let model = ModelLabels { model: "m".into() };
        m.ttft.get_or_create(&model).observe(0.01);
        m.request_duration.get_or_create(&model).observe(0.5);
        m.request_prompt_tokens.get_or_create(&model).observe(10.0);
        m.request_completion_tokens
            .get_or_create(&model)
            .observe(3.0);
        m.prompt_tokens.get_or_create(&model).inc_by(10);
        let text = m.encode();
        for series in [
            "switchyard_requests_total{endpoint=\"chat\",status=\"ok\",model=\"m\"} 1",
            "switchyard_request_duration_seconds_count{model=\"m\"} 1",
            "switchyard_time_to_first_token_seconds_count{model=\"m\"} 1",
            "switchyard_request_prompt_tokens_count{model=\"m\"} 1",
            "switchyard_request_completion_tokens_sum{model=\"m\"} 3",
            "switchyard_prompt_tokens_total{model=\"m\"} 10",
            "switchyard_kv_events_applied_total",
            "switchyard_kv_event_lag_seconds_bucket",
            "switchyard_load_reports_total",
            "switchyard_admission_wait_seconds_bucket",
            "switchyard_cached_prompt_tokens_total",
        ] {
            assert!(text.contains(series), "{series} missing from\n{text}");
        }
    }
}
