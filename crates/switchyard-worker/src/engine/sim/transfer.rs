//! The decode side's cost of a KV import: each chunk is planned between the two layouts
//! (through the worker's one staging area) and its transfer charged on a simulated link that
//! moves chunks one after another.

use std::time::Duration;

use switchyard_engine_sim::KvLayout;
use tokio::sync::oneshot;
use tokio::time::Instant;

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
            // The layout the source announced, else the configured one (a silent, older peer).
            let source = import.source_layout.unwrap_or(self.transfer.source);
            staging.plan(
                &source,
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
        // A link that became free less than a timer tick ago was busy until now as far as
        // anyone can tell (the wake-up was late, not the chunk): continuing from its own clock
        // keeps the ticks from adding up over many chunks.
        let start = match import.link_free_at {
            Some(free_at) if now.saturating_duration_since(free_at) < TIMER_SLACK => free_at,
            Some(free_at) => free_at.max(now),
            None => now,
        };
        let done = start + transfer;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use switchyard_core::{BlockSize, WorkerId, block_hashes};
    use switchyard_engine_sim::{KvLayout, SimConfig};
    use tokio::time::Instant;

    use super::TransferSetup;
    use crate::engine::sim::SimEngine;
    use crate::engine::{Engine, HeldBlock, KvImporter};

    fn engine(coalesce: bool) -> SimEngine {
        let config = SimConfig {
            block_size: BlockSize::new(16).unwrap(),
            num_device_blocks: 256,
            ..SimConfig::default()
        };
        let tp = |n| KvLayout {
            tensor_parallel: n,
            ..KvLayout::default()
        };
        let setup = TransferSetup {
            source: tp(1),
            dest: tp(2),
            coalesce,
            staging_bytes: 8 << 20,
        };
        SimEngine::start(
            WorkerId::new("w").unwrap(),
            1,
            config,
            1.0,
            131_072,
            64,
            setup,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn the_simulator_offers_kv_export_and_import_but_no_engine_transfer() {
        let engine = engine(true);
        let dyn_engine: &dyn Engine = &engine;
        assert!(dyn_engine.kv_export().is_some());
        assert!(dyn_engine.kv_import().is_some());
        assert!(dyn_engine.engine_transfer().is_none());
        let err = dyn_engine
            .kv_export()
            .unwrap()
            .pull_kv("no-such-handle")
            .await
            .unwrap_err();
        assert!(
            matches!(err, crate::engine::EngineError::HandleNotFound(_)),
            "{err}"
        );
        dyn_engine.shutdown();
    }

    fn blocks(n: u32) -> Vec<HeldBlock> {
        let prompt: Vec<u32> = (0..n * 16).collect();
        block_hashes(&prompt, BlockSize::new(16).unwrap())
            .into_iter()
            .zip(prompt.chunks(16))
            .map(|(hash, tokens)| HeldBlock {
                hash,
                tokens: tokens.to_vec(),
            })
            .collect()
    }

    async fn active_blocks(engine: &SimEngine) -> u64 {
        // The runner publishes load after each command; give it a turn.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        engine.load().active_blocks
    }

    /// Virtual time: the elapsed time is what the plan charges, to the timer's millisecond.
    #[tokio::test(start_paused = true)]
    async fn each_chunk_is_planned_charged_and_held_until_the_import_is_dropped() {
        for coalesce in [true, false] {
            let engine = engine(coalesce);
            let all = blocks(64);
            let mut import = engine.start_import().unwrap();
            let started = Instant::now();
            for chunk in all.chunks(32) {
                let placed = engine.import_kv(&mut import, chunk.to_vec()).await.unwrap();
                assert_eq!(placed, 32);
            }
            import.settle().await;
            let elapsed = started.elapsed();
            assert_eq!(import.imported, 64);
            // TP1 → TP2: 2,048 fragments of 1 KiB per block; per chunk and decode rank,
            // 32 MiB in 8 MiB staging fills.
            assert_eq!(import.stats.raw_descriptors, 64 * 2048);
            assert_eq!(import.stats.descriptors, 2 * 2 * 4);
            assert_eq!(import.stats.bytes, 64 * 16 * 131_072);
            let charged = if coalesce {
                import.stats.descriptors
            } else {
                import.stats.raw_descriptors
            };
            let per_chunk = engine
                .timing
                .transfer_time(import.stats.bytes / 2, charged / 2);
            // Timers fire on whole milliseconds, even in virtual time.
            let expected = per_chunk * 2;
            assert!(
                elapsed >= expected && elapsed <= expected + Duration::from_millis(1),
                "{elapsed:?} vs {expected:?}"
            );
            // Held while the import lives, released (still cached) when it goes.
            assert_eq!(active_blocks(&engine).await, 64);
            drop(import);
            assert_eq!(active_blocks(&engine).await, 0);
            assert_eq!(engine.load().used_blocks, 64);
            engine.shutdown();
        }
    }
}
