//! Retention hints: pinned prefixes outlive unpinned ones, expire, stay within their budget,
//! and never keep a new request from being admitted.

use std::time::Duration;

use switchyard_core::{BlockHash, Retention, block_hashes};

use crate::SimConfig;
use crate::testutil::{Driver, bs, req, tiny};

fn range(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

fn keep(ttl_ms: u64, priority: u8) -> Retention {
    Retention { ttl_ms, priority }
}

fn cached(d: &Driver, hashes: &[BlockHash]) -> usize {
    let all: Vec<BlockHash> = d.sim.cached_blocks().iter().map(|b| b.hash).collect();
    hashes.iter().filter(|h| all.contains(h)).count()
}

/// A 4-token-block cache of 8 blocks holding A (finished first) and B (finished later), then
/// C arrives needing 4 blocks: plain LRU would evict A.
fn a_then_b_then_c(config: SimConfig, a_keep: Retention, advance: Duration) -> (Driver, usize) {
    let size = bs(4);
    let mut d = Driver::new(config);
    let (a, b, c) = (range(0, 16), range(100, 16), range(200, 16));
    let ha = block_hashes(&a, size);
    d.add(crate::SimRequest {
        retention: a_keep,
        ..req(1, a, 1)
    });
    d.run(10);
    d.add(req(2, b, 1));
    d.run(10);
    d.now += advance;
    d.add(req(3, c, 1));
    d.run(10);
    let kept = cached(&d, &ha);
    (d, kept)
}

#[test]
fn a_pinned_prefix_outlives_a_newer_unpinned_one() {
    let (_, kept) = a_then_b_then_c(tiny(4, 8), Retention::default(), Duration::ZERO);
    assert_eq!(kept, 0, "without a hint LRU evicts the older prefix");
    let (d, kept) = a_then_b_then_c(tiny(4, 8), keep(60_000, 0), Duration::ZERO);
    assert_eq!(kept, 4, "the pinned prefix stays whole");
    assert_eq!(cached(&d, &block_hashes(&range(100, 16), bs(4))), 0);
    // A's prefix is a hit for its session's next turn.
    let mut d = d;
    d.add(req(4, range(0, 20), 1));
    d.run(10);
    assert_eq!(d.outputs[&4][0].1.cached_prompt_tokens, 16);
}

#[test]
fn an_expired_pin_is_plain_lru_again() {
    let (_, kept) = a_then_b_then_c(tiny(4, 8), keep(1_000, 0), Duration::from_secs(2));
    assert_eq!(kept, 0);
}

#[test]
fn a_zero_budget_ignores_hints() {
    let config = SimConfig {
        retention_budget_fraction: 0.0,
        ..tiny(4, 8)
    };
    let (d, kept) = a_then_b_then_c(config, keep(60_000, 0), Duration::ZERO);
    assert_eq!(kept, 0);
    assert_eq!(d.sim.retained_blocks(), 0);
}

#[test]
fn pins_beyond_the_budget_are_plain_lru() {
    // Budget 2 of 8 blocks: only two of A's four blocks can be pinned.
    let config = SimConfig {
        retention_budget_fraction: 0.25,
        ..tiny(4, 8)
    };
    let (_, kept) = a_then_b_then_c(config, keep(60_000, 0), Duration::ZERO);
    assert!(kept <= 2, "{kept}");
}

#[test]
fn pinned_sessions_never_keep_a_new_session_from_being_admitted() {
    // Every block may be pinned, every session asks for a long pin at the highest priority,
    // and each new session's prompt needs nearly the whole cache: each is still admitted at
    // once (in the first step after it arrives), evicting pinned blocks as needed.
    let config = SimConfig {
        retention_budget_fraction: 1.0,
        ..tiny(4, 16)
    };
    let mut d = Driver::new(config);
    for s in 0..12u32 {
        let id = u64::from(s);
        d.add(crate::SimRequest {
            retention: keep(3_600_000, u8::MAX),
            ..req(id, range(1000 * (s + 1), 56), 2)
        });
        let first = d.step().clone();
        assert!(
            first.prefill_tokens > 0,
            "session {s} was not admitted: {first:?}"
        );
        d.run(20);
        assert!(d.outputs.contains_key(&id));
        assert!(d.sim.retained_blocks() <= 16);
    }
}

#[test]
fn a_held_prefills_hint_pins_its_blocks_once_the_hold_is_released() {
    // A is a disaggregated prefill: its blocks are held for a puller, then released. With a
    // hint they outlive B's (released later) when C needs room; without one, LRU takes them.
    for (hint, expect) in [(Retention::default(), 0), (keep(60_000, 0), 4)] {
        let mut d = Driver::new(tiny(4, 8));
        let a = range(0, 16);
        d.add(crate::SimRequest {
            hold_blocks: true,
            retention: hint,
            ..req(1, a.clone(), 1)
        });
        d.run(10);
        assert!(d.sim.release_hold(1));
        d.add(req(2, range(100, 16), 1));
        d.run(10);
        d.add(req(3, range(200, 16), 1));
        d.run(10);
        assert_eq!(cached(&d, &block_hashes(&a, bs(4))), expect, "{hint:?}");
    }
}
