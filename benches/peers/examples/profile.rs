//! One workload of the side-by-side bench for the chosen contenders only, in a process of its
//! own, for `perf record` and for A/B runs of two builds of the index.
//!
//! ```sh
//! cargo build --release --example profile
//! target/release/examples/profile load switchyard,radix_tree 3 64    # 1M pairs over 64 workers
//! target/release/examples/profile churn switchyard,radix_tree 1 64   # load, then 100 churn rounds
//! target/release/examples/profile churn switchyard 1 64 1048576 1500  # 1,500 rounds, for perf
//! target/release/examples/profile agent switchyard,radix_tree 3      # the agent-session replay
//! target/release/examples/profile mooncake switchyard 3              # the Mooncake replay
//! target/release/examples/profile mooncake-mix switchyard,radix_tree,jump,concurrent 3
//!                                   # contenders interleaved step by step, as the bench runs them
//! target/release/examples/profile floor - 3                          # hash-map insert floors
//! ```
//!
//! Arguments: workload, contenders (comma-separated name parts, as `only=` in the bench),
//! repetitions, workers (synthetic only), pairs (synthetic only), timed rounds (churn only:
//! 100, as the bench; more for `perf record`). Each line gives the contender's
//! figure as the bench computes it (time inside the index) and the thread's CPU time for the
//! whole repetition (from `/proc/thread-self/schedstat`; conversions included), which a
//! descheduled process does not inflate: on a shared machine, compare two builds by the lowest
//! CPU time of several alternated runs.
//!
//! `mooncake-mix` and `agent-mix` replay a trace as the bench does, every contender answering
//! and applying each step in turn, so each finds the caches as the others left them (the
//! bench's trace figures are these, not the ones of a replay alone: alone, an index keeps its
//! working set in cache). To compare two builds of the index, run each in its own process, in
//! turns, and compare their ratios to a Dynamo contender of the same process: two Switchyard
//! indexes in one process share code and per-thread buffers, and the one running second in a
//! step gains as much as a fifth.
//!
//! `floor` inserts 750,000 random keys (the synthetic million pairs' distinct blocks) into one
//! growing FxHash map with 24-byte values, into one presized, and into 64 maps of 16-byte
//! values filled one after the other (the layout of Dynamo's radix tree, whose per-worker
//! lookup maps the bench fills one worker at a time): the cost of one insert per block into a
//! map the size of the whole index, against maps the size of one worker's share.

use std::time::{Duration, Instant};

use switchyard_peer_bench::contenders::{self, Contender};
use switchyard_peer_bench::traces::{self, Replay};
use switchyard_peer_bench::workload::{Event, Synthetic};

/// The thread's CPU time in seconds, if the kernel tells it.
fn cpu() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(ns / 1e9)
}

fn cpu_since(start: Option<f64>) -> String {
    match (start, cpu()) {
        (Some(a), Some(b)) => format!("{:.3} s CPU", b - a),
        _ => "CPU time unknown".to_owned(),
    }
}

fn contender(name: &str, workers: usize) -> Option<Box<dyn Contender>> {
    contenders::lineup(workers, true, &[name.to_owned()])
        .into_iter()
        .next()
}

fn spec(workers: usize, pairs: usize) -> Synthetic {
    Synthetic::of(workers, pairs)
}

fn chunks(spec: &Synthetic) -> Vec<Vec<Event>> {
    let mut events = spec.population();
    let mut out = Vec::new();
    loop {
        let chunk: Vec<Event> = events.by_ref().take(1024).collect();
        if chunk.is_empty() {
            return out;
        }
        out.push(chunk);
    }
}

fn load(names: &[&str], reps: usize, workers: usize, pairs: usize) {
    let chunks = chunks(&spec(workers, pairs));
    let ops: usize = chunks.iter().flatten().map(Event::block_ops).sum();
    for _ in 0..reps {
        for name in names {
            let Some(mut c) = contender(name, workers) else {
                continue;
            };
            let start = cpu();
            let took: Duration = chunks.iter().map(|ch| c.apply(ch)).sum();
            let rate = ops as f64 / took.as_secs_f64() / 1e6;
            println!("{name} load {rate:.2} M/s, {}", cpu_since(start));
        }
    }
}

fn churn(names: &[&str], workers: usize, pairs: usize, rounds: usize) {
    let spec = spec(workers, pairs);
    let chunks = chunks(&spec);
    let batch = spec.churn(1024);
    let ops: usize = batch.iter().map(Event::block_ops).sum();
    let mut line: Vec<(&str, Box<dyn Contender>)> = names
        .iter()
        .filter_map(|n| Some((*n, contender(n, workers)?)))
        .collect();
    for (_, c) in &mut line {
        for ch in &chunks {
            c.apply(ch);
        }
    }
    // As the bench: 20 untimed rounds, the median of 100, contenders interleaved.
    let mut samples = vec![Vec::new(); line.len()];
    for round in 0..20 + rounds {
        for (i, (_, c)) in line.iter_mut().enumerate() {
            let took = c.apply(&batch);
            if round >= 20 {
                samples[i].push(took);
            }
        }
    }
    for ((name, _), s) in line.iter().zip(&mut samples) {
        s.sort_unstable();
        let rate = ops as f64 / s[s.len() / 2].as_secs_f64() / 1e6;
        println!("{name} churn {rate:.2} M/s");
    }
}

fn replay(label: &str, r: &Replay, names: &[&str], reps: usize) {
    let ops = r.block_ops();
    for _ in 0..reps {
        for name in names {
            let Some(mut c) = contender(name, r.workers) else {
                continue;
            };
            let start = cpu();
            let (mut apply, mut query) = (Duration::ZERO, Duration::ZERO);
            for step in &r.steps {
                query += c.overlap(&step.query).0;
                if !step.events.is_empty() {
                    apply += c.apply(&step.events);
                }
            }
            let rate = ops as f64 / apply.as_secs_f64() / 1e6;
            println!(
                "{name} {label} apply {rate:.2} M/s, queries {query:?}, {}",
                cpu_since(start)
            );
        }
    }
}

/// The replay as the bench runs it: every step, each contender (in rotated order) answers the
/// query and applies the events, so each finds the caches as the others left them. Query
/// p50/p99 and apply rate per contender.
fn interleaved(label: &str, r: &Replay, names: &[&str], reps: usize) {
    let ops = r.block_ops();
    for _ in 0..reps {
        let mut line: Vec<(&str, Box<dyn Contender>)> = names
            .iter()
            .filter_map(|n| Some((*n, contender(n, r.workers)?)))
            .collect();
        let n = line.len();
        let mut apply = vec![Duration::ZERO; n];
        let mut query: Vec<Vec<Duration>> = vec![Vec::with_capacity(r.steps.len()); n];
        for (k, step) in r.steps.iter().enumerate() {
            for i in (0..n).map(|i| (i + k) % n) {
                let c = &mut line[i].1;
                query[i].push(c.overlap(&step.query).0);
                if !step.events.is_empty() {
                    apply[i] += c.apply(&step.events);
                }
            }
        }
        for (i, (name, _)) in line.iter().enumerate() {
            let q = &mut query[i];
            q.sort_unstable();
            let at = |p: f64| q[((q.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6;
            let rate = ops as f64 / apply[i].as_secs_f64() / 1e6;
            println!(
                "{name} {label} apply {rate:.2} M/s, query p50 {:.2} µs p99 {:.2} µs",
                at(0.5),
                at(0.99)
            );
        }
    }
}

/// FxHash's multiply-rotate step, as the index's own hasher (`switchyard_router::hasher`).
#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(26) ^ n).wrapping_mul(0xf135_7aea_2e62_a9c5);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<Fx>>;

fn floor(reps: usize) {
    let n = 750_000usize;
    let mut rng = switchyard_peer_bench::workload::Rng::new(12345);
    let keys: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
    let rate = |t: Instant| n as f64 / t.elapsed().as_secs_f64() / 1e6;
    for _ in 0..reps {
        let t = Instant::now();
        let mut grown: FxMap<[u64; 2]> = FxMap::default();
        for &k in &keys {
            grown.insert(k, [k, k]);
        }
        let grown_rate = rate(t);
        let t = Instant::now();
        let mut sized: FxMap<[u64; 2]> = FxMap::default();
        sized.reserve(n);
        for &k in &keys {
            sized.insert(k, [k, k]);
        }
        let sized_rate = rate(t);
        let t = Instant::now();
        let mut per_worker: Vec<FxMap<u64>> = Vec::new();
        for share in keys.chunks(n / 64) {
            let mut m: FxMap<u64> = FxMap::default();
            for &k in share {
                m.insert(k, k);
            }
            per_worker.push(m);
        }
        let per_worker_rate = rate(t);
        std::hint::black_box((&grown, &sized, &per_worker));
        println!(
            "one map, grown {grown_rate:.1} M/s; presized {sized_rate:.1} M/s; 64 maps, one after the other {per_worker_rate:.1} M/s"
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str);
    let names: Vec<&str> = arg(2).unwrap_or("switchyard").split(',').collect();
    let reps: usize = arg(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let workers: usize = arg(4).and_then(|s| s.parse().ok()).unwrap_or(64);
    let pairs: usize = arg(5).and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
    match arg(1).unwrap_or("load") {
        "load" => load(&names, reps, workers, pairs),
        "churn" => churn(
            &names,
            workers,
            pairs,
            arg(6).and_then(|s| s.parse().ok()).unwrap_or(100),
        ),
        "floor" => floor(reps),
        name @ ("mooncake" | "agent") => match traces::recorded(name) {
            Some(Ok(r)) => replay(name, &r, &names, reps),
            Some(Err(e)) => eprintln!("{name}: {e}"),
            None => {}
        },
        mixed @ ("mooncake-mix" | "agent-mix") => match traces::recorded(&mixed[..mixed.len() - 4])
        {
            Some(Ok(r)) => interleaved(mixed, &r, &names, reps),
            Some(Err(e)) => eprintln!("{mixed}: {e}"),
            None => {}
        },
        other => {
            eprintln!(
                "unknown workload {other}: load, churn, agent, mooncake, agent-mix, mooncake-mix or floor"
            );
            std::process::exit(64);
        }
    }
}
