//! What one `(block, worker)` pair costs Switchyard's index, by how the blocks arrive: the
//! synthetic population (1M pairs over 64 workers, 16-block chains) as stored chains (as the
//! bench feeds it), as one `Stored` event per block naming its parent (a decode step at a time),
//! as snapshots naming parents, and as snapshots naming none (each block then a run of its own:
//! the run layout's worst case). Heap charged by the counting allocator while the index is built.
//!
//! ```sh
//! cargo build --release --example memory && target/release/examples/memory
//! ```

use switchyard_core::{
    BlockHash, BlockSize, KvEvent, SnapshotBlock, StorageTier, StoredBlock, WorkerId,
};
use switchyard_peer_bench::contenders::BLOCK_TOKENS;
use switchyard_peer_bench::measure::{Account, CountingAlloc};
use switchyard_peer_bench::workload::{Event, Op, Synthetic};
use switchyard_router::{IndexConfig, PrefixIndex};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn index() -> PrefixIndex {
    let bs = BlockSize::new(BLOCK_TOKENS).unwrap_or_else(|e| panic!("block size: {e}"));
    let mut cfg = IndexConfig::new(bs);
    cfg.verify_hashes = false;
    cfg.max_entries = usize::MAX;
    PrefixIndex::new(cfg)
}

fn stored(parent: Option<u64>, seqs: &[u64]) -> KvEvent {
    KvEvent::Stored {
        parent: parent.map(BlockHash),
        blocks: seqs
            .iter()
            .map(|&s| StoredBlock {
                hash: BlockHash(s),
                tokens: vec![0; BLOCK_TOKENS as usize],
            })
            .collect(),
        tier: StorageTier::Device,
    }
}

/// Each worker's chains as `(parent, blocks)`.
fn chains(events: &[Event], workers: usize) -> Vec<Vec<(Option<u64>, Vec<u64>)>> {
    let mut out = vec![Vec::new(); workers];
    for ev in events {
        if let Op::Store { parent, blocks } = &ev.op {
            out[ev.worker as usize].push((*parent, blocks.iter().map(|b| b.seq).collect()));
        }
    }
    out
}

fn measure(label: &str, pairs: usize, build: impl FnOnce(&mut PrefixIndex)) {
    let account = Account(1);
    account.reset();
    let index = account.charge(|| {
        let mut index = index();
        build(&mut index);
        index
    });
    assert_eq!(index.stats().entries, pairs, "{label}: pairs");
    println!(
        "{label}: {:.1} bytes per pair (heap_bytes estimate {:.1})",
        account.bytes() as f64 / pairs as f64,
        index.heap_bytes() as f64 / pairs as f64
    );
}

fn main() {
    let workers = 64;
    let spec = Synthetic::of(workers, 1 << 20);
    let events: Vec<Event> = spec.population().collect();
    let per_worker = chains(&events, workers);
    let ids: Vec<WorkerId> = (0..workers)
        .map(|i| WorkerId::new(format!("worker-{i:04}")).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let pairs: usize = per_worker
        .iter()
        .map(|cs| {
            let mut seen = std::collections::HashSet::new();
            cs.iter()
                .flat_map(|(_, b)| b.iter())
                .filter(|&&b| seen.insert(b))
                .count()
        })
        .sum();
    measure("stored chains", pairs, |index| {
        for (w, cs) in per_worker.iter().enumerate() {
            for (seq, (parent, blocks)) in cs.iter().enumerate() {
                let ev = stored(*parent, blocks);
                index
                    .apply(&ids[w], 1, seq as u64, &ev)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    });
    measure("one block per event, naming its parent", pairs, |index| {
        for (w, cs) in per_worker.iter().enumerate() {
            let mut seq = 0u64;
            for (parent, blocks) in cs {
                let mut prev = *parent;
                for &b in blocks {
                    let ev = stored(prev, &[b]);
                    index
                        .apply(&ids[w], 1, seq, &ev)
                        .unwrap_or_else(|e| panic!("{e}"));
                    seq += 1;
                    prev = Some(b);
                }
            }
        }
    });
    for (label, with_parents) in [
        ("snapshots naming parents", true),
        ("snapshots naming no parents", false),
    ] {
        measure(label, pairs, |index| {
            for (w, cs) in per_worker.iter().enumerate() {
                let mut snapshot: Vec<SnapshotBlock> = Vec::new();
                let mut seen = std::collections::HashSet::new();
                for (parent, blocks) in cs {
                    let mut prev = *parent;
                    for &b in blocks {
                        if seen.insert(b) {
                            snapshot.push(SnapshotBlock {
                                hash: BlockHash(b),
                                parent: if with_parents {
                                    prev.map(BlockHash)
                                } else {
                                    None
                                },
                                tier: StorageTier::Device,
                            });
                        }
                        prev = Some(b);
                    }
                }
                // Sorted by hash, as the simulator sends them: parents rarely first.
                snapshot.sort_by_key(|b| b.hash);
                index
                    .apply_snapshot(&ids[w], 1, 0, &snapshot)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        });
    }
}
