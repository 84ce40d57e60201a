//! Retention hints as SGLang radix-eviction priorities (`--engine-retention-priority`, in front
//! of an SGLang started with `--radix-eviction-policy priority`).
//!
//! SGLang's rule (`python/sglang/srt/mem_cache/radix_cache.py` and `evict_policy.py`, read at
//! commit 006b0e3d317f1cd4a7300e919a4eaa878b1947e7):
//! * a request's `priority` reaches the radix tree when its KV is inserted
//!   (`cache_unfinished_req`, `cache_finished_req`: `InsertParams(priority=req.priority or 0)`);
//! * `_insert_helper` sets every node on the request's path to `max(node.priority, priority)`,
//!   a new node starts at the request's priority and a split node inherits its child's: a
//!   node's priority only ever rises while it lives;
//! * `PriorityStrategy` evicts the evictable leaf with the smallest `(priority,
//!   last_access_time)` first.
//!
//! So a later request over the prefix at a normal priority cannot take a hint back: the max
//! keeps the higher value for as long as the nodes live. What works under that rule is a
//! clock: every request the worker sends carries the time until which its blocks are worth
//! keeping, in milliseconds since the Unix epoch: the send time for a request without a hint,
//! the send time plus `ttl_ms` for a hinted one. A node's priority is then the latest such
//! deadline of the requests that used it; among nodes whose deadlines passed the order is that
//! of their last use (as SGLang's LRU), and a hinted prefix ranks as if used `ttl_ms` later.
//! Once its hint expires, every later request (whatever its prompt) carries a larger value, so
//! the departed session's blocks are evicted before theirs: the hint is taken back by the
//! passing of time, with no request sent for it, and no session keeps its blocks for good.
//!
//! Limits (docs/engines.md, "Retention hints"): the hint's own priority (0–255) is not
//! carried, since one integer cannot order by it first and still expire (the hints of one
//! gateway all carry the same one, and the simulator also evicts among them by soonest
//! expiry); the TTL counts from when the request is sent, because SGLang fixes a request's
//! priority when it arrives; requests SGLang gets from elsewhere (priority 0) are evicted
//! before all of the worker's. The same field orders SGLang's scheduling under
//! `--enable-priority-scheduling`, so the flag is refused together with
//! `--engine-priority-scheduling`.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use switchyard_core::Retention;

/// The eviction priority of a request sent at `now` with `retention`: its keep-until time in
/// milliseconds since the Unix epoch (the send time without a hint, plus `ttl_ms` with one).
pub fn eviction_priority(now: SystemTime, retention: &Retention) -> u64 {
    let now_ms = now
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    now_ms.saturating_add(retention.ttl_ms)
}

/// Puts the eviction priority of a request sent now into its SGLang `/generate` body
/// (`GenerateReqInput.priority`, at the top of the body).
pub fn set_eviction_priority(body: &mut Value, retention: &Retention) {
    body["priority"] = json!(eviction_priority(SystemTime::now(), retention));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    fn hint(ttl_ms: u64) -> Retention {
        Retention {
            ttl_ms,
            priority: 200,
        }
    }

    #[test]
    fn an_unhinted_request_carries_its_send_time_and_a_hinted_one_its_expiry() {
        let now = 1_765_000_000_000;
        assert_eq!(eviction_priority(at(now), &Retention::default()), now);
        assert_eq!(eviction_priority(at(now), &hint(30_000)), now + 30_000);
        // The hint's own priority does not move the value: expiry alone orders hints.
        assert_eq!(
            eviction_priority(
                at(now),
                &Retention {
                    ttl_ms: 30_000,
                    priority: 0
                }
            ),
            now + 30_000
        );
        assert_eq!(eviction_priority(at(now), &hint(u64::MAX)), u64::MAX);
    }

    /// SGLang keeps the max of the priorities that touched a node and evicts the smallest
    /// first: a hinted prefix outranks traffic sent before its expiry, and every request sent
    /// after its expiry outranks it, even one over the same prefix, which cannot lower it.
    #[test]
    fn a_hint_holds_until_its_expiry_and_is_taken_back_by_later_traffic() {
        let t = 1_765_000_000_000;
        let hinted = eviction_priority(at(t), &hint(10_000));
        // Re-touched by an unhinted request over the same prefix: the max keeps the hint.
        let node = hinted.max(eviction_priority(at(t + 1_000), &Retention::default()));
        assert_eq!(node, hinted);
        for sent in [t - 5_000, t, t + 1, t + 9_999] {
            assert!(
                eviction_priority(at(sent), &Retention::default()) < node,
                "{sent}"
            );
        }
        for sent in [t + 10_001, t + 60_000] {
            assert!(
                eviction_priority(at(sent), &Retention::default()) > node,
                "{sent}"
            );
        }
        // A later turn of the session extends the hold from its own send time.
        let next = node.max(eviction_priority(at(t + 8_000), &hint(10_000)));
        assert_eq!(next, t + 18_000);
    }

    #[test]
    fn the_body_carries_the_priority_at_its_top() {
        let mut body = json!({"input_ids": [1, 2, 3], "sampling_params": {}});
        let before = eviction_priority(SystemTime::now(), &Retention::default());
        set_eviction_priority(&mut body, &hint(5_000));
        let sent = body["priority"].as_u64().unwrap();
        assert!(sent >= before + 5_000, "{body}");
        assert!(body["sampling_params"].get("priority").is_none());
    }

    #[test]
    fn a_clock_before_the_epoch_gives_the_ttl_alone() {
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(eviction_priority(before, &hint(7)), 7);
    }
}
