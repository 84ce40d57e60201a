//! Per-call percentiles of the two CPU steps before dispatch: routing (block hashing, timed
//! apart because the request path does it with tokenization, then `routing::route`, the
//! gateway's own path: candidates, the KV policy over a ~100k-block index, load bookkeeping,
//! decision log, metrics; tokenization excluded) and tokenization (builtin cl100k,
//! and Qwen3 when its tokenizer is in `${SWITCHYARD_TEST_MODELS:-~/.cache/switchyard/test-models}`).
//! Criterion reports means; the targets are about p99, so each call is timed on its own.
//!
//! `cargo bench -p switchyard-gateway --bench latency` (all rows), or
//! `cargo bench -p switchyard-gateway --bench latency -- 64 131072` (the routing rows of that
//! many workers and prompt tokens only, for a profile).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchyard_core::KvIdentity;
use switchyard_gateway::serving::routing;
use switchyard_router::serve::DecodeFilter;
use switchyard_tokenize::ModelDir;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Times this thread has been scheduled in (`/proc/thread-self/schedstat`, third field): a
/// change across a timed call means the call was preempted, which on a shared machine says more
/// about the neighbours than about the code.
fn slices() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(0)
}

fn qwen3_dir() -> Option<PathBuf> {
    let base = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })?;
    let dir = base.join("qwen3");
    dir.join("tokenizer.json").exists().then_some(dir)
}

fn main() {
    // `-- WORKERS TOKENS`: only that routing row, and no tokenization.
    let numbers: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let only = match numbers[..] {
        [] => None,
        [workers, tokens] => Some((workers, tokens)),
        _ => panic!("usage: cargo bench --bench latency [-- WORKERS TOKENS]"),
    };
    // The pool's subscriber tasks are spawned on this runtime, which is never driven: the index
    // holds exactly the synthetic blocks.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();

    println!(
        "## routing overhead (`routing::route`, KV policy, {} blocks in the index, half the workers hold prefixes of the prompt)",
        support::INDEX_BLOCKS
    );
    println!(
        "Each call timed in two parts: hashing the prompt's blocks (`routing::route_request`), which \
         can run with tokenization, and routing on those hashes (`routing::route`)."
    );
    println!(
        "| workers | prompt tokens | hash + route p50 µs | hash + route p99 µs | hash p50 µs | route p50 µs | route p99 µs | preempted calls | route p99 µs, calls not preempted |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    // 1,000: the fleet test's size (issue 17), where the per-worker part of routing shows.
    for workers in [4usize, 16, 64, 1000] {
        for tokens in [1024usize, 8192, 32768, 131_072] {
            if only.is_some_and(|row| row != (workers, tokens)) {
                continue;
            }
            let prompt = support::prompt_tokens(tokens, 7);
            let (pool, routes) = support::pool(workers, &prompt);
            let iters = match (tokens, workers) {
                (1024, _) => 20_000,
                (8192, _) => 5_000,
                (32768, _) => 2_000,
                (_, 1000) => 500,
                _ => 2_000,
            };
            // A single row is for a profile: ten times the calls.
            let iters = if only.is_some() { iters * 10 } else { iters };
            let mut both = Vec::with_capacity(iters);
            let mut hashing = Vec::with_capacity(iters);
            let mut routing = Vec::with_capacity(iters);
            let mut clean = Vec::with_capacity(iters);
            for i in 0..iters + iters / 10 {
                let before = slices();
                let t = Instant::now();
                let request = routing::route_request(
                    &pool,
                    &routes,
                    black_box(&prompt),
                    &KvIdentity::PLAIN,
                    None,
                );
                let hashed = t.elapsed();
                let tags =
                    std::sync::Arc::new(switchyard_gateway::observe::audit::RequestTags::new("b"));
                let routed = routing::route(
                    &pool,
                    &pool.observers,
                    &routes,
                    routing::DecodeAsk::first(
                        black_box(&request),
                        4,
                        DecodeFilter::default(),
                        &tags,
                    ),
                )
                .unwrap();
                let elapsed = t.elapsed();
                let preempted = slices() != before;
                // Releasing the load count is the request's end, not part of its routing.
                drop(black_box(routed));
                if i >= iters / 10 {
                    both.push(elapsed);
                    hashing.push(hashed);
                    routing.push(elapsed - hashed);
                    if !preempted {
                        clean.push(elapsed - hashed);
                    }
                }
            }
            for samples in [&mut both, &mut hashing, &mut routing, &mut clean] {
                samples.sort_unstable();
            }
            println!(
                "| {workers} | {tokens} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}% | {:.1} |",
                us(percentile(&both, 0.5)),
                us(percentile(&both, 0.99)),
                us(percentile(&hashing, 0.5)),
                us(percentile(&routing, 0.5)),
                us(percentile(&routing, 0.99)),
                100.0 * (routing.len() - clean.len()) as f64 / routing.len() as f64,
                us(percentile(&clean, 0.99)),
            );
        }
    }

    if only.is_some() {
        return;
    }
    println!();
    println!("## tokenization (`Tokenizer::encode`, English-like text)");
    println!("| tokenizer | prompt tokens | p50 ms | p99 ms |");
    println!("|---|---|---|---|");
    let mut models = vec![("builtin cl100k", ModelDir::builtin())];
    match qwen3_dir() {
        Some(dir) => models.push(("qwen3 (HF tokenizer.json)", ModelDir::load(&dir).unwrap())),
        None => eprintln!("qwen3 tokenizer not found; skipping it"),
    }
    for (name, model) in &models {
        for tokens in [1024usize, 8192, 32768] {
            let text = support::text_of(tokens, 11);
            let actual = model.tokenizer().encode(&text).unwrap().len();
            let iters = match tokens {
                1024 => 300,
                8192 => 60,
                _ => 20,
            };
            let mut samples = Vec::with_capacity(iters);
            for _ in 0..iters {
                let t = Instant::now();
                black_box(model.tokenizer().encode(black_box(&text)).unwrap());
                samples.push(t.elapsed());
            }
            samples.sort_unstable();
            println!(
                "| {name} | {actual} | {:.3} | {:.3} |",
                us(percentile(&samples, 0.5)) / 1e3,
                us(percentile(&samples, 0.99)) / 1e3
            );
        }
    }
}
