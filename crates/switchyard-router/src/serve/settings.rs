//! How a request uses the prefill pool: the one set of disaggregation settings and defaults the
//! gateway, the replay lab and the planner's bench share.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Whether requests use the prefill pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Disaggregation {
    /// Every request prefills on its decode worker.
    #[default]
    Off,
    /// Per request: through the prefill pool when the decode worker's uncached prompt is long
    /// enough and the pool has a worker that is not saturated; aggregated otherwise.
    Auto,
    /// Every request through the prefill pool (the gateway answers 503 when it has no worker).
    Enforce,
}

impl Disaggregation {
    pub fn as_str(self) -> &'static str {
        match self {
            Disaggregation::Off => "off",
            Disaggregation::Auto => "auto",
            Disaggregation::Enforce => "enforce",
        }
    }
}

impl FromStr for Disaggregation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "enforce" => Ok(Self::Enforce),
            _ => Err(format!(
                "unknown disaggregation mode {s:?} (off, auto or enforce)"
            )),
        }
    }
}

impl std::fmt::Display for Disaggregation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Default [`ServeSettings::min_uncached_tokens`].
pub const DEFAULT_MIN_UNCACHED_TOKENS: u64 = 2048;
/// Default [`ServeSettings::max_prefill_queue_tokens`].
pub const DEFAULT_MAX_PREFILL_QUEUE_TOKENS: u64 = 262_144;

/// The serving decision's settings (a KV recording's header carries them, so a replay serves as
/// the live gateway did; missing fields read as the defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServeSettings {
    pub disaggregation: Disaggregation,
    /// `auto` uses the prefill pool from this many uncached prompt tokens on the decode worker
    /// (what the decode worker would have to compute, not the prompt's length).
    pub min_uncached_tokens: u64,
    /// `auto` stays aggregated when the best prefill worker has more prefill tokens queued.
    pub max_prefill_queue_tokens: u64,
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self {
            disaggregation: Disaggregation::Off,
            min_uncached_tokens: DEFAULT_MIN_UNCACHED_TOKENS,
            max_prefill_queue_tokens: DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
        }
    }
}
