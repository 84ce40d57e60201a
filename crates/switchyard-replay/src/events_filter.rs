//! Which recorded decisions `switchyard replay events` reports: those of one session, one
//! tenant, or both (`--session`, `--tenant`).
//!
//! The filter decides what is *counted*, not what is replayed: every recorded request is still
//! routed by every policy, so the load each policy books and the state it keeps (turns, pins,
//! predicted caches) are those of the full run, and one session's figures are exactly its rows
//! of the unfiltered replay. Dropping the other requests instead would replay workers idler
//! than they were.

use serde::Serialize;
use switchyard_router::recording::RouteRecord;

use crate::error::ReplayError;

/// The first recording version whose `route` records carry the tenant.
pub const TENANT_SINCE_VERSION: u32 = 2;

/// What a recorded decision must match to be counted; every given field must match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RouteFilter {
    /// The session the request was routed with (`x-session-id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The fairness tenant (`user:…`, `key:…`, `ip:…`, `anonymous`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl RouteFilter {
    pub fn is_empty(&self) -> bool {
        self.session.is_none() && self.tenant.is_none()
    }

    pub fn matches(&self, record: &RouteRecord) -> bool {
        let eq = |want: &Option<String>, got: &Option<String>| {
            want.as_ref().is_none_or(|want| got.as_ref() == Some(want))
        };
        eq(&self.session, &record.session) && eq(&self.tenant, &record.tenant)
    }

    /// Refuses a filter the recording cannot answer: a tenant asked of a file written before
    /// tenants were recorded would match nothing, silently.
    pub fn check_version(&self, version: u32) -> Result<(), ReplayError> {
        if self.tenant.is_some() && version < TENANT_SINCE_VERSION {
            return Err(ReplayError::InvalidConfig(format!(
                "--tenant needs a recording of version {TENANT_SINCE_VERSION} or later (this one is version {version}, which does not record tenants); --session works on it"
            )));
        }
        Ok(())
    }

    /// `session s1, tenant user:alice`, for the report.
    pub fn describe(&self) -> Option<String> {
        let parts: Vec<String> = [("session", &self.session), ("tenant", &self.tenant)]
            .into_iter()
            .filter_map(|(name, value)| value.as_ref().map(|v| format!("{name} {v}")))
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use switchyard_core::WorkerId;

    fn record(session: Option<&str>, tenant: Option<&str>) -> RouteRecord {
        let w = WorkerId::new("w").unwrap();
        RouteRecord {
            tick: 0,
            model: "m".into(),
            key: 1,
            attempt: 1,
            block_size: 16,
            prompt_tokens: 1,
            max_tokens: 1,
            session: session.map(str::to_owned),
            tenant: tenant.map(str::to_owned),
            block_hashes: Vec::new(),
            candidates: vec![w.clone()],
            policy: "kv".into(),
            chosen: w,
            cached_blocks: 0,
            prefill_pool: false,
            served: Default::default(),
            prefill: None,
        }
    }

    #[test]
    fn every_given_field_must_match() {
        let both = RouteFilter {
            session: Some("s1".into()),
            tenant: Some("user:a".into()),
        };
        assert!(both.matches(&record(Some("s1"), Some("user:a"))));
        assert!(!both.matches(&record(Some("s1"), Some("user:b"))));
        assert!(!both.matches(&record(None, Some("user:a"))));
        assert!(RouteFilter::default().matches(&record(None, None)));
        assert_eq!(
            both.describe().as_deref(),
            Some("session s1, tenant user:a")
        );
        assert!(
            both.check_version(1)
                .unwrap_err()
                .to_string()
                .contains("version 1")
        );
        assert!(both.check_version(2).is_ok());
        let session = RouteFilter {
            session: Some("s1".into()),
            tenant: None,
        };
        assert!(session.check_version(1).is_ok());
    }
}
