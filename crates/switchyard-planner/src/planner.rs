//! The planning loop: every interval observe → predict → size → stabilise → act, and record
//! the decision with its reasons (admin API, metrics, the registry's `plan`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use switchyard_registry::Registry;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::connector::{Connector, PoolSizes};
use crate::correction::{Correction, CorrectionFactors, CorrectionSettings, Served};
use crate::metrics::PlannerMetrics;
use crate::observe::{Observation, Observer};
use crate::predict::{Load, Predictor};
use crate::profile::PerformanceProfile;
use crate::sizing::{self, Limits, Requirement, Targets};
use crate::stability::{Stabilizer, Verdict};

/// One interval's decision, as the admin API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// Counts the intervals since the planner started.
    pub interval: u64,
    pub at_unix_ms: u64,
    pub observed: Observation,
    pub predicted: Option<Load>,
    pub required: Option<Requirement>,
    /// The profile correction factors the sizing used (after this interval's update).
    pub correction: CorrectionFactors,
    pub current: Option<PoolSizes>,
    /// The sizes the load asks for, within the limits.
    pub wanted: Option<PoolSizes>,
    /// `hold`, `scale`, `failed` (the connector could not move the pools) or `skip` (nothing
    /// to plan with yet).
    pub action: &'static str,
    /// The sizes the planner moved to (`scale`, `failed`).
    pub target: Option<PoolSizes>,
    pub reason: String,
    pub error: Option<String>,
}

/// What the planner last decided and recently did; shared with the admin API.
#[derive(Debug)]
pub struct PlannerState {
    pub settings: PlanSettings,
    inner: Mutex<StateInner>,
}

#[derive(Debug, Default)]
struct StateInner {
    plan: Option<serde_json::Value>,
    decisions: VecDeque<Decision>,
}

/// The fixed facts about this planner, shown with every plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlanSettings {
    pub connector: &'static str,
    pub predictor: &'static str,
    pub interval_seconds: f64,
    pub targets: Targets,
    pub limits: Limits,
    pub profile_source: String,
    /// The gateways' disaggregation threshold: shorter uncached prompts prefill on decode workers.
    pub disagg_min_uncached_tokens: u64,
    /// How the profile is corrected by the observed latencies.
    pub correction: CorrectionSettings,
    #[serde(skip)]
    pub decision_log_size: usize,
}

impl PlannerState {
    pub fn new(settings: PlanSettings) -> Self {
        Self {
            settings,
            inner: Mutex::new(StateInner::default()),
        }
    }

    /// The latest plan (what the registry holds under `plan`).
    pub fn plan(&self) -> Option<serde_json::Value> {
        self.lock().plan.clone()
    }

    /// The most recent decisions, newest first.
    pub fn decisions(&self, limit: usize) -> Vec<Decision> {
        self.lock()
            .decisions
            .iter()
            .rev()
            .take(limit)
            .cloned()
            .collect()
    }

    fn record(&self, decision: Decision, plan: serde_json::Value) {
        let mut inner = self.lock();
        inner.plan = Some(plan);
        inner.decisions.push_back(decision);
        while inner.decisions.len() > self.settings.decision_log_size.max(1) {
            inner.decisions.pop_front();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StateInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Everything one planner runs with.
#[derive(Debug)]
pub struct Planner {
    pub state: Arc<PlannerState>,
    pub metrics: Arc<PlannerMetrics>,
    observer: Observer,
    predictor: Predictor,
    stabilizer: Stabilizer,
    connector: Arc<dyn Connector>,
    registry: Arc<dyn Registry>,
    profile: PerformanceProfile,
    correction: Correction,
    /// The pools the previous observation saw: an interval whose pools differ at its end was
    /// served by two shapes.
    last_pools: Option<PoolSizes>,
    interval: Duration,
    count: u64,
}

impl Planner {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        state: Arc<PlannerState>,
        metrics: Arc<PlannerMetrics>,
        observer: Observer,
        predictor: Predictor,
        stabilizer: Stabilizer,
        connector: Arc<dyn Connector>,
        registry: Arc<dyn Registry>,
        profile: PerformanceProfile,
        interval: Duration,
    ) -> Self {
        let correction = Correction::new(state.settings.correction);
        Self {
            state,
            metrics,
            observer,
            predictor,
            stabilizer,
            connector,
            registry,
            profile,
            correction,
            last_pools: None,
            interval,
            count: 0,
        }
    }

    /// Replaces the gateways whose `/metrics` are read (`switchyard up` knows its gateway's
    /// address only once it listens).
    pub fn set_gateways(&mut self, gateways: Vec<String>) {
        self.observer.set_gateways(gateways);
    }

    /// Plans every interval until `shutdown`. The first observation only sets the baseline of
    /// the gateways' counters; planning starts with the second. A round under way when the
    /// shutdown comes is finished first (a move is bounded by the drain timeout), so no worker
    /// is left drained half-way through a move.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.interval);
        // A slow move (a long drain) must not be followed by a burst of catch-up intervals.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            self.step().await;
        }
    }

    /// One interval: observe, then plan.
    pub async fn step(&mut self) -> Decision {
        let observed = self.observer.observe().await;
        self.plan(observed).await
    }

    /// Plans from one interval's observation: predict, size, stabilise, act, record.
    pub async fn plan(&mut self, observed: Observation) -> Decision {
        self.count += 1;
        let correction = self.correct(&observed);
        let mut decision = Decision {
            interval: self.count,
            at_unix_ms: unix_ms(),
            observed: observed.clone(),
            predicted: None,
            required: None,
            correction,
            current: None,
            wanted: None,
            action: "skip",
            target: None,
            reason: String::new(),
            error: None,
        };
        if observed.seconds > 0.0 && observed.gateways_answered > 0 {
            self.predictor.observe(&observed.load);
        }
        decision.predicted = self.predictor.predict();
        self.decide(&mut decision, &observed).await;
        self.metrics.record(&decision);
        let plan = serde_json::json!({
            "settings": self.state.settings,
            "interval": decision.interval,
            "at_unix_ms": decision.at_unix_ms,
            "current": decision.current,
            "target": decision.target.or(decision.current),
            "action": decision.action,
            "reason": decision.reason,
            "correction": decision.correction,
        });
        if let Err(err) = self.registry.put_plan(&plan).await {
            tracing::warn!(error = %err, "cannot record the plan in the registry");
        }
        tracing::info!(
            interval = decision.interval,
            action = decision.action,
            current = ?decision.current,
            target = ?decision.target,
            reason = %decision.reason,
            "planner decision"
        );
        self.state.record(decision.clone(), plan);
        decision
    }

    /// Updates the profile correction from the interval just observed: the load it actually
    /// served on the pools the workers reported.
    fn correct(&mut self, observed: &Observation) -> CorrectionFactors {
        let pools = PoolSizes {
            prefill: observed.workers.prefill,
            decode: observed.workers.decode,
        };
        let steady = self.last_pools == Some(pools)
            && observed.workers.draining == 0
            && observed.workers.unreachable == 0;
        self.last_pools = Some(pools);
        if observed.seconds <= 0.0 || observed.gateways_answered == 0 {
            return self.correction.factors();
        }
        let served = Served {
            load: observed.load,
            requests: observed.requests,
            ttft_mean_seconds: observed.ttft_mean_seconds,
            itl_mean_seconds: observed.itl_mean_seconds,
            pools,
            steady,
        };
        self.correction.observe(
            &served,
            &self.profile,
            self.state.settings.disagg_min_uncached_tokens as f64,
        )
    }

    async fn decide(&mut self, decision: &mut Decision, observed: &Observation) {
        let (current, capacity) = match (
            self.connector.current().await,
            self.connector.capacity().await,
        ) {
            (Ok(current), Ok(capacity)) => (current, capacity),
            (Err(err), _) | (_, Err(err)) => {
                decision.reason = "cannot read the pools".into();
                decision.error = Some(err.to_string());
                return;
            }
        };
        decision.current = Some(current);
        let Some(predicted) = decision.predicted else {
            decision.reason =
                "no traffic figures yet (the first interval sets the baseline)".into();
            return;
        };
        if capacity == Some(0) {
            decision.reason = "no prefill or decode worker to place".into();
            return;
        }
        let settings = &self.state.settings;
        let required = sizing::required(
            &predicted,
            &sizing::Backlog {
                active_decode_sequences: observed.workers.active_decode_sequences as f64,
                queued_prefill_tokens: observed.workers.prefill_pool_queued_tokens as f64,
                interval_seconds: settings.interval_seconds,
            },
            &self.correction.apply(&self.profile),
            &settings.targets,
            settings.disagg_min_uncached_tokens as f64,
        );
        let wanted = sizing::allocate(
            (required.prefill, required.decode),
            &settings.limits,
            capacity,
        );
        decision.wanted = Some(wanted);
        let verdict = self.stabilizer.judge(
            current,
            wanted,
            &settings.limits,
            is_short(current, wanted, &required),
            Instant::now(),
        );
        let needs = format!(
            "needs {} prefill / {} decode ({}; {})",
            required.prefill,
            required.decode,
            required.why,
            decision.correction.describe()
        );
        decision.required = Some(required);
        match verdict {
            Verdict::Hold { why } => {
                decision.action = "hold";
                decision.reason = format!("{why}; {needs}");
            }
            Verdict::Scale { target, why } => {
                decision.target = Some(target);
                decision.reason = format!(
                    "{} prefill / {} decode -> {} / {}: {why}; {needs}",
                    current.prefill, current.decode, target.prefill, target.decode
                );
                match self.connector.scale_to(target).await {
                    Ok(()) => decision.action = "scale",
                    Err(err) => {
                        decision.action = "failed";
                        decision.error = Some(err.to_string());
                        if err.retryable() {
                            self.stabilizer.change_failed();
                        }
                    }
                }
            }
        }
    }
}

/// Whether a pool has fewer workers than the load needs (and than the budget allows).
pub fn is_short(current: PoolSizes, wanted: PoolSizes, required: &Requirement) -> bool {
    current.prefill < required.prefill.min(wanted.prefill)
        || current.decode < required.decode.min(wanted.decode)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
