//! Prometheus metrics of the planner (`switchyard_planner_*`), served at `/metrics` on the
//! planner's own listener and appended to the gateway's `/metrics` when embedded in `up`.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::planner::Decision;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// `prefill` or `decode`.
    pub pool: &'static str,
    /// `current` (what the connector reports), `wanted` (what the load needs, within the
    /// limits) or `target` (the last size moved to).
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FigureLabels {
    /// `request_rate`, `input_tokens`, `output_tokens`, `cache_hit_rate`.
    pub figure: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FactorLabels {
    /// `prefill` (TTFT) or `decode` (ITL).
    pub pool: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Debug)]
pub struct PlannerMetrics {
    registry: Registry,
    pools: Family<PoolLabels, Gauge>,
    decisions: Family<ActionLabels, Counter>,
    observed: Family<FigureLabels, FloatGauge>,
    predicted: Family<FigureLabels, FloatGauge>,
    ttft_p99: FloatGauge,
    itl_p99: FloatGauge,
    correction: Family<FactorLabels, FloatGauge>,
    correction_updates: Family<FactorLabels, Counter>,
}

impl Default for PlannerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PlannerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchyard_planner");
        let m = Self {
            pools: Family::default(),
            decisions: Family::default(),
            observed: Family::default(),
            predicted: Family::default(),
            ttft_p99: FloatGauge::default(),
            itl_p99: FloatGauge::default(),
            correction: Family::default(),
            correction_updates: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "pool_workers",
            "Workers per pool: current, wanted by the load, last target",
            m.pools.clone(),
        );
        registry.register(
            "decisions",
            "Planner intervals by outcome (hold, scale, failed, skip)",
            m.decisions.clone(),
        );
        registry.register(
            "observed_load",
            "Last interval's traffic as the gateways reported it",
            m.observed.clone(),
        );
        registry.register(
            "predicted_load",
            "The next interval's traffic as predicted",
            m.predicted.clone(),
        );
        registry.register(
            "observed_ttft_p99_seconds",
            "Last interval's 99th-percentile time to first token",
            m.ttft_p99.clone(),
        );
        registry.register(
            "observed_itl_p99_seconds",
            "Last interval's 99th-percentile inter-token latency",
            m.itl_p99.clone(),
        );
        registry.register(
            "correction_factor",
            "Observed over profiled latency the sizing scales the profile by (1: trusted as is)",
            m.correction.clone(),
        );
        registry.register(
            "correction_updates",
            "Intervals that updated a correction factor (thin or unsteady ones do not)",
            m.correction_updates.clone(),
        );
        Self { registry, ..m }
    }

    pub fn record(&self, d: &Decision) {
        self.decisions
            .get_or_create(&ActionLabels { action: d.action })
            .inc();
        let pool = |kind, sizes: Option<crate::PoolSizes>| {
            if let Some(s) = sizes {
                for (name, n) in [("prefill", s.prefill), ("decode", s.decode)] {
                    self.pools
                        .get_or_create(&PoolLabels { pool: name, kind })
                        .set(i64::from(n));
                }
            }
        };
        pool("current", d.current);
        pool("wanted", d.wanted);
        pool("target", d.target);
        let figures = |family: &Family<FigureLabels, FloatGauge>, load: &crate::Load| {
            for (figure, v) in [
                ("request_rate", load.request_rate),
                ("input_tokens", load.input_tokens),
                ("output_tokens", load.output_tokens),
                ("cache_hit_rate", load.cache_hit_rate),
            ] {
                family.get_or_create(&FigureLabels { figure }).set(v);
            }
        };
        if d.observed.seconds > 0.0 {
            figures(&self.observed, &d.observed.load);
        }
        if let Some(p) = &d.predicted {
            figures(&self.predicted, p);
        }
        if let Some(v) = d.observed.ttft_p99_seconds {
            self.ttft_p99.set(v);
        }
        if let Some(v) = d.observed.itl_p99_seconds {
            self.itl_p99.set(v);
        }
        let c = &d.correction;
        for (pool, factor, updated) in [
            ("prefill", c.prefill, c.prefill_sample.is_some()),
            ("decode", c.decode, c.decode_sample.is_some()),
        ] {
            self.correction
                .get_or_create(&FactorLabels { pool })
                .set(factor);
            let updates = self
                .correction_updates
                .get_or_create(&FactorLabels { pool });
            if updated {
                updates.inc();
            }
        }
    }

    /// The text exposition (OpenMetrics, ending in `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %err, "cannot encode planner metrics");
        }
        out
    }
}
