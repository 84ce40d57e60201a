//! Whether each worker's KV events can be trusted: do they arrive at all, do they agree with
//! the worker's own view (digests), and is the worker what it registered as (model, block size,
//! hash scheme). Every finding is reported at once — metric, log line, `/admin/workers`,
//! `/ready` — rather than leaving the worker silently scored as holding nothing.

use std::time::Duration;

use serde::Serialize;
use switchyard_core::{HASH_SCHEME, hash_probe};
use switchyard_proto::v1;
use tokio::time::Instant;

#[derive(Debug, Clone, Default, Serialize)]
pub struct DigestStatus {
    pub checks: u64,
    pub mismatches: u64,
    /// Mismatches followed by a matching digest after the resync.
    pub repairs: u64,
    /// Whether the last check found the index diverged (a resync is then under way).
    pub diverged: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_check_secs_ago: Option<f64>,
    /// At the last check: `(block, tier)` pairs the worker holds and the index holds for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_blocks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_blocks: Option<u64>,
}

#[derive(Debug)]
struct State {
    events: u64,
    last_event: Option<Instant>,
    /// Since when (and how many) generations computed new full prompt blocks with no KV event
    /// arriving after.
    unanswered_since: Option<Instant>,
    unanswered: u64,
    silent: Option<String>,
    identity: Option<String>,
    digest: DigestStatus,
    last_digest: Option<Instant>,
}

/// One worker's KV audit state.
#[derive(Debug)]
pub struct KvAudit {
    state: parking_lot::Mutex<State>,
}

impl Default for KvAudit {
    fn default() -> Self {
        Self {
            state: parking_lot::Mutex::new(State {
                events: 0,
                last_event: None,
                unanswered_since: None,
                unanswered: 0,
                silent: None,
                identity: None,
                digest: DigestStatus::default(),
                last_digest: None,
            }),
        }
    }
}

/// What `/admin/workers` shows of a worker's KV audit.
#[derive(Debug, Clone, Serialize)]
pub struct KvAuditView {
    pub events_applied: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_event_secs_ago: Option<f64>,
    /// Why the worker is reported as not publishing KV events, while it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events_silent: Option<String>,
    /// What does not match in the worker's digests (model, block size, hash scheme).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_mismatch: Option<String>,
    pub digest: DigestStatus,
}

impl KvAudit {
    /// An event (or snapshot) of the worker was applied; true when this ends a silence.
    pub fn event_applied(&self) -> bool {
        let mut s = self.state.lock();
        s.events += 1;
        s.last_event = Some(Instant::now());
        s.unanswered_since = None;
        s.unanswered = 0;
        s.silent.take().is_some()
    }

    /// A generation on the worker, sent there `dispatched_ago`, computed new full prompt
    /// blocks: a KV event should follow — unless one was applied since it was sent (the engine
    /// announces blocks as it stores them, and the announcement can reach the gateway, over the
    /// event plane above all, before the response that shows them).
    pub fn expect_event(&self, dispatched_ago: Duration) {
        let mut s = self.state.lock();
        let now = Instant::now();
        let dispatched = now.checked_sub(dispatched_ago).unwrap_or(now);
        if s.last_event.is_some_and(|t| t >= dispatched) {
            return;
        }
        s.unanswered += 1;
        s.unanswered_since.get_or_insert_with(Instant::now);
    }

    /// Reports the worker silent when events were owed for longer than `after`; the reason
    /// when this call made it so.
    pub fn check_silence(&self, now: Instant, after: Duration) -> Option<String> {
        let mut s = self.state.lock();
        let since = s.unanswered_since?;
        if s.silent.is_some() || now.duration_since(since) < after {
            return None;
        }
        let reason = if s.events == 0 {
            format!(
                "served {} generation(s) that stored new prompt blocks over {:.1}s and has published no KV event since it joined: are KV events configured on its engine?",
                s.unanswered,
                now.duration_since(since).as_secs_f64()
            )
        } else {
            format!(
                "served {} generation(s) that stored new prompt blocks over {:.1}s with no KV event after them (last event {:.1}s ago): its events stopped",
                s.unanswered,
                now.duration_since(since).as_secs_f64(),
                s.last_event
                    .map_or(0.0, |t| now.duration_since(t).as_secs_f64())
            )
        };
        s.silent = Some(reason.clone());
        Some(reason)
    }

    pub fn silent(&self) -> Option<String> {
        self.state.lock().silent.clone()
    }

    pub fn identity_mismatch(&self) -> Option<String> {
        self.state.lock().identity.clone()
    }

    pub fn events_applied(&self) -> u64 {
        self.state.lock().events
    }

    pub fn last_event_age(&self) -> Option<Duration> {
        self.state.lock().last_event.map(|t| t.elapsed())
    }

    pub fn diverged(&self) -> bool {
        self.state.lock().digest.diverged
    }

    /// Records a digest check; true when it repaired an earlier divergence.
    pub fn digest_checked(&self, matched: bool, worker_blocks: u64, index_blocks: u64) -> bool {
        let mut s = self.state.lock();
        let d = &mut s.digest;
        d.checks += 1;
        d.worker_blocks = Some(worker_blocks);
        d.index_blocks = Some(index_blocks);
        let repaired = matched && d.diverged;
        if repaired {
            d.repairs += 1;
        }
        if !matched {
            d.mismatches += 1;
        }
        d.diverged = !matched;
        s.last_digest = Some(Instant::now());
        repaired
    }

    /// Sets what does not match in the worker's identity; true when it changed.
    pub fn set_identity(&self, problem: Option<String>) -> bool {
        let mut s = self.state.lock();
        let changed = s.identity != problem;
        s.identity = problem;
        changed
    }

    pub fn view(&self) -> KvAuditView {
        let s = self.state.lock();
        let mut digest = s.digest.clone();
        digest.last_check_secs_ago = s.last_digest.map(|t| t.elapsed().as_secs_f64());
        KvAuditView {
            events_applied: s.events,
            last_event_secs_ago: s.last_event.map(|t| t.elapsed().as_secs_f64()),
            events_silent: s.silent.clone(),
            identity_mismatch: s.identity.clone(),
            digest,
        }
    }
}

/// What in a digest does not match the worker's registration or this gateway's hashing.
pub fn identity_problem(
    model: &str,
    block_size: switchyard_core::BlockSize,
    digest: &v1::KvDigest,
) -> Option<String> {
    let mut problems = Vec::new();
    if digest.model != model {
        problems.push(format!(
            "it serves model {:?} but registered {model:?}",
            digest.model
        ));
    }
    if digest.block_size != block_size.get() {
        problems.push(format!(
            "it hashes blocks of {} tokens but registered {} (the model's block size)",
            digest.block_size,
            block_size.get()
        ));
    }
    if digest.hash_scheme != HASH_SCHEME {
        problems.push(format!(
            "it uses hash scheme {:?}, this gateway {HASH_SCHEME:?}",
            digest.hash_scheme
        ));
    } else if digest.block_size == block_size.get() && digest.hash_probe != hash_probe(block_size) {
        problems.push(format!(
            "its probe block hashes to {:016x}, here to {:016x}: another seed or hash implementation",
            digest.hash_probe,
            hash_probe(block_size)
        ));
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::BlockSize;

    #[tokio::test(start_paused = true)]
    async fn owed_events_make_a_worker_silent_until_one_arrives() {
        let kv = KvAudit::default();
        let after = Duration::from_secs(5);
        assert_eq!(kv.check_silence(Instant::now(), after), None);
        kv.expect_event(Duration::ZERO);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(kv.check_silence(Instant::now(), after), None);
        tokio::time::advance(Duration::from_secs(2)).await;
        let reason = kv.check_silence(Instant::now(), after).unwrap();
        assert!(reason.contains("no KV event since it joined"), "{reason}");
        // Reported once.
        assert_eq!(kv.check_silence(Instant::now(), after), None);
        assert!(kv.event_applied());
        assert_eq!(kv.silent(), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        kv.expect_event(Duration::ZERO);
        tokio::time::advance(Duration::from_secs(6)).await;
        let reason = kv.check_silence(Instant::now(), after).unwrap();
        assert!(reason.contains("its events stopped"), "{reason}");
    }

    /// An event applied after the generation was sent answers it even when it arrives before
    /// the response that shows the new blocks; one applied before the generation was sent
    /// does not.
    #[tokio::test(start_paused = true)]
    async fn an_event_that_beats_its_response_answers_it() {
        let kv = KvAudit::default();
        let after = Duration::from_secs(5);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!kv.event_applied());
        tokio::time::advance(Duration::from_millis(300)).await;
        // Sent 500 ms ago: the event 300 ms ago came after it.
        kv.expect_event(Duration::from_millis(500));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(kv.check_silence(Instant::now(), after), None);
        // Sent 100 ms ago: the last event, 6.3 s ago, came before it.
        kv.expect_event(Duration::from_millis(100));
        tokio::time::advance(Duration::from_secs(6)).await;
        let reason = kv.check_silence(Instant::now(), after).unwrap();
        assert!(reason.contains("its events stopped"), "{reason}");
    }

    #[test]
    fn digests_from_another_model_size_or_scheme_are_named() {
        let bs = BlockSize::new(16).unwrap();
        let good = v1::KvDigest {
            model: "m".into(),
            block_size: 16,
            hash_scheme: HASH_SCHEME.into(),
            hash_probe: hash_probe(bs),
            ..Default::default()
        };
        assert_eq!(identity_problem("m", bs, &good), None);
        let other = v1::KvDigest {
            model: "x".into(),
            block_size: 32,
            ..good.clone()
        };
        let problem = identity_problem("m", bs, &other).unwrap();
        assert!(problem.contains("\"x\"") && problem.contains("32") && problem.contains("16"));
        let seeded = v1::KvDigest {
            hash_probe: 7,
            ..good
        };
        assert!(identity_problem("m", bs, &seeded).unwrap().contains("seed"));
    }

    #[test]
    fn a_match_after_a_mismatch_counts_as_a_repair() {
        let kv = KvAudit::default();
        assert!(!kv.digest_checked(true, 3, 3));
        assert!(!kv.digest_checked(false, 3, 5));
        assert!(kv.diverged());
        assert!(kv.digest_checked(true, 3, 3));
        let view = kv.view();
        assert_eq!(
            (
                view.digest.checks,
                view.digest.mismatches,
                view.digest.repairs
            ),
            (3, 1, 1)
        );
    }
}
