//! The decision log: every routing decision with the request, session and tenant it was for,
//! the candidates' scores, and — once known — what actually happened (the engine's realized
//! prefix hit, retry, migration, failure). A bounded ring in memory; finished decisions also go
//! to the optional on-disk log ([`super::disk`]), which queries read past the ring.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use switchyard_router::Decision;
use switchyard_router::serve::RescoreBasis;

use super::disk::DiskLog;
use super::flag::Flag;
use super::metrics::DecisionOutcomeLabels;
use super::tags::{RequestTags, unix_ms};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// Which pool a decision chose from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// A worker that generates (role decode or both).
    Decode,
    /// A prefill-pool worker (role prefill) computing the prompt's KV for a decode worker.
    Prefill,
}

/// How a decision's attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeStatus {
    /// Still running (or never reached an end the gateway saw).
    #[default]
    Pending,
    /// The generation finished on this worker (a prefill decision: its prefill was handed over).
    Completed,
    /// The worker failed before the first token; the request was retried elsewhere.
    Retried,
    /// The worker failed mid-stream; the generation moved to another worker.
    Migrated,
    /// The worker serves only with a prefill worker and none could serve; routed again.
    Rerouted,
    /// The request failed here.
    Failed,
    /// The client went away, a stop string matched, or the deadline passed.
    Cancelled,
}

impl OutcomeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Completed => "completed",
            Self::Retried => "retried",
            Self::Migrated => "migrated",
            Self::Rerouted => "rerouted",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Pending,
            Self::Completed,
            Self::Retried,
            Self::Migrated,
            Self::Rerouted,
            Self::Failed,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|o| o.as_str() == s)
    }
}

/// What happened after a decision.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcome {
    pub status: OutcomeStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// `aggregated`, `disaggregated`, or `placement` (the prompt's prefix pulled from the peer
    /// holding it) (decode decisions, once dispatched).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_worker: Option<String>,
    /// The retention hint the worker was sent (`ttl_ms`, `priority`), when the request is a
    /// session's turn and hints are on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retention: Option<switchyard_core::Retention>,
    /// Prompt tokens the engine reported reusing from its prefix cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub realized_cached_tokens: Option<u64>,
    /// Predicted minus realized cached tokens, when the two are comparable (the worker computed
    /// the prompt itself: aggregated decode, or a prefill decision).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction_error_tokens: Option<i64>,
    /// Set when the realized hit fell far from the prediction, with the likely cause.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flag: Option<Flag>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at_unix_ms: Option<u64>,
}

/// One decision as the log keeps it.
#[derive(Debug)]
pub struct DecisionEntry {
    /// Increases by one per decision of this gateway.
    pub id: u64,
    pub tags: Arc<RequestTags>,
    pub model: String,
    pub block_size: u32,
    pub at_unix_ms: u64,
    /// 1 for the request's first route; a later attempt follows one whose outcome says why
    /// (`retried`, `migrated`, `rerouted`).
    pub attempt: u32,
    /// The pool chosen from: `decode` (generation) or `prefill` (disaggregated prefill).
    pub stage: Stage,
    /// The routed request's own decision, shared rather than copied.
    pub decision: Arc<Decision>,
    /// Why the candidates were narrowed, when an earlier attempt of the request says so.
    pub note: Option<String>,
    /// Prompt tokens of the chosen worker's leading blocks in any tier, per the index: an engine
    /// loads what it holds in host memory, on disk or in a remote store back rather than
    /// recompute it, and reports those tokens as cached like its device hits.
    pub predicted_cached_tokens: u64,
    /// What re-scoring the decision under another policy needs besides its explanation
    /// ([`switchyard_router::serve::counterfactual`]); kept only in the ring.
    pub basis: Option<RescoreBasis>,
    outcome: parking_lot::Mutex<Outcome>,
}

impl DecisionEntry {
    pub fn new(
        tags: Arc<RequestTags>,
        model: String,
        block_size: u32,
        attempt: u32,
        stage: Stage,
        decision: Arc<Decision>,
        note: Option<String>,
    ) -> Self {
        let predicted_blocks = decision.chosen().map_or(0, |c| c.overlap.any_tier);
        Self {
            id: 0,
            tags,
            model,
            block_size,
            at_unix_ms: unix_ms(),
            attempt,
            stage,
            decision,
            note,
            predicted_cached_tokens: u64::from(predicted_blocks) * u64::from(block_size),
            basis: None,
            outcome: parking_lot::Mutex::new(Outcome::default()),
        }
    }

    /// The same entry, re-scorable under another policy from `basis`.
    pub fn with_basis(mut self, basis: RescoreBasis) -> Self {
        self.basis = Some(basis);
        self
    }

    pub fn outcome(&self) -> Outcome {
        self.outcome.lock().clone()
    }

    pub fn status(&self) -> OutcomeStatus {
        self.outcome.lock().status
    }

    /// Changes the outcome while it is pending; false once it has ended.
    pub fn update(&self, change: impl FnOnce(&mut Outcome)) -> bool {
        let mut outcome = self.outcome.lock();
        if outcome.status != OutcomeStatus::Pending {
            return false;
        }
        change(&mut outcome);
        true
    }

    /// Ends the outcome (once: later calls change nothing); true when this call ended it.
    pub fn end(&self, status: OutcomeStatus, detail: Option<String>) -> bool {
        let mut outcome = self.outcome.lock();
        if outcome.status != OutcomeStatus::Pending {
            return false;
        }
        outcome.status = status;
        outcome.detail = detail;
        outcome.finished_at_unix_ms = Some(unix_ms());
        true
    }

    /// The JSON the admin API and the on-disk log show.
    pub fn view(&self) -> serde_json::Value {
        let outcome = self.outcome();
        let tags = &self.tags;
        let mut view = serde_json::json!({
            "id": self.id,
            "request_id": tags.request_id,
            "model": self.model,
            "at_unix_ms": self.at_unix_ms,
            "attempt": self.attempt,
            "stage": self.stage,
            "worker": self.decision.worker,
            "block_size": self.block_size,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "explanation": self.decision.explanation,
            "outcome": outcome,
        });
        if let Some(map) = view.as_object_mut() {
            let optional = [
                ("choice", tags.choice.map(serde_json::Value::from)),
                ("session", tags.session.clone().map(serde_json::Value::from)),
                ("tenant", tags.tenant.clone().map(serde_json::Value::from)),
                (
                    "session_source",
                    tags.session_source.map(serde_json::Value::from),
                ),
                (
                    "ignored_fields",
                    (!tags.ignored_fields.is_empty())
                        .then(|| serde_json::Value::from(tags.ignored_fields.clone())),
                ),
                ("note", self.note.clone().map(serde_json::Value::from)),
                (
                    "session_hold",
                    tags.session_hold
                        .and_then(|hold| serde_json::to_value(hold).ok()),
                ),
            ];
            for (key, value) in optional {
                if let Some(value) = value {
                    map.insert(key.to_owned(), value);
                }
            }
        }
        view
    }
}

/// What `/admin/decisions` filters on; every given field must match.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionQuery {
    pub limit: Option<usize>,
    pub request_id: Option<String>,
    pub session: Option<String>,
    pub tenant: Option<String>,
    /// The chosen worker.
    pub worker: Option<String>,
    pub model: Option<String>,
    /// Decisions at or after this time (unix milliseconds).
    pub since_ms: Option<u64>,
    /// Decisions before this time (unix milliseconds).
    pub until_ms: Option<u64>,
    /// `pending`, `completed`, `retried`, `migrated`, `rerouted`, `failed`, `cancelled`.
    pub outcome: Option<String>,
    /// Only decisions flagged as mispredicted (`true`) or not (`false`).
    pub flagged: Option<bool>,
    /// `decode` or `prefill`.
    pub stage: Option<String>,
}

pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 10_000;

impl DecisionQuery {
    /// One sentence on what is wrong with the query, if anything.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(outcome) = &self.outcome
            && OutcomeStatus::parse(outcome).is_none()
        {
            return Err(format!(
                "unknown outcome {outcome:?}: use pending, completed, retried, migrated, rerouted, failed or cancelled"
            ));
        }
        if let Some(stage) = &self.stage
            && !matches!(stage.as_str(), "decode" | "prefill")
        {
            return Err(format!("unknown stage {stage:?}: use decode or prefill"));
        }
        if let (Some(since), Some(until)) = (self.since_ms, self.until_ms)
            && since > until
        {
            return Err(format!("since_ms {since} is after until_ms {until}"));
        }
        if self.limit == Some(0) {
            return Err("limit must be at least 1".to_owned());
        }
        Ok(())
    }

    pub fn limit(&self) -> usize {
        self.limit.unwrap_or(DEFAULT_LIMIT).min(MAX_LIMIT)
    }

    /// Whether a decision's JSON view (from the ring or the disk log) matches.
    pub fn matches(&self, view: &serde_json::Value) -> bool {
        let text = |key: &str| view.get(key).and_then(serde_json::Value::as_str);
        let eq = |want: &Option<String>, got: Option<&str>| {
            want.as_deref().is_none_or(|want| got == Some(want))
        };
        let at = view.get("at_unix_ms").and_then(serde_json::Value::as_u64);
        let outcome = view.get("outcome");
        let status = outcome
            .and_then(|o| o.get("status"))
            .and_then(serde_json::Value::as_str);
        let flagged = outcome.is_some_and(|o| o.get("flag").is_some_and(|f| !f.is_null()));
        eq(&self.request_id, text("request_id"))
            && eq(&self.session, text("session"))
            && eq(&self.tenant, text("tenant"))
            && eq(&self.worker, text("worker"))
            && eq(&self.model, text("model"))
            && eq(&self.outcome, status)
            && eq(&self.stage, text("stage"))
            && self.flagged.is_none_or(|want| want == flagged)
            && self.since_ms.is_none_or(|s| at.is_some_and(|at| at >= s))
            && self.until_ms.is_none_or(|u| at.is_some_and(|at| at < u))
    }
}

/// The decision log of one gateway.
#[derive(Debug)]
pub struct DecisionLog {
    ring: parking_lot::Mutex<VecDeque<Arc<DecisionEntry>>>,
    capacity: usize,
    next_id: AtomicU64,
    disk: Option<DiskLog>,
    /// Finished decisions by model, policy, stage and outcome.
    outcomes: Family<DecisionOutcomeLabels, Counter>,
}

impl DecisionLog {
    /// A log keeping the last `capacity` decisions in memory (at least one), and finished ones
    /// on `disk` when given.
    pub fn new(capacity: usize, disk: Option<DiskLog>) -> Self {
        Self {
            ring: parking_lot::Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            next_id: AtomicU64::new(1),
            disk,
            outcomes: Family::default(),
        }
    }

    /// The same log, counting finished decisions in `outcomes` (a registered metric).
    pub fn counting_outcomes(mut self, outcomes: Family<DecisionOutcomeLabels, Counter>) -> Self {
        self.outcomes = outcomes;
        self
    }

    /// How many decisions the ring keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Logs a new decision and returns it as the log holds it.
    pub fn push(&self, mut entry: DecisionEntry) -> Arc<DecisionEntry> {
        entry.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(entry);
        let evicted = {
            let mut ring = self.ring.lock();
            let evicted = (ring.len() == self.capacity)
                .then(|| ring.pop_front())
                .flatten();
            ring.push_back(Arc::clone(&entry));
            evicted
        };
        // Freed outside the ring's lock: an explanation is several allocations, and every
        // decision of every model pushes here.
        drop(evicted);
        entry
    }

    /// `entry` ended: counted, and written to the on-disk log, once.
    pub fn ended(&self, entry: &DecisionEntry) {
        self.outcomes
            .get_or_create(&DecisionOutcomeLabels {
                model: entry.model.clone(),
                policy: entry.decision.explanation.policy,
                stage: match entry.stage {
                    Stage::Decode => "decode",
                    Stage::Prefill => "prefill",
                },
                outcome: entry.status().as_str(),
            })
            .inc();
        if let Some(disk) = &self.disk {
            disk.write(entry.view());
        }
    }

    /// Ends `entry` with `status` unless it has ended already, and logs it to disk.
    pub fn end(&self, entry: &DecisionEntry, status: OutcomeStatus, detail: Option<String>) {
        if entry.end(status, detail) {
            self.ended(entry);
        }
    }

    /// Every decision in the ring, oldest first.
    pub fn entries(&self) -> Vec<Arc<DecisionEntry>> {
        self.ring.lock().iter().cloned().collect()
    }

    /// The decisions matching `query`, newest first: the ring first, then (for what is older
    /// than the ring's oldest decision) the on-disk log.
    pub async fn query(&self, query: &DecisionQuery) -> Vec<serde_json::Value> {
        let limit = query.limit();
        let (mut out, oldest) = {
            let ring = self.entries();
            let oldest = ring.first().map_or(u64::MAX, |e| e.id);
            let out: Vec<serde_json::Value> = ring
                .iter()
                .rev()
                .map(|e| e.view())
                .filter(|v| query.matches(v))
                .take(limit)
                .collect();
            (out, oldest)
        };
        if out.len() < limit
            && let Some(disk) = &self.disk
        {
            let older = disk
                .read_before(
                    oldest,
                    {
                        let query = query.clone();
                        move |view| query.matches(view)
                    },
                    limit - out.len(),
                )
                .await;
            out.extend(older);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{KvTierCosts, WorkerId};
    use switchyard_router::policy::Onboarding;
    use switchyard_router::{Explanation, TierOverlap, WorkerScore};

    pub(crate) fn decision(worker: &str, device: u32) -> Arc<Decision> {
        let id = WorkerId::new(worker).unwrap();
        Arc::new(Decision {
            worker: id.clone(),
            explanation: Explanation {
                policy: "kv",
                chosen: id.clone(),
                why: "test".into(),
                prompt_tokens: 64,
                prompt_blocks: 4,
                sampled: false,
                workers: vec![WorkerScore {
                    pending_blocks: 0,
                    worker: id,
                    overlap: TierOverlap::uniform(device),
                    uncached_prompt_tokens: 0,
                    queued_prefill_tokens: 0,
                    running_requests: 0,
                    active_decode_sequences: 0,
                    active_blocks: 0,
                    kv_utilisation: 0.0,
                    onboarding: Onboarding::price(
                        TierOverlap::uniform(device),
                        KvTierCosts::typical(1),
                        false,
                        0,
                        16,
                    ),
                    overflow_blocks: 0,
                    prefill_term: 0.0,
                    decode_term: 0.0,
                    score: 0.0,
                    probability: None,
                }],
            },
        })
    }

    fn entry(request: &str, session: Option<&str>, worker: &str) -> DecisionEntry {
        let tags = RequestTags {
            request_id: request.into(),
            choice: None,
            session: session.map(str::to_owned),
            tenant: Some("user:a".into()),
            ..RequestTags::default()
        };
        DecisionEntry::new(
            Arc::new(tags),
            "m".into(),
            16,
            1,
            Stage::Decode,
            decision(worker, 2),
            None,
        )
    }

    #[test]
    fn the_prediction_counts_blocks_the_engine_loads_back_from_other_tiers() {
        // Two blocks on the device, then three in host memory and one on disk: the engine
        // loads all six back and reports them cached, so all six are predicted.
        let mut decision = (*decision("w0", 2)).clone();
        decision.explanation.workers[0].overlap = TierOverlap {
            device: 2,
            device_or_host: 5,
            device_host_or_disk: 6,
            any_tier: 6,
        };
        let entry = DecisionEntry::new(
            Arc::new(RequestTags::default()),
            "m".into(),
            16,
            1,
            Stage::Decode,
            Arc::new(decision),
            None,
        );
        assert_eq!(entry.predicted_cached_tokens, 6 * 16);
    }

    #[tokio::test]
    async fn queries_filter_by_every_key_newest_first_within_the_ring() {
        let log = DecisionLog::new(3, None);
        let a = log.push(entry("r1", Some("s1"), "w0"));
        log.push(entry("r2", Some("s1"), "w1"));
        log.push(entry("r3", None, "w1"));
        assert_eq!(a.predicted_cached_tokens, 32);
        let q = |f: fn(&mut DecisionQuery)| {
            let mut q = DecisionQuery::default();
            f(&mut q);
            q
        };
        let ids = |v: Vec<serde_json::Value>| -> Vec<String> {
            v.iter()
                .map(|d| d["request_id"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(ids(log.query(&q(|_| {})).await), ["r3", "r2", "r1"]);
        assert_eq!(
            ids(log.query(&q(|q| q.session = Some("s1".into()))).await),
            ["r2", "r1"]
        );
        assert_eq!(
            ids(log.query(&q(|q| q.worker = Some("w0".into()))).await),
            ["r1"]
        );
        assert_eq!(
            ids(log.query(&q(|q| q.request_id = Some("r2".into()))).await),
            ["r2"]
        );
        assert_eq!(ids(log.query(&q(|q| q.limit = Some(1))).await), ["r3"]);
        log.end(&a, OutcomeStatus::Completed, None);
        assert_eq!(
            ids(log
                .query(&q(|q| q.outcome = Some("completed".into())))
                .await),
            ["r1"]
        );
        // An ended outcome does not change again.
        assert!(!a.end(OutcomeStatus::Failed, None));
        assert_eq!(a.status(), OutcomeStatus::Completed);
        // The ring is bounded: a fourth decision pushes the first out.
        log.push(entry("r4", None, "w0"));
        assert_eq!(ids(log.query(&q(|_| {})).await), ["r4", "r3", "r2"]);
        assert!(log.query(&q(|q| q.until_ms = Some(0))).await.is_empty());
    }

    #[test]
    fn bad_queries_get_a_sentence() {
        let q = DecisionQuery {
            outcome: Some("done".into()),
            ..DecisionQuery::default()
        };
        assert!(q.validate().unwrap_err().contains("completed"));
        let q = DecisionQuery {
            since_ms: Some(5),
            until_ms: Some(1),
            ..DecisionQuery::default()
        };
        assert!(q.validate().is_err());
    }
}
