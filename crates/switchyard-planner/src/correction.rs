//! Correction of the performance profile by what the gateways observe, as Dynamo's SLA planner
//! does with its correction factors.
//!
//! A profile measured on an idle worker, or for another engine version, is off in practice. Each
//! interval the observed mean TTFT and ITL are set against what the profile predicts for the
//! load that was actually served on the pools that actually served it; the ratio, smoothed and
//! bounded, scales the profile the sizing uses ([`Correction::apply`]): every prefill figure by
//! the prefill factor, every decode figure by the decode factor.
//!
//! **Inverting a queueing model, not dividing by it.** If the engine is `k` times slower than
//! its profile, both the idle prefill time `t` and the utilisation `ρ = rate · t / n` of the
//! prefill pool grow by `k`, and the queueing delay grows faster still: the observed TTFT is
//! not `k` times the prediction (at ρ = 0.4 a 2× slower engine reads as about 4×). So the
//! round's estimate is the `k` that explains the observed mean TTFT under a queueing model. The
//! model is M/D/1 (Poisson arrivals, one prompt length takes one time; Pollaczek–Khinchine):
//! TTFT = `k·t · (2 − k·ρ) / (2 · (1 − k·ρ))`, solved in closed form,
//! `k = 2·TTFT / (t + TTFT·ρ + √(t² + TTFT²·ρ²))`. The sizing itself keeps the more cautious
//! M/M/1 `t / (1 − ρ)`: that margin is what keeps the TTFT *tail* within target, and
//! estimating `k` with the sizing's own M/M/1 would read that margin as a fast engine (with a
//! right profile the simulator then reads as 0.75×) and size it away. ITL is inverted through
//! the decode pool's share of time spent prefilling aggregated prompts: ITL =
//! `k·step / (1 − k·share)`, so `k = ITL / (step + ITL·share)`. The decode concurrency comes
//! from Little's law with the *observed* ITL (`rate × output × ITL`), so the profile is
//! evaluated at the batch the workers really ran.
//!
//! **Choices**, each a constant of [`CorrectionSettings`]:
//! - EWMA with weight 0.5 on the new interval: converges to within 6 % in 4 intervals, while one
//!   odd interval (a burst that left a queue) moves the factor only half way.
//! - Clamped to `[0.25, 4]`: a profile off by more than 4× is a wrong profile, to be re-measured,
//!   and a stalled interval must not make the planner ask for every worker at once.
//! - Thin intervals are ignored (fewer than 20 finished requests): a mean of a handful of
//!   requests says more about those requests than about the engine.
//! - An interval during which a pool changed size (or a worker drained) is skipped: its latencies
//!   mix two shapes and match neither prediction. The factors are *not* reset when the pools
//!   change shape: they describe the engine against its profile, which a move does not change,
//!   and forgetting them would repeat the initial mis-sizing after every move.
//! - TTFT of an interval whose mean uncached prompt stays on the decode workers (aggregated) does
//!   not update the prefill factor: there it is dominated by waiting for the running decode step,
//!   not by the prefill speed the factor describes.

use serde::{Deserialize, Serialize};

use crate::connector::PoolSizes;
use crate::predict::Load;
use crate::profile::PerformanceProfile;

/// How the correction factors are estimated (`[correction]` in the config file).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CorrectionSettings {
    /// Off: the profile is trusted as it is (the factors stay 1).
    pub enabled: bool,
    /// Weight of the newest interval in the moving average, in (0, 1].
    pub smoothing: f64,
    /// Bounds of each factor.
    pub min_factor: f64,
    pub max_factor: f64,
    /// Fewest finished requests an interval needs to say anything.
    pub min_requests: u32,
}

impl Default for CorrectionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            smoothing: 0.5,
            min_factor: 0.25,
            max_factor: 4.0,
            min_requests: 20,
        }
    }
}

impl CorrectionSettings {
    /// Why the settings cannot be used, in one sentence.
    pub fn problem(&self) -> Option<String> {
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Some("correction.smoothing must lie in (0, 1]".into());
        }
        let ok = self.min_factor.is_finite()
            && self.max_factor.is_finite()
            && self.min_factor > 0.0
            && self.min_factor <= 1.0
            && self.max_factor >= 1.0;
        if !ok {
            return Some(
                "correction.min_factor must lie in (0, 1] and correction.max_factor be at least 1"
                    .into(),
            );
        }
        None
    }
}

/// What one interval served and how fast, as the gateways and workers report it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Served {
    /// The load actually served (not the prediction).
    pub load: Load,
    /// Requests finished in the interval.
    pub requests: f64,
    pub ttft_mean_seconds: Option<f64>,
    pub itl_mean_seconds: Option<f64>,
    /// The pools that served it.
    pub pools: PoolSizes,
    /// Whether the pools kept that shape the whole interval (no move, no drain).
    pub steady: bool,
}

/// The factors and how they were last updated; shown in every decision and plan.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CorrectionFactors {
    pub enabled: bool,
    /// Observed prefill time over the profile's (TTFT).
    pub prefill: f64,
    /// Observed decode step time over the profile's (ITL).
    pub decode: f64,
    /// This interval's raw estimates, before smoothing and bounds (`None`: not updated).
    pub prefill_sample: Option<f64>,
    pub decode_sample: Option<f64>,
    /// Intervals that updated each factor so far.
    pub prefill_intervals: u64,
    pub decode_intervals: u64,
}

impl CorrectionFactors {
    /// The factors for a decision's reason.
    pub fn describe(&self) -> String {
        if !self.enabled {
            return "profile uncorrected (correction off)".into();
        }
        format!(
            "profile corrected x{:.2} prefill / x{:.2} decode from {} / {} intervals",
            self.prefill, self.decode, self.prefill_intervals, self.decode_intervals
        )
    }
}

/// The estimator: smoothed, bounded observed-over-profile ratios.
#[derive(Debug, Clone)]
pub struct Correction {
    settings: CorrectionSettings,
    factors: CorrectionFactors,
}

impl Correction {
    pub fn new(settings: CorrectionSettings) -> Self {
        Self {
            settings,
            factors: CorrectionFactors {
                enabled: settings.enabled,
                prefill: 1.0,
                decode: 1.0,
                prefill_sample: None,
                decode_sample: None,
                prefill_intervals: 0,
                decode_intervals: 0,
            },
        }
    }

    pub fn factors(&self) -> CorrectionFactors {
        self.factors
    }

    /// Updates the factors from one interval. `disagg_min_uncached_tokens` is the gateways'
    /// threshold: shorter uncached prompts were prefilled on the decode workers.
    pub fn observe(
        &mut self,
        served: &Served,
        profile: &PerformanceProfile,
        disagg_min_uncached_tokens: f64,
    ) -> CorrectionFactors {
        self.factors.prefill_sample = None;
        self.factors.decode_sample = None;
        let enough = served.requests >= f64::from(self.settings.min_requests.max(1));
        if !self.settings.enabled || !enough || !served.steady {
            return self.factors;
        }
        let load = &served.load;
        let uncached = load.input_tokens * (1.0 - load.cache_hit_rate.clamp(0.0, 1.0));
        let aggregated = uncached < disagg_min_uncached_tokens;
        if let (false, Some(ttft)) = (aggregated, served.ttft_mean_seconds)
            && served.pools.prefill > 0
            && uncached >= 1.0
        {
            let t = profile.prefill_seconds(uncached);
            let rho = load.request_rate * t / f64::from(served.pools.prefill);
            self.factors.prefill_sample = invert_md1(ttft, t, rho);
        }
        if let Some(itl) = served.itl_mean_seconds
            && served.pools.decode > 0
            && load.output_tokens > 1.0
        {
            let decode = f64::from(served.pools.decode);
            let concurrency = load.request_rate * load.output_tokens * itl;
            let context = load.input_tokens + load.output_tokens / 2.0;
            let step = profile.itl_seconds((concurrency / decode).max(1.0), context);
            // Share of each decode worker's time spent prefilling the aggregated prompts
            // (their marginal cost, as the sizing counts it).
            let share = if aggregated && uncached >= 1.0 {
                load.request_rate
                    * (profile.prefill_seconds(uncached) - profile.prefill_seconds(0.0)).max(0.0)
                    / decode
            } else {
                0.0
            };
            self.factors.decode_sample = invert_busy(itl, step, share);
        }
        let (alpha, lo, hi) = (
            self.settings.smoothing,
            self.settings.min_factor,
            self.settings.max_factor,
        );
        let blend = |old: f64, sample: f64| ((1.0 - alpha) * old + alpha * sample).clamp(lo, hi);
        if let Some(s) = self.factors.prefill_sample {
            self.factors.prefill = blend(self.factors.prefill, s);
            self.factors.prefill_intervals += 1;
        }
        if let Some(s) = self.factors.decode_sample {
            self.factors.decode = blend(self.factors.decode, s);
            self.factors.decode_intervals += 1;
        }
        self.factors
    }

    /// The profile the sizing uses: `profile` with its figures scaled by the factors.
    pub fn apply(&self, profile: &PerformanceProfile) -> PerformanceProfile {
        if !self.settings.enabled {
            return profile.clone();
        }
        profile.scaled(self.factors.prefill, self.factors.decode)
    }
}

/// `k` such that `observed = k·base / (1 − k·share)`: the slowdown that explains a decode
/// step stretched by the share of time the worker spends on other work. `None` when the
/// figures are not usable (zero, negative, not finite).
fn invert_busy(observed: f64, base: f64, share: f64) -> Option<f64> {
    usable(
        observed / (base + observed * share.max(0.0)),
        observed,
        base,
    )
}

/// `k` such that the M/D/1 time in system of a service `k·base` at utilisation `k·load` is
/// `observed`: the smaller root of `base·load·k² − 2·(base + observed·load)·k + 2·observed = 0`
/// (the one with `k·load < 1`), written so that it cannot cancel.
fn invert_md1(observed: f64, base: f64, load: f64) -> Option<f64> {
    let load = load.max(0.0);
    let k = 2.0 * observed
        / (base + observed * load + (base * base + observed * observed * load * load).sqrt());
    usable(k, observed, base)
}

fn usable(k: f64, observed: f64, base: f64) -> Option<f64> {
    (observed.is_finite() && observed > 0.0 && base > 0.0 && k.is_finite() && k > 0.0).then_some(k)
}

/// The M/D/1 mean time in system of a service time `t` at utilisation `rho` (< 1): what
/// [`invert_md1`] inverts; for the tests and the benchmark's synthetic streams.
pub fn md1_time_in_system(t: f64, rho: f64) -> f64 {
    t * (2.0 - rho) / (2.0 * (1.0 - rho))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use switchyard_engine_sim::TimingModel;

    fn profile() -> PerformanceProfile {
        PerformanceProfile::from_timing(&TimingModel::default(), 1.0, 8192)
    }

    const DISAGG: f64 = 512.0;

    /// What an engine `slow` times slower than `profile` would show: TTFT and ITL generated
    /// from the same queueing model the estimator inverts, with some noise.
    fn served(p: &PerformanceProfile, slow: f64, noise: f64, requests: f64) -> Served {
        let load = Load {
            request_rate: 3.0,
            input_tokens: 4000.0,
            output_tokens: 200.0,
            cache_hit_rate: 0.25,
        };
        let pools = PoolSizes {
            prefill: 3,
            decode: 2,
        };
        let uncached = 3000.0;
        let t = slow * p.prefill_seconds(uncached);
        let rho = load.request_rate * t / 3.0;
        let ttft = md1_time_in_system(t, rho) * noise;
        // Solve the ITL fixed point: concurrency depends on the ITL by Little's law.
        let mut itl = 0.02;
        for _ in 0..200 {
            let c = load.request_rate * load.output_tokens * itl / 2.0;
            itl = slow * p.itl_seconds(c.max(1.0), 4100.0);
        }
        Served {
            load,
            requests,
            ttft_mean_seconds: Some(ttft),
            itl_mean_seconds: Some(itl * noise),
            pools,
            steady: true,
        }
    }

    #[test]
    fn converges_to_the_true_ratio_on_a_noisy_stream() {
        let p = profile();
        for truth in [0.5, 1.0, 2.0, 3.0] {
            let mut c = Correction::new(CorrectionSettings::default());
            // Alternating ±10 % noise around the truth.
            for i in 0..30 {
                let noise = if i % 2 == 0 { 1.1 } else { 1.0 / 1.1 };
                c.observe(&served(&p, truth, noise, 100.0), &p, DISAGG);
            }
            let f = c.factors();
            assert!(
                (f.prefill / truth - 1.0).abs() < 0.12,
                "truth {truth}: prefill factor {f:?}"
            );
            assert!(
                (f.decode / truth - 1.0).abs() < 0.12,
                "truth {truth}: decode factor {f:?}"
            );
            assert_eq!(f.prefill_intervals, 30);
            // The plain ratio (observed / profile's prediction) overstates the slowdown under
            // load; the inverted model gets it exactly.
            let s = served(&p, truth, 1.0, 100.0);
            let t = p.prefill_seconds(3000.0);
            let plain = s.ttft_mean_seconds.unwrap() / md1_time_in_system(t, t);
            if truth > 1.0 {
                assert!(plain > truth * 1.1, "truth {truth}: plain ratio {plain}");
            }
            let mut once = Correction::new(CorrectionSettings {
                smoothing: 1.0,
                ..CorrectionSettings::default()
            });
            let exact = once.observe(&s, &p, DISAGG);
            assert!((exact.prefill / truth - 1.0).abs() < 1e-6, "{exact:?}");
            assert!((exact.decode / truth - 1.0).abs() < 1e-6, "{exact:?}");
        }
    }

    #[test]
    fn the_queueing_models_are_inverted_exactly() {
        for t in [0.01, 0.2, 1.5] {
            for rho in [0.0, 0.1, 0.45] {
                for k in [0.3, 1.0, 2.0] {
                    if k * rho >= 1.0 {
                        continue;
                    }
                    let observed = md1_time_in_system(k * t, k * rho);
                    let got = invert_md1(observed, t, rho).unwrap();
                    assert!(
                        (got / k - 1.0).abs() < 1e-9,
                        "t {t} rho {rho}: {got} for {k}"
                    );
                    let observed = k * t / (1.0 - k * rho);
                    let got = invert_busy(observed, t, rho).unwrap();
                    assert!(
                        (got / k - 1.0).abs() < 1e-9,
                        "t {t} share {rho}: {got} for {k}"
                    );
                }
            }
        }
        assert_eq!(invert_md1(1.0, 0.0, 0.5), None);
        assert_eq!(invert_busy(f64::INFINITY, 1.0, 0.0), None);
    }

    #[test]
    fn factors_stay_within_their_bounds() {
        let p = profile();
        let mut c = Correction::new(CorrectionSettings::default());
        let mut s = served(&p, 1.0, 1.0, 100.0);
        s.ttft_mean_seconds = Some(1e6);
        s.itl_mean_seconds = Some(1e6);
        for _ in 0..20 {
            c.observe(&s, &p, DISAGG);
        }
        assert_eq!((c.factors().prefill, c.factors().decode), (4.0, 4.0));
        s.ttft_mean_seconds = Some(1e-9);
        s.itl_mean_seconds = Some(1e-9);
        for _ in 0..20 {
            c.observe(&s, &p, DISAGG);
        }
        assert_eq!((c.factors().prefill, c.factors().decode), (0.25, 0.25));
        // Unusable figures leave the factors alone.
        s.ttft_mean_seconds = Some(f64::NAN);
        s.itl_mean_seconds = Some(-1.0);
        let f = c.observe(&s, &p, DISAGG);
        assert_eq!((f.prefill_sample, f.decode_sample), (None, None));
        assert_eq!((f.prefill, f.decode), (0.25, 0.25));
    }

    #[test]
    fn thin_unsteady_and_aggregated_intervals_are_ignored() {
        let p = profile();
        let mut c = Correction::new(CorrectionSettings::default());
        c.observe(&served(&p, 2.0, 1.0, 19.0), &p, DISAGG);
        let mut moving = served(&p, 2.0, 1.0, 100.0);
        moving.steady = false;
        c.observe(&moving, &p, DISAGG);
        let f = c.factors();
        assert_eq!((f.prefill, f.decode), (1.0, 1.0));
        assert_eq!((f.prefill_intervals, f.decode_intervals), (0, 0));
        // Aggregated prompts: TTFT says nothing about the prefill pool; ITL still counts.
        let f = c.observe(&served(&p, 2.0, 1.0, 20.0), &p, 10_000.0);
        assert_eq!(f.prefill_sample, None);
        assert_eq!(f.prefill, 1.0);
        assert!(f.decode > 1.0, "{f:?}");
    }

    #[test]
    fn disabled_it_neither_learns_nor_changes_the_profile() {
        let p = profile();
        let mut c = Correction::new(CorrectionSettings {
            enabled: false,
            ..CorrectionSettings::default()
        });
        for _ in 0..10 {
            c.observe(&served(&p, 2.0, 1.0, 100.0), &p, DISAGG);
        }
        let f = c.factors();
        assert!(!f.enabled);
        assert_eq!((f.prefill, f.decode, f.prefill_intervals), (1.0, 1.0, 0));
        assert_eq!(c.apply(&p), p);
        assert!(f.describe().contains("off"));

        let mut on = Correction::new(CorrectionSettings::default());
        for _ in 0..10 {
            on.observe(&served(&p, 2.0, 1.0, 100.0), &p, DISAGG);
        }
        let corrected = on.apply(&p);
        let ratio = corrected.prefill_seconds(3000.0) / p.prefill_seconds(3000.0);
        assert!((ratio - on.factors().prefill).abs() < 1e-9);
        let ratio = corrected.itl_seconds(16.0, 2048.0) / p.itl_seconds(16.0, 2048.0);
        assert!((ratio - on.factors().decode).abs() < 1e-9);
    }

    #[test]
    fn bad_settings_are_named() {
        let bad = |f: &dyn Fn(&mut CorrectionSettings)| {
            let mut s = CorrectionSettings::default();
            f(&mut s);
            s.problem().unwrap()
        };
        assert!(bad(&|s| s.smoothing = 0.0).contains("smoothing"));
        assert!(bad(&|s| s.max_factor = 0.5).contains("max_factor"));
        assert!(bad(&|s| s.min_factor = f64::NAN).contains("min_factor"));
        assert_eq!(CorrectionSettings::default().problem(), None);
    }
}
