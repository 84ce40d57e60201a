//! Label sets shared by the gateway's metrics and the audit's.

use prometheus_client::encoding::EncodeLabelSet;

/// One worker's series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
}
