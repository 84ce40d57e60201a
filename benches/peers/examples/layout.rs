//! A prototype of the per-worker layout named under "not reached" in `docs/BENCHMARKS.md`
//! (branch `idx5`), measured against Switchyard's index and Dynamo's radix tree on the same
//! synthetic population and queries, in one process: does keeping each worker's blocks in a map
//! of its own (the layout of Dynamo's radix tree's lookup maps) make loading as cheap as the
//! floor promises, and what does the overlap query then cost?
//!
//! ```sh
//! cargo build --release --example layout
//! target/release/examples/layout 64 3         # synthetic 1M pairs: workers, repetitions
//! target/release/examples/layout agent 3      # the agent-session replay
//! target/release/examples/layout mooncake 3   # the Mooncake replay
//! ```
//!
//! The prototype keeps, per worker, a map from each block it holds to the parent the worker
//! stored it under and how many of its children the worker holds (the index's closure
//! bookkeeping), the worker's blocks in insertion order (its eviction queue), and one global map
//! only of the blocks stored at the root (a prompt's first block) to the workers holding them. A
//! store or a removal touches the worker's own map and, for a first block, the global one: no
//! map of every block. A query takes its candidates from the prompt's first block and finds,
//! for each, the last prompt block it holds in the worker's own map: `overlap` probes the
//! prompt's last block, then gallops from the start and bisects, one candidate after the other;
//! `overlap_interleaved` probes the last block, then advances every candidate's bisection
//! together, one probe of each per round (so the probes of a round are independent and their
//! cache misses overlap), a probed block held with no child settling the worker.
//!
//! It answers exactly only for prefix-closed, device-only workers whose prompts start at a root
//! block (every stream here is that: each answer is checked against the bench's reference). It
//! has none of the index's tiers, gap detection, bounded memory or broken-closure walk, and it
//! does not find a block a second worker stores unless the block is a first block: its apply
//! figures are a lower bound of what the layout would cost inside the real index.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use switchyard_peer_bench::contenders::{self, Contender};
use switchyard_peer_bench::measure::percentile;
use switchyard_peer_bench::traces::{self, Replay};
use switchyard_peer_bench::workload::{Event, Op, Query, Scores, Synthetic};

type FxMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// What the prototype keeps per (block, worker) pair: the parent the worker stored it under and
/// how many of its children the worker holds (the index's closure bookkeeping).
#[derive(Debug, Clone, Copy)]
struct Pair {
    parent: u64,
    children: u32,
    /// The block is (or was) in `roots` with this worker as a holder.
    in_roots: bool,
}

#[derive(Default)]
struct PerWorker {
    /// Per worker: block -> pair.
    blocks: Vec<FxMap<u64, Pair>>,
    /// Per worker: blocks in insertion order (the index's eviction queue).
    order: Vec<VecDeque<u64>>,
    /// Per worker: a block was stored under a parent it does not hold.
    broken: Vec<bool>,
    /// Blocks stored at the root -> the workers holding them (sorted); with `shared`, also
    /// every other block found held by two workers or more.
    roots: FxMap<u64, Vec<u32>>,
    /// Keep blocks that two workers hold in `roots` as well, found through their parents (see
    /// `find_shared`).
    shared: bool,
    /// Scratch: the blocks a store added.
    added: Vec<(u64, u64)>,
}

impl PerWorker {
    fn apply(&mut self, ev: &Event) {
        let w = ev.worker as usize;
        if self.blocks.len() <= w {
            self.blocks.resize_with(w + 1, FxMap::default);
            self.order.resize_with(w + 1, VecDeque::new);
            self.broken.resize(w + 1, false);
        }
        let map = &mut self.blocks[w];
        match &ev.op {
            Op::Store { parent, blocks } => {
                let mut prev = parent.unwrap_or(0);
                self.added.clear();
                for b in blocks {
                    if let std::collections::hash_map::Entry::Vacant(v) = map.entry(b.seq) {
                        v.insert(Pair {
                            parent: prev,
                            children: 0,
                            in_roots: prev == 0,
                        });
                        self.order[w].push_back(b.seq);
                        self.added.push((b.seq, prev));
                        if prev == 0 {
                            let h = self.roots.entry(b.seq).or_default();
                            let at = h.partition_point(|&x| x < ev.worker);
                            h.insert(at, ev.worker);
                        } else {
                            match map.get_mut(&prev) {
                                Some(p) => p.children += 1,
                                None => self.broken[w] = true,
                            }
                        }
                    }
                    prev = b.seq;
                }
                if self.shared {
                    self.find_shared(ev.worker);
                }
            }
            Op::Remove { seqs } => {
                for s in seqs {
                    let Some(pair) = map.remove(s) else {
                        continue;
                    };
                    if pair.children > 0 {
                        self.broken[w] = true;
                    }
                    if pair.parent != 0
                        && let Some(p) = map.get_mut(&pair.parent)
                    {
                        p.children -= 1;
                    }
                    if pair.in_roots
                        && let Some(h) = self.roots.get_mut(s)
                    {
                        h.retain(|&x| x != ev.worker);
                        // A block held by one worker stays only if it is a first block.
                        if h.is_empty() || (h.len() == 1 && pair.parent != 0) {
                            self.roots.remove(s);
                        }
                    }
                }
            }
        }
    }

    /// After `w` stored the blocks in `added` (head first): a block already in `roots` gains `w`
    /// as a holder; another is held by some other closed worker only if that worker holds its
    /// parent too, so it is looked for only in the maps of the parent's other holders (it is in
    /// at most one of them, or it would be in `roots` already), and only while the parent is in
    /// `roots`; the first block found in no other map ends the search (its descendants cannot
    /// be shared either). A chain of a worker's own costs one lookup.
    fn find_shared(&mut self, w: u32) {
        for i in 0..self.added.len() {
            let (block, parent) = self.added[i];
            if parent == 0 {
                continue;
            }
            if let Some(h) = self.roots.get_mut(&block) {
                // Shared already: `w` joins.
                let at = h.partition_point(|&x| x < w);
                h.insert(at, w);
                self.mark_in_roots(w, block);
                continue;
            }
            let Some(holders) = self.roots.get(&parent) else {
                return;
            };
            // Not yet shared, so at most one other worker holds it.
            let Some(other) = holders
                .iter()
                .copied()
                .find(|&x| x != w && self.blocks[x as usize].contains_key(&block))
            else {
                return;
            };
            self.roots.insert(
                block,
                if other < w {
                    vec![other, w]
                } else {
                    vec![w, other]
                },
            );
            self.mark_in_roots(w, block);
            self.mark_in_roots(other, block);
        }
    }

    fn mark_in_roots(&mut self, w: u32, block: u64) {
        if let Some(p) = self.blocks[w as usize].get_mut(&block) {
            p.in_roots = true;
        }
    }

    /// See the module docs: candidates from the first block, then one bisection per worker.
    fn overlap(&self, prompt: &[u64]) -> Scores {
        let Some(first) = prompt.first() else {
            return Vec::new();
        };
        let mut out: Scores = Vec::new();
        for &w in self.roots.get(first).map_or(&[][..], Vec::as_slice) {
            let map = &self.blocks[w as usize];
            // Every block up to `lo` is held; `hi` is not held (or past the end).
            let (mut lo, mut step) = (0usize, 1usize);
            let mut hi = prompt.len();
            // Gallop from the end first, as the real jump search does.
            if map.contains_key(&prompt[prompt.len() - 1]) {
                out.push((w, prompt.len() as u32));
                continue;
            }
            while lo + step < hi {
                if map.contains_key(&prompt[lo + step]) {
                    lo += step;
                    step *= 2;
                } else {
                    hi = lo + step;
                    break;
                }
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if map.contains_key(&prompt[mid]) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            out.push((w, lo as u32 + 1));
        }
        out.sort_unstable();
        out
    }

    /// As [`Self::overlap`], but the candidates' bisections advance together, one probe of each
    /// per round: the probes of a round are independent, so their cache misses overlap.
    fn overlap_interleaved(&self, prompt: &[u64]) -> Scores {
        let Some(first) = prompt.first() else {
            return Vec::new();
        };
        let last = prompt.len() - 1;
        // (worker, lo, hi): blocks up to `lo` held, `hi` not (or past the end).
        let mut open: Vec<(u32, usize, usize)> = Vec::new();
        let mut out: Scores = Vec::new();
        for &w in self.roots.get(first).map_or(&[][..], Vec::as_slice) {
            if self.blocks[w as usize].contains_key(&prompt[last]) {
                out.push((w, prompt.len() as u32));
            } else {
                open.push((w, 0, last));
            }
        }
        while !open.is_empty() {
            open.retain_mut(|(w, lo, hi)| {
                let mid = *lo + (*hi - *lo) / 2;
                match self.blocks[*w as usize].get(&prompt[mid]) {
                    // Holding none of the block's children, a closed worker ends its prefix here.
                    Some(p) if p.children == 0 => (*lo, *hi) = (mid, mid + 1),
                    Some(_) => *lo = mid,
                    None => *hi = mid,
                }
                if *hi - *lo > 1 {
                    return true;
                }
                out.push((*w, *lo as u32 + 1));
                false
            });
        }
        out.sort_unstable();
        out
    }
}

/// The trace replays of the bench: apply and per-request queries, every answer checked.
fn replay(r: &Replay, reps: usize) {
    let ops = r.block_ops() as f64;
    let us = |s: &mut Vec<Duration>| {
        let p50 = percentile(s, 0.5).as_secs_f64() * 1e6;
        let p99 = percentile(s, 0.99).as_secs_f64() * 1e6;
        format!("{p50:.2} / {p99:.2}")
    };
    let seqs: Vec<Vec<u64>> = r.steps.iter().map(|s| s.query.seqs()).collect();
    for _ in 0..reps {
        let mut with_shared = PerWorker {
            shared: true,
            ..PerWorker::default()
        };
        let t = Instant::now();
        for ev in r.steps.iter().flat_map(|s| &s.events) {
            with_shared.apply(ev);
        }
        let shared_rate = ops / t.elapsed().as_secs_f64() / 1e6;
        drop(with_shared);
        let mut proto = PerWorker::default();
        let (mut apply, mut queries) = (Duration::ZERO, Vec::new());
        for (step, q) in r.steps.iter().zip(&seqs) {
            let t = Instant::now();
            let got = proto.overlap_interleaved(q);
            queries.push(t.elapsed());
            assert_eq!(got, step.expected, "prototype answer");
            let t = Instant::now();
            for ev in &step.events {
                proto.apply(ev);
            }
            apply += t.elapsed();
        }
        let mut line = vec![format!(
            "{}: apply M/s, overlap p50 / p99 µs: prototype {:.2}, {} (apply with shared \
             blocks {shared_rate:.2})",
            r.name,
            ops / apply.as_secs_f64() / 1e6,
            us(&mut queries)
        )];
        let mut contenders: Vec<Box<dyn Contender>> =
            contenders::lineup(r.workers, true, &["switchyard".into(), "radix_tree".into()]);
        contenders.retain(|c| matches!(c.name(), "switchyard" | "dynamo radix_tree"));
        for c in &mut contenders {
            let (mut apply, mut queries) = (Duration::ZERO, Vec::new());
            for step in &r.steps {
                let (took, got) = c.overlap(&step.query);
                queries.push(took);
                assert_eq!(got, step.expected, "{} answer", c.name());
                if !step.events.is_empty() {
                    apply += c.apply(&step.events);
                }
            }
            line.push(format!(
                "{} {:.2}, {}",
                c.name(),
                ops / apply.as_secs_f64() / 1e6,
                us(&mut queries)
            ));
        }
        println!("{}", line.join("; "));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let name = args.get(1).map_or("64", String::as_str);
    if let Some(trace) = traces::recorded(name) {
        match trace {
            Ok(r) => replay(&r, reps),
            Err(e) => eprintln!("{name}: {e}"),
        }
        return;
    }
    let workers: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let spec = Synthetic::of(workers, 1 << 20);
    let events: Vec<Event> = spec.population().collect();
    let ops: usize = events.iter().map(Event::block_ops).sum();
    let prompt = spec.prompt();
    let lens = [128usize, 8192];
    let queries: Vec<Query> = lens
        .iter()
        .map(|&n| Query {
            blocks: prompt.blocks[..n].to_vec(),
        })
        .collect();
    for _ in 0..reps {
        let t = Instant::now();
        let mut with_shared = PerWorker {
            shared: true,
            ..PerWorker::default()
        };
        for ev in &events {
            with_shared.apply(ev);
        }
        let shared_rate = ops as f64 / t.elapsed().as_secs_f64() / 1e6;
        drop(with_shared);
        let t = Instant::now();
        let mut proto = PerWorker::default();
        for ev in &events {
            proto.apply(ev);
        }
        let proto_rate = ops as f64 / t.elapsed().as_secs_f64() / 1e6;
        let mut line: Vec<Box<dyn Contender>> =
            contenders::lineup(workers, true, &["switchyard".into(), "radix_tree".into()]);
        // The concurrent radix tree's name contains "radix_tree" too.
        line.retain(|c| matches!(c.name(), "switchyard" | "dynamo radix_tree"));
        let mut rates = Vec::new();
        for c in &mut line {
            let took: Duration = events.chunks(1024).map(|ch| c.apply(ch)).sum();
            rates.push(ops as f64 / took.as_secs_f64() / 1e6);
        }
        println!(
            "load M/s: per-worker prototype {proto_rate:.2}, with shared blocks \
             {shared_rate:.2}, switchyard {:.2}, radix_tree {:.2}",
            rates[0], rates[1]
        );
        for (q, &n) in queries.iter().zip(&lens) {
            let seqs = q.seqs();
            let want = spec.expected(n);
            // Interleaved, as the bench: one query each per round.
            let mut samples = vec![Vec::new(); 4];
            for _ in 0..2000 {
                let t = Instant::now();
                let got = proto.overlap(&seqs);
                samples[0].push(t.elapsed());
                assert_eq!(got, want, "prototype answer, {n} blocks");
                let t = Instant::now();
                let got = proto.overlap_interleaved(&seqs);
                samples[1].push(t.elapsed());
                assert_eq!(got, want, "interleaved prototype answer, {n} blocks");
                for (i, c) in line.iter_mut().enumerate() {
                    let (took, got) = c.overlap(q);
                    samples[i + 2].push(took);
                    assert_eq!(got, want, "contender {i} answer, {n} blocks");
                }
            }
            let us = |s: &mut Vec<Duration>| {
                let p50 = percentile(s, 0.5).as_secs_f64() * 1e6;
                let p99 = percentile(s, 0.99).as_secs_f64() * 1e6;
                format!("{p50:.2} / {p99:.2}")
            };
            println!(
                "overlap {n} blocks p50 / p99 µs: prototype {}, interleaved {}, switchyard {}, \
                 radix_tree {}",
                us(&mut samples[0]),
                us(&mut samples[1]),
                us(&mut samples[2]),
                us(&mut samples[3])
            );
        }
    }
}
