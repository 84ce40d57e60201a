//! Per-call percentiles of the two CPU steps before dispatch: routing (block hashing, timed
//! apart because the request path does it with tokenization, then `routing::route`, the
//! gateway's own path: candidates, the KV policy over a ~100k-block index, load bookkeeping,
//! decision log, metrics; tokenization excluded) and tokenization (builtin cl100k,
//! and Qwen3 when its tokenizer is in `${SWITCHYARD_TEST_MODELS:-~/.cache/switchyard/test-models}`).
//! Criterion reports means; the targets are about p99, so each call is timed on its own.
//!
//! `cargo bench -p switchyard-gateway --bench latency` (all rows),
//! `cargo bench -p switchyard-gateway --bench latency -- 64 131072` (the routing rows of that
//! many workers and prompt tokens only, for a profile), or
//! `cargo bench -p switchyard-gateway --bench latency -- threads 1000 1024`: decisions for one
//! model from 1 and 2 threads at once (decisions per second of wall clock and per second of the
//! threads' CPU time, which a machine shared with other work inflates less).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchyard_core::{KvIdentity, TokenId};
use switchyard_gateway::cluster::pool::ModelRoutes;
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

/// One routing call as the request path makes it: hashing the prompt, then routing on the
/// hashes; the routed request is released (the request's end) outside the timing. Returns the
/// time to hash and the time of both.
fn route_once(
    pool: &support::Pool,
    routes: &std::sync::Arc<ModelRoutes>,
    prompt: &[TokenId],
) -> (Duration, Duration) {
    let t = Instant::now();
    let request = routing::route_request(pool, routes, black_box(prompt), &KvIdentity::PLAIN, None);
    let hashed = t.elapsed();
    let tags = std::sync::Arc::new(switchyard_gateway::observe::audit::RequestTags::new("b"));
    let routed = routing::route(
        pool,
        &pool.observers,
        routes,
        routing::DecodeAsk::first(black_box(&request), 4, DecodeFilter::default(), &tags),
    )
    .unwrap();
    let elapsed = t.elapsed();
    drop(black_box(routed));
    (hashed, elapsed)
}

/// Decisions for one model from `threads` threads at once, `per_thread` each: decisions per
/// second of wall clock and per second of the threads' own CPU time.
fn threaded(workers: usize, tokens: usize, holders: usize, rt: &tokio::runtime::Runtime) {
    let prompt = support::prompt_tokens(tokens, 7);
    let (pool, routes) = support::pool_with_holders(workers, &prompt, holders);
    let per_thread = if workers >= 10_000 { 4_000 } else { 20_000 };
    let mut single = None;
    for threads in [1usize, 2] {
        let wall = Instant::now();
        let cpu: Duration = std::thread::scope(|s| {
            let running: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let _guard = rt.enter();
                        let start = support::thread_cpu();
                        for _ in 0..per_thread {
                            black_box(route_once(&pool, &routes, &prompt));
                        }
                        support::thread_cpu() - start
                    })
                })
                .collect();
            running.into_iter().map(|t| t.join().unwrap()).sum()
        });
        let wall = wall.elapsed().as_secs_f64();
        let decisions = (threads * per_thread) as f64;
        let per_s = decisions / wall;
        let speedup = *single.get_or_insert(per_s);
        println!(
            "| {workers} | {holders} | {tokens} | {threads} | {:.0} | {:.2}x | {:.0} | {:.1} |",
            per_s,
            per_s / speedup,
            decisions / cpu.as_secs_f64(),
            us(cpu) / decisions,
        );
    }
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

/// One routing row: `holders` of `workers` hold prefixes of a `tokens`-token prompt. `profile`:
/// a single row run for a profile, with ten times the calls.
fn routing_row((workers, tokens, holders): (usize, usize, usize), profile: bool) {
    let prompt = support::prompt_tokens(tokens, 7);
    let (pool, routes) = support::pool_with_holders(workers, &prompt, holders);
    let iters = match (tokens, workers) {
        (1024, 10_000) => 5_000,
        (1024, _) => 20_000,
        (8192, _) => 5_000,
        (32768, _) => 2_000,
        (_, 1000) => 500,
        _ => 2_000,
    };
    let iters = if profile { iters * 10 } else { iters };
    let mut both = Vec::with_capacity(iters);
    let mut hashing = Vec::with_capacity(iters);
    let mut routing = Vec::with_capacity(iters);
    let mut clean = Vec::with_capacity(iters);
    let cpu_start = support::thread_cpu();
    for i in 0..iters + iters / 10 {
        let before = support::slices();
        let (hashed, elapsed) = route_once(&pool, &routes, &prompt);
        let preempted = support::slices() != before;
        if i >= iters / 10 {
            both.push(elapsed);
            hashing.push(hashed);
            routing.push(elapsed - hashed);
            if !preempted {
                clean.push(elapsed - hashed);
            }
        }
    }
    let cpu_per_call = us(support::thread_cpu() - cpu_start) / (iters + iters / 10) as f64;
    for samples in [&mut both, &mut hashing, &mut routing, &mut clean] {
        samples.sort_unstable();
    }
    println!(
        "| {workers} | {holders} | {tokens} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}% | {:.1} | {:.1} |",
        us(percentile(&both, 0.5)),
        us(percentile(&both, 0.99)),
        us(percentile(&hashing, 0.5)),
        us(percentile(&routing, 0.5)),
        us(percentile(&routing, 0.99)),
        100.0 * (routing.len() - clean.len()) as f64 / routing.len() as f64,
        us(percentile(&clean, 0.99)),
        cpu_per_call,
    );
}

/// The throughput rows (`-- threads`): the given row, or 1,000 and 10,000 workers.
fn throughput_rows(only: Option<(usize, usize, Option<usize>)>, rt: &tokio::runtime::Runtime) {
    println!("## routing throughput, one model, decisions from several threads at once");
    println!(
        "| workers | prefix holders | prompt tokens | threads | decisions/s (wall) | vs 1 thread | decisions per CPU-second | CPU µs per decision |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let rows = only.map_or(vec![(1000, 1024, None), (10_000, 1024, None)], |row| {
        vec![row]
    });
    for (workers, tokens, holders) in rows {
        threaded(workers, tokens, holders.unwrap_or(workers / 2), rt);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads_mode = args.iter().any(|a| a == "threads");
    // `-- WORKERS TOKENS`: only that routing row, and no tokenization.
    let numbers: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let only = match numbers[..] {
        [] => None,
        [workers, tokens] => Some((workers, tokens, None)),
        [workers, tokens, holders] => Some((workers, tokens, Some(holders))),
        _ => panic!("usage: cargo bench --bench latency [-- [threads] WORKERS TOKENS [HOLDERS]]"),
    };
    // The pool's subscriber tasks are spawned on this runtime, which is never driven: the index
    // holds exactly the synthetic blocks.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();

    if threads_mode {
        throughput_rows(only, &rt);
        return;
    }
    println!(
        "## routing overhead (`routing::route`, KV policy, {} blocks in the index, half the workers hold prefixes of the prompt)",
        support::INDEX_BLOCKS
    );
    println!(
        "Each call timed in two parts: hashing the prompt's blocks (`routing::route_request`), which \
         can run with tokenization, and routing on those hashes (`routing::route`)."
    );
    println!(
        "| workers | prefix holders | prompt tokens | hash + route p50 µs | hash + route p99 µs | hash p50 µs | route p50 µs | route p99 µs | preempted calls | route p99 µs, calls not preempted | CPU µs per call |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    // 1,000: the fleet test's size (issue 17), where the per-worker part of routing shows;
    // 10,000: issue 43's fleet, with the short prompt only. Half the fleet holds the prompt's
    // prefix (a shared system prompt), and at 1,000 and 10,000 also two workers only (an agent
    // session's own prefix).
    for workers in [4usize, 16, 64, 1000, 10_000] {
        for tokens in [1024usize, 8192, 32768, 131_072] {
            let few = if workers >= 1000 && tokens == 1024 {
                vec![workers / 2, 2]
            } else {
                vec![workers / 2]
            };
            for holders in few {
                let row = (workers, tokens, holders);
                let wanted = match only {
                    Some((w, t, h)) => {
                        (w, t) == (workers, tokens) && h.unwrap_or(workers / 2) == holders
                    }
                    None => workers <= 1000 || tokens == 1024,
                };
                if wanted {
                    routing_row(row, only.is_some());
                }
            }
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
