//! The decode side's KV transfer settings (`[kv_transfer]`) and the layouts they imply.

use serde::Deserialize;
use switchyard_engine_sim::KvLayout;

use crate::engine::sim::TransferSetup;

/// KV transfer planning on the decode side (`[kv_transfer]`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvTransferConfig {
    /// Tensor-parallel degree assumed for prefill workers that do not announce their KV layout
    /// (workers older than the announcement). Sources that announce it are planned from what
    /// they say, whatever this is. Default: this worker's own, so blocks move as contiguous
    /// regions.
    pub prefill_tensor_parallel: Option<u32>,
    /// Coalesce small strided fragments through the staging area into few descriptors.
    pub coalesce: bool,
    /// Size of the staging area, reused across chunks and requests.
    pub staging_bytes: u64,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        Self {
            prefill_tensor_parallel: None,
            coalesce: true,
            staging_bytes: 8 << 20,
        }
    }
}

impl KvTransferConfig {
    /// The layouts on both sides of a pull into a worker whose own layout is `own`, and how
    /// fragments are coalesced.
    pub fn setup(&self, own: KvLayout) -> TransferSetup {
        let source_tp = self.prefill_tensor_parallel.unwrap_or(own.tensor_parallel);
        TransferSetup {
            source: KvLayout {
                tensor_parallel: source_tp,
                ..own
            },
            dest: own,
            coalesce: self.coalesce,
            staging_bytes: self.staging_bytes,
        }
    }
}
