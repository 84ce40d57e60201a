//! Texts and CPU-time measurement shared by the tokenizer benches: Qwen3's `tokenizer.json`
//! (from `fetch-test-models.sh`), prose and code from this repository, CJK from the
//! vocabulary, cut to a token count; and the CPU time of the calling thread.

#![allow(dead_code)] // each bench uses part of it

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_tokenize::Tokenizer;

const RUNS: usize = 3;
const MIN_CPU: Duration = Duration::from_millis(1500);

pub fn qwen3_json() -> PathBuf {
    let root = std::env::var_os("SWITCHYARD_TEST_MODELS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/test-models"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/switchyard/test-models"));
    root.join("qwen3/tokenizer.json")
}

pub fn read_tree(dir: &Path, ext: &str, out: &mut String) {
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
pub fn cjk_text(json: &serde_json::Value, bytes: usize) -> String {
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
pub fn cut(tok: &Tokenizer, corpus: &str, tokens: usize) -> String {
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

/// User + system CPU time from a `/proc/.../stat` file.
fn stat_cpu(path: &str) -> Duration {
    let stat = std::fs::read_to_string(path).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    // Fields 14 and 15 of the file (utime, stime) are 11 and 12 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// CPU time this thread has used (user + system), from `/proc/thread-self/stat`: on a
/// shared machine wall time counts the neighbours' builds too.
pub fn thread_cpu() -> Duration {
    stat_cpu("/proc/thread-self/stat")
}

/// CPU time of the whole process (every thread), user and system.
pub fn process_cpu() -> Duration {
    stat_cpu("/proc/self/stat")
}

/// Mean `clock` time of one call, over at least `MIN_CPU` of it (clock ticks are 10 ms).
fn per_call(clock: fn() -> Duration, mut f: impl FnMut()) -> Duration {
    f();
    let started = clock();
    let mut calls = 0u32;
    while calls < RUNS as u32 || clock() - started < MIN_CPU {
        f();
        calls += 1;
    }
    (clock() - started) / calls
}

/// Mean CPU time of the whole process per call (helper threads included).
pub fn process_cpu_per_call(f: impl FnMut()) -> Duration {
    per_call(process_cpu, f)
}

/// Mean CPU time of this thread per call.
pub fn cpu_per_call(f: impl FnMut()) -> Duration {
    per_call(thread_cpu, f)
}

/// The three texts of the throughput benches, by name: prose (this repository's `docs/*.md`),
/// code (its `crates/**/*.rs`) and `cjk_bytes` of CJK (see [`cjk_text`]).
pub fn corpora(json: &serde_json::Value, cjk_bytes: usize) -> [(&'static str, String); 3] {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut prose = String::new();
    read_tree(&root.join("docs"), "md", &mut prose);
    let mut code = String::new();
    read_tree(&root.join("crates"), "rs", &mut code);
    [
        ("prose", prose),
        ("code", code),
        ("CJK", cjk_text(json, cjk_bytes)),
    ]
}
