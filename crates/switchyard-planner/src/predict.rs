//! Predicting the next interval's load from the intervals observed so far.
//!
//! Each figure of [`Load`] has its own one-dimensional predictor:
//!
//! - **constant**: the moving average of the last `window` observations (`window = 1` is the
//!   last value). Steady, and slow to follow a ramp by `window / 2` intervals.
//! - **holt**: Holt's linear (double exponential) smoothing: a level and a trend, each
//!   smoothed; the forecast is level + trend, so a rising load is met one interval early.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// What the planner sizes the pools for: the traffic of one interval.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Load {
    /// Requests per second.
    pub request_rate: f64,
    /// Mean prompt length, tokens.
    pub input_tokens: f64,
    /// Mean generated length, tokens.
    pub output_tokens: f64,
    /// Fraction of prompt tokens served from a prefix cache, `[0, 1]`.
    pub cache_hit_rate: f64,
}

/// Which predictor to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PredictorKind {
    #[default]
    Constant,
    Holt,
}

impl PredictorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Holt => "holt",
        }
    }
}

/// Smoothing settings of the predictors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PredictorSettings {
    /// Observations the constant predictor averages.
    pub window: usize,
    /// Holt's level smoothing, `(0, 1]`.
    pub alpha: f64,
    /// Holt's trend smoothing, `(0, 1]`.
    pub beta: f64,
}

impl Default for PredictorSettings {
    fn default() -> Self {
        Self {
            window: 3,
            alpha: 0.5,
            beta: 0.3,
        }
    }
}

/// A one-dimensional forecaster.
#[derive(Debug, Clone)]
enum Series {
    Constant {
        window: usize,
        values: VecDeque<f64>,
    },
    Holt {
        alpha: f64,
        beta: f64,
        state: Option<(f64, f64)>,
    },
}

impl Series {
    fn new(kind: PredictorKind, settings: &PredictorSettings) -> Self {
        match kind {
            PredictorKind::Constant => Self::Constant {
                window: settings.window.max(1),
                values: VecDeque::new(),
            },
            PredictorKind::Holt => Self::Holt {
                alpha: settings.alpha,
                beta: settings.beta,
                state: None,
            },
        }
    }

    fn observe(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        match self {
            Self::Constant { window, values } => {
                values.push_back(x);
                while values.len() > *window {
                    values.pop_front();
                }
            }
            Self::Holt { alpha, beta, state } => {
                *state = Some(match *state {
                    // The first two observations set the level and the first trend.
                    None => (x, 0.0),
                    Some((level, trend)) => {
                        let next_level = *alpha * x + (1.0 - *alpha) * (level + trend);
                        let next_trend = *beta * (next_level - level) + (1.0 - *beta) * trend;
                        (next_level, next_trend)
                    }
                });
            }
        }
    }

    fn predict(&self) -> Option<f64> {
        match self {
            Self::Constant { values, .. } => {
                (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
            }
            Self::Holt { state, .. } => state.map(|(level, trend)| level + trend),
        }
    }
}

/// Forecasts every figure of [`Load`].
#[derive(Debug, Clone)]
pub struct Predictor {
    kind: PredictorKind,
    rate: Series,
    input: Series,
    output: Series,
    hit: Series,
}

impl Predictor {
    pub fn new(kind: PredictorKind, settings: &PredictorSettings) -> Self {
        let series = || Series::new(kind, settings);
        Self {
            kind,
            rate: series(),
            input: series(),
            output: series(),
            hit: series(),
        }
    }

    pub fn kind(&self) -> PredictorKind {
        self.kind
    }

    /// Adds one interval's observation. An interval without requests says nothing about
    /// prompt or output lengths or the hit rate, so only its rate (zero) is recorded.
    pub fn observe(&mut self, load: &Load) {
        self.rate.observe(load.request_rate);
        if load.request_rate > 0.0 {
            self.input.observe(load.input_tokens);
            self.output.observe(load.output_tokens);
            self.hit.observe(load.cache_hit_rate);
        }
    }

    /// The next interval's load; `None` before the first observation.
    pub fn predict(&self) -> Option<Load> {
        let rate = self.rate.predict()?;
        // A trend may run below zero or above one; the quantities cannot.
        Some(Load {
            request_rate: rate.max(0.0),
            input_tokens: self.input.predict().unwrap_or(0.0).max(0.0),
            output_tokens: self.output.predict().unwrap_or(0.0).max(0.0),
            cache_hit_rate: self.hit.predict().unwrap_or(0.0).clamp(0.0, 1.0),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use proptest::prelude::*;

    fn load(rate: f64) -> Load {
        Load {
            request_rate: rate,
            input_tokens: 100.0,
            output_tokens: 10.0,
            cache_hit_rate: 0.5,
        }
    }

    #[test]
    fn constant_is_the_moving_average_of_the_window() {
        let settings = PredictorSettings {
            window: 2,
            ..PredictorSettings::default()
        };
        let mut p = Predictor::new(PredictorKind::Constant, &settings);
        assert!(p.predict().is_none());
        for r in [1.0, 2.0, 6.0] {
            p.observe(&load(r));
        }
        assert_eq!(p.predict().unwrap().request_rate, 4.0);
    }

    #[test]
    fn holt_follows_a_ramp_and_constant_lags_it() {
        let settings = PredictorSettings::default();
        let mut holt = Predictor::new(PredictorKind::Holt, &settings);
        let mut constant = Predictor::new(PredictorKind::Constant, &settings);
        for i in 0..30 {
            let l = load(10.0 + 5.0 * f64::from(i));
            holt.observe(&l);
            constant.observe(&l);
        }
        let next = 10.0 + 5.0 * 30.0;
        let holt_err = (holt.predict().unwrap().request_rate - next).abs();
        let const_err = (constant.predict().unwrap().request_rate - next).abs();
        assert!(holt_err < 0.5, "holt error {holt_err}");
        assert!(
            const_err > 5.0 * holt_err,
            "constant {const_err} holt {holt_err}"
        );
    }

    #[test]
    fn idle_intervals_keep_the_last_lengths() {
        let mut p = Predictor::new(PredictorKind::Constant, &PredictorSettings::default());
        p.observe(&load(4.0));
        p.observe(&Load::default());
        let next = p.predict().unwrap();
        assert_eq!(next.input_tokens, 100.0);
        assert_eq!(next.request_rate, 2.0);
    }

    proptest! {
        /// A steady load is predicted as itself, and forecasts stay within their ranges.
        #[test]
        fn forecasts_are_sane(values in prop::collection::vec(0.0f64..1e4, 1..40), hit in 0.0f64..=1.0, holt: bool) {
            let kind = if holt { PredictorKind::Holt } else { PredictorKind::Constant };
            let mut p = Predictor::new(kind, &PredictorSettings::default());
            for v in &values {
                p.observe(&Load { request_rate: *v, input_tokens: *v, output_tokens: 1.0, cache_hit_rate: hit });
            }
            let next = p.predict().unwrap();
            prop_assert!(next.request_rate >= 0.0 && next.input_tokens >= 0.0);
            prop_assert!((0.0..=1.0).contains(&next.cache_hit_rate));
            let mut steady = Predictor::new(kind, &PredictorSettings::default());
            for _ in 0..20 {
                steady.observe(&Load { request_rate: values[0], input_tokens: 5.0, output_tokens: 5.0, cache_hit_rate: hit });
            }
            prop_assert!((steady.predict().unwrap().request_rate - values[0]).abs() < 1e-6 * values[0].max(1.0));
        }
    }
}
