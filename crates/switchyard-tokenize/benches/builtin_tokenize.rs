//! The built-in vocabularies (`cl100k_base`, `o200k_base`) encoding through the fast path
//! against `tiktoken-rs` (their reference, what the built-in tokenizer ran before), with the
//! Hugging Face pipeline on Qwen3's `tokenizer.json` timed on the same texts for scale.
//!
//! `cargo bench -p switchyard-tokenize --bench builtin_tokenize` (Qwen3 from
//! `fetch-test-models.sh`, for the CJK text and the Hugging Face column). Texts as in
//! `fast_tokenize`: prose (`docs/*.md`), code (`crates/**/*.rs`), CJK, each cut to ~1k, ~9k
//! and ~36k tokens of the vocabulary measured. One thread; each figure is the mean CPU time
//! of one encode over at least 1.5 s of this thread's CPU time. The fast ids are asserted
//! equal to tiktoken's on every text.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::time::Duration;

use switchyard_tokenize::Tokenizer;
use switchyard_tokenize::builtin::BuiltinVocab;

mod texts;

use texts::{corpora, cpu_per_call, cut, qwen3_json, thread_cpu};

const SIZES: [usize; 3] = [1_000, 9_000, 36_000];

fn main() {
    let path = qwen3_json();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let hf = Tokenizer::from_hf_file_without_fast_path(&path).unwrap();
    let corpora = corpora(&json, 200_000);

    println!(
        "| vocab | text | tokens | tiktoken ms | tiktoken M tok/s | fast ms | fast M tok/s | fast / tiktoken | HF Qwen3 ms (same text) | fast / HF |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut loads = Vec::new();
    for vocab in BuiltinVocab::ALL {
        let started = thread_cpu();
        let reference = Tokenizer::builtin_without_fast_path(vocab);
        drop(reference.encode("warm up").unwrap());
        let reference_load = thread_cpu() - started;
        let started = thread_cpu();
        let fast = Tokenizer::builtin(vocab);
        let fast_load = thread_cpu() - started;
        assert!(fast.uses_fast_path());
        loads.push((vocab, reference_load, fast_load));
        for (kind, corpus) in &corpora {
            for size in SIZES {
                let text = cut(&reference, corpus, size);
                let want = reference.encode(&text).unwrap();
                assert_eq!(
                    fast.encode(&text).unwrap(),
                    want,
                    "{vocab:?} {kind} {size}: fast differs"
                );
                let t_ref =
                    cpu_per_call(|| drop(std::hint::black_box(reference.encode(&text).unwrap())));
                let t_fast =
                    cpu_per_call(|| drop(std::hint::black_box(fast.encode(&text).unwrap())));
                let t_hf = cpu_per_call(|| drop(std::hint::black_box(hf.encode(&text).unwrap())));
                let rate = |t: Duration| want.len() as f64 / t.as_secs_f64() / 1e6;
                let ms = |t: Duration| t.as_secs_f64() * 1e3;
                println!(
                    "| {} | {kind} | {} | {:.3} | {:.2} | {:.3} | {:.1} | {:.1}× | {:.2} | {:.0}× |",
                    vocab.name(),
                    want.len(),
                    ms(t_ref),
                    rate(t_ref),
                    ms(t_fast),
                    rate(t_fast),
                    t_ref.as_secs_f64() / t_fast.as_secs_f64(),
                    ms(t_hf),
                    t_hf.as_secs_f64() / t_fast.as_secs_f64(),
                );
            }
        }
    }
    for (vocab, reference_load, fast_load) in loads {
        println!(
            "load {}: tiktoken-rs {reference_load:?}, fast path tables on top {fast_load:?} (CPU time)",
            vocab.name()
        );
    }
}
