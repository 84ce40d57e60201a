//! Routing overhead through the gateway's own `routing::route` (block hashing, candidates, the
//! KV policy over a ~100k-block index, load bookkeeping, decision log, metrics) and tokenization
//! of 1k/8k/32k-token prompts. Means only; `--bench latency` prints p50/p99.
//!
//! `cargo bench -p switchyard-gateway --bench routing`
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use switchyard_core::KvIdentity;
use switchyard_gateway::serving::routing;
use switchyard_router::serve::DecodeFilter;
use switchyard_tokenize::ModelDir;

fn routing_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let mut group = c.benchmark_group("route");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(30);
    for workers in [4usize, 16, 64] {
        for tokens in [1024usize, 8192, 32768] {
            let prompt = support::prompt_tokens(tokens, 7);
            let (pool, routes) = support::pool(workers, &prompt);
            group.throughput(Throughput::Elements(tokens as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("{workers}w"), tokens),
                &prompt,
                |b, prompt| {
                    b.iter(|| {
                        // Hashing the prompt is part of routing's cost, as dispatch pays it per attempt.
                        let request = routing::route_request(
                            &pool,
                            &routes,
                            black_box(prompt),
                            &KvIdentity::PLAIN,
                            None,
                        );
                        let tags = std::sync::Arc::new(
                            switchyard_gateway::observe::audit::RequestTags::new("b"),
                        );
                        routing::route(
                            &pool,
                            &pool.observers,
                            &routes,
                            routing::DecodeAsk::first(&request, 4, DecodeFilter::default(), &tags),
                        )
                        .unwrap()
                    })
                },
            );
        }
    }
    group.finish();
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

fn tokenization(c: &mut Criterion) {
    let mut models = vec![("cl100k", ModelDir::builtin())];
    if let Some(dir) = qwen3_dir() {
        models.push(("qwen3", ModelDir::load(&dir).unwrap()));
    }
    let mut group = c.benchmark_group("tokenize");
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    group.sample_size(10);
    for tokens in [1024usize, 8192, 32768] {
        let text = support::text_of(tokens, 11);
        for (name, model) in &models {
            group.throughput(Throughput::Elements(tokens as u64));
            group.bench_with_input(BenchmarkId::new(*name, tokens), &text, |b, text| {
                b.iter(|| model.tokenizer().encode(black_box(text)).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, routing_overhead, tokenization);
criterion_main!(benches);
