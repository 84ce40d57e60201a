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
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_tokenize::Tokenizer;

const RUNS: usize = 3;
const MIN_CPU: Duration = Duration::from_millis(1500);
const SIZES: [usize; 3] = [1_000, 9_000, 36_000];
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn qwen3_json() -> PathBuf {
    let root = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/switchyard/test-models"));
    root.join("qwen3/tokenizer.json")
}

fn read_tree(dir: &Path, ext: &str, out: &mut String) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_tree(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// CJK text from the vocabulary: words of ideographs, a comma or full stop every few words.
fn cjk_text(json: &serde_json::Value, bytes: usize) -> String {
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
    let mut words: Vec<String> = json["model"]["vocab"]
        .as_object()
        .unwrap()
        .keys()
        .filter_map(|t| {
            let bytes: Vec<u8> = t.chars().map(|c| byte_char[&c]).collect();
            let s = String::from_utf8(bytes).ok()?;
            (s.chars().count() >= 1 && s.chars().all(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)))
                .then_some(s)
        })
        .collect();
    words.sort();
    let mut state = 0x1234_5678_u64;
    let mut out = String::new();
    while out.len() < bytes {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(&words[(state >> 33) as usize % words.len()]);
        match (state >> 20) % 9 {
            0 => out.push('，'),
            1 => out.push('。'),
            2 if (state >> 40).is_multiple_of(5) => out.push('\n'),
            _ => {}
        }
    }
    out
}

/// The longest prefix of `corpus` (repeated as needed) with about `tokens` tokens.
fn cut(tok: &Tokenizer, corpus: &str, tokens: usize) -> String {
    let mut text = corpus.to_owned();
    while tok.encode(&text).unwrap().len() < tokens {
        text.push_str(corpus);
    }
    let (mut lo, mut hi) = (0, text.len());
    while hi - lo > 64 {
        let mid = text.floor_char_boundary((lo + hi) / 2);
        if tok.encode(&text[..mid]).unwrap().len() < tokens {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    text.truncate(text.floor_char_boundary(hi));
    text
}

/// CPU time this thread has used (user + system), from `/proc/thread-self/stat`: on a
/// shared machine wall time counts the neighbours' builds too.
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    // Fields 14 and 15 of the file (utime, stime) are 11 and 12 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// Mean CPU time of one call, over at least `MIN_CPU` of CPU time (clock ticks are 10 ms).
fn cpu_per_call(mut f: impl FnMut()) -> Duration {
    f();
    let started = thread_cpu();
    let mut calls = 0u32;
    while calls < RUNS as u32 || thread_cpu() - started < MIN_CPU {
        f();
        calls += 1;
    }
    (thread_cpu() - started) / calls
}

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

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut prose = String::new();
    read_tree(&root.join("docs"), "md", &mut prose);
    let mut code = String::new();
    read_tree(&root.join("crates"), "rs", &mut code);
    let cjk = cjk_text(&json, 200_000);

    println!(
        "load: HF {hf_load:?}, HF + fast {fast_load:?}, tiktoken CoreBPE {core_load:?} (CPU time)"
    );
    println!(
        "| text | tokens | HF ms | HF M tok/s | tiktoken ms | tiktoken M tok/s | tiktoken = HF | fast ms | fast M tok/s | fast / HF |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|");
    for (kind, corpus) in [("prose", &prose), ("code", &code), ("CJK", &cjk)] {
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
