//! The prefix cache on the built-in cl100k: hits equal fresh tokenizations, counters move,
//! the byte bound holds while prompts churn, and a bound of 0 turns it off.

use super::*;
use crate::Tokenizer;

fn chat(system: &str, user: &str) -> String {
    format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// Tokenizes `text` through `cache` as the session tokenizer does: the cached opening, the
/// rest fresh, the new segments stored. Returns the ids and how many were reused.
fn encode(tok: &Tokenizer, cache: &PrefixCache, text: &str) -> (Vec<TokenId>, usize) {
    let cuts = cache.cuts(text);
    let mut hit = cache.lookup(text, &cuts);
    cache.count(&hit);
    let reused = hit.ids.len();
    let (ids, starts) = tok.encode_with_starts(&text[hit.bytes..]).unwrap();
    hit.ids.extend(ids);
    hit.starts
        .extend(starts.into_iter().map(|s| s + hit.bytes as u32));
    cache
        .insert(text, &cuts, hit.segments, &hit.ids, &hit.starts)
        .unwrap();
    (hit.ids, reused)
}

#[test]
fn a_shared_system_prompt_is_reused_across_prompts_and_counted() {
    let tok = Tokenizer::builtin_cl100k();
    let cache = PrefixCache::new(&tok, 1 << 20);
    let system = "You are a coding agent. Use the tools below; answer in JSON. ".repeat(30);
    let system_tokens = tok.encode(&system).unwrap().len();
    let a = chat(&system, "Fix the failing test in src/lib.rs.");
    let b = chat(&system, "Добавь описание функции — и пример 🦀.");
    let (ids, reused) = encode(&tok, &cache, &a);
    assert_eq!((ids, reused), (tok.encode(&a).unwrap(), 0));
    let (ids, reused) = encode(&tok, &cache, &b);
    assert_eq!(ids, tok.encode(&b).unwrap());
    assert!(reused >= system_tokens, "{reused} of {system_tokens}");
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (1, 1));
    assert_eq!(stats.reused_tokens, reused as u64);
    assert!(stats.segments >= 1 && stats.bytes > system.len());
    assert_eq!(stats.evictions, 0);
}

#[test]
fn the_byte_bound_holds_while_prompts_churn() {
    let tok = Tokenizer::builtin_cl100k();
    let bound = 64 << 10;
    let cache = PrefixCache::new(&tok, bound);
    let hot = "Shared instructions for every sub-agent. ".repeat(20);
    for i in 0..200 {
        let cold = format!("System prompt number {i}, unique to this tenant. ").repeat(12);
        let text = chat(&cold, &format!("question {i}"));
        assert_eq!(encode(&tok, &cache, &text).0, tok.encode(&text).unwrap());
        let shared = chat(&hot, &format!("task {i}"));
        let (ids, reused) = encode(&tok, &cache, &shared);
        assert_eq!(ids, tok.encode(&shared).unwrap());
        assert!(i == 0 || reused > 0, "the hot prompt was evicted at {i}");
        assert!(
            cache.stats().bytes <= bound,
            "{} > {bound}",
            cache.stats().bytes
        );
    }
    let stats = cache.stats();
    assert!(stats.evictions > 0 && stats.hits >= 199, "{stats:?}");
}

#[test]
fn a_zero_bound_turns_the_cache_off() {
    let tok = Tokenizer::builtin_cl100k();
    let cache = PrefixCache::new(&tok, 0);
    assert!(!cache.is_enabled());
    let text = chat(&"x y z ".repeat(200), "q");
    for _ in 0..2 {
        assert_eq!(encode(&tok, &cache, &text), (tok.encode(&text).unwrap(), 0));
    }
    assert_eq!(
        cache.stats(),
        PrefixStats::default(),
        "nothing held, nothing counted"
    );
}
