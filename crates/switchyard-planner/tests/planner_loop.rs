//! The planning round on its own: observations in, decisions out, with the registry (the
//! in-memory backend) receiving the plan and a recording connector receiving the moves.
//! Time is paused, so the cooldown is exact.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use switchyard_engine_sim::TimingModel;
use switchyard_planner::observe::{Observation, Observer};
use switchyard_planner::predict::PredictorSettings;
use switchyard_planner::sizing::{Limits, Targets};
use switchyard_planner::stability::{StabilitySettings, Stabilizer};
use switchyard_planner::{
    Connector, ConnectorError, CorrectionSettings, Load, PerformanceProfile, PlanSettings, Planner,
    PlannerMetrics, PlannerState, PoolSizes, Predictor, PredictorKind,
};
use switchyard_registry::{MemoryRegistry, Registry};

/// Moves a fixed set of four workers between the pools and remembers every request; can be
/// told to fail.
#[derive(Debug)]
struct RecordingConnector {
    sizes: Mutex<PoolSizes>,
    calls: Mutex<Vec<PoolSizes>>,
    fail: Mutex<bool>,
}

#[async_trait]
impl Connector for RecordingConnector {
    fn name(&self) -> &'static str {
        "recording"
    }

    async fn current(&self) -> Result<PoolSizes, ConnectorError> {
        Ok(*self.sizes.lock().unwrap())
    }

    async fn capacity(&self) -> Result<Option<u32>, ConnectorError> {
        Ok(Some(4))
    }

    async fn scale_to(&self, target: PoolSizes) -> Result<(), ConnectorError> {
        self.calls.lock().unwrap().push(target);
        if *self.fail.lock().unwrap() {
            return Err(ConnectorError::Failed {
                what: "worker unreachable".into(),
                retryable: true,
            });
        }
        *self.sizes.lock().unwrap() = target;
        Ok(())
    }
}

fn planner(connector: Arc<RecordingConnector>, registry: Arc<dyn Registry>) -> Planner {
    let targets = Targets {
        ttft_seconds: 1.0,
        itl_seconds: 0.025,
    };
    let limits = Limits {
        min_prefill: 1,
        min_decode: 1,
        max_total: 8,
    };
    let state = Arc::new(PlannerState::new(PlanSettings {
        connector: "recording",
        predictor: "constant",
        interval_seconds: 10.0,
        targets,
        limits,
        profile_source: "test".into(),
        disagg_min_uncached_tokens: 512,
        correction: CorrectionSettings::default(),
        decision_log_size: 3,
    }));
    Planner::new(
        state,
        Arc::new(PlannerMetrics::new()),
        Observer::new(
            Vec::new(),
            Arc::clone(&registry),
            Arc::new(Mutex::new(BTreeMap::new())),
        ),
        Predictor::new(
            PredictorKind::Constant,
            &PredictorSettings {
                window: 1,
                ..PredictorSettings::default()
            },
        ),
        Stabilizer::new(StabilitySettings {
            cooldown: Duration::from_secs(60),
            hysteresis_intervals: 2,
        }),
        connector,
        registry,
        PerformanceProfile::from_timing(&TimingModel::default(), 1.0, 8192),
        Duration::from_secs(10),
    )
}

fn interval(rate: f64, input: f64, output: f64) -> Observation {
    Observation {
        seconds: 10.0,
        load: Load {
            request_rate: rate,
            input_tokens: input,
            output_tokens: output,
            cache_hit_rate: 0.0,
        },
        gateways_answered: 1,
        ..Observation::default()
    }
}

#[tokio::test(start_paused = true)]
async fn decisions_follow_the_load_within_hysteresis_and_cooldown_and_are_recorded() {
    let connector = Arc::new(RecordingConnector {
        sizes: Mutex::new(PoolSizes {
            prefill: 2,
            decode: 2,
        }),
        calls: Mutex::new(Vec::new()),
        fail: Mutex::new(false),
    });
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let mut p = planner(Arc::clone(&connector), Arc::clone(&registry));
    let prefill_heavy = || interval(4.0, 6000.0, 20.0);
    let decode_heavy = || interval(30.0, 200.0, 400.0);

    // Without traffic figures there is nothing to plan with.
    let first = p.plan(Observation::default()).await;
    assert_eq!(first.action, "skip");
    assert_eq!(
        first.current,
        Some(PoolSizes {
            prefill: 2,
            decode: 2
        })
    );

    // Prefill-heavy: the prefill pool is short (2 of the 3 it needs), so the move skips the
    // hysteresis.
    let d = p.plan(prefill_heavy()).await;
    assert_eq!(
        d.wanted,
        Some(PoolSizes {
            prefill: 3,
            decode: 1
        })
    );
    assert_eq!(d.action, "scale", "{}", d.reason);
    assert!(d.reason.contains("short"), "{}", d.reason);
    assert_eq!(
        connector.calls.lock().unwrap().clone(),
        vec![PoolSizes {
            prefill: 3,
            decode: 1
        }]
    );
    let plan = registry.plan().await.unwrap().unwrap();
    assert_eq!(
        plan["target"],
        serde_json::json!({"prefill": 3, "decode": 1})
    );
    assert_eq!(plan["action"], "scale");

    // Decode-heavy right after: the decode pool is short, but the cooldown holds.
    tokio::time::advance(Duration::from_secs(10)).await;
    let d = p.plan(decode_heavy()).await;
    assert_eq!(d.action, "hold");
    assert!(
        d.reason.starts_with("cooldown: 10.0 s of 60.0 s"),
        "{}",
        d.reason
    );
    tokio::time::advance(Duration::from_secs(51)).await;
    let d = p.plan(decode_heavy()).await;
    assert_eq!(d.action, "scale", "{}", d.reason);
    assert_eq!(
        d.target,
        Some(PoolSizes {
            prefill: 1,
            decode: 3
        })
    );

    // A failed move is reported and retried at the next interval (no cooldown started).
    *connector.fail.lock().unwrap() = true;
    tokio::time::advance(Duration::from_secs(61)).await;
    let d = p.plan(prefill_heavy()).await;
    assert_eq!(d.action, "failed");
    assert!(d.error.as_deref().unwrap().contains("worker unreachable"));
    *connector.fail.lock().unwrap() = false;
    let d = p.plan(prefill_heavy()).await;
    assert_eq!(d.action, "scale", "{}", d.reason);

    // The log keeps the last three, newest first; the metrics carry the pools.
    let log = p.state.decisions(10);
    assert_eq!(log.len(), 3);
    assert!(log[0].interval > log[1].interval && log[1].interval > log[2].interval);
    assert_eq!(log[1].action, "failed");
    let text = p.metrics.encode();
    assert!(
        text.contains("switchyard_planner_pool_workers{pool=\"prefill\",kind=\"current\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("switchyard_planner_decisions_total{action=\"failed\"} 1"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_small_shift_waits_for_the_hysteresis() {
    let connector = Arc::new(RecordingConnector {
        sizes: Mutex::new(PoolSizes {
            prefill: 1,
            decode: 3,
        }),
        calls: Mutex::new(Vec::new()),
        fail: Mutex::new(false),
    });
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let mut p = planner(Arc::clone(&connector), registry);
    // Idle: one worker per pool is enough, so no pool is short; the spare workers would be
    // spread evenly (2/2), which is an improvement, not a shortage, and waits two intervals.
    let d = p.plan(interval(0.1, 100.0, 10.0)).await;
    assert_eq!(
        d.wanted,
        Some(PoolSizes {
            prefill: 2,
            decode: 2
        })
    );
    assert_eq!(d.action, "hold");
    assert!(d.reason.contains("1 of 2 intervals"), "{}", d.reason);
    let d = p.plan(interval(0.1, 100.0, 10.0)).await;
    assert_eq!(d.action, "scale", "{}", d.reason);
    assert_eq!(connector.calls.lock().unwrap().len(), 1);
}
