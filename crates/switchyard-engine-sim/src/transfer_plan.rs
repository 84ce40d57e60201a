//! Planning a KV transfer between two workers whose caches are laid out differently.
//!
//! Each rank of a tensor-parallel engine holds a block as one contiguous region laid out
//! `[layer][K|V][token][head][dim]` over the KV heads of that rank. When both sides split the
//! heads the same way, a block moves as one copy per rank. When they differ (prefill at TP=1,
//! decode at TP=2, say), each destination rank needs a head group that is a strided fragment
//! of the source region: one short run per (layer, K/V, token), thousands per block. Issuing
//! one transfer descriptor per fragment makes the per-descriptor cost dominate, so
//! [`StagingArea`] gathers small fragments bound for the same rank pair into a bounded staging
//! buffer and ships each fill as one descriptor (the scatter on arrival is a local copy).
//!
//! Blocks are pages of a paged cache: two blocks are never assumed adjacent in memory, so only
//! runs inside one block merge without staging. Pure arithmetic, no I/O: the worker charges
//! the simulated transfer from [`PlanStats`], and the planner is property-tested on its own.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// How one side of a transfer lays out its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvLayout {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16, 1 for fp8).
    pub dtype_bytes: u32,
    /// Tensor-parallel degree: the KV heads are split evenly over this many ranks.
    pub tensor_parallel: u32,
}

impl Default for KvLayout {
    /// An 8B-class model (32 layers, 8 KV heads of 128 dims, fp16) on one GPU: 128 KiB/token.
    fn default() -> Self {
        Self {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            tensor_parallel: 1,
        }
    }
}

impl KvLayout {
    /// Refuses zero sizes and a head count the tensor-parallel degree does not divide.
    pub fn validate(&self) -> Result<(), SimError> {
        let fields = [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("tensor_parallel", self.tensor_parallel),
        ];
        for (name, value) in fields {
            if value == 0 {
                return Err(SimError::InvalidConfig(format!(
                    "kv layout {name} must be at least 1"
                )));
            }
        }
        if !self.kv_heads.is_multiple_of(self.tensor_parallel) {
            return Err(SimError::InvalidConfig(format!(
                "kv layout: {} KV heads cannot be split evenly over tensor_parallel {}",
                self.kv_heads, self.tensor_parallel
            )));
        }
        Ok(())
    }

    /// KV bytes of one token over all layers, keys and values, and ranks.
    pub fn bytes_per_token(&self) -> u64 {
        u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * 2
            * u64::from(self.dtype_bytes)
    }

    fn heads_per_rank(&self) -> u64 {
        u64::from(self.kv_heads / self.tensor_parallel.max(1))
    }

    fn head_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }

    /// Whether `other` describes the same model (only the split may differ).
    pub fn same_model(&self, other: &KvLayout) -> bool {
        (self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)
            == (
                other.layers,
                other.kv_heads,
                other.head_dim,
                other.dtype_bytes,
            )
    }
}

/// A run of bytes contiguous on both sides, inside one block: the unit a copier without
/// staging issues one descriptor for. Offsets are within the block's region on each rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// Index of the block among the planned blocks.
    pub block: u32,
    pub src_rank: u32,
    pub dst_rank: u32,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// One transfer descriptor: either one large fragment sent as is, or a staging fill carrying
/// a run of small fragments of one rank pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub src_rank: u32,
    pub dst_rank: u32,
    pub bytes: u64,
    /// Whether the bytes go through the staging area (then `bytes` is at most its capacity).
    pub staged: bool,
    /// The fragments carried, as indices into [`StagingArea::fragments`]' order.
    pub fragments: Range<u64>,
}

/// What a plan moves and how many descriptors it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanStats {
    pub bytes: u64,
    /// Descriptors without coalescing: one per fragment.
    pub raw_descriptors: u64,
    /// Descriptors after coalescing through the staging area.
    pub descriptors: u64,
}

impl PlanStats {
    pub fn add(&mut self, other: PlanStats) {
        self.bytes += other.bytes;
        self.raw_descriptors += other.raw_descriptors;
        self.descriptors += other.descriptors;
    }
}

/// A fragment of the per-block pattern (the same for every block of a layout pair).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PatternFragment {
    src_rank: u32,
    dst_rank: u32,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
}

/// A bounded staging area and the planner's buffers, kept and reused across chunks and
/// requests: planning allocates only when the layouts change or a plan needs more descriptors
/// than any before it.
#[derive(Debug)]
pub struct StagingArea {
    capacity: u64,
    key: Option<(KvLayout, KvLayout, u32)>,
    /// The fragments of one block, ordered by rank pair then offset, runs merged.
    pattern: Vec<PatternFragment>,
    /// Where each rank pair's fragments start in `pattern` (and the end).
    groups: Vec<usize>,
    descriptors: Vec<Descriptor>,
}

impl StagingArea {
    /// A staging area of `capacity_bytes` (at least 1).
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes.max(1),
            key: None,
            pattern: Vec::new(),
            groups: Vec::new(),
            descriptors: Vec::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The descriptors of the last plan.
    pub fn descriptors(&self) -> &[Descriptor] {
        &self.descriptors
    }

    /// Capacity of the reused buffers, to check they stop growing.
    pub fn buffer_capacity(&self) -> (usize, usize) {
        (self.pattern.capacity(), self.descriptors.capacity())
    }

    fn prepare(&mut self, src: &KvLayout, dst: &KvLayout, block_size: u32) {
        if self.key == Some((*src, *dst, block_size)) {
            return;
        }
        self.key = Some((*src, *dst, block_size));
        self.pattern.clear();
        self.groups.clear();
        let (hs, hd) = (src.heads_per_rank(), dst.heads_per_rank());
        let head_bytes = src.head_bytes();
        let rows = u64::from(src.layers) * 2 * u64::from(block_size);
        for dst_rank in 0..dst.tensor_parallel {
            let (d_lo, d_hi) = (u64::from(dst_rank) * hd, u64::from(dst_rank + 1) * hd);
            for src_rank in 0..src.tensor_parallel {
                let (s_lo, s_hi) = (u64::from(src_rank) * hs, u64::from(src_rank + 1) * hs);
                let (lo, hi) = (s_lo.max(d_lo), s_hi.min(d_hi));
                if lo >= hi {
                    continue;
                }
                self.groups.push(self.pattern.len());
                // One row per (layer, K/V, token): the overlapping heads are contiguous in it.
                for row in 0..rows {
                    let fragment = PatternFragment {
                        src_rank,
                        dst_rank,
                        src_offset: (row * hs + lo - s_lo) * head_bytes,
                        dst_offset: (row * hd + lo - d_lo) * head_bytes,
                        len: (hi - lo) * head_bytes,
                    };
                    match self.pattern.last_mut() {
                        Some(last)
                            if last.src_rank == src_rank
                                && last.dst_rank == dst_rank
                                && last.src_offset + last.len == fragment.src_offset
                                && last.dst_offset + last.len == fragment.dst_offset =>
                        {
                            last.len += fragment.len;
                        }
                        _ => self.pattern.push(fragment),
                    }
                }
            }
        }
        self.groups.push(self.pattern.len());
    }

    /// Every raw fragment of copying `blocks` blocks, in the order descriptors index them:
    /// rank pair, then block, then offset. For tests and inspection; planning never
    /// materialises this list.
    pub fn fragments(
        &mut self,
        src: &KvLayout,
        dst: &KvLayout,
        block_size: u32,
        blocks: u32,
    ) -> Vec<Fragment> {
        self.prepare(src, dst, block_size);
        let mut out = Vec::new();
        for group in self.groups.windows(2) {
            for block in 0..blocks {
                out.extend(self.pattern[group[0]..group[1]].iter().map(|p| Fragment {
                    block,
                    src_rank: p.src_rank,
                    dst_rank: p.dst_rank,
                    src_offset: p.src_offset,
                    dst_offset: p.dst_offset,
                    len: p.len,
                }));
            }
        }
        out
    }

    /// Plans the copy of `blocks` blocks from `src` to `dst` (same model and block size) and
    /// leaves the coalesced descriptors in [`Self::descriptors`]. A fragment at least as large
    /// as the staging area goes as its own descriptor; smaller ones of one rank pair fill the
    /// staging area in order, one descriptor per fill, so no descriptor is staged over
    /// capacity and there are never more descriptors than fragments.
    pub fn plan(
        &mut self,
        src: &KvLayout,
        dst: &KvLayout,
        block_size: u32,
        blocks: u32,
    ) -> PlanStats {
        self.prepare(src, dst, block_size);
        self.descriptors.clear();
        let capacity = self.capacity;
        let mut stats = PlanStats::default();
        let mut index = 0u64;
        for g in 0..self.groups.len().saturating_sub(1) {
            let group = self.groups[g]..self.groups[g + 1];
            let mut pending: Option<Descriptor> = None;
            for _ in 0..blocks {
                for p in &self.pattern[group.clone()] {
                    stats.bytes += p.len;
                    stats.raw_descriptors += 1;
                    let here = index..index + 1;
                    index += 1;
                    if p.len >= capacity {
                        self.descriptors.extend(pending.take());
                        self.descriptors.push(Descriptor {
                            src_rank: p.src_rank,
                            dst_rank: p.dst_rank,
                            bytes: p.len,
                            staged: false,
                            fragments: here,
                        });
                        continue;
                    }
                    match pending.as_mut() {
                        Some(d) if d.bytes + p.len <= capacity => {
                            d.bytes += p.len;
                            d.fragments.end = here.end;
                        }
                        _ => {
                            self.descriptors.extend(pending.take());
                            pending = Some(Descriptor {
                                src_rank: p.src_rank,
                                dst_rank: p.dst_rank,
                                bytes: p.len,
                                staged: true,
                                fragments: here,
                            });
                        }
                    }
                }
            }
            self.descriptors.extend(pending.take());
        }
        stats.descriptors = self.descriptors.len() as u64;
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tp(n: u32) -> KvLayout {
        KvLayout {
            tensor_parallel: n,
            ..KvLayout::default()
        }
    }

    #[test]
    fn the_same_layout_moves_one_contiguous_region_per_block_and_rank() {
        let mut staging = StagingArea::new(8 << 20);
        let stats = staging.plan(&tp(1), &tp(1), 16, 10);
        assert_eq!(stats.raw_descriptors, 10);
        assert_eq!(stats.bytes, 10 * 16 * KvLayout::default().bytes_per_token());
        // 2 MiB blocks: four fit one 8 MiB staging fill.
        assert_eq!(stats.descriptors, 3);
        // A block as large as the staging area goes as it is.
        let mut small = StagingArea::new(2 << 20);
        assert_eq!(small.plan(&tp(1), &tp(1), 16, 10).descriptors, 10);
        assert!(small.descriptors().iter().all(|d| !d.staged));
        let stats = staging.plan(&tp(2), &tp(2), 16, 10);
        assert_eq!(stats.raw_descriptors, 20);
    }

    #[test]
    fn a_tensor_parallel_mismatch_fragments_and_staging_coalesces() {
        let mut staging = StagingArea::new(8 << 20);
        // TP1 → TP2: per decode rank, 32 layers × K/V × 16 tokens runs of 4 heads (1 KiB).
        let stats = staging.plan(&tp(1), &tp(2), 16, 512);
        assert_eq!(stats.raw_descriptors, 512 * 2 * 32 * 2 * 16);
        assert_eq!(stats.bytes, 512 * 16 * 131_072);
        // 512 MiB per decode rank in 8 MiB fills.
        assert_eq!(stats.descriptors, 2 * 64);
        assert!(staging.descriptors().iter().all(|d| d.bytes <= 8 << 20));
    }

    #[test]
    fn buffers_are_reused_across_plans() {
        let mut staging = StagingArea::new(1 << 20);
        staging.plan(&tp(1), &tp(2), 16, 32);
        let warm = staging.buffer_capacity();
        for _ in 0..50 {
            staging.plan(&tp(1), &tp(2), 16, 32);
            staging.plan(&tp(1), &tp(2), 16, 7);
        }
        assert_eq!(staging.buffer_capacity(), warm);
    }

    #[test]
    fn layouts_are_validated() {
        assert!(KvLayout::default().validate().is_ok());
        assert!(tp(3).validate().is_err());
        let zero = KvLayout {
            head_dim: 0,
            ..KvLayout::default()
        };
        assert!(zero.validate().is_err());
        assert_eq!(KvLayout::default().bytes_per_token(), 131_072);
    }

    fn layout_pair() -> impl Strategy<Value = (KvLayout, KvLayout)> {
        (1u32..4, 0u32..4, 1u32..6, 1u32..3, 0u32..4, 0u32..4).prop_map(
            |(layers, heads_log, head_dim, dtype, src_tp, dst_tp)| {
                let kv_heads = 1 << heads_log;
                let base = KvLayout {
                    layers,
                    kv_heads,
                    head_dim,
                    dtype_bytes: dtype,
                    tensor_parallel: 1,
                };
                let split = |t: u32| KvLayout {
                    tensor_parallel: 1 << t.min(heads_log),
                    ..base
                };
                (split(src_tp), split(dst_tp))
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn coalescing_covers_the_same_bytes_within_bounds_with_no_more_descriptors(
            (src, dst) in layout_pair(),
            block_size in 1u32..6,
            blocks in 0u32..6,
            capacity in 1u64..600,
        ) {
            let mut staging = StagingArea::new(capacity);
            let raw = staging.fragments(&src, &dst, block_size, blocks);
            let stats = staging.plan(&src, &dst, block_size, blocks);
            prop_assert_eq!(stats.raw_descriptors, raw.len() as u64);
            prop_assert!(stats.descriptors <= stats.raw_descriptors);
            let total: u64 = raw.iter().map(|f| f.len).sum();
            prop_assert_eq!(stats.bytes, total);
            prop_assert_eq!(total, u64::from(blocks) * u64::from(block_size) * src.bytes_per_token());
            // The descriptors partition the fragments, in order, each within one rank pair.
            let mut next = 0u64;
            for d in staging.descriptors() {
                prop_assert_eq!(d.fragments.start, next);
                prop_assert!(d.fragments.end > d.fragments.start);
                next = d.fragments.end;
                let carried = &raw[d.fragments.start as usize..d.fragments.end as usize];
                prop_assert_eq!(d.bytes, carried.iter().map(|f| f.len).sum::<u64>());
                prop_assert!(carried.iter().all(|f| f.src_rank == d.src_rank && f.dst_rank == d.dst_rank));
                if d.staged {
                    prop_assert!(d.bytes <= capacity);
                } else {
                    prop_assert_eq!(carried.len(), 1);
                }
            }
            prop_assert_eq!(next, raw.len() as u64);
            // Every destination byte of every block is written exactly once.
            let per_rank = u64::from(block_size) * dst.bytes_per_token() / u64::from(dst.tensor_parallel);
            for block in 0..blocks {
                for rank in 0..dst.tensor_parallel {
                    let mut runs: Vec<(u64, u64)> = raw
                        .iter()
                        .filter(|f| f.block == block && f.dst_rank == rank)
                        .map(|f| (f.dst_offset, f.len))
                        .collect();
                    runs.sort_unstable();
                    let mut at = 0;
                    for (offset, len) in runs {
                        prop_assert_eq!(offset, at);
                        at += len;
                    }
                    prop_assert_eq!(at, per_rank);
                }
            }
        }
    }
}
