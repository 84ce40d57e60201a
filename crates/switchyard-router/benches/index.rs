//! Criterion benches of the prefix index: apply throughput and overlap query time.
//!
//! `cargo bench -p switchyard-router --bench index -- --warm-up-time 1 --measurement-time 2`
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use support::{BLOCK_SIZE, Rng};
use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier, StoredBlock, block_hashes};

const EVENT_BLOCKS: usize = 16;
const EVENTS: usize = 1024;

/// Stored events of 16-block chains (the first 4 blocks from a pool shared by all workers) and
/// the matching Removed events, so a batch leaves the index as it found it.
fn batch(rng: &mut Rng, verified: bool) -> Vec<(usize, KvEvent, KvEvent)> {
    let bs = BlockSize::new(BLOCK_SIZE).unwrap();
    (0..EVENTS)
        .map(|_| {
            let worker = rng.below(64) as usize;
            let shared_prefix = rng.below(256);
            let tokens: Vec<u32> = (0..EVENT_BLOCKS * BLOCK_SIZE as usize)
                .map(|i| {
                    if i < 4 * BLOCK_SIZE as usize {
                        (shared_prefix * 100_000) as u32 + i as u32
                    } else {
                        rng.next() as u32
                    }
                })
                .collect();
            let hashes: Vec<BlockHash> = if verified {
                block_hashes(&tokens, bs)
            } else {
                (0..EVENT_BLOCKS)
                    .map(|i| {
                        if i < 4 {
                            BlockHash(shared_prefix * 16 + i as u64)
                        } else {
                            BlockHash(rng.next())
                        }
                    })
                    .collect()
            };
            let stored = KvEvent::Stored {
                parent: None,
                blocks: hashes
                    .iter()
                    .zip(tokens.chunks_exact(BLOCK_SIZE as usize))
                    .map(|(&hash, t)| StoredBlock {
                        hash,
                        tokens: t.to_vec(),
                    })
                    .collect(),
                tier: StorageTier::Device,
            };
            let removed = KvEvent::Removed {
                blocks: hashes,
                tier: StorageTier::Device,
            };
            (worker, stored, removed)
        })
        .collect()
}

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    group.throughput(Throughput::Elements((2 * EVENTS * EVENT_BLOCKS) as u64));
    for verified in [false, true] {
        // Steady state: 1M pairs already indexed over 64 workers.
        let (mut index, ids, _) = support::build_shared(64, 1 << 20, 128, 8, 3, verified);
        let mut rng = Rng(42);
        let events = batch(&mut rng, verified);
        let mut seqs = vec![0u64; ids.len()];
        let name = if verified { "verified" } else { "unverified" };
        group.bench_function(BenchmarkId::new(name, "1M-pairs-64w"), |b| {
            b.iter(|| {
                for (w, stored, removed) in &events {
                    let s = seqs[*w];
                    black_box(index.apply(&ids[*w], 1, s, stored).unwrap());
                    black_box(index.apply(&ids[*w], 1, s + 1, removed).unwrap());
                    seqs[*w] = s + 2;
                }
            })
        });
    }
    group.finish();
}

fn overlap(c: &mut Criterion) {
    let mut group = c.benchmark_group("overlap");
    for workers in [8usize, 64, 512] {
        let (index, _, prompt) = support::build(workers, 1 << 20, 8192, 32);
        for blocks in [64usize, 128, 1024, 8192] {
            let q = &prompt[..blocks];
            group.bench_function(
                BenchmarkId::new(format!("1M-pairs-{workers}w"), format!("{blocks}-blocks")),
                |b| b.iter(|| black_box(index.overlap(black_box(q)))),
            );
        }
    }
    // Worst case for the walk: every one of 64 workers holds the whole 128-block prompt.
    let (index, _, prompt) = support::build(64, 1 << 20, 128, 64);
    let mut index = index;
    let stored = KvEvent::Stored {
        parent: None,
        blocks: prompt
            .iter()
            .map(|&hash| StoredBlock {
                hash,
                tokens: vec![0; BLOCK_SIZE as usize],
            })
            .collect(),
        tier: StorageTier::Device,
    };
    for id in &support::workers(64) {
        index.apply(id, 1, 0, &stored).unwrap();
    }
    group.bench_function(BenchmarkId::new("all-64w-hold-prompt", "128-blocks"), |b| {
        b.iter(|| black_box(index.overlap(black_box(&prompt))))
    });
    group.finish();
}

criterion_group!(benches, apply, overlap);
criterion_main!(benches);
