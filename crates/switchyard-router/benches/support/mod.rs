//! Synthetic indexes shared by the benches.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use switchyard_core::{BlockHash, BlockSize, SnapshotBlock, StorageTier, WorkerId};
use switchyard_router::{IndexConfig, PrefixIndex};

pub const BLOCK_SIZE: u32 = 16;

/// SplitMix64: deterministic data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

pub fn workers(n: usize) -> Vec<WorkerId> {
    (0..n)
        .map(|i| WorkerId::new(format!("worker-{i:04}")).unwrap())
        .collect()
}

pub fn config(max_entries: usize) -> IndexConfig {
    let mut c = IndexConfig::new(BlockSize::new(BLOCK_SIZE).unwrap());
    c.max_entries = max_entries;
    c.verify_hashes = false;
    c
}

/// An index with `entries` (block, worker) pairs over `n_workers` workers.
///
/// - The query prompt is a chain of `prompt_len` blocks; `holders` workers hold prefixes of it
///   of lengths `prompt_len · (i+1) / holders` (so one holds all of it).
/// - Every worker then holds filler blocks up to its share of `entries`: 70% its own, 30% drawn
///   from a pool of blocks shared by all workers (see `build_shared`) (common system prompts), so both the inline
///   and the shared holder representations are exercised.
pub fn build(
    n_workers: usize,
    entries: usize,
    prompt_len: usize,
    holders: usize,
) -> (PrefixIndex, Vec<WorkerId>, Vec<BlockHash>) {
    build_shared(n_workers, entries, prompt_len, holders, 3, false)
}

/// [`build`] with `shared_tenths` tenths of the filler drawn from the shared pool, and a choice
/// of verifying later `Stored` events (snapshots carry no tokens to verify).
pub fn build_shared(
    n_workers: usize,
    entries: usize,
    prompt_len: usize,
    holders: usize,
    shared_tenths: u64,
    verify_hashes: bool,
) -> (PrefixIndex, Vec<WorkerId>, Vec<BlockHash>) {
    let mut rng = Rng(0x5eed ^ n_workers as u64);
    let ids = workers(n_workers);
    let prompt: Vec<BlockHash> = (0..prompt_len).map(|_| BlockHash(rng.next())).collect();
    let shared: Vec<BlockHash> = (0..(entries / 20).max(1))
        .map(|_| BlockHash(rng.next()))
        .collect();
    let mut cfg = config(usize::MAX);
    cfg.verify_hashes = verify_hashes;
    let mut index = PrefixIndex::new(cfg);
    let holders = holders.min(n_workers);
    let prompt_entries: usize = (0..holders).map(|i| prompt_len * (i + 1) / holders).sum();
    let per_worker = entries.saturating_sub(prompt_entries) / n_workers;
    let mut blocks: Vec<SnapshotBlock> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        blocks.clear();
        if i < holders {
            let len = prompt_len * (i + 1) / holders;
            blocks.extend(SnapshotBlock::chain(&prompt[..len], StorageTier::Device));
        }
        let mut seen = std::collections::HashSet::new();
        while blocks.len()
            < per_worker
                + if i < holders {
                    prompt_len * (i + 1) / holders
                } else {
                    0
                }
        {
            let hash = if rng.below(10) < shared_tenths {
                shared[rng.below(shared.len() as u64) as usize]
            } else {
                BlockHash(rng.next())
            };
            if seen.insert(hash) {
                blocks.push(SnapshotBlock {
                    hash,
                    parent: None,
                    tier: StorageTier::Device,
                });
            }
        }
        index.apply_snapshot(id, 1, 0, &blocks).unwrap();
    }
    (index, ids, prompt)
}

/// Resident set size of this process in bytes (Linux), for memory deltas.
pub fn rss_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
