//! The planner as a controller of the replay cluster: every interval of virtual time it takes
//! what the gateways would report for the requests that finished, and runs the real
//! predictor, correction, sizing and stabiliser; its moves drain a worker and switch it once
//! idle, as the local connector does. A fixed split only records its (unchanging) pools.

use std::time::Duration;

use switchyard_core::Role;
use switchyard_replay::{Control, Controller, Micros, RequestRecord};

use super::report::Finished;
use super::{ShiftSettings, Sizing};
use crate::PoolSizes;
use crate::correction::{Correction, CorrectionSettings, Served};
use crate::predict::{Load, Predictor, PredictorSettings};
use crate::profile::PerformanceProfile;
use crate::sizing::{self, Limits};
use crate::stability::{Stabilizer, Verdict};

/// The planner's parts, when the run is planned.
struct Planning {
    predictor: Predictor,
    stabilizer: Stabilizer,
    correction: Correction,
}

pub(super) struct PlannerController<'a> {
    settings: &'a ShiftSettings,
    planning: Option<Planning>,
    profile: PerformanceProfile,
    limits: Limits,
    workers: u32,
    /// Phase of each request (its id is its index).
    phases: Vec<usize>,
    /// Finished requests already reported.
    reported: usize,
    last_pools: Option<PoolSizes>,
    clock: tokio::time::Instant,
    end: Micros,
    interval: Micros,
    /// (virtual seconds, prefill workers, decode workers) at every interval.
    pub timeline: Vec<(f64, u32, u32)>,
    pub moves: u32,
    /// The planner's reasons at every interval.
    pub decisions: Vec<(f64, String)>,
}

impl<'a> PlannerController<'a> {
    pub fn new(
        settings: &'a ShiftSettings,
        sizing: Sizing,
        workers: u32,
        phases: Vec<usize>,
    ) -> Self {
        let planning = match sizing {
            Sizing::Planner {
                predictor,
                correction,
            } => Some(Planning {
                predictor: Predictor::new(predictor, &PredictorSettings::default()),
                stabilizer: Stabilizer::new(settings.stability),
                correction: Correction::new(CorrectionSettings {
                    enabled: correction,
                    ..settings.correction
                }),
            }),
            Sizing::Fixed { .. } => None,
        };
        let end: f64 = settings.phases.iter().map(|p| p.seconds).sum();
        Self {
            settings,
            planning,
            profile: PerformanceProfile::from_timing(
                &settings.sim.timing,
                settings.profile_speedup,
                settings.sim.max_batched_tokens as u64,
            ),
            limits: Limits {
                min_prefill: 1,
                min_decode: 1,
                max_total: workers,
            },
            workers,
            phases,
            reported: 0,
            last_pools: None,
            clock: tokio::time::Instant::now(),
            end: (end * 1e6) as Micros,
            interval: (settings.interval_seconds * 1e6) as Micros,
            timeline: Vec::new(),
            moves: 0,
            decisions: Vec::new(),
        }
    }

    /// The planner's correction at the end of the run.
    pub fn correction(&self) -> Option<crate::correction::CorrectionFactors> {
        self.planning.as_ref().map(|p| p.correction.factors())
    }

    /// One planning round at `now` over the requests that finished since the last.
    fn plan(&mut self, now: f64, recent: &[Finished], control: &mut Control<'_>) {
        let Some(planning) = self.planning.as_mut() else {
            return;
        };
        let settings = self.settings;
        let load = observed(recent, settings.interval_seconds);
        planning.predictor.observe(&load);
        let moving = control.moving();
        let (p, d, _) = control.pools();
        let pools = PoolSizes {
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
            steady: !moving && self.last_pools == Some(pools),
        };
        self.last_pools = Some(pools);
        let threshold = settings.disagg_min_uncached_tokens as f64;
        let factors = planning
            .correction
            .observe(&served, &self.profile, threshold);
        let predicted = planning.predictor.predict();
        let Some(load) = predicted.filter(|_| !moving) else {
            if moving {
                self.decisions.push((now, "a move is under way".into()));
            }
            return;
        };
        let req = sizing::required(
            &load,
            &sizing::Backlog {
                active_decode_sequences: control.active_decode_sequences() as f64,
                queued_prefill_tokens: control.prefill_pool_queued_tokens() as f64,
                interval_seconds: settings.interval_seconds,
            },
            &planning.correction.apply(&self.profile),
            &settings.targets,
            threshold,
        );
        let wanted = sizing::allocate((req.prefill, req.decode), &self.limits, Some(self.workers));
        let at = self.clock + Duration::from_secs_f64(now);
        let short = crate::planner::is_short(pools, wanted, &req);
        let why = match planning
            .stabilizer
            .judge(pools, wanted, &self.limits, short, at)
        {
            Verdict::Scale { target, why } => {
                self.moves += start_moves(control, pools, target);
                format!("scale to {}/{}: {why}", target.prefill, target.decode)
            }
            Verdict::Hold { why } => format!("hold: {why}"),
        };
        self.decisions.push((
            now,
            format!(
                "{why}; needs {}/{} ({}; {})",
                req.prefill,
                req.decode,
                req.why,
                factors.describe()
            ),
        ));
    }
}

impl Controller for PlannerController<'_> {
    fn tick(&mut self, now: Micros, control: &mut Control<'_>) -> Option<Micros> {
        let seconds = now as f64 / 1e6;
        let recent: Vec<Finished> = control
            .finished_since(self.reported)
            .into_iter()
            .filter_map(|r| finished(r, &self.phases))
            .collect();
        self.reported = control.finished_count();
        if now > 0 {
            self.plan(seconds, &recent, control);
        }
        let (p, d, _) = control.pools();
        self.timeline.push((seconds, p, d));
        let next = now + self.interval;
        (next <= self.end).then_some(next)
    }
}

/// A finished request's figures (`None` for one that did not finish); `phases` gives each
/// request's phase by id.
pub(super) fn finished(r: &RequestRecord, phases: &[usize]) -> Option<Finished> {
    if !r.ok {
        return None;
    }
    let (first, last) = (r.first_token?, r.finished?);
    let seconds = |us: Micros| us as f64 / 1e6;
    let tokens = r.output_tokens.min(u64::from(u32::MAX)) as u32;
    Some(Finished {
        phase: phases.get(r.id as usize).copied().unwrap_or(0),
        ttft: seconds(first.saturating_sub(r.arrival)),
        itl: (tokens > 1).then(|| seconds(last.saturating_sub(first)) / f64::from(tokens - 1)),
        prompt_tokens: r.prompt_tokens.min(u64::from(u32::MAX)) as u32,
        output_tokens: tokens,
        cached_tokens: r.cached_tokens.min(u64::from(u32::MAX)) as u32,
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
fn start_moves(control: &mut Control<'_>, current: PoolSizes, target: PoolSizes) -> u32 {
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
    let chosen: Vec<usize> = control
        .movable(from)
        .into_iter()
        .take(count as usize)
        .collect();
    for &w in &chosen {
        control.move_worker(w, to);
    }
    chosen.len() as u32
}
