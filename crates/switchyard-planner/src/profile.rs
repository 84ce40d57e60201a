//! The performance profile of one worker: how fast it prefills a prompt of a given length and
//! how long one decode step takes with a given number of sequences of a given context.
//!
//! The planner sizes the pools from it. For the simulator it is derived from the timing model
//! ([`PerformanceProfile::from_timing`]); for a real engine it is measured by
//! `switchyard planner profile` and read from a JSON file (format in `docs/planner.md`):
//!
//! ```json
//! {
//!   "version": 1,
//!   "source": "measured against 10.0.0.5:7000",
//!   "prefill": [{"input_tokens": 1024, "seconds": 0.070}, {"input_tokens": 8192, "seconds": 0.53}],
//!   "decode": [{"concurrency": 1, "context_tokens": 2048, "itl_seconds": 0.0082}]
//! }
//! ```
//!
//! Between measured points the figures are interpolated linearly (in input length for
//! prefill; in concurrency, then context, for decode); beyond the last point they are
//! extrapolated from the last two, because a profile measured up to 8k tokens still has to
//! say something about a 16k prompt.

use std::path::Path;

use serde::{Deserialize, Serialize};
use switchyard_engine_sim::TimingModel;

/// Why a profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read profile {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("profile {path} is not valid JSON of the profile format: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("invalid profile: {0}")]
    Invalid(String),
}

/// Time to prefill a prompt of `input_tokens` uncached tokens on an idle worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillPoint {
    pub input_tokens: u64,
    pub seconds: f64,
}

/// Time between two tokens of a sequence when `concurrency` sequences of `context_tokens`
/// each decode together on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodePoint {
    pub concurrency: u64,
    pub context_tokens: u64,
    pub itl_seconds: f64,
}

/// A worker's measured or modelled speed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerformanceProfile {
    pub version: u32,
    /// Where the figures come from, for people reading the file.
    #[serde(default)]
    pub source: String,
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
}

/// Input lengths and batch shapes at which a timing model is evaluated.
const PREFILL_LENGTHS: [u64; 8] = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768];
const DECODE_CONCURRENCY: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
const DECODE_CONTEXT: [u64; 6] = [256, 1024, 2048, 4096, 8192, 16384];

impl PerformanceProfile {
    pub const VERSION: u32 = 1;

    /// The profile of a simulated worker running `timing` with `speedup` (simulated time runs
    /// that many times faster than real time, so every figure is divided by it) and chunked
    /// prefill of at most `max_batched_tokens` per step.
    pub fn from_timing(timing: &TimingModel, speedup: f64, max_batched_tokens: u64) -> Self {
        let speedup = if speedup.is_finite() && speedup > 0.0 {
            speedup
        } else {
            1.0
        };
        let chunk = max_batched_tokens.max(1);
        let prefill = PREFILL_LENGTHS
            .iter()
            .map(|&len| {
                // Every chunk after the first pays one more step overhead.
                let extra_steps = len.div_ceil(chunk).saturating_sub(1);
                let secs = timing.prefill_time(len, 0).as_secs_f64()
                    + extra_steps as f64 * timing.step_overhead_us / 1e6;
                PrefillPoint {
                    input_tokens: len,
                    seconds: secs / speedup,
                }
            })
            .collect();
        let mut decode = Vec::new();
        for &context in &DECODE_CONTEXT {
            for &batch in &DECODE_CONCURRENCY {
                decode.push(DecodePoint {
                    concurrency: batch,
                    context_tokens: context,
                    itl_seconds: timing.decode_step_time(batch, context).as_secs_f64() / speedup,
                });
            }
        }
        Self {
            version: Self::VERSION,
            source: format!("simulator timing model, speedup {speedup}"),
            prefill,
            decode,
        }
    }

    /// The same profile with every prefill time multiplied by `prefill` and every decode step
    /// by `decode` (the planner's correction factors; non-positive factors leave it as it is).
    pub fn scaled(&self, prefill: f64, decode: f64) -> Self {
        let factor = |f: f64| if f.is_finite() && f > 0.0 { f } else { 1.0 };
        let (prefill, decode) = (factor(prefill), factor(decode));
        let mut out = self.clone();
        for point in &mut out.prefill {
            point.seconds *= prefill;
        }
        for point in &mut out.decode {
            point.itl_seconds *= decode;
        }
        out
    }

    /// Reads and checks a profile file.
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: shown.clone(),
            source,
        })?;
        let profile: Self = serde_json::from_str(&text).map_err(|source| ProfileError::Parse {
            path: shown,
            source,
        })?;
        profile.validate()?;
        Ok(profile)
    }

    pub fn validate(&self) -> Result<(), ProfileError> {
        let invalid = |m: String| Err(ProfileError::Invalid(m));
        if self.version != Self::VERSION {
            return invalid(format!(
                "version {} is not supported (expected {})",
                self.version,
                Self::VERSION
            ));
        }
        if self.prefill.is_empty() || self.decode.is_empty() {
            return invalid("needs at least one prefill and one decode point".into());
        }
        for p in &self.prefill {
            if p.input_tokens == 0 || !(p.seconds.is_finite() && p.seconds > 0.0) {
                return invalid(format!(
                    "prefill point {p:?} needs input_tokens >= 1 and seconds > 0"
                ));
            }
        }
        for d in &self.decode {
            if d.concurrency == 0 || !(d.itl_seconds.is_finite() && d.itl_seconds > 0.0) {
                return invalid(format!(
                    "decode point {d:?} needs concurrency >= 1 and itl_seconds > 0"
                ));
            }
        }
        Ok(())
    }

    /// Seconds to prefill `input_tokens` uncached tokens on an idle worker.
    pub fn prefill_seconds(&self, input_tokens: f64) -> f64 {
        let mut points: Vec<(f64, f64)> = self
            .prefill
            .iter()
            .map(|p| (p.input_tokens as f64, p.seconds))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        interpolate(&points, input_tokens.max(0.0)).max(0.0)
    }

    /// Prefill tokens per second one worker sustains at prompts of `input_tokens`.
    pub fn prefill_throughput(&self, input_tokens: f64) -> f64 {
        let len = input_tokens.max(1.0);
        let secs = self.prefill_seconds(len);
        if secs > 0.0 { len / secs } else { f64::MAX }
    }

    /// Inter-token latency with `concurrency` sequences of `context_tokens` each on one worker.
    pub fn itl_seconds(&self, concurrency: f64, context_tokens: f64) -> f64 {
        let mut contexts: Vec<u64> = self.decode.iter().map(|d| d.context_tokens).collect();
        contexts.sort_unstable();
        contexts.dedup();
        // ITL at `concurrency` for each measured context, then across contexts.
        let per_context: Vec<(f64, f64)> = contexts
            .iter()
            .map(|&ctx| {
                let mut points: Vec<(f64, f64)> = self
                    .decode
                    .iter()
                    .filter(|d| d.context_tokens == ctx)
                    .map(|d| (d.concurrency as f64, d.itl_seconds))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                (ctx as f64, interpolate(&points, concurrency.max(1.0)))
            })
            .collect();
        interpolate(&per_context, context_tokens.max(0.0)).max(0.0)
    }

    /// The most sequences of `context_tokens` one worker decodes together while keeping the
    /// inter-token latency within `itl_target` seconds; 0 when even one sequence is too slow.
    pub fn max_concurrency(&self, context_tokens: f64, itl_target: f64) -> u64 {
        if self.itl_seconds(1.0, context_tokens) > itl_target {
            return 0;
        }
        // ITL grows with concurrency: binary search the largest batch within the target.
        let (mut lo, mut hi) = (1u64, 1u64 << 20);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.itl_seconds(mid as f64, context_tokens) <= itl_target {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// Piecewise-linear interpolation over points sorted by x, extrapolated from the end segments.
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    match points {
        [] => 0.0,
        [(_, y)] => *y,
        _ => {
            let i = points
                .windows(2)
                .position(|w| x <= w[1].0)
                .unwrap_or(points.len() - 2);
            let ((x0, y0), (x1, y1)) = (points[i], points[i + 1]);
            if (x1 - x0).abs() < f64::EPSILON {
                return y1;
            }
            y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn timing_profile_matches_the_timing_model_at_its_points_and_between() {
        let timing = TimingModel::default();
        let p = PerformanceProfile::from_timing(&timing, 1.0, 8192);
        let exact = timing.prefill_time(1024, 0).as_secs_f64();
        assert!((p.prefill_seconds(1024.0) - exact).abs() < 1e-9);
        // Between points the estimate lies between the neighbours.
        let mid = p.prefill_seconds(1536.0);
        assert!(mid > exact && mid < timing.prefill_time(2048, 0).as_secs_f64());
        let itl = timing.decode_step_time(64, 2048).as_secs_f64();
        assert!((p.itl_seconds(64.0, 2048.0) - itl).abs() < 1e-9);
    }

    #[test]
    fn speedup_divides_every_figure() {
        let timing = TimingModel::default();
        let slow = PerformanceProfile::from_timing(&timing, 1.0, 8192);
        let fast = PerformanceProfile::from_timing(&timing, 10.0, 8192);
        let ratio = slow.prefill_seconds(4096.0) / fast.prefill_seconds(4096.0);
        assert!((ratio - 10.0).abs() < 1e-6);
        let ratio = slow.itl_seconds(8.0, 1024.0) / fast.itl_seconds(8.0, 1024.0);
        assert!((ratio - 10.0).abs() < 1e-6);
    }

    #[test]
    fn max_concurrency_is_the_largest_batch_within_the_target() {
        let p = PerformanceProfile::from_timing(&TimingModel::default(), 1.0, 8192);
        let target = p.itl_seconds(32.0, 2048.0);
        let c = p.max_concurrency(2048.0, target);
        assert!(p.itl_seconds(c as f64, 2048.0) <= target);
        assert!(p.itl_seconds((c + 1) as f64, 2048.0) > target);
        assert_eq!(p.max_concurrency(2048.0, 0.000_1), 0);
    }

    #[test]
    fn files_round_trip_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        let p = PerformanceProfile::from_timing(&TimingModel::default(), 2.0, 8192);
        std::fs::write(&path, serde_json::to_string_pretty(&p).unwrap()).unwrap();
        assert_eq!(PerformanceProfile::load(&path).unwrap(), p);

        std::fs::write(&path, r#"{"version": 1, "prefill": [], "decode": []}"#).unwrap();
        let err = PerformanceProfile::load(&path).unwrap_err().to_string();
        assert!(err.contains("at least one"), "{err}");
        std::fs::write(&path, r#"{"version": 1, "prefill": [{"input_tokens": 5, "seconds": -1}], "decode": [{"concurrency": 1, "context_tokens": 1, "itl_seconds": 1}]}"#).unwrap();
        assert!(PerformanceProfile::load(&path).is_err());
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(
            PerformanceProfile::load(&path),
            Err(ProfileError::Parse { .. })
        ));
    }
}
