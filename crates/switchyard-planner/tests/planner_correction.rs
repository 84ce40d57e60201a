//! The profile correction in the planning round: a planner whose profile believes the engine
//! is twice as fast as it is sizes its pools too small at first, learns the factor from the
//! latencies the (simulated) gateways report, and grows the pools; with the correction off it
//! keeps trusting the profile. Time is paused.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use switchyard_engine_sim::TimingModel;
use switchyard_planner::correction::md1_time_in_system;
use switchyard_planner::observe::{Observation, Observer, WorkerFigures};
use switchyard_planner::predict::PredictorSettings;
use switchyard_planner::sizing::{Limits, Targets};
use switchyard_planner::stability::{StabilitySettings, Stabilizer};
use switchyard_planner::{
    Connector, ConnectorError, CorrectionSettings, Decision, Load, PerformanceProfile,
    PlanSettings, Planner, PlannerMetrics, PlannerState, PoolSizes, Predictor, PredictorKind,
};
use switchyard_registry::{MemoryRegistry, Registry};

/// Scales two pools freely (like the Kubernetes connector) and remembers their sizes.
#[derive(Debug)]
struct ElasticConnector(Mutex<PoolSizes>);

#[async_trait]
impl Connector for ElasticConnector {
    fn name(&self) -> &'static str {
        "elastic"
    }

    async fn current(&self) -> Result<PoolSizes, ConnectorError> {
        Ok(*self.0.lock().unwrap())
    }

    async fn capacity(&self) -> Result<Option<u32>, ConnectorError> {
        Ok(None)
    }

    async fn scale_to(&self, target: PoolSizes) -> Result<(), ConnectorError> {
        *self.0.lock().unwrap() = target;
        Ok(())
    }
}

const TARGETS: Targets = Targets {
    ttft_seconds: 1.0,
    itl_seconds: 0.025,
};

const LOAD: Load = Load {
    request_rate: 6.0,
    input_tokens: 4000.0,
    output_tokens: 500.0,
    cache_hit_rate: 0.0,
};

fn planner(
    registry: Arc<dyn Registry>,
    connector: Arc<ElasticConnector>,
    profile: PerformanceProfile,
    correction: bool,
) -> Planner {
    let state = Arc::new(PlannerState::new(PlanSettings {
        connector: "elastic",
        predictor: "constant",
        interval_seconds: 10.0,
        targets: TARGETS,
        limits: Limits {
            min_prefill: 1,
            min_decode: 1,
            max_total: 32,
        },
        profile_source: "believes the engine twice as fast".into(),
        disagg_min_uncached_tokens: 512,
        correction: CorrectionSettings {
            enabled: correction,
            ..CorrectionSettings::default()
        },
        decision_log_size: 50,
    }));
    Planner::new(
        state,
        Arc::new(PlannerMetrics::new()),
        Observer::new(
            Vec::new(),
            Arc::clone(&registry),
            Arc::new(Mutex::new(BTreeMap::new())),
        ),
        Predictor::new(PredictorKind::Constant, &PredictorSettings::default()),
        Stabilizer::new(StabilitySettings {
            cooldown: Duration::from_secs(20),
            hysteresis_intervals: 2,
        }),
        connector,
        registry,
        profile,
        Duration::from_secs(10),
    )
}

/// What the gateways report for an interval of `LOAD` served by `pools` of the engine whose
/// real speed is `engine`: mean TTFT from an M/D/1 queue per prefill worker (saturated
/// pools report a long, finite TTFT, as a real queue does within one interval), mean ITL from
/// the engine's decode step at the batch Little's law gives.
fn observation(engine: &PerformanceProfile, pools: PoolSizes) -> Observation {
    let t = engine.prefill_seconds(LOAD.input_tokens);
    let rho = (LOAD.request_rate * t / f64::from(pools.prefill)).min(0.9);
    let context = LOAD.input_tokens + LOAD.output_tokens / 2.0;
    let mut itl = TARGETS.itl_seconds;
    for _ in 0..100 {
        let per_worker = LOAD.request_rate * LOAD.output_tokens * itl / f64::from(pools.decode);
        itl = engine.itl_seconds(per_worker.max(1.0), context);
    }
    Observation {
        seconds: 10.0,
        load: LOAD,
        requests: LOAD.request_rate * 10.0,
        ttft_mean_seconds: Some(md1_time_in_system(t, rho)),
        itl_mean_seconds: Some(itl),
        gateways_answered: 1,
        workers: WorkerFigures {
            prefill: pools.prefill,
            decode: pools.decode,
            ..WorkerFigures::default()
        },
        ..Observation::default()
    }
}

/// Runs `rounds` intervals against the engine; returns every decision.
async fn run(
    correction: bool,
    engine: &PerformanceProfile,
    believed: &PerformanceProfile,
    rounds: usize,
) -> (Vec<Decision>, Planner, Arc<dyn Registry>) {
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let connector = Arc::new(ElasticConnector(Mutex::new(PoolSizes {
        prefill: 2,
        decode: 2,
    })));
    let mut p = planner(
        Arc::clone(&registry),
        Arc::clone(&connector),
        believed.clone(),
        correction,
    );
    let mut decisions = Vec::new();
    for _ in 0..rounds {
        let pools = *connector.0.lock().unwrap();
        decisions.push(p.plan(observation(engine, pools)).await);
        tokio::time::advance(Duration::from_secs(10)).await;
    }
    (decisions, p, registry)
}

#[tokio::test(start_paused = true)]
async fn a_profile_twice_too_optimistic_is_corrected_into_bigger_pools() {
    let engine = PerformanceProfile::from_timing(&TimingModel::default(), 1.0, 8192);
    let believed = PerformanceProfile::from_timing(&TimingModel::default(), 2.0, 8192);
    let (trusting, ..) = run(false, &engine, &believed, 12).await;
    let (learning, planner, registry) = run(true, &engine, &believed, 12).await;

    // The first sizing knows nothing yet: both planners want the same.
    assert_eq!(trusting[0].wanted, learning[0].wanted);
    let first = trusting[0].required.as_ref().unwrap();

    // Without correction the profile's figures are all the planner goes by.
    let stuck = trusting.last().unwrap();
    assert_eq!(stuck.correction.prefill, 1.0);
    assert_eq!(stuck.correction.decode, 1.0);
    assert!(stuck.reason.contains("correction off"), "{}", stuck.reason);
    let stuck_needs = stuck.required.as_ref().unwrap();
    assert_eq!(
        (stuck_needs.prefill, stuck_needs.decode),
        (first.prefill, first.decode)
    );

    // With it, the factors approach the true 2 and the pools grow past the trusting ones.
    let last = learning.last().unwrap();
    let f = last.correction;
    assert!((f.prefill - 2.0).abs() < 0.2, "{f:?}");
    assert!((f.decode - 2.0).abs() < 0.2, "{f:?}");
    let needs = last.required.as_ref().unwrap();
    assert!(
        needs.prefill > stuck_needs.prefill && needs.decode > stuck_needs.decode,
        "corrected {needs:?}, trusting {stuck_needs:?}"
    );
    let grown = last.current.unwrap();
    let kept = stuck.current.unwrap();
    assert!(
        grown.prefill > kept.prefill && grown.decode > kept.decode,
        "corrected pools {grown:?}, trusting pools {kept:?}"
    );
    // ...and the pools it reached meet the targets on the real engine.
    let served = observation(&engine, grown);
    assert!(served.ttft_mean_seconds.unwrap() <= TARGETS.ttft_seconds);
    assert!(served.itl_mean_seconds.unwrap() <= TARGETS.itl_seconds);

    // Intervals right after a move are skipped (served by two shapes), so not every interval
    // after the first updated the factors.
    let updates = learning
        .iter()
        .filter(|d| d.correction.prefill_sample.is_some())
        .count() as u64;
    assert_eq!(updates, f.prefill_intervals);
    assert!(updates < learning.len() as u64 - 1, "{updates}");
    assert!(
        last.reason.contains("profile corrected x"),
        "{}",
        last.reason
    );

    // Visible in the plan (registry and admin API) and the metrics.
    let plan = registry.plan().await.unwrap().unwrap();
    assert_eq!(plan["correction"]["enabled"], true);
    assert!(plan["correction"]["prefill"].as_f64().unwrap() > 1.8);
    assert_eq!(plan["settings"]["correction"]["max_factor"], 4.0);
    let text = planner.metrics.encode();
    let shown: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("switchyard_planner_correction_factor{pool=\"decode\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(shown, f.decode);
    assert!(
        text.contains(&format!(
            "switchyard_planner_correction_updates_total{{pool=\"prefill\"}} {updates}"
        )),
        "{text}"
    );
}
