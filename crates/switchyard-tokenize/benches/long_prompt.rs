//! Long prompts through the fast path alone: tokens per second of one core on prose, code and
//! CJK at 36k and 128k tokens (CPU time of the encoding thread, as `fast_tokenize`, with the
//! Hugging Face pipeline's CPU time on the same text for the ratio), and the
//! wall time of a fresh prompt of that size in one pass against the session tokenizer's
//! parallel path (pieces on tokio's blocking pool, one per core), median of 9 each.
//!
//! `cargo bench -p switchyard-tokenize --bench long_prompt` (Qwen3 from
//! `fetch-test-models.sh`). The ids are asserted equal to the Hugging Face pipeline's once per
//! text before anything is timed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_tokenize::{SessionConfig, SessionTokenizer, Tokenizer};

mod texts;

use texts::{cjk_text, cpu_per_call, cut, qwen3_json, read_tree};

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
        "| text | tokens | bytes | HF CPU ms | CPU ms | M tok/s per core | fast / HF | one pass wall ms | parallel wall ms | one pass / parallel |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
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
            let serial = median_wall(|| drop(std::hint::black_box(fast.encode(&text).unwrap())));
            let shared = Arc::new(text.clone());
            let sessions = SessionTokenizer::new(Arc::clone(&fast), SessionConfig::default());
            let text_once = Arc::clone(&shared);
            let once = runtime
                .block_on(runtime.spawn_blocking(move || sessions.encode(None, &text_once)))
                .unwrap()
                .unwrap();
            assert_eq!(once, want, "{kind} {size}: parallel differs");
            let parallel = median_wall(|| {
                // A fresh session tokenizer each time: the prompt is new, nothing to reuse.
                let sessions = SessionTokenizer::new(
                    Arc::clone(&fast),
                    SessionConfig {
                        verify_sample_rate: 0.0,
                        ..SessionConfig::default()
                    },
                );
                let text = Arc::clone(&shared);
                let ids = runtime
                    .block_on(runtime.spawn_blocking(move || sessions.encode(None, &text)))
                    .unwrap()
                    .unwrap();
                assert_eq!(ids.len(), want.len());
            });
            let ms = |t: Duration| t.as_secs_f64() * 1e3;
            println!(
                "| {kind} | {} | {} | {:.1} | {:.2} | {:.1} | {:.0}× | {:.2} | {:.2} | {:.2}× |",
                want.len(),
                text.len(),
                ms(t_hf),
                ms(t),
                want.len() as f64 / t.as_secs_f64() / 1e6,
                t_hf.as_secs_f64() / t.as_secs_f64(),
                ms(serial),
                ms(parallel),
                serial.as_secs_f64() / parallel.as_secs_f64(),
            );
        }
    }
}
