//! The decode side's KV transfer settings (`[kv_transfer]`) and the layouts they imply.

use serde::Deserialize;
use switchyard_engine_sim::KvLayout;

use crate::config::WorkerConfig;
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

impl WorkerConfig {
    /// The layouts on both sides of a pull into this worker, and how fragments are coalesced.
    pub fn transfer_setup(&self) -> TransferSetup {
        let source_tp = self
            .kv_transfer
            .prefill_tensor_parallel
            .unwrap_or(self.kv_layout.tensor_parallel);
        TransferSetup {
            source: KvLayout {
                tensor_parallel: source_tp,
                ..self.kv_layout
            },
            dest: self.kv_layout,
            coalesce: self.kv_transfer.coalesce,
            staging_bytes: self.kv_transfer.staging_bytes,
        }
    }
}
