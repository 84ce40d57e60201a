//! Synthetic gateway state shared by the benches: a `WorkerPool` whose model index holds
//! ~100k blocks, and prompts of a given token length.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::{
    BlockHash, BlockSize, EngineKind, Role, SnapshotBlock, StorageTier, TokenId, WorkerId,
    WorkerInfo, block_hashes,
};
use switchyard_gateway::cluster::pool::follow::FollowContext;
use switchyard_gateway::cluster::pool::followers::Followers;
use switchyard_gateway::cluster::pool::{ModelRoutes, WorkerPool};
use switchyard_gateway::observe::Observers;
use switchyard_gateway::observe::metrics::Metrics;
use switchyard_router::{PolicyConfig, PolicyKind};

pub const BLOCK_SIZE: u32 = 16;
pub const MODEL: &str = "sim-8b";
pub const INDEX_BLOCKS: usize = 100_000;

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
}

pub fn prompt_tokens(len: usize, seed: u64) -> Vec<TokenId> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|_| (rng.next() % 100_000) as TokenId)
        .collect()
}

/// A bench's pool, with its observers and followers; it reads like the pool (it derefs to it).
pub struct Pool {
    pub pool: Arc<WorkerPool>,
    pub observers: Observers,
    pub followers: Followers,
}

impl std::ops::Deref for Pool {
    type Target = Arc<WorkerPool>;
    fn deref(&self) -> &Arc<WorkerPool> {
        &self.pool
    }
}

/// A pool with `workers` workers of one model and an empty index, without a network: it must
/// be built inside an entered tokio runtime that is never driven, so the per-worker subscriber
/// tasks never run and the index holds exactly what the bench puts there. Workers are `sim-0`…
pub fn empty_pool(workers: usize) -> (Pool, Arc<ModelRoutes>, Vec<WorkerId>) {
    let block_size = BlockSize::new(BLOCK_SIZE).unwrap();
    let pool = Arc::new(WorkerPool::new(PolicyKind::Kv, PolicyConfig::default()).unwrap());
    let observers = Observers::in_memory(1024, Arc::new(Metrics::new()), pool.epoch());
    let followers = Followers::new(
        Arc::clone(&pool),
        Arc::new(FollowContext::new(&observers, 1000)),
    );
    let ids: Vec<WorkerId> = (0..workers)
        .map(|i| WorkerId::new(format!("sim-{i}")).unwrap())
        .collect();
    for id in &ids {
        followers.upsert_worker(WorkerInfo {
            id: id.clone(),
            // Never dialled: the runtime that would run the subscribers is not driven.
            address: "127.0.0.1:9".to_owned(),
            model: MODEL.to_owned(),
            role: Role::Both,
            block_size,
            kv_capacity_blocks: 1 << 20,
            max_context_tokens: 1 << 20,
            engine: EngineKind::Sim,
            incarnation: 1,
            adapters: Vec::new(),
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        });
    }
    let routes = pool.model(MODEL).unwrap();
    let pool = Pool {
        pool,
        observers,
        followers,
    };
    (pool, routes, ids)
}

/// [`empty_pool`] whose index holds ~`INDEX_BLOCKS` blocks: half the workers hold prefixes of
/// `prompt` (one of them all of it); every worker holds filler blocks up to `INDEX_BLOCKS` in
/// total.
pub fn pool(workers: usize, prompt: &[TokenId]) -> (Pool, Arc<ModelRoutes>) {
    pool_with_holders(workers, prompt, workers / 2)
}

/// [`pool`] with `holders` workers holding prefixes of `prompt` (at least one): half the fleet
/// is a shared system prompt, one to three an agent session's own.
pub fn pool_with_holders(
    workers: usize,
    prompt: &[TokenId],
    holders: usize,
) -> (Pool, Arc<ModelRoutes>) {
    let block_size = BlockSize::new(BLOCK_SIZE).unwrap();
    let (pool, routes, ids) = empty_pool(workers);
    let hashes = block_hashes(prompt, block_size);
    let holders = holders.clamp(1, workers);
    let per_worker = INDEX_BLOCKS / workers;
    let mut rng = Rng(0x5eed ^ workers as u64);
    {
        let mut core = routes.lock();
        for (i, id) in ids.iter().enumerate() {
            let mut blocks: Vec<SnapshotBlock> = Vec::with_capacity(per_worker);
            if i < holders {
                let len = hashes.len() * (i + 1) / holders;
                blocks.extend(SnapshotBlock::chain(&hashes[..len], StorageTier::Device));
            }
            while blocks.len() < per_worker {
                blocks.push(SnapshotBlock {
                    hash: BlockHash(rng.next()),
                    parent: None,
                    tier: StorageTier::Device,
                });
            }
            core.serving
                .index
                .apply_snapshot(id, 1, 0, &blocks)
                .unwrap();
        }
    }
    (pool, routes)
}

/// English-like text of about `tokens` cl100k tokens (words from a fixed list, punctuation,
/// numbers), deterministic.
pub fn text_of(tokens: usize, seed: u64) -> String {
    const WORDS: &[&str] = &[
        "the",
        "gateway",
        "routes",
        "requests",
        "to",
        "workers",
        "that",
        "hold",
        "cached",
        "prefix",
        "blocks",
        "of",
        "a",
        "prompt",
        "and",
        "streams",
        "tokens",
        "back",
        "while",
        "tokenizer",
        "turns",
        "text",
        "into",
        "ids",
        "latency",
        "throughput",
        "scheduler",
        "kubernetes",
        "inference",
        "model",
        "attention",
        "decode",
        "prefill",
        "memory",
        "bandwidth",
        "is",
        "limited",
        "by",
        "when",
        "under",
        "load",
        "with",
        "many",
        "users",
        "sharing",
        "system",
        "prompts",
        "across",
        "sessions",
    ];
    let mut rng = Rng(seed);
    let mut out = String::with_capacity(tokens * 6);
    // ~1.15 cl100k tokens per word with this list and punctuation.
    let words = tokens * 87 / 100;
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        let r = rng.next();
        out.push_str(WORDS[(r % WORDS.len() as u64) as usize]);
        match (r >> 32) % 29 {
            0 => out.push('.'),
            1 => out.push(','),
            2 => {
                out.push(' ');
                out.push_str(&((r >> 40) % 10_000).to_string());
            }
            _ => {}
        }
    }
    out
}

/// CPU time this thread has run, from the scheduler's account (nanoseconds, the first field of
/// `/proc/thread-self/schedstat`); zero where there is none. On a machine shared with other
/// work it says what the code cost where the wall clock also counts the neighbours.
pub fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// Times this thread has been scheduled in (`/proc/thread-self/schedstat`, third field): a
/// change across a timed call means the call was preempted, which on a shared machine says more
/// about the neighbours than about the code.
pub fn slices() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(0)
}
