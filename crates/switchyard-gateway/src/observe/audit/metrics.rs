//! The audit's Prometheus series, registered into the gateway's registry.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::observe::labels::WorkerLabels;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub model: String,
    pub worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MispredictionLabels {
    pub model: String,
    pub worker: String,
    /// [`crate::observe::audit::flag::Cause`] as text.
    pub cause: &'static str,
}

/// A finished routing decision: for which model, by which policy, for which pool, and how it
/// ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionOutcomeLabels {
    pub model: String,
    pub policy: &'static str,
    /// `decode` or `prefill`.
    pub stage: &'static str,
    /// `completed`, `retried`, `migrated`, `rerouted`, `failed` or `cancelled`.
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DigestLabels {
    /// `match` or `mismatch`.
    pub result: &'static str,
}

fn error_histogram() -> Histogram {
    // Predicted minus realized cached tokens: symmetric around 0 (over- and under-prediction).
    Histogram::new([
        -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0, 1024.0,
        4096.0, 16384.0,
    ])
}

/// Every series of the audit.
#[derive(Debug)]
pub struct AuditMetrics {
    pub prediction_error: Family<RouteLabels, Histogram>,
    pub predicted_tokens: Family<RouteLabels, Counter>,
    pub realized_tokens: Family<RouteLabels, Counter>,
    pub evaluated: Family<RouteLabels, Counter>,
    pub accurate: Family<RouteLabels, Counter>,
    pub accuracy_ratio: Family<RouteLabels, Gauge<f64, AtomicU64>>,
    pub mispredictions: Family<MispredictionLabels, Counter>,
    pub kv_silent: Family<WorkerLabels, Gauge>,
    pub kv_mismatch: Family<WorkerLabels, Gauge>,
    pub digest_checks: Family<DigestLabels, Counter>,
    pub index_diverged: Family<WorkerLabels, Gauge>,
    pub index_divergence_blocks: Family<WorkerLabels, Gauge>,
    pub index_repairs: Counter,
    pub workers_refused: Gauge,
    pub decisions_logged: Counter,
    pub decision_log_dropped: Counter,
    pub decision_outcomes: Family<DecisionOutcomeLabels, Counter>,
}

impl Default for AuditMetrics {
    fn default() -> Self {
        Self {
            prediction_error: Family::new_with_constructor(error_histogram),
            predicted_tokens: Family::default(),
            realized_tokens: Family::default(),
            evaluated: Family::default(),
            accurate: Family::default(),
            accuracy_ratio: Family::default(),
            mispredictions: Family::default(),
            kv_silent: Family::default(),
            kv_mismatch: Family::default(),
            digest_checks: Family::default(),
            index_diverged: Family::default(),
            index_divergence_blocks: Family::default(),
            index_repairs: Counter::default(),
            workers_refused: Gauge::default(),
            decisions_logged: Counter::default(),
            decision_log_dropped: Counter::default(),
            decision_outcomes: Family::default(),
        }
    }
}

impl AuditMetrics {
    pub fn register(&self, registry: &mut Registry) {
        // Both results exist from the start, so a mismatch rate is 0 rather than absent.
        for result in ["match", "mismatch"] {
            self.digest_checks
                .get_or_create(&DigestLabels { result })
                .inc_by(0);
        }
        registry.register(
            "route_prediction_error_tokens",
            "Per routed generation: prompt tokens the router predicted cached on the chosen worker minus those the engine reported reusing",
            self.prediction_error.clone(),
        );
        registry.register(
            "route_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the chosen worker",
            self.predicted_tokens.clone(),
        );
        registry.register(
            "route_realized_cached_tokens",
            "Prompt tokens the chosen worker's engine reported reusing",
            self.realized_tokens.clone(),
        );
        registry.register(
            "route_predictions_evaluated",
            "Routed generations whose predicted hit was checked against the engine's",
            self.evaluated.clone(),
        );
        registry.register(
            "route_predictions_accurate",
            "Checked generations whose realized hit was within one block of the prediction",
            self.accurate.clone(),
        );
        registry.register(
            "route_accuracy_ratio",
            "Accurate over evaluated predictions, per worker and model (1 = the index matches the engine)",
            self.accuracy_ratio.clone(),
        );
        registry.register(
            "route_mispredictions",
            "Generations whose realized hit fell far short of (or far above) the prediction, by likely cause",
            self.mispredictions.clone(),
        );
        registry.register(
            "worker_kv_events_silent",
            "1 while a worker serves new prompt blocks but publishes no KV events",
            self.kv_silent.clone(),
        );
        registry.register(
            "worker_kv_identity_mismatch",
            "1 while a worker's digests name another model, block size or hash scheme than the gateway routes it with",
            self.kv_mismatch.clone(),
        );
        registry.register(
            "index_digest_checks",
            "Comparisons of a worker's block digest with the index's, by result",
            self.digest_checks.clone(),
        );
        registry.register(
            "worker_index_diverged",
            "1 from a digest mismatch until a later digest of the worker matches again",
            self.index_diverged.clone(),
        );
        registry.register(
            "worker_index_divergence_blocks",
            "At the last digest check: blocks in the index minus blocks the worker holds (0 when they match)",
            self.index_divergence_blocks.clone(),
        );
        registry.register(
            "index_digest_repairs",
            "Diverged worker indexes rebuilt from a snapshot and found matching afterwards",
            self.index_repairs.clone(),
        );
        registry.register(
            "workers_refused",
            "Registered workers the gateway refuses to route to (block size differs from the model's)",
            self.workers_refused.clone(),
        );
        registry.register(
            "decisions_logged",
            "Routing decisions written to the on-disk decision log",
            self.decisions_logged.clone(),
        );
        registry.register(
            "routing_decision_outcomes",
            "Finished routing decisions by model, policy, stage (decode or prefill) and outcome (completed, retried, migrated, rerouted, failed, cancelled)",
            self.decision_outcomes.clone(),
        );
        registry.register(
            "decision_log_dropped",
            "Finished decisions not written to the on-disk log because its writer fell behind or failed",
            self.decision_log_dropped.clone(),
        );
    }

    /// A worker joined: its health series start at 0 rather than absent, so dashboards and
    /// alerts (`== 1`, `increase(...) > 0`) see every worker from the start.
    pub fn worker_joined(&self, worker: &str, model: &str) {
        let labels = WorkerLabels {
            worker: worker.to_owned(),
        };
        self.kv_silent.get_or_create(&labels).set(0);
        self.kv_mismatch.get_or_create(&labels).set(0);
        // Until its first digest check: nothing found diverged.
        self.index_diverged.get_or_create(&labels).set(0);
        self.index_divergence_blocks.get_or_create(&labels).set(0);
        for cause in crate::observe::audit::flag::Cause::ALL {
            self.mispredictions
                .get_or_create(&MispredictionLabels {
                    model: model.to_owned(),
                    worker: worker.to_owned(),
                    cause: cause.as_str(),
                })
                .inc_by(0);
        }
    }

    /// Forgets a departed worker's labelled series.
    pub fn remove_worker(&self, worker: &str) {
        let labels = WorkerLabels {
            worker: worker.to_owned(),
        };
        self.kv_silent.remove(&labels);
        self.kv_mismatch.remove(&labels);
        self.index_diverged.remove(&labels);
        self.index_divergence_blocks.remove(&labels);
    }
}
