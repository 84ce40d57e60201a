//! Auditing the router: every decision findable by request and session, each prediction
//! checked against what the engine really reused, each worker's index checked against the
//! worker's own view of its cache.
//!
//! - [`decisions`]: the decision log — a bounded ring of [`DecisionEntry`]s (what was decided,
//!   for which request, session and tenant, and what then happened) and its query.
//! - [`disk`]: the optional JSON Lines copy of finished decisions, rotated under a size cap,
//!   which queries read past the ring.
//! - [`realized`]: predicted against realized prefix hits, the metrics over them and the likely
//!   cause of a decision whose hit fell far short.
//! - [`kv`]: per worker, whether its KV events arrive and agree with its own view (digests,
//!   identity), reported at once in metrics, logs, `/admin/workers` and `/ready`.
//! - [`counterfactual`]: what another policy would have chosen for a logged decision.
//! - [`metrics`]: the series the above export.

pub mod counterfactual;
pub mod decisions;
pub mod disk;
pub mod flag;
pub mod kv;
pub mod metrics;
pub mod realized;
pub mod tags;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use decisions::{DecisionEntry, DecisionLog, DecisionQuery, Outcome, OutcomeStatus};
pub use kv::KvAudit;
pub use metrics::AuditMetrics;
pub use tags::{MAX_REQUEST_ID_LEN, RequestTags, check_request_id};

/// Settings of the audit (the `[audit]` table of the gateway's configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Also write each finished decision as one JSON line to this file; it is rotated to
    /// `<path>.1` when it reaches half of `decision_log_max_bytes`, so the two files together
    /// stay under that cap. Queries read it past the in-memory ring.
    pub decision_log_path: Option<PathBuf>,
    /// Cap on the decision log's bytes on disk (current file and its one rotation together).
    pub decision_log_max_bytes: u64,
    /// How often each worker sends a digest of its blocks to compare with the index, in
    /// milliseconds; 0 turns the check off.
    pub digest_interval_ms: u32,
    /// A worker that served prompts with new full blocks and published no KV event for this
    /// many milliseconds is reported as silent.
    pub kv_silence_after_ms: u64,
}

pub const DEFAULT_DECISION_LOG_MAX_BYTES: u64 = 64 << 20;

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            decision_log_path: None,
            decision_log_max_bytes: DEFAULT_DECISION_LOG_MAX_BYTES,
            digest_interval_ms: 2000,
            kv_silence_after_ms: 5000,
        }
    }
}

impl AuditConfig {
    /// One sentence on what is wrong, if anything.
    pub fn validate(&self) -> Result<(), String> {
        if self.decision_log_path.is_some() && self.decision_log_max_bytes < 64 * 1024 {
            return Err(format!(
                "decision_log_max_bytes must be at least 65536 (got {}), or the log rotates on every few decisions",
                self.decision_log_max_bytes
            ));
        }
        if self.digest_interval_ms != 0 && self.digest_interval_ms < 100 {
            return Err(format!(
                "digest_interval_ms must be 0 (off) or at least 100 (got {})",
                self.digest_interval_ms
            ));
        }
        if self.kv_silence_after_ms < 500 {
            return Err(format!(
                "kv_silence_after_ms must be at least 500 (got {}), or workers are called silent between two events",
                self.kv_silence_after_ms
            ));
        }
        Ok(())
    }

    pub fn kv_silence_after(&self) -> Duration {
        Duration::from_millis(self.kv_silence_after_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_checked_for_length_and_charset() {
        assert!(check_request_id("req-1.a_b:c").is_ok());
        assert!(check_request_id(&"a".repeat(128)).is_ok());
        assert!(check_request_id("").is_err());
        assert!(
            check_request_id(&"a".repeat(129))
                .unwrap_err()
                .contains("129")
        );
        assert!(check_request_id("a b").unwrap_err().contains("' '"));
        assert!(check_request_id("é").is_err());
    }

    #[test]
    fn bad_audit_settings_are_refused_with_a_sentence() {
        assert!(AuditConfig::default().validate().is_ok());
        let bad = AuditConfig {
            digest_interval_ms: 5,
            ..AuditConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("digest_interval_ms"));
        let bad = AuditConfig {
            decision_log_path: Some("/tmp/x".into()),
            decision_log_max_bytes: 10,
            ..AuditConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .contains("decision_log_max_bytes")
        );
    }
}
