//! The metrics of the tenant quotas ([`crate::access::quota`]), part of the gateway's
//! `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LimitLabels {
    pub(crate) limit: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StoreErrorLabels {
    /// `fail_open` or `fail_closed`: what the request got.
    pub(crate) outcome: &'static str,
}

/// The quota series of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct QuotaMetrics {
    pub(crate) refused: Family<LimitLabels, Counter>,
    pub(crate) store_errors: Family<StoreErrorLabels, Counter>,
}

impl QuotaMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "quota_refused",
            "Requests refused (429) for a tenant quota, by limit",
            self.refused.clone(),
        );
        registry.register(
            "quota_store_errors",
            "Requests the quota store could not answer for in time, by what they got",
            self.store_errors.clone(),
        );
    }
}
