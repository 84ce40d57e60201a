//! Qwen3 encoding throughput: the Hugging Face pipeline (`tokenizers`, fancy-regex), the fast
//! path of `switchyard_tokenize::fast`, and — as the candidate measured before writing it —
//! tiktoken's `CoreBPE` built from the same vocabulary and split regex.
//!
//! `cargo bench -p switchyard-tokenize --bench fast_tokenize` (Qwen3 from
//! `fetch-test-models.sh`). Texts: prose (this repository's `docs/*.md`), code (its Rust
//! sources) and CJK (Qwen3 vocabulary words of CJK ideographs with Chinese punctuation),
//! each cut to ~1k, ~9k and ~36k tokens. One thread; each figure is the mean CPU time of one
//! encode over at least 1.5 s of this thread's CPU time (so preemption by other work on a
//! shared machine does not count). The fast ids are asserted equal to Hugging Face's on every text; the tiktoken
//! candidate's agreement is reported, not assumed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failure report

use std::collections::HashMap;
use std::time::Duration;

use switchyard_tokenize::Tokenizer;

mod texts;

use texts::{corpora, cpu_per_call, cut, qwen3_json, thread_cpu};
const SIZES: [usize; 3] = [1_000, 9_000, 36_000];
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn main() {
    let path = qwen3_json();
    let raw = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: run crates/switchyard-tokenize/fetch-test-models.sh",
            path.display()
        )
    });
    let json: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    let load_started = thread_cpu();
    let fast = Tokenizer::from_hf_file(&path).unwrap();
    let fast_load = thread_cpu() - load_started;
    let load_started = thread_cpu();
    let hf = Tokenizer::from_hf_file_without_fast_path(&path).unwrap();
    let hf_load = thread_cpu() - load_started;
    assert!(fast.uses_fast_path());
    let started = thread_cpu();
    let byte_char: HashMap<char, u8> = {
        let mut map = HashMap::new();
        let mut extra = 0u32;
        for b in 0..=255u8 {
            let cp = if matches!(b, 33..=126 | 161..=172 | 174..=255) {
                u32::from(b)
            } else {
                extra += 1;
                255 + extra
            };
            map.insert(char::from_u32(cp).unwrap(), b);
        }
        map
    };
    let core = tiktoken_rs::CoreBPE::new(
        json["model"]["vocab"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(t, id)| {
                let bytes: Vec<u8> = t.chars().map(|c| byte_char[&c]).collect();
                (bytes, id.as_u64().unwrap() as u32)
            })
            .collect(),
        json["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["content"].as_str().unwrap().to_owned(),
                    t["id"].as_u64().unwrap() as u32,
                )
            })
            .collect(),
        QWEN2_REGEX,
    )
    .unwrap();
    let core_load = thread_cpu() - started;

    let corpora = corpora(&json, 200_000);

    println!(
        "load: HF {hf_load:?}, HF + fast {fast_load:?}, tiktoken CoreBPE {core_load:?} (CPU time)"
    );
    println!(
        "| text | tokens | HF ms | HF M tok/s | tiktoken ms | tiktoken M tok/s | tiktoken = HF | fast ms | fast M tok/s | fast / HF |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|");
    for (kind, corpus) in &corpora {
        for size in SIZES {
            let text = cut(&hf, corpus, size);
            let want = hf.encode(&text).unwrap();
            assert_eq!(
                fast.encode(&text).unwrap(),
                want,
                "{kind} {size}: fast differs"
            );
            let same = core.encode_ordinary(&text) == want;
            let t_hf = cpu_per_call(|| drop(std::hint::black_box(hf.encode(&text).unwrap())));
            let t_core = cpu_per_call(|| drop(std::hint::black_box(core.encode_ordinary(&text))));
            let t_fast = cpu_per_call(|| drop(std::hint::black_box(fast.encode(&text).unwrap())));
            let rate = |t: Duration| want.len() as f64 / t.as_secs_f64() / 1e6;
            let ms = |t: Duration| t.as_secs_f64() * 1e3;
            println!(
                "| {kind} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.3} | {:.1} | {:.0}× |",
                want.len(),
                ms(t_hf),
                rate(t_hf),
                ms(t_core),
                rate(t_core),
                if same { "yes" } else { "no" },
                ms(t_fast),
                rate(t_fast),
                t_hf.as_secs_f64() / t_fast.as_secs_f64(),
            );
        }
    }
}
