//! The planner benchmark: a workload that shifts between phases (decode-heavy, then
//! prefill-heavy) served by a cluster of simulated workers in virtual time, once per fixed
//! prefill/decode split and once with the planner moving workers; reported as TTFT and ITL
//! target attainment (`switchyard planner bench`).
//!
//! The planner here is the real one minus I/O: the same [`Predictor`], [`sizing`] and
//! [`Stabilizer`], fed each interval with what the gateway would report (finished requests'
//! rate, lengths and cached tokens; the decode workers' active sequences), and its moves behave
//! like the local connector's (drain, switch when idle). Arrivals are open-loop (Poisson), so
//! every configuration sees exactly the same requests.
//!
//! `profile_speedup` makes the planner's profile wrong on purpose: it is derived from the
//! simulators' timing model divided by that factor, so at 2 the planner believes the engine is
//! twice as fast as the simulated one. The [`Correction`] then has something to correct; it is
//! fed the mean TTFT and ITL (per token gap, as the gateway's histograms count them) of the
//! requests that finished in the interval.

mod cluster;
mod report;

use std::time::Duration;

use serde::Serialize;
use switchyard_core::Role;
use switchyard_engine_sim::{SimConfig, SimError};

use crate::correction::{Correction, CorrectionFactors, CorrectionSettings, Served};
use crate::predict::{Load, Predictor, PredictorKind, PredictorSettings};
use crate::profile::PerformanceProfile;
use crate::sizing::{self, Limits, Targets};
use crate::stability::{StabilitySettings, Stabilizer, Verdict};
use cluster::{Cluster, Finished, Flight};
use report::attainment;
pub use report::markdown;

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
    pub disagg_min_tokens: usize,
    pub kv_bytes_per_token: f64,
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
            disagg_min_tokens: 512,
            kv_bytes_per_token: 131_072.0,
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

/// SplitMix64: a small, seedable generator, so the workload is the same for every run.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// The requests of the whole run: (arrival, phase, input tokens, output tokens), in order.
fn arrivals(settings: &ShiftSettings) -> Vec<(f64, usize, u32, u32)> {
    let mut rng = Rng(settings.seed);
    let mut out = Vec::new();
    let mut start = 0.0;
    for (i, phase) in settings.phases.iter().enumerate() {
        let mut t = start;
        if phase.rate > 0.0 {
            loop {
                t += -rng.unit().ln() / phase.rate;
                if t >= start + phase.seconds {
                    break;
                }
                out.push((t, i, phase.input_tokens, phase.output_tokens));
            }
        }
        start += phase.seconds;
    }
    out
}

/// Runs the shift once with `sizing`.
pub fn run(settings: &ShiftSettings, sizing: Sizing) -> Result<Outcome, SimError> {
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
    let mut cluster = Cluster::new(
        &settings.sim,
        &roles,
        settings.disagg_min_tokens,
        settings.kv_bytes_per_token,
    )?;
    let profile = PerformanceProfile::from_timing(
        &settings.sim.timing,
        settings.profile_speedup,
        settings.sim.max_batched_tokens as u64,
    );
    let limits = Limits {
        min_prefill: 1,
        min_decode: 1,
        max_total: n,
    };
    let mut planner = match sizing {
        Sizing::Planner {
            predictor,
            correction,
        } => Some((
            Predictor::new(predictor, &PredictorSettings::default()),
            Stabilizer::new(settings.stability),
            Correction::new(CorrectionSettings {
                enabled: correction,
                ..settings.correction
            }),
        )),
        Sizing::Fixed { .. } => None,
    };
    let clock = tokio::time::Instant::now();
    let requests = arrivals(settings);
    let end: f64 = settings.phases.iter().map(|p| p.seconds).sum();
    let mut token_rng = Rng(settings.seed ^ 0xA5A5);
    let mut next = 0usize;
    let mut tick = settings.interval_seconds;
    let mut reported = 0usize;
    let mut last_pools = None;
    let mut timeline = vec![(0.0, cluster.pools().0, cluster.pools().1)];
    let mut moves = 0u32;
    let mut decisions = Vec::new();
    let mut now = 0.0f64;
    loop {
        cluster.start_steps(now);
        let arrival = requests.get(next).map(|r| r.0);
        let planning = (tick <= end).then_some(tick);
        let Some(t) = [arrival, cluster.next_event(), planning]
            .into_iter()
            .flatten()
            .min_by(f64::total_cmp)
        else {
            break;
        };
        now = t;
        cluster.complete(now);
        while let Some(&(at, phase, input, output)) = requests.get(next) {
            if at > now {
                break;
            }
            let prompt = (0..input)
                .map(|_| 100 + (token_rng.next_u64() % 29_900) as u32)
                .collect();
            let flight = Flight {
                arrival: at,
                phase,
                prompt,
                prompt_tokens: input,
                max_tokens: output.max(1),
                first_token: None,
                last_token: None,
                tokens: 0,
                cached: 0,
            };
            cluster.admit(next as u64, flight);
            next += 1;
        }
        if planning.is_some_and(|p| p <= now) {
            if let Some((predictor, stabilizer, correction)) = planner.as_mut() {
                let recent = &cluster.finished[reported..];
                let load = observed(recent, settings.interval_seconds);
                predictor.observe(&load);
                reported = cluster.finished.len();
                let moving = cluster.workers.iter().any(|w| w.moving_to.is_some());
                let (p, d) = cluster.pools();
                let pools = crate::PoolSizes {
                    prefill: p,
                    decode: d,
                };
                let (ttft_mean_seconds, itl_mean_seconds) = mean_latencies(recent);
                let served = Served {
                    load,
                    requests: recent.len() as f64,
                    ttft_mean_seconds,
                    itl_mean_seconds,
                    pools,
                    steady: !moving && last_pools == Some(pools),
                };
                last_pools = Some(pools);
                let factors =
                    correction.observe(&served, &profile, settings.disagg_min_tokens as f64);
                if let (Some(load), false) = (predictor.predict(), moving) {
                    let current = pools;
                    let req = sizing::required(
                        &load,
                        &sizing::Backlog {
                            active_decode_sequences: cluster.active_decode_sequences() as f64,
                            queued_prefill_tokens: cluster.prefill_pool_queued_tokens() as f64,
                            interval_seconds: settings.interval_seconds,
                        },
                        &correction.apply(&profile),
                        &settings.targets,
                        settings.disagg_min_tokens as f64,
                    );
                    let wanted = sizing::allocate((req.prefill, req.decode), &limits, Some(n));
                    let at = clock + Duration::from_secs_f64(now);
                    let short = crate::planner::is_short(current, wanted, &req);
                    let why = match stabilizer.judge(current, wanted, &limits, short, at) {
                        Verdict::Scale { target, why } => {
                            moves += start_moves(&mut cluster, current, target);
                            format!("scale to {}/{}: {why}", target.prefill, target.decode)
                        }
                        Verdict::Hold { why } => format!("hold: {why}"),
                    };
                    decisions.push((
                        now,
                        format!(
                            "{why}; needs {}/{} ({}; {})",
                            req.prefill,
                            req.decode,
                            req.why,
                            factors.describe()
                        ),
                    ));
                } else if moving {
                    decisions.push((now, "a move is under way".into()));
                }
            }
            let (p, d) = cluster.pools();
            timeline.push((now, p, d));
            tick += settings.interval_seconds;
        }
    }
    let failed = cluster.failed + cluster.in_flight();
    let finished = &cluster.finished;
    let phases = (0..settings.phases.len())
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
    let correction = planner.map(|(_, _, c)| c.factors());
    Ok(Outcome {
        label,
        overall: attainment(finished, &settings.targets),
        phases,
        failed,
        timeline,
        moves,
        decisions,
        correction,
    })
}

/// Mean TTFT of the requests and mean time between their tokens, per token gap (as the
/// gateway's ITL histogram counts them).
fn mean_latencies(recent: &[Finished]) -> (Option<f64>, Option<f64>) {
    if recent.is_empty() {
        return (None, None);
    }
    let ttft = recent.iter().map(|f| f.ttft).sum::<f64>() / recent.len() as f64;
    let (mut gaps, mut seconds) = (0.0, 0.0);
    for f in recent {
        if let Some(itl) = f.itl {
            let n = f64::from(f.output_tokens.saturating_sub(1));
            gaps += n;
            seconds += itl * n;
        }
    }
    (Some(ttft), (gaps > 0.0).then(|| seconds / gaps))
}

/// What the gateways would report for an interval that finished `recent`.
fn observed(recent: &[Finished], seconds: f64) -> Load {
    let count = recent.len() as f64;
    if count == 0.0 {
        return Load::default();
    }
    let prompt: f64 = recent.iter().map(|f| f64::from(f.prompt_tokens)).sum();
    let cached: f64 = recent.iter().map(|f| f64::from(f.cached_tokens)).sum();
    Load {
        request_rate: count / seconds,
        input_tokens: prompt / count,
        output_tokens: recent
            .iter()
            .map(|f| f64::from(f.output_tokens))
            .sum::<f64>()
            / count,
        cache_hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
    }
}

/// Starts the moves from `current` to `target`, least busy workers first; returns how many.
fn start_moves(cluster: &mut Cluster, current: crate::PoolSizes, target: crate::PoolSizes) -> u32 {
    let (from, to, count) = if target.prefill > current.prefill {
        (
            Role::Decode,
            Role::Prefill,
            target.prefill - current.prefill,
        )
    } else {
        (
            Role::Prefill,
            Role::Decode,
            current.prefill - target.prefill,
        )
    };
    let mut candidates: Vec<(u64, usize)> = cluster
        .workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.role == from && w.moving_to.is_none())
        .map(|(i, w)| (w.assigned as u64, i))
        .collect();
    candidates.sort_unstable();
    let chosen: Vec<usize> = candidates
        .into_iter()
        .take(count as usize)
        .map(|c| c.1)
        .collect();
    for &i in &chosen {
        cluster.move_worker(i, to);
    }
    chosen.len() as u32
}

/// Every fixed split (at least one worker per pool), the planner with each predictor, and the
/// constant-predictor planner trusting its profile (no correction).
pub fn run_all(settings: &ShiftSettings) -> Result<Vec<Outcome>, SimError> {
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
