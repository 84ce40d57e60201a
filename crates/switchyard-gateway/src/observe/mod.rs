//! What the gateway lets operators see; nothing here changes a request's answer.
//!
//! [`metrics`] are the Prometheus metrics ([`fleet_metrics`] the replicas', [`quota_metrics`] the quotas', [`session_metrics`] session scheduling's); [`audit`] the decision log (every routing decision
//! with what then happened, predicted against realized prefix hits, the counterfactual) and
//! the check of each worker's KV events against its own view; [`recorder`] the on-demand
//! recording of the router's inputs for `switchyard replay events`. [`observers`] holds the
//! four together, made once at start and passed to whatever writes to them.

pub mod audit;
pub mod fleet_metrics;
pub mod labels;
pub mod metrics;
pub mod observers;
pub mod quota_metrics;
pub mod recorder;
pub mod session_metrics;

pub use observers::Observers;
