//! Switchyard's prefix index and Dynamo's indexers, side by side, in one run.
//!
//! `cargo bench` (in `benches/peers/`) runs everything; `cargo bench -- quick` skips the 10M-pair
//! index and the agent sessions; `only=<name part>` (repeatable) keeps only matching
//! contenders. The table is printed and written to `results/peers.md` and
//! `results/peers.json`. `tests/same_streams.rs` checks, untimed, that every contender answers
//! the small copies of these workloads as the reference does. See `src/lib.rs` for what each part does and `docs/BENCHMARKS.md` for
//! how to read the figures.

use std::path::PathBuf;
use std::time::Duration;

use switchyard_peer_bench::contenders::{self, Contender};
use switchyard_peer_bench::measure::{
    Account, CountingAlloc, Machine, loadavg, median, percentile,
};
use switchyard_peer_bench::report::{Cell, Kind, Report, Row};
use switchyard_peer_bench::traces::{self, Replay};
use switchyard_peer_bench::workload::{Event, Query, Scores, Synthetic, all_hold};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Steady-state churn batch: 1,024 16-block stores and their removals.
const CHURN_EVENTS: usize = 1024;
/// Churn rounds: the first `CHURN_WARMUP` are not timed. Re-applying the batch moves every
/// contender's throughput for the first dozen or so rounds (9 measured rounds once put
/// Switchyard and Dynamo's radix tree at 10–13 M/s, where 100 later rounds give 2–5 M/s), so
/// the figure is the median of many rounds after a warm-up.
const CHURN_WARMUP: usize = 20;
const APPLY_ROUNDS: usize = 100;
/// Query samples are taken in this many rounds, contenders interleaved, so a burst of load from
/// the other users of the machine falls on all of them alike.
const QUERY_ROUNDS: usize = 10;
/// Each trace is replayed this many times, into fresh indexes, the contenders taking turns at
/// every step: its apply figure is the median pass, its query figures are over every pass.
const REPLAY_PASSES: usize = 5;
/// Synthetic loads are applied in chunks of this many events, the contenders taking turns.
const LOAD_CHUNK: usize = 1024;

struct Entry {
    contender: Box<dyn Contender>,
    account: Account,
}

/// Every contender (see `contenders::lineup`), each with its own heap account. `only=<name
/// part>` arguments keep the matching ones.
fn lineup(workers: usize, big: bool) -> Vec<Entry> {
    let only: Vec<String> = std::env::args()
        .filter_map(|a| a.strip_prefix("only=").map(str::to_owned))
        .collect();
    contenders::lineup(workers, big, &only)
        .into_iter()
        .enumerate()
        .map(|(i, contender)| Entry {
            contender,
            account: Account(i + 1),
        })
        .collect()
}

fn names() -> Vec<String> {
    lineup(1, false)
        .iter()
        .map(|e| e.contender.name().to_owned())
        .collect()
}

struct Bench {
    rows: Vec<Row>,
    notes: Vec<String>,
    mismatches: usize,
}

impl Bench {
    fn row(&mut self, workload: &str, figure: &str, kind: Kind, cells: Vec<Cell>) {
        let row = Row {
            workload: workload.to_owned(),
            figure: figure.to_owned(),
            kind,
            cells,
            loadavg: loadavg(),
        };
        let adv = row
            .advantage()
            .map_or(String::new(), |a| format!("  ×{:.2}", a.value));
        eprintln!("  {workload} | {figure}{adv}");
        self.rows.push(row);
    }

    fn check(&mut self, who: &str, what: &str, got: &Scores, expected: &Scores) {
        if got != expected {
            self.mismatches += usize::from(who == "switchyard");
            let note = format!(
                "{who} answered {what} differently from the reference ({} workers vs {} expected)",
                got.len(),
                expected.len()
            );
            eprintln!("MISMATCH: {note}");
            self.notes.push(note);
        }
    }

    /// Loads a synthetic index into every contender, then measures churn, queries and memory.
    fn synthetic(&mut self, spec: Synthetic, label: &str, lengths: &[usize], churn: bool) {
        eprintln!("{label}: loading");
        let big = spec.pairs > 4 << 20;
        if big {
            self.notes.push(format!(
                "{label}: dynamo positional (binary) left out; it builds the same structure as the strided one and a second copy would take gigabytes"
            ));
        }
        let mut line = lineup(spec.workers, big);
        let mut pairs = 0usize;
        let mut load_cells = Vec::new();
        let mut bytes_cells = Vec::new();
        // The contenders load in turns, a chunk of events each in rotated order, so a burst of
        // load from the machine's other users falls on all of them alike.
        let mut streams: Vec<_> = line.iter().map(|_| spec.population()).collect();
        let mut took = vec![Duration::ZERO; line.len()];
        let mut ops = vec![0usize; line.len()];
        for e in &line {
            e.account.reset();
        }
        for round in 0.. {
            let mut applied = false;
            for i in rotation(line.len(), round) {
                let chunk: Vec<Event> = streams[i].by_ref().take(LOAD_CHUNK).collect();
                if chunk.is_empty() {
                    continue;
                }
                applied = true;
                ops[i] += chunk.iter().map(Event::block_ops).sum::<usize>();
                let e = &mut line[i];
                took[i] += e.account.charge(|| e.contender.apply(&chunk));
            }
            if !applied {
                break;
            }
        }
        for (i, e) in line.iter().enumerate() {
            pairs = ops[i];
            load_cells.push(Cell {
                contender: e.contender.name().to_owned(),
                value: ops[i] as f64 / took[i].as_secs_f64(),
                p99: None,
            });
            bytes_cells.push(Cell {
                contender: e.contender.name().to_owned(),
                value: e.account.bytes() as f64 / ops[i] as f64,
                p99: None,
            });
        }
        self.row(label, "load (stores only)", Kind::Throughput, load_cells);
        self.row(label, "memory, bytes/pair", Kind::Bytes, bytes_cells);
        eprintln!("{label}: {pairs} pairs loaded");

        if churn {
            let batch = spec.churn(CHURN_EVENTS);
            let ops: usize = batch.iter().map(Event::block_ops).sum();
            let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); line.len()];
            for round in 0..CHURN_WARMUP + APPLY_ROUNDS {
                for i in rotation(line.len(), round) {
                    let e = &mut line[i];
                    let took = e.account.charge(|| e.contender.apply(&batch));
                    if round >= CHURN_WARMUP {
                        samples[i].push(took);
                    }
                }
            }
            let cells = line
                .iter()
                .zip(&mut samples)
                .map(|(e, s)| Cell {
                    contender: e.contender.name().to_owned(),
                    value: ops as f64 / median(s).as_secs_f64(),
                    p99: None,
                })
                .collect();
            self.row(
                label,
                "apply (16-block store + remove)",
                Kind::Throughput,
                cells,
            );
        }

        let prompt = spec.prompt();
        for &len in lengths {
            let q = Query {
                blocks: prompt.blocks[..len.min(prompt.blocks.len())].to_vec(),
            };
            let expected = spec.expected(q.blocks.len());
            self.queries(&mut line, label, &q, &expected);
        }
        for e in &line {
            if e.contender.errors() > 0 {
                self.notes.push(format!(
                    "{}: {} events refused on {label}",
                    e.contender.name(),
                    e.contender.errors()
                ));
            }
        }
    }

    fn queries(&mut self, line: &mut [Entry], label: &str, q: &Query, expected: &Scores) {
        let len = q.blocks.len();
        let per_round = if len >= 8192 {
            100
        } else if len >= 1024 {
            300
        } else {
            1000
        };
        let what = format!("{len}-block query on {label}");
        for e in line.iter_mut() {
            let (_, got) = e.contender.overlap(q);
            let name = e.contender.name().to_owned();
            self.check(&name, &what, &got, expected);
        }
        // Contenders take turns, `per_round` queries each; a round's first query finds the
        // caches as the previous contender left them and is not counted (the trace replays
        // measure queries among other work): counted, those 1 % of samples would decide p99.
        let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); line.len()];
        for round in 0..=QUERY_ROUNDS {
            for i in rotation(line.len(), round) {
                for j in 0..per_round {
                    let (took, _) = line[i].contender.overlap(q);
                    if round > 0 && j > 0 {
                        samples[i].push(took);
                    }
                }
            }
        }
        let cells = line
            .iter()
            .zip(&mut samples)
            .map(|(e, s)| Cell {
                contender: e.contender.name().to_owned(),
                value: percentile(s, 0.5).as_secs_f64() * 1e6,
                p99: Some(percentile(s, 0.99).as_secs_f64() * 1e6),
            })
            .collect();
        self.row(
            label,
            &format!("overlap {len} blocks"),
            Kind::Latency,
            cells,
        );
    }

    /// Replays a trace stream through every contender, step by step, interleaved.
    fn replay(&mut self, replay: &Replay) {
        let label = format!(
            "{} ({} requests, {} workers × {} blocks)",
            replay.name,
            replay.steps.len(),
            replay.workers,
            replay.capacity
        );
        eprintln!("{label}: replaying");
        let n = names().len();
        // Per contender: each pass's apply time, and every query of every pass.
        let mut apply: Vec<Vec<Duration>> = vec![Vec::with_capacity(REPLAY_PASSES); n];
        let mut query: Vec<Vec<Duration>> =
            vec![Vec::with_capacity(REPLAY_PASSES * replay.steps.len()); n];
        let mut wrong = vec![0usize; n];
        let mut line = Vec::new();
        for pass in 0..REPLAY_PASSES {
            // Fresh indexes each pass: the last pass's are measured for memory below.
            drop(line);
            line = lineup(replay.workers, false);
            for e in &line {
                e.account.reset();
            }
            let mut took_apply = vec![Duration::ZERO; n];
            for (k, step) in replay.steps.iter().enumerate() {
                for i in rotation(n, k + pass) {
                    let e = &mut line[i];
                    let (took, got) = e.contender.overlap(&step.query);
                    query[i].push(took);
                    if got != step.expected && pass == 0 {
                        wrong[i] += 1;
                    }
                    if !step.events.is_empty() {
                        took_apply[i] += e.account.charge(|| e.contender.apply(&step.events));
                    }
                }
            }
            for (i, t) in took_apply.into_iter().enumerate() {
                apply[i].push(t);
            }
        }
        let ops = replay.block_ops();
        let (stored, removed) =
            replay
                .steps
                .iter()
                .flat_map(|s| &s.events)
                .fold((0usize, 0usize), |(s, r), ev| match &ev.op {
                    switchyard_peer_bench::workload::Op::Store { blocks, .. } => {
                        (s + blocks.len(), r)
                    }
                    switchyard_peer_bench::workload::Op::Remove { seqs } => (s, r + seqs.len()),
                });
        let pairs = stored - removed;
        for (i, e) in line.iter().enumerate() {
            if wrong[i] > 0 {
                let name = e.contender.name().to_owned();
                self.mismatches += usize::from(name == "switchyard");
                let note = format!(
                    "{name} answered {} of {} queries of {} differently from the reference",
                    wrong[i],
                    replay.steps.len(),
                    replay.name
                );
                eprintln!("MISMATCH: {note}");
                self.notes.push(note);
            }
        }
        let cells = |f: &dyn Fn(usize, &Entry) -> Cell| -> Vec<Cell> {
            line.iter().enumerate().map(|(i, e)| f(i, e)).collect()
        };
        self.row(
            &label,
            &format!("apply ({ops} block ops)"),
            Kind::Throughput,
            cells(&|i, e| Cell {
                contender: e.contender.name().to_owned(),
                value: ops as f64 / median(&mut apply[i].clone()).as_secs_f64(),
                p99: None,
            }),
        );
        let lat = cells(&|i, e| {
            let mut s = query[i].clone();
            Cell {
                contender: e.contender.name().to_owned(),
                value: percentile(&mut s, 0.5).as_secs_f64() * 1e6,
                p99: Some(percentile(&mut s, 0.99).as_secs_f64() * 1e6),
            }
        });
        self.row(&label, "overlap per request", Kind::Latency, lat);
        self.row(
            &label,
            &format!("memory at end ({pairs} pairs), bytes/pair"),
            Kind::Bytes,
            cells(&|_, e| Cell {
                contender: e.contender.name().to_owned(),
                value: e.account.bytes() as f64 / pairs.max(1) as f64,
                p99: None,
            }),
        );
        self.notes.push(format!(
            "{}: prefix hit rate of the simulated routing {:.1} % ({} of {} prompt blocks)",
            replay.name,
            100.0 * replay.hit_blocks as f64 / replay.prompt_blocks.max(1) as f64,
            replay.hit_blocks,
            replay.prompt_blocks
        ));
    }
}

/// Contender order for one round: rotated so no contender always runs first.
fn rotation(n: usize, round: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| (i + round) % n)
}

fn date() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "unknown".to_owned(), |s| s.trim().to_owned())
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let machine = Machine::read();
    let date = date();
    eprintln!(
        "{date}; {} ({} CPUs); load {}",
        machine.cpu, machine.cpus, machine.loadavg
    );
    let mut bench = Bench {
        rows: Vec::new(),
        notes: Vec::new(),
        mismatches: 0,
    };
    let lengths = [64usize, 128, 1024, 8192];
    for workers in [8usize, 64, 512] {
        let spec = Synthetic::of(workers, 1 << 20);
        let label = format!("synthetic 1M pairs, {workers} workers");
        bench.synthetic(spec, &label, &lengths, workers == 64);
    }
    let worst = Synthetic {
        workers: 64,
        pairs: 1 << 20,
        prompt_len: 128,
        holders: 64,
        seed: 11,
    };
    bench.all_64_hold(worst);
    if !quick {
        let spec = Synthetic {
            workers: 64,
            pairs: 10 << 20,
            prompt_len: 8192,
            holders: 32,
            seed: 13,
        };
        bench.synthetic(spec, "synthetic 10M pairs, 64 workers", &[128, 8192], true);
    }

    match traces::recorded("mooncake") {
        Some(Ok(r)) => bench.replay(&r),
        Some(Err(e)) => bench.notes.push(format!("mooncake trace skipped: {e}")),
        None => {}
    }
    if !quick {
        match traces::recorded("agent") {
            Some(Ok(r)) => bench.replay(&r),
            Some(Err(e)) => bench.notes.push(format!("agent sessions skipped: {e}")),
            None => {}
        }
    }

    let mut notes = vec![
        "Same thread: every contender but Dynamo's concurrent radix tree applies and queries on the bench's thread; that tree can only apply events in its worker loop, so it gets one dedicated thread (its queries run on the bench's thread), and the median empty round trip is subtracted from its apply timings.".to_owned(),
        "Like with like: Switchyard answers per-worker leading blocks at four tier levels (device, device-or-host, device-host-or-disk, any); Dynamo's indexers answer one count per worker. All events here are device-tier, and every answer is checked against the reference (analytic for synthetic prompts, the simulation for traces): only equal answers are compared.".to_owned(),
        "Synthetic query rows: the contenders take turns (10 rounds of 100 to 1,000 repetitions of the query each); the first query of each turn finds the caches as the previous contender left them and is not counted (counted, those 1 % of samples decide p99; the trace replays measure queries among other work).".to_owned(),
        "Synthetic loads: the contenders take turns of 1,024 events, in rotated order, so a burst of load from the machine's other users falls on all of them; a load row is the total time each spent applying its events.".to_owned(),
        format!("Trace replays: each trace is replayed {REPLAY_PASSES} times into fresh indexes, every contender answering and applying each step in turn; apply is the median pass, the query percentiles are over every pass's queries, memory is the last pass's."),
        "Queries are given per-block hashes computed beforehand: chained hashes to Switchyard (what its gateway computes from tokens), local hashes to Dynamo (what its router computes from tokens). Dynamo's positional indexer chains local hashes inside its query; that work is part of its figure.".to_owned(),
        "Dynamo's approximate indexer is not a column: it consumes no KV events (it predicts each worker's cache from the router's own decisions, through async leases and an LRU or TTL model), so it cannot be fed the same stream; it runs inside the concurrent radix tree's worker loop, which it feeds with events it makes up, and its queries are that tree's, measured here.".to_owned(),
    ];
    notes.append(&mut bench.notes);
    let report = Report {
        command: format!(
            "cd benches/peers && cargo bench{}",
            if quick { " -- quick" } else { "" }
        ),
        date,
        machine: Machine {
            loadavg: format!("{} at start, {} at end", machine.loadavg, loadavg()),
            ..machine
        },
        dynamo_kv_router: "1.6.1".to_owned(),
        contenders: names(),
        rows: bench.rows,
        notes,
    };
    let md = report.markdown();
    println!("{md}");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("peers.md"), &md))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(dir.join("peers.json"), json)
        });
    if let Err(e) = written {
        eprintln!("could not write {}: {e}", dir.display());
    }
    if bench.mismatches > 0 {
        eprintln!("switchyard gave {} wrong answers", bench.mismatches);
        std::process::exit(1);
    }
}

impl Bench {
    /// Every one of 64 workers holds the whole 128-block prompt (on top of a 1M-pair index).
    fn all_64_hold(&mut self, spec: Synthetic) {
        let label = "synthetic 1M pairs, all 64 workers hold the prompt";
        eprintln!("{label}: loading");
        let mut line = lineup(spec.workers, false);
        let prompt = spec.prompt();
        let extra = all_hold(spec.workers, &prompt);
        for e in &mut line {
            let mut events = spec.population();
            loop {
                let chunk: Vec<Event> = events.by_ref().take(1024).collect();
                if chunk.is_empty() {
                    break;
                }
                e.contender.apply(&chunk);
            }
            e.contender.apply(&extra);
        }
        let expected: Scores = (0..spec.workers as u32)
            .map(|w| (w, prompt.blocks.len() as u32))
            .collect();
        self.queries(&mut line, label, &prompt, &expected);
    }
}
