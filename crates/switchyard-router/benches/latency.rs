//! Overlap query percentiles, bytes per indexed pair, and a Mooncake trace replay.
//!
//! Criterion reports means; the targets are about p99 and memory, so this bench measures each
//! query on its own and prints a table.
//!
//! `cargo bench -p switchyard-router --bench latency`
//! (`-- quick` skips the 10M-pair memory point and the trace replay)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeSet, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use support::BLOCK_SIZE;
use switchyard_core::{BlockHash, KvEvent, StorageTier, StoredBlock, WorkerId};
use switchyard_router::{IndexConfig, PrefixIndex};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn query_percentiles(
    index: &PrefixIndex,
    prompt: &[BlockHash],
    iters: usize,
) -> (Duration, Duration) {
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters / 10 {
        black_box(index.overlap(black_box(prompt)));
    }
    for _ in 0..iters {
        let t = Instant::now();
        black_box(index.overlap(black_box(prompt)));
        samples.push(t.elapsed());
    }
    samples.sort_unstable();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    if let [_, mode, entries, shared] = &std::env::args().collect::<Vec<_>>()[..]
        && mode == "memory-point"
    {
        memory_point(entries.parse().unwrap(), shared.parse().unwrap());
        return;
    }
    println!("## bytes per (block, worker) pair (64 workers; each point in a fresh process)");
    println!(
        "| pairs | filler shared between workers | capacity-based heap bytes/pair | RSS delta bytes/pair |"
    );
    println!("|---|---|---|---|");
    let sizes: &[usize] = if quick {
        &[1 << 20]
    } else {
        &[1 << 20, 10 << 20]
    };
    for &entries in sizes {
        for shared in [0u64, 3] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["memory-point", &entries.to_string(), &shared.to_string()])
                .output()
                .unwrap();
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
    }
    println!();
    println!(
        "## overlap query latency (1M (block, worker) pairs; 32 workers hold prefixes of the prompt)"
    );
    println!("| workers | prompt blocks (tokens @16) | p50 µs | p99 µs |");
    println!("|---|---|---|---|");
    let mut admin = Vec::new();
    for workers in [8usize, 64, 512] {
        let (index, _, prompt) = support::build(workers, 1 << 20, 8192, 32);
        admin.push((workers, admin_stats(&index)));
        for blocks in [64usize, 128, 1024, 8192] {
            let iters = if blocks >= 8192 { 2_000 } else { 20_000 };
            let (p50, p99) = query_percentiles(&index, &prompt[..blocks], iters);
            println!(
                "| {workers} | {blocks} ({}) | {:.2} | {:.2} |",
                blocks * BLOCK_SIZE as usize,
                p50.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6
            );
        }
    }

    println!();
    println!("## `/admin/index` statistics (1M pairs; median of 5)");
    println!(
        "| workers | copy, under the model's lock (ms) | distinct count, off the lock (ms) | distinct blocks |"
    );
    println!("|---|---|---|---|");
    for (workers, (copy, count, blocks)) in admin {
        println!(
            "| {workers} | {:.1} | {:.1} | {blocks} |",
            copy.as_secs_f64() * 1e3,
            count.as_secs_f64() * 1e3
        );
    }

    if !quick {
        mooncake();
    }
}

/// Times the statistics' two halves: the copy the admin API takes under the model's lock and
/// the distinct count it makes afterwards (median of five each), and the count.
fn admin_stats(index: &PrefixIndex) -> (Duration, Duration, usize) {
    let mut copy = Vec::new();
    let mut count = Vec::new();
    let mut blocks = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let draft = black_box(index.stats_draft());
        copy.push(t.elapsed());
        let t = Instant::now();
        blocks = black_box(draft.finish()).blocks;
        count.push(t.elapsed());
    }
    copy.sort_unstable();
    count.sort_unstable();
    (copy[2], count[2], blocks)
}

/// A worker's cache in the replay: block -> last use, and (last use, block) in order.
type Lru = (HashMap<u64, u64>, BTreeSet<(u64, u64)>);

/// Builds one index in this (fresh) process and prints its table row.
fn memory_point(entries: usize, shared_tenths: u64) {
    let before = support::rss_bytes().unwrap_or(0);
    let (index, _, _) = support::build_shared(64, entries, 128, 8, shared_tenths, false);
    let after = support::rss_bytes().unwrap_or(0);
    let stats = index.stats();
    println!(
        "| {} | {}% | {:.1} | {:.1} |",
        stats.entries,
        shared_tenths * 10,
        stats.heap_bytes as f64 / stats.entries as f64,
        after.saturating_sub(before) as f64 / stats.entries as f64
    );
}

/// Replays the Mooncake conversation trace through the index: each request's overlap is queried
/// over 16 workers, the request goes to the worker with the longest prefix (ties: fewest
/// blocks), its blocks are stored there, and each worker evicts least-recently-used blocks past
/// a fixed capacity, publishing Removed events.
fn mooncake() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/traces/mooncake/conversation_trace.jsonl"
    );
    let Ok(text) = std::fs::read_to_string(path) else {
        println!("\n(mooncake trace not found at {path}; skipped)");
        return;
    };
    let requests: Vec<Vec<u64>> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                .unwrap_or_default()
        })
        .collect();
    const WORKERS: usize = 16;
    // Blocks of 512 tokens per worker; MOONCAKE_CAPACITY overrides it.
    let capacity: usize = std::env::var("MOONCAKE_CAPACITY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let ids: Vec<WorkerId> = support::workers(WORKERS);
    let mut cfg = IndexConfig::new(switchyard_core::BlockSize::new(512).unwrap());
    cfg.verify_hashes = false;
    let mut index = PrefixIndex::new(cfg);
    // Per-worker LRU: hash -> last use, and (last use, hash) ordered.
    let mut lru: Vec<Lru> = (0..WORKERS).map(|_| Lru::default()).collect();
    let mut seqs = [0u64; WORKERS];
    let mut query_times = Vec::with_capacity(requests.len());
    let mut block_ops = 0u64;
    let mut hit_blocks = 0u64;
    let mut total_blocks = 0u64;
    let to_hash = |id: u64| BlockHash(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5157);
    let dummy = vec![0u32; 512];
    let start = Instant::now();
    let mut index_time = Duration::ZERO;
    for (tick, hash_ids) in requests.iter().enumerate() {
        let prompt: Vec<BlockHash> = hash_ids.iter().map(|&h| to_hash(h)).collect();
        let t = Instant::now();
        let scores = index.overlap(&prompt);
        let q = t.elapsed();
        query_times.push(q);
        index_time += q;
        let (best, overlap) = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (i, index.worker_key(id).map_or(0, |k| scores.get(k).device)))
            .max_by_key(|&(i, o)| (o, std::cmp::Reverse(lru[i].0.len())))
            .unwrap();
        hit_blocks += u64::from(overlap);
        total_blocks += prompt.len() as u64;
        let (map, order) = &mut lru[best];
        let mut new_blocks = Vec::new();
        for &h in hash_ids {
            if let Some(old) = map.insert(h, tick as u64) {
                order.remove(&(old, h));
            } else {
                new_blocks.push(h);
            }
            order.insert((tick as u64, h));
        }
        let mut evicted = Vec::new();
        while map.len() > capacity {
            let (_, h) = order.pop_first().unwrap();
            map.remove(&h);
            evicted.push(to_hash(h));
        }
        if !new_blocks.is_empty() {
            let ev = KvEvent::Stored {
                parent: None,
                blocks: new_blocks
                    .iter()
                    .map(|&h| StoredBlock {
                        hash: to_hash(h),
                        tokens: dummy.clone(),
                    })
                    .collect(),
                tier: StorageTier::Device,
            };
            block_ops += new_blocks.len() as u64;
            let t_apply = Instant::now();
            assert_eq!(
                index.apply(&ids[best], 1, seqs[best], &ev).unwrap(),
                switchyard_router::ApplyOutcome::Applied
            );
            index_time += t_apply.elapsed();
            seqs[best] += 1;
        }
        if !evicted.is_empty() {
            block_ops += evicted.len() as u64;
            let ev = KvEvent::Removed {
                blocks: evicted,
                tier: StorageTier::Device,
            };
            let t_apply = Instant::now();
            assert_eq!(
                index.apply(&ids[best], 1, seqs[best], &ev).unwrap(),
                switchyard_router::ApplyOutcome::Applied
            );
            index_time += t_apply.elapsed();
            seqs[best] += 1;
        }
    }
    let wall = start.elapsed();
    query_times.sort_unstable();
    let ops = block_ops + requests.len() as u64;
    println!();
    println!(
        "## mooncake conversation trace replay (block size 512, {WORKERS} workers, {capacity} blocks each, longest-prefix routing)"
    );
    println!(
        "| requests | block ops | index time s | ops/s (block ops + queries, index time) | query p50 µs | query p99 µs | prefix hit rate |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {block_ops} | {:.3} | {:.2}M | {:.2} | {:.2} | {:.1}% |",
        requests.len(),
        index_time.as_secs_f64(),
        ops as f64 / index_time.as_secs_f64() / 1e6,
        percentile(&query_times, 0.5).as_secs_f64() * 1e6,
        percentile(&query_times, 0.99).as_secs_f64() * 1e6,
        100.0 * hit_blocks as f64 / total_blocks.max(1) as f64,
    );
    println!(
        "(whole replay including the bench's own LRU bookkeeping: {:.3} s)",
        wall.as_secs_f64()
    );
}
