//! The endpoint picker's routing overhead per request, as percentiles of single calls of
//! [`switchyard_epp::pick::pick`]: the body parsed, the prompt rendered (chat template) and
//! tokenized (builtin cl100k, each call a text the session cache has not seen), admission, and
//! the gateway's routing over a model with a ~100k-block index (block hashing, candidates, the
//! KV policy, booking, decision log), down to the destination with its fallbacks. The ext_proc
//! gRPC hop itself is not included. The booking is released outside the timed region.
//!
//! `cargo bench -p switchyard-epp --bench pick`
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_core::{
    BlockHash, BlockSize, EngineKind, Role, SnapshotBlock, StorageTier, TokenId, WorkerId,
    WorkerInfo, block_hashes,
};
use switchyard_epp::EppConfig;
use switchyard_epp::envoy::Headers;
use switchyard_epp::pick::{PickInput, pick};
use switchyard_gateway::GatewayConfig;
use switchyard_gateway::access::admission::Admission;
use switchyard_gateway::api::http::AppState;
use switchyard_gateway::cluster::pool::follow::FollowContext;
use switchyard_gateway::cluster::pool::followers::Followers;
use switchyard_gateway::cluster::pool::{Delivery, WorkerPool};
use switchyard_gateway::observe::Observers;
use switchyard_gateway::observe::metrics::Metrics;
use switchyard_gateway::serving::preprocess::Tokenizers;
use switchyard_router::{PolicyConfig, PolicyKind};

const MODEL: &str = "bench-model";
const BLOCK_SIZE: u32 = 16;
const INDEX_BLOCKS: usize = 100_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// English-like text of about `tokens` cl100k tokens, different for every seed.
fn text_of(tokens: usize, seed: u64) -> String {
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
        "scheduler",
        "kubernetes",
        "inference",
        "model",
        "attention",
        "decode",
        "prefill",
        "memory",
        "is",
        "limited",
        "by",
    ];
    let mut rng = Rng(seed);
    let mut out = String::with_capacity(tokens * 6);
    for i in 0..tokens * 87 / 100 {
        if i > 0 {
            out.push(' ');
        }
        let r = rng.next();
        out.push_str(WORDS[(r % WORDS.len() as u64) as usize]);
        if (r >> 32).is_multiple_of(29) {
            out.push('.');
        }
    }
    out
}

/// The picker's state with `workers` vLLM workers; half hold prefixes of `prompt` (one all of
/// it), all hold filler blocks up to `INDEX_BLOCKS`. Built inside `idle`, a runtime never driven,
/// so the workers' subscriber tasks never run and the index holds exactly what is put here.
fn state(idle: &tokio::runtime::Runtime, workers: usize, prompt: &[TokenId]) -> Arc<AppState> {
    let _guard = idle.enter();
    let config = GatewayConfig::default();
    let metrics = Arc::new(Metrics::new());
    let pool = Arc::new(
        WorkerPool::new(PolicyKind::Kv, PolicyConfig::default())
            .unwrap()
            .with_delivery(Delivery::EngineHttp),
    );
    let observers = Observers::in_memory(1024, metrics, pool.epoch());
    let followers = Followers::new(
        Arc::clone(&pool),
        Arc::new(FollowContext::new(&observers, 1000)),
    );
    let block_size = BlockSize::new(BLOCK_SIZE).unwrap();
    let ids: Vec<WorkerId> = (0..workers)
        .map(|i| WorkerId::new(format!("vllm-{i}")).unwrap())
        .collect();
    for (i, id) in ids.iter().enumerate() {
        followers.upsert_worker(WorkerInfo {
            id: id.clone(),
            address: "127.0.0.1:9".into(),
            model: MODEL.into(),
            role: Role::Both,
            block_size,
            kv_capacity_blocks: 1 << 20,
            max_context_tokens: 1 << 20,
            engine: EngineKind::Vllm,
            incarnation: 1,
            adapters: Vec::new(),
            engine_endpoint: Some(format!("10.0.0.{}:8000", i + 1)),
            kv_tiers: None,
            kv_peer: None,
        });
    }
    let routes = pool.model(MODEL).unwrap();
    let hashes = block_hashes(prompt, block_size);
    let holders = (workers / 2).max(1);
    let mut rng = Rng(0x5eed ^ workers as u64);
    {
        let mut core = routes.lock();
        for (i, id) in ids.iter().enumerate() {
            let mut blocks = Vec::with_capacity(INDEX_BLOCKS / workers);
            if i < holders {
                let len = hashes.len() * (i + 1) / holders;
                // Parents named, as engines' snapshots do (a snapshot naming none is walked).
                blocks.extend(SnapshotBlock::chain(&hashes[..len], StorageTier::Device));
            }
            while blocks.len() < INDEX_BLOCKS / workers {
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
    let tokenizers = Tokenizers::load(
        &config.tokenizer,
        &BTreeMap::new(),
        &config.session_cache.to_session_config(),
    )
    .unwrap();
    let sessions = Arc::new(switchyard_gateway::serving::sessions::SessionSchedule::new(
        &Default::default(),
        Arc::clone(&pool),
        observers.metrics.sessions.clone(),
    ));
    Arc::new(AppState {
        sessions,
        admission: Admission::new(1 << 20, 0, 0),
        quota: Default::default(),
        config,
        pool,
        tasks: followers.context().tasks.clone(),
        transport: Arc::new(switchyard_gateway::serving::transport::GrpcTransport::new(
            Arc::clone(&followers.context().connections),
        )),
        followers: Arc::new(followers),
        observers: Arc::new(observers),
        tokenizers,
        extensions: Default::default(),
        retention: switchyard_gateway::serving::retention::SessionRetention::new(
            &Default::default(),
        )
        .unwrap(),
        responses: std::sync::Arc::new(
            switchyard_gateway::api::http::responses::ResponsesState::new(
                &Default::default(),
                None,
            )
            .unwrap(),
        ),
        access: switchyard_gateway::access::listener::ClientAccess {
            api_keys: None,
            metrics_token: None,
            tls: None,
        },
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

#[derive(Clone, Copy)]
enum Shape {
    TokenIds,
    Text,
    Chat,
}

fn main() {
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let epp = EppConfig::default();
    println!(
        "## endpoint picker overhead per request (`pick::pick`, KV policy, {INDEX_BLOCKS} blocks in the index, half the workers hold prefixes of the prompt, 2 fallbacks)"
    );
    println!("| workers | body | prompt tokens | p50 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|---|");
    for workers in [4usize, 16] {
        for tokens in [1024usize, 8192] {
            let iters = if tokens == 1024 { 2000 } else { 400 };
            // Distinct texts: each call tokenizes text the session cache has not seen.
            let texts: Vec<String> = (0..iters + iters / 10)
                .map(|i| text_of(tokens, 1000 + i as u64))
                .collect();
            let ids = (0..tokens)
                .map(|i| (i as u32 * 7919) % 100_000)
                .collect::<Vec<_>>();
            let state = state(&idle, workers, &ids);
            for (shape, name) in [
                (Shape::TokenIds, "completion, token ids"),
                (Shape::Text, "completion, text"),
                (Shape::Chat, "chat"),
            ] {
                let bodies: Vec<Vec<u8>> = texts
                    .iter()
                    .map(|text| {
                        let body = match shape {
                            Shape::TokenIds => json!({"model": MODEL, "prompt": ids, "max_tokens": 64}),
                            Shape::Text => json!({"model": MODEL, "prompt": text, "max_tokens": 64}),
                            Shape::Chat => json!({"model": MODEL, "max_tokens": 64,
                                "messages": [{"role": "system", "content": "You are a coding agent."},
                                             {"role": "user", "content": text}]}),
                        };
                        body.to_string().into_bytes()
                    })
                    .collect();
                let headers = Headers::default();
                let mut samples = Vec::with_capacity(iters);
                for (i, body) in bodies.iter().enumerate() {
                    let input = PickInput {
                        headers: &headers,
                        body: Some(body),
                        subset: None,
                    };
                    let t = Instant::now();
                    let picked = rt.block_on(pick(&state, &epp, input)).unwrap();
                    let took = t.elapsed();
                    std::hint::black_box(&picked.destination);
                    drop(picked);
                    // The first tenth warms caches and allocators.
                    if i >= iters / 10 {
                        samples.push(took);
                    }
                }
                samples.sort();
                println!(
                    "| {workers} | {name} | {tokens} | {:.1} | {:.1} | {:.1} |",
                    percentile(&samples, 0.5),
                    percentile(&samples, 0.99),
                    percentile(&samples, 1.0)
                );
            }
        }
    }
}
