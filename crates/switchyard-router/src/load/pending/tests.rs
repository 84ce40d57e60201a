#![allow(clippy::unwrap_used)]

use super::*;

const BLOCK: u32 = 16;
/// One engine step: 64 prompt tokens (4 blocks).
const STEP: u64 = 64;

fn w(n: &str) -> WorkerId {
    WorkerId::new(n).unwrap()
}

/// A chain of `n` blocks of family `f` (chained: a longer chain of the same family extends a
/// shorter one).
fn chain(f: u64, n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(f * 1_000 + i)).collect()
}

fn add(p: &mut PendingPrefixes, request: u64, worker: &str, blocks: &[BlockHash], prefill: u64) {
    p.add(
        Incoming {
            request,
            worker: &w(worker),
            blocks,
            prompt_tokens: blocks.len() as u64 * u64::from(BLOCK),
            prefill_tokens: prefill,
        },
        0,
        1_000,
    );
}

fn leading(p: &PendingPrefixes, c: &[BlockHash]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = p
        .leading(c, BLOCK, STEP)
        .into_iter()
        .map(|(w, n)| (w.to_string(), n))
        .collect();
    out.sort();
    out
}

#[test]
fn blocks_count_only_when_a_step_of_work_lies_between_them_and_the_new_request() {
    let mut p = PendingPrefixes::default();
    // A 10-block prompt on `a`: a request sharing its first 4 blocks starts at least 6 blocks
    // (96 tokens, more than a step) after they are computed.
    add(&mut p, 1, "a", &chain(1, 10), 160);
    assert_eq!(leading(&p, &chain(1, 4)), [("a".to_owned(), 4)]);
    // Sharing all 10 leaves nothing between: the same step computes both.
    assert!(leading(&p, &chain(1, 12)).is_empty());
    // ... unless a step of prefill was queued behind it since.
    add(&mut p, 2, "a", &chain(2, 4), 64);
    assert_eq!(leading(&p, &chain(1, 12)), [("a".to_owned(), 10)]);
    // Or once its prefill is done, whatever the queue.
    p.remove(2);
    assert!(leading(&p, &chain(1, 12)).is_empty());
    p.prefill_done(1);
    assert_eq!(leading(&p, &chain(1, 12)), [("a".to_owned(), 10)]);
    // Another chain shares nothing.
    assert!(leading(&p, &chain(3, 12)).is_empty());
}

#[test]
fn the_work_behind_counts_only_what_is_still_to_compute_on_that_worker() {
    let mut p = PendingPrefixes::default();
    add(&mut p, 1, "a", &chain(1, 5), 80);
    // Behind it on `b`, not on `a`: nothing counts for `a`.
    add(&mut p, 2, "b", &chain(2, 8), 128);
    assert!(leading(&p, &chain(1, 5)).is_empty());
    // Behind it on `a`, but a disaggregated decode that computes none of its prompt.
    add(&mut p, 3, "a", &chain(3, 8), 0);
    assert!(leading(&p, &chain(1, 5)).is_empty());
    // Its serving mode changes: the prefill came back to `a`.
    p.set_prefill_tokens(3, 128);
    assert_eq!(leading(&p, &chain(1, 5)), [("a".to_owned(), 5)]);
    p.prefill_done(3);
    assert!(leading(&p, &chain(1, 5)).is_empty());
    // The best request per worker wins.
    add(&mut p, 4, "b", &chain(1, 20), 320);
    assert_eq!(
        leading(&p, &chain(1, 5)),
        [("b".to_owned(), 5)],
        "request 1 on a has too little behind it; request 4 on b has 15 blocks past the shared 5"
    );
}

#[test]
fn finished_expired_and_departed_requests_leave_nothing_behind() {
    let mut p = PendingPrefixes::default();
    add(&mut p, 1, "a", &chain(1, 10), 160);
    add(&mut p, 2, "b", &chain(1, 10), 160);
    p.remove(1);
    p.remove_worker(&w("b"));
    assert!(p.is_empty());
    assert!(p.by_first.is_empty() && p.queues.is_empty());
    // Expiry: at 120 the first (routed at 0) is past a TTL of 100, the second not.
    let at = |p: &mut PendingPrefixes, request: u64, family: u64, now: Tick, ttl: Tick| {
        let blocks = chain(family, 1);
        p.add(
            Incoming {
                request,
                worker: &w("a"),
                blocks: &blocks,
                prompt_tokens: 16,
                prefill_tokens: 16,
            },
            now,
            ttl,
        );
    };
    at(&mut p, 1, 1, 0, 100);
    at(&mut p, 2, 2, 50, 100);
    at(&mut p, 3, 3, 120, 100);
    assert_eq!(p.len(), 2);
    assert!(!p.requests.contains_key(&1));
    // A finished request's queue entry does not hold back the expiry of later ones.
    p.remove(2);
    at(&mut p, 4, 1, 230, 100);
    assert_eq!(p.len(), 1);
    for i in 0..(MAX_PENDING as u64 + 10) {
        at(&mut p, 100 + i, 2, 300, 1_000_000);
    }
    assert_eq!(p.len(), MAX_PENDING);
}

#[test]
fn shared_prefixes_are_found_by_bisection() {
    let a = chain(1, 9);
    let mut b = chain(1, 9);
    assert_eq!(shared_prefix(&a, &b), 9);
    b[5] = BlockHash(7);
    b[6] = BlockHash(8);
    b[7] = BlockHash(9);
    b[8] = BlockHash(10);
    assert_eq!(shared_prefix(&a, &b), 5);
    assert_eq!(shared_prefix(&a, &chain(1, 3)), 3);
    assert_eq!(shared_prefix(&a, &chain(2, 3)), 0);
    assert_eq!(shared_prefix(&a, &[]), 0);
}
