//! The planner benchmark: a workload that shifts between phases (decode-heavy, then
//! prefill-heavy) served by the replay lab's simulated cluster in virtual time — the same
//! serving core as the gateway (KV-aware decode choice, `auto` disaggregation by uncached
//! tokens, the prefill pool's choice, pipelined KV transfer) — once per fixed prefill/decode
//! split and once with the planner moving workers; reported as TTFT and ITL target attainment
//! (`switchyard planner bench`).
//!
//! The planner here is the real one minus I/O ([`controller`]): the same predictor, sizing and
//! stabiliser, fed each interval with what the gateway would report (finished requests' rate,
//! lengths and cached tokens; the decode workers' active sequences), and its moves behave like
//! the local connector's (drain, switch when idle). Arrivals are open-loop (Poisson,
//! [`workload`]), so every configuration sees exactly the same requests.
//!
//! `profile_speedup` makes the planner's profile wrong on purpose: it is derived from the
//! simulators' timing model divided by that factor, so at 2 the planner believes the engine is
//! twice as fast as the simulated one. The [`Correction`] then has something to correct; it is
//! fed the mean TTFT and ITL (per token gap, as the gateway's histograms count them) of the
//! requests that finished in the interval.

mod controller;
mod report;
mod workload;

use std::time::Duration;

use indicatif::ProgressBar;
use serde::Serialize;
use switchyard_core::Role;
use switchyard_engine_sim::{KvLayout, SimConfig};
use switchyard_replay::{Cluster, ClusterConfig, DisaggConfig, DisaggMode, ReplayError};
use switchyard_router::{PolicyConfig, PolicyKind};

use crate::correction::{CorrectionFactors, CorrectionSettings};
use crate::predict::PredictorKind;
use crate::sizing::Targets;
use crate::stability::StabilitySettings;
use controller::PlannerController;
pub use report::markdown;
use report::{Finished, attainment};

/// One stretch of steady traffic.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Phase {
    pub name: &'static str,
    pub seconds: f64,
    /// Requests per second (Poisson arrivals).
    pub rate: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
}

#[derive(Debug, Clone)]
pub struct ShiftSettings {
    pub phases: Vec<Phase>,
    pub workers: u32,
    pub targets: Targets,
    pub interval_seconds: f64,
    pub stability: StabilitySettings,
    pub seed: u64,
    pub sim: SimConfig,
    /// The gateways' `auto` threshold: a prompt with at least this many uncached tokens on its
    /// decode worker is prefilled in the prefill pool.
    pub disagg_min_uncached_tokens: u64,
    /// The model's KV layout: what a transfer moves per token.
    pub kv_layout: KvLayout,
    /// Workers report their load this often (the gateway's default 100 ms).
    pub load_report_ms: u64,
    /// How much faster than the simulated engine the planner's profile believes it is (1: the
    /// profile is right).
    pub profile_speedup: f64,
    pub correction: CorrectionSettings,
}

impl Default for ShiftSettings {
    fn default() -> Self {
        Self {
            phases: vec![
                Phase {
                    name: "decode-heavy",
                    seconds: 180.0,
                    rate: 30.0,
                    input_tokens: 200,
                    output_tokens: 400,
                },
                Phase {
                    name: "prefill-heavy",
                    seconds: 180.0,
                    rate: 4.0,
                    input_tokens: 6000,
                    output_tokens: 20,
                },
            ],
            workers: 4,
            targets: Targets {
                ttft_seconds: 1.0,
                itl_seconds: 0.025,
            },
            interval_seconds: 10.0,
            stability: StabilitySettings {
                cooldown: Duration::from_secs(30),
                hysteresis_intervals: 2,
            },
            seed: 1,
            sim: SimConfig::default(),
            disagg_min_uncached_tokens: 512,
            kv_layout: KvLayout::default(),
            load_report_ms: 100,
            profile_speedup: 1.0,
            correction: CorrectionSettings::default(),
        }
    }
}

/// How the pools are sized in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sizing {
    Fixed {
        prefill: u32,
    },
    /// The planner with a predictor, correcting its profile or trusting it.
    Planner {
        predictor: PredictorKind,
        correction: bool,
    },
}

/// Target attainment of a set of requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Attainment {
    pub requests: usize,
    /// Fraction of requests whose TTFT met the target.
    pub ttft: f64,
    /// Fraction of multi-token requests whose mean inter-token latency met the target.
    pub itl: f64,
    /// Fraction of requests meeting both (one-token requests: TTFT only).
    pub both: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p99: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub label: String,
    pub overall: Attainment,
    pub phases: Vec<Attainment>,
    /// Requests that could not be served (no worker of a needed pool, refused by an engine).
    pub failed: usize,
    /// (virtual seconds, prefill workers, decode workers) at every interval.
    pub timeline: Vec<(f64, u32, u32)>,
    pub moves: u32,
    /// The planner's reasons at every interval: (virtual seconds, reason).
    pub decisions: Vec<(f64, String)>,
    /// The planner's profile correction at the end of the run.
    pub correction: Option<CorrectionFactors>,
}

/// Runs the shift once with `sizing`.
pub fn run(settings: &ShiftSettings, sizing: Sizing) -> Result<Outcome, ReplayError> {
    let n = settings.workers.max(2);
    let start_prefill = match sizing {
        Sizing::Fixed { prefill } => prefill.min(n - 1),
        Sizing::Planner { .. } => n / 2,
    };
    let roles: Vec<Role> = (0..n)
        .map(|i| {
            if i < start_prefill {
                Role::Prefill
            } else {
                Role::Decode
            }
        })
        .collect();
    let mut disagg = DisaggConfig::split(0, 0, DisaggMode::Auto);
    disagg.roles = roles;
    disagg.min_uncached_tokens = settings.disagg_min_uncached_tokens;
    disagg.layout = settings.kv_layout;
    let cluster = Cluster::new(ClusterConfig {
        workers: n as usize,
        sim: settings.sim.clone(),
        policy: PolicyKind::Kv,
        policy_config: PolicyConfig::default(),
        event_delay_us: 0,
        load_report_interval_us: settings.load_report_ms * 1000,
        disagg: Some(disagg),
        token_gaps: false,
        retention: None,
        session_scheduling: false,
    })?;
    let arrivals = workload::arrivals(settings);
    let phases: Vec<usize> = arrivals.iter().map(|a| a.phase).collect();
    let mut load = workload::PhaseWorkload::new(arrivals, settings.seed ^ 0xA5A5);
    let mut controller = PlannerController::new(settings, sizing, n, phases.clone());
    let run = cluster.run_with(&mut load, &ProgressBar::hidden(), &mut controller)?;
    let finished: Vec<Finished> = run
        .records
        .iter()
        .filter_map(|r| controller::finished(r, &phases))
        .collect();
    let failed = run.records.len() - finished.len();
    let phase_attainment = (0..settings.phases.len())
        .map(|i| {
            let of_phase: Vec<Finished> =
                finished.iter().filter(|f| f.phase == i).copied().collect();
            attainment(&of_phase, &settings.targets)
        })
        .collect();
    let label = match sizing {
        Sizing::Fixed { prefill } => format!("fixed {prefill} prefill / {} decode", n - prefill),
        Sizing::Planner {
            predictor,
            correction: true,
        } => format!("planner ({})", predictor.as_str()),
        Sizing::Planner {
            predictor,
            correction: false,
        } => format!("planner ({}, no correction)", predictor.as_str()),
    };
    let correction = controller.correction();
    Ok(Outcome {
        label,
        overall: attainment(&finished, &settings.targets),
        phases: phase_attainment,
        failed,
        timeline: controller.timeline,
        moves: controller.moves,
        decisions: controller.decisions,
        correction,
    })
}

/// Every fixed split (at least one worker per pool), the planner with each predictor, and the
/// constant-predictor planner trusting its profile (no correction).
pub fn run_all(settings: &ShiftSettings) -> Result<Vec<Outcome>, ReplayError> {
    let n = settings.workers.max(2);
    let mut sizings: Vec<Sizing> = (1..n).map(|prefill| Sizing::Fixed { prefill }).collect();
    for (predictor, correction) in [
        (PredictorKind::Constant, true),
        (PredictorKind::Holt, true),
        (PredictorKind::Constant, false),
    ] {
        sizings.push(Sizing::Planner {
            predictor,
            correction,
        });
    }
    sizings.into_iter().map(|s| run(settings, s)).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A small shift: the planner moves workers toward the pool each phase needs, every
    /// request is served, and the arrivals are the same for every configuration.
    #[test]
    fn the_planner_moves_workers_with_the_shift() {
        let mut settings = ShiftSettings::default();
        for p in &mut settings.phases {
            p.seconds = 60.0;
        }
        settings.stability.cooldown = Duration::from_secs(10);
        let planned = run(
            &settings,
            Sizing::Planner {
                predictor: PredictorKind::Constant,
                correction: true,
            },
        )
        .unwrap();
        assert_eq!(planned.failed, 0);
        let during = |from: f64, to: f64| {
            planned
                .timeline
                .iter()
                .filter(|(t, _, _)| *t > from && *t <= to)
                .map(|(_, p, d)| (*p, *d))
                .collect::<Vec<_>>()
        };
        assert!(
            during(20.0, 60.0).iter().any(|(p, d)| d > p),
            "{:?}",
            planned.timeline
        );
        assert!(
            during(80.0, 120.0).iter().any(|(p, d)| p > d),
            "{:?}",
            planned.timeline
        );
        let fixed = run(&settings, Sizing::Fixed { prefill: 2 }).unwrap();
        assert_eq!(fixed.overall.requests, planned.overall.requests);
        assert_eq!(fixed.moves, 0);
    }

    /// A profile twice too optimistic: trusting it keeps the decode pool too small for the
    /// decode-heavy phase; the correction learns the factor and moves sooner and further. With
    /// the right profile the factors stay near 1.
    #[test]
    fn the_correction_recovers_from_a_wrong_profile() {
        let mut settings = ShiftSettings::default();
        for p in &mut settings.phases {
            p.seconds = 60.0;
        }
        settings.profile_speedup = 2.0;
        let planner = |correction| Sizing::Planner {
            predictor: PredictorKind::Constant,
            correction,
        };
        let learning = run(&settings, planner(true)).unwrap();
        let trusting = run(&settings, planner(false)).unwrap();
        let f = learning.correction.unwrap();
        assert!(f.prefill > 1.5 && f.decode > 1.5, "{f:?}");
        assert!(!trusting.correction.unwrap().enabled);
        assert!(
            learning.overall.both > trusting.overall.both + 0.2,
            "learning {:?}, trusting {:?}",
            learning.overall,
            trusting.overall
        );
        assert!(
            learning
                .decisions
                .iter()
                .any(|(_, why)| why.contains("profile corrected x")),
            "{:?}",
            learning.decisions
        );

        settings.profile_speedup = 1.0;
        let right = run(&settings, planner(true)).unwrap().correction.unwrap();
        assert!(
            (0.8..1.25).contains(&right.prefill) && (0.8..1.25).contains(&right.decode),
            "{right:?}"
        );
    }
}
