//! The metrics of the gateway replicas serving as one ([`crate::cluster::fleet`]), part of the
//! gateway's `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardLabels {
    /// `forwarded` (the owner answered), `owner_unreachable` (served here instead).
    pub outcome: &'static str,
}

/// The fleet's metrics, part of the gateway's `/metrics`.
#[derive(Debug)]
pub struct FleetMetrics {
    pub forwarded: Family<ForwardLabels, Counter>,
    /// Sending a turn to its owner until the owner's response headers arrive.
    pub forward_seconds: Histogram,
    /// Turns other replicas forwarded here.
    pub received: Counter,
    pub replicas: Gauge,
}

impl Default for FleetMetrics {
    fn default() -> Self {
        Self {
            forwarded: Family::default(),
            forward_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            received: Counter::default(),
            replicas: Gauge::default(),
        }
    }
}

impl FleetMetrics {
    pub fn register(&self, registry: &mut Registry) {
        for outcome in ["forwarded", "owner_unreachable"] {
            self.forwarded
                .get_or_create(&ForwardLabels { outcome })
                .inc_by(0);
        }
        registry.register(
            "fleet_forwarded_requests",
            "Session turns owned by another gateway replica: forwarded there, or served here because the owner could not be reached",
            self.forwarded.clone(),
        );
        registry.register(
            "fleet_forward_seconds",
            "Forwarding a turn to its owner replica until the owner's response headers arrive",
            self.forward_seconds.clone(),
        );
        registry.register(
            "fleet_received_requests",
            "Session turns other gateway replicas forwarded to this one",
            self.received.clone(),
        );
        registry.register(
            "fleet_replicas",
            "Live gateway replicas this one shares sessions with (itself included)",
            self.replicas.clone(),
        );
    }
}
