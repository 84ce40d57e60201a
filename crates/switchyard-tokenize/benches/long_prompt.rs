//! Long prompts through the fast path alone: tokens per second of one core on prose, code and
//! CJK at 36k and 128k tokens (CPU time of the encoding thread, as `fast_tokenize`, with the
//! Hugging Face pipeline's CPU time on the same text for the ratio), and a fresh prompt of that
//! size through the session tokenizer as the gateway runs it (on tokio's blocking pool): in one
//! pass (every core of the process's `CoreBudget` held busy, as under load) against cut over the
//! free cores (nothing else tokenizing): wall time, median of 9, and the whole process's CPU
//! time per call, so the cost of the hand-off shows next to the gain.
//!
//! `cargo bench -p switchyard-tokenize --bench long_prompt` (Qwen3 from
//! `fetch-test-models.sh`). The ids are asserted equal to the Hugging Face pipeline's once per
//! text before anything is timed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_tokenize::{CoreBudget, SessionConfig, SessionTokenizer, Tokenizer};

mod texts;

use texts::{cjk_text, cpu_per_call, cut, process_cpu_per_call, qwen3_json, read_tree};

const SIZES: [usize; 2] = [36_000, 128_000];
const WALL_RUNS: usize = 9;

fn median_wall(mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..WALL_RUNS)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .collect();
    times.sort();
    times[WALL_RUNS / 2]
}

fn main() {
    let path = qwen3_json();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let fast = Arc::new(Tokenizer::from_hf_file(&path).unwrap());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let hf = Tokenizer::from_hf_file_without_fast_path(&path).unwrap();
    assert!(fast.uses_fast_path());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut prose = String::new();
    read_tree(&root.join("docs"), "md", &mut prose);
    let mut code = String::new();
    read_tree(&root.join("crates"), "rs", &mut code);
    let cjk = cjk_text(&json, 600_000);
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));

    println!(
        "| text | tokens | bytes | HF CPU ms | CPU ms | M tok/s per core | fast / HF | one pass wall ms | cut wall ms | one pass / cut | one pass CPU ms | cut CPU ms | was cut |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let budget = CoreBudget::process();
    for (kind, corpus) in [("prose", &prose), ("code", &code), ("CJK", &cjk)] {
        if only.as_deref().is_some_and(|o| o != kind) {
            continue;
        }
        for size in SIZES {
            let text = cut(&fast, corpus, size);
            let want = hf.encode(&text).unwrap();
            assert_eq!(
                fast.encode(&text).unwrap(),
                want,
                "{kind} {size}: fast differs"
            );
            let t = cpu_per_call(|| drop(std::hint::black_box(fast.encode(&text).unwrap())));
            let t_hf = cpu_per_call(|| drop(std::hint::black_box(hf.encode(&text).unwrap())));
            let shared = Arc::new(text.clone());
            // A fresh session tokenizer each time: the prompt is new, nothing to reuse.
            let fresh = || {
                let sessions = SessionTokenizer::new(
                    Arc::clone(&fast),
                    SessionConfig {
                        verify_sample_rate: 0.0,
                        ..SessionConfig::default()
                    },
                );
                let text = Arc::clone(&shared);
                runtime
                    .block_on(runtime.spawn_blocking(move || sessions.encode(None, &text)))
                    .unwrap()
                    .unwrap()
            };
            let split_before = budget.split_texts();
            assert_eq!(fresh(), want, "{kind} {size}: cut differs");
            let pieces_used = budget.split_texts() > split_before;
            let cut_wall = median_wall(|| assert_eq!(fresh().len(), want.len()));
            let cut_cpu = process_cpu_per_call(|| assert_eq!(fresh().len(), want.len()));
            let (one_wall, one_cpu) = {
                let _all_busy: Vec<_> = (0..budget.capacity()).map(|_| budget.occupy()).collect();
                let whole_before = budget.whole_for_busy_cores();
                assert_eq!(fresh(), want, "{kind} {size}: one pass differs");
                assert!(
                    budget.whole_for_busy_cores() > whole_before || !pieces_used,
                    "held cores did not stop the cut"
                );
                (
                    median_wall(|| assert_eq!(fresh().len(), want.len())),
                    process_cpu_per_call(|| assert_eq!(fresh().len(), want.len())),
                )
            };
            let ms = |t: Duration| t.as_secs_f64() * 1e3;
            println!(
                "| {kind} | {} | {} | {:.1} | {:.2} | {:.1} | {:.0}× | {:.2} | {:.2} | {:.2}× | {:.2} | {:.2} | {} |",
                want.len(),
                text.len(),
                ms(t_hf),
                ms(t),
                want.len() as f64 / t.as_secs_f64() / 1e6,
                t_hf.as_secs_f64() / t.as_secs_f64(),
                ms(one_wall),
                ms(cut_wall),
                one_wall.as_secs_f64() / cut_wall.as_secs_f64(),
                ms(one_cpu),
                ms(cut_cpu),
                if pieces_used { "yes" } else { "no" },
            );
        }
    }
}
