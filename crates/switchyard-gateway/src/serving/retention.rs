//! `[retention]`: the retention hint a session's turns carry to their worker.
//!
//! A turn of a session (`x-session-id`) asks its worker to keep its prefix cached for a while
//! after it ends, because the session's next turn (after a tool call, a user's reading) will
//! arrive on top of it. How long comes from the session's observed think times
//! ([`ThinkTimes`], the same estimator the replay uses), capped by `max_seconds`; the worker
//! honours the hint within its own retention budget, so pinned sessions never keep a new one
//! from being admitted. Requests without a session carry no hint.

use std::sync::Arc;

use parking_lot::Mutex;
use serde::Deserialize;
use switchyard_core::Retention;
use switchyard_router::serve::{RetentionConfig, ThinkTimes};
use tokio::time::Instant;

/// `[retention]` in the gateway's configuration, or the `--session-retention` and
/// `--retention-max-seconds` flags.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionSettings {
    /// Send retention hints with sessions' turns.
    pub enabled: bool,
    /// Longest hint, in seconds.
    pub max_seconds: f64,
    /// The hint of a session's turns before one of its pauses was seen, in seconds.
    pub initial_seconds: f64,
    /// The hint is this many times the session's average pause.
    pub factor: f64,
    /// Priority the hints carry (0 to 255): among pinned prefixes, a lower one goes first.
    pub priority: u8,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        let d = RetentionConfig::default();
        Self {
            enabled: false,
            max_seconds: d.cap_ms as f64 / 1e3,
            initial_seconds: d.initial_ms as f64 / 1e3,
            factor: d.factor,
            priority: d.priority,
        }
    }
}

impl RetentionSettings {
    /// The estimator's configuration; one sentence naming the setting when one is wrong.
    pub fn estimator(&self) -> Result<RetentionConfig, String> {
        let ms = |name: &str, secs: f64| {
            if (0.001..=86_400.0).contains(&secs) {
                Ok((secs * 1e3).round() as u64)
            } else {
                Err(format!(
                    "retention.{name} must be between 0.001 and 86400 seconds, got {secs}"
                ))
            }
        };
        let config = RetentionConfig {
            cap_ms: ms("max_seconds", self.max_seconds)?,
            initial_ms: ms("initial_seconds", self.initial_seconds)?,
            factor: self.factor,
            priority: self.priority,
            ..RetentionConfig::default()
        };
        config
            .validate()
            .map_err(|e| format!("{e} ([retention])"))?;
        Ok(config)
    }
}

/// Flags and `SWITCHYARD_*` variables of `[retention]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RetentionArgs {
    /// Send retention hints with sessions' (`x-session-id`) turns, from their think times.
    #[arg(long = "session-retention", env = "SWITCHYARD_SESSION_RETENTION")]
    pub enabled: bool,
    /// Longest retention hint, in seconds.
    #[arg(
        long = "retention-max-seconds",
        env = "SWITCHYARD_RETENTION_MAX_SECONDS"
    )]
    pub max_seconds: Option<f64>,
}

impl RetentionArgs {
    pub fn apply(&self, settings: &mut RetentionSettings) {
        if self.enabled {
            settings.enabled = true;
        }
        if let Some(v) = self.max_seconds {
            settings.max_seconds = v;
        }
    }
}

/// The sessions' think times, when hints are on.
#[derive(Debug)]
pub struct SessionRetention {
    think: Option<Mutex<ThinkTimes>>,
    epoch: Instant,
}

impl SessionRetention {
    /// Hints as `settings` say (checked at start: a bad one is refused there).
    pub fn new(settings: &RetentionSettings) -> Result<Arc<Self>, String> {
        let config = settings.estimator()?;
        Ok(Arc::new(Self {
            think: settings
                .enabled
                .then(|| Mutex::new(ThinkTimes::new(config))),
            epoch: Instant::now(),
        }))
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// A turn of `session` starts: the hint it carries, and a guard that marks the turn's end
    /// when dropped (the start of the session's next pause).
    pub fn begin(self: &Arc<Self>, session: Option<&str>) -> SessionTurn {
        let (Some(think), Some(session)) = (&self.think, session) else {
            return SessionTurn::default();
        };
        let hint = think.lock().arrive(session, self.now());
        SessionTurn {
            hint,
            owner: Some((Arc::clone(self), session.to_owned())),
        }
    }
}

/// One turn of a session in flight, with the hint its requests carry.
#[derive(Debug, Default)]
pub struct SessionTurn {
    hint: Retention,
    owner: Option<(Arc<SessionRetention>, String)>,
}

impl SessionTurn {
    /// The hint (asking for nothing without a session or with hints off).
    pub fn hint(&self) -> Retention {
        self.hint
    }
}

impl Drop for SessionTurn {
    fn drop(&mut self) {
        if let Some((owner, session)) = self.owner.take()
            && let Some(think) = &owner.think
        {
            think.lock().finished(&session, owner.now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> RetentionSettings {
        RetentionSettings {
            enabled: true,
            ..RetentionSettings::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_sessions_turns_carry_hints_from_its_pauses_within_the_cap() {
        let retention = SessionRetention::new(&RetentionSettings {
            max_seconds: 30.0,
            ..on()
        })
        .unwrap();
        // Before any pause: the initial guess (60 s), capped at 30 s.
        let turn = retention.begin(Some("s"));
        assert_eq!(turn.hint().ttl_ms, 30_000);
        assert_eq!(turn.hint().priority, 1);
        drop(turn);
        // A 5 s pause: twice that.
        tokio::time::advance(std::time::Duration::from_secs(5)).await;
        let turn = retention.begin(Some("s"));
        assert_eq!(turn.hint().ttl_ms, 10_000);
        // No session, no hint.
        assert!(!retention.begin(None).hint().is_some());
    }

    #[test]
    fn the_retention_table_is_read_and_checked_with_the_gateways_configuration() {
        let config: crate::GatewayConfig = toml::from_str(
            "[retention]\nenabled = true\nmax_seconds = 90.0\ninitial_seconds = 10.0\n\
             factor = 3.0\npriority = 7",
        )
        .unwrap();
        let estimator = config.retention.estimator().unwrap();
        assert!(config.retention.enabled);
        assert_eq!((estimator.cap_ms, estimator.initial_ms), (90_000, 10_000));
        assert_eq!((estimator.factor, estimator.priority), (3.0, 7));
        assert!(toml::from_str::<crate::GatewayConfig>("[retention]\nttl = 5").is_err());
        let bad: crate::GatewayConfig = toml::from_str("[retention]\nmax_seconds = 0.0").unwrap();
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("retention.max_seconds"), "{err}");
    }

    #[test]
    fn hints_off_send_nothing() {
        let retention = SessionRetention::new(&RetentionSettings::default()).unwrap();
        assert!(!retention.begin(Some("s")).hint().is_some());
    }

    #[test]
    fn bad_settings_name_the_key() {
        for (bad, key) in [
            (
                RetentionSettings {
                    max_seconds: 0.0,
                    ..on()
                },
                "retention.max_seconds",
            ),
            (
                RetentionSettings {
                    initial_seconds: f64::NAN,
                    ..on()
                },
                "retention.initial_seconds",
            ),
            (
                RetentionSettings {
                    factor: -1.0,
                    ..on()
                },
                "factor",
            ),
        ] {
            let err = SessionRetention::new(&bad).unwrap_err();
            assert!(err.contains(key), "{err}");
        }
    }
}
