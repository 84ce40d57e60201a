//! The decode side's cost of a KV import: each chunk is planned between the two layouts
//! (through the worker's one staging area) and its transfer charged on a simulated link that
//! moves chunks one after another.

use switchyard_engine_sim::KvLayout;
use tokio::sync::oneshot;
use tokio::time::Instant;

use std::time::Duration;

use super::{Command, SimEngine};
use crate::engine::{EngineError, HeldBlock, KvImport};

/// Link time owed below this is carried over rather than slept one chunk at a time.
const TIMER_SLACK: Duration = Duration::from_millis(2);

/// How a decode worker's imports are costed: the prefill side's layout, this side's, and
/// whether fragments are coalesced through a staging area of `staging_bytes`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferSetup {
    pub source: KvLayout,
    pub dest: KvLayout,
    pub coalesce: bool,
    pub staging_bytes: u64,
}

impl Default for TransferSetup {
    fn default() -> Self {
        Self {
            source: KvLayout::default(),
            dest: KvLayout::default(),
            coalesce: true,
            staging_bytes: 8 << 20,
        }
    }
}

impl SimEngine {
    /// Charges one chunk's transfer on the import's link, then places its blocks.
    pub(super) async fn import_chunk(
        &self,
        import: &mut KvImport,
        blocks: Vec<HeldBlock>,
    ) -> Result<usize, EngineError> {
        if import.stopped || blocks.is_empty() {
            return Ok(0);
        }
        // The transfer is charged here, outside the runner: a KV copy between workers is DMA
        // that overlaps the engine's steps, so it delays this request only, not the batch.
        let plan = {
            let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            staging.plan(
                &self.transfer.source,
                &self.transfer.dest,
                self.spec.block_size.get(),
                blocks.len() as u32,
            )
        };
        let descriptors = if self.transfer.coalesce {
            plan.descriptors
        } else {
            plan.raw_descriptors
        };
        let transfer = self
            .timing
            .transfer_time(plan.bytes, descriptors)
            .div_f64(self.speedup);
        let now = Instant::now();
        let done = import.link_free_at.map_or(now, |t| t.max(now)) + transfer;
        import.link_free_at = Some(done);
        // Timers fire on a millisecond wheel: sleeping out each sub-millisecond chunk would add
        // up to a tick per chunk (16 ticks for an 8k prompt). A short debt stays on the link
        // clock instead and is paid with a later chunk or by `KvImport::settle`.
        if done.saturating_duration_since(now) >= TIMER_SLACK {
            tokio::time::sleep_until(done).await;
        }
        import.stats.add(plan);
        let offered = blocks.len();
        let parent = blocks.last().map(|b| b.hash);
        let (reply, reply_rx) = oneshot::channel();
        self.send(Command::Import {
            hold: import.hold,
            parent: import.parent,
            blocks: blocks.into_iter().map(|b| (b.hash, b.tokens)).collect(),
            reply,
        })?;
        let placed = reply_rx.await.map_err(|_| EngineError::Stopped)?;
        import.imported += placed;
        import.parent = parent;
        import.stopped = placed < offered;
        Ok(placed)
    }
}
