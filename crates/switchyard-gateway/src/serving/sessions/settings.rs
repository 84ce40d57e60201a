//! `[sessions]` in the gateway's configuration and its flags.

use serde::Deserialize;

/// Longest `idle_seconds` accepted: a day.
const MAX_IDLE_SECONDS: f64 = 86_400.0;

/// `[sessions]` in the gateway's configuration, or the `--session-scheduling` and
/// `--session-idle-seconds` flags.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionSettings {
    /// Schedule sessions' turns as programs (see `serving::sessions`): a turn whose session's
    /// working set does not fit beside the resident sessions' waits between turns, up to its
    /// aging bound.
    pub schedule: bool,
    /// A session with no turn in flight or waiting for this many seconds has left: its working
    /// set no longer counts, and what waited behind it goes on.
    pub idle_seconds: f64,
}

impl Default for SessionSettings {
    fn default() -> Self {
        Self {
            schedule: false,
            idle_seconds: 300.0,
        }
    }
}

impl SessionSettings {
    /// A one-sentence reason the settings cannot be used.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.001..=MAX_IDLE_SECONDS).contains(&self.idle_seconds) {
            return Err(format!(
                "sessions.idle_seconds must be between 0.001 and {MAX_IDLE_SECONDS} seconds, got {}",
                self.idle_seconds
            ));
        }
        Ok(())
    }

    /// `idle_seconds` in microseconds (validated: finite and positive).
    pub fn idle_micros(&self) -> u64 {
        (self.idle_seconds.clamp(0.001, MAX_IDLE_SECONDS) * 1e6).round() as u64
    }
}

/// Flags and `SWITCHYARD_*` variables of `[sessions]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SessionArgs {
    /// Schedule sessions' (`x-session-id`) turns by their working sets: a turn that does not
    /// fit beside the resident sessions' waits between turns, up to its aging bound.
    #[arg(long = "session-scheduling", env = "SWITCHYARD_SESSION_SCHEDULING")]
    pub schedule: bool,
    /// Seconds a session may go without a turn before it has left (session scheduling).
    #[arg(long = "session-idle-seconds", env = "SWITCHYARD_SESSION_IDLE_SECONDS")]
    pub idle_seconds: Option<f64>,
}

impl SessionArgs {
    pub fn apply(&self, settings: &mut SessionSettings) {
        if self.schedule {
            settings.schedule = true;
        }
        if let Some(v) = self.idle_seconds {
            settings.idle_seconds = v;
        }
    }
}
