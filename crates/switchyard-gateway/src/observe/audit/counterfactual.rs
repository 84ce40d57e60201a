//! Counterfactual explain: what another policy would have chosen for a logged decision.
//!
//! Each decision in the ring keeps a [`RescoreBasis`] beside its explanation (about 80 bytes
//! plus 8 per candidate; see [`switchyard_router::serve::counterfactual`]), so the question is
//! answered by the router's own policy code over the candidates, load and index overlap the
//! live policy saw — the index *as recorded*, since the request itself has since stored its
//! prompt on the worker it went to. Decisions older than the ring (on disk only) keep no basis
//! and are not found.

use serde::{Deserialize, Serialize};
use switchyard_core::BlockSize;
use switchyard_router::serve::rescore;
use switchyard_router::{Decision, PolicyConfig, PolicyKind, RouteError};

use super::decisions::{DecisionEntry, DecisionLog};
use crate::error::ApiError;

/// `GET /admin/explain?request_id=…&policy=…`, or the same fields as a `POST` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CounterfactualQuery {
    /// Every decision of this request (`x-request-id`): attempts, stages and choices.
    pub request_id: Option<String>,
    /// Or one decision by its `id` in `/admin/decisions`.
    pub decision_id: Option<u64>,
    /// The policy to re-score with (`kv`, `round-robin`, `random`, `least-loaded`, `session`,
    /// `approx-kv`).
    pub policy: String,
}

/// The answer.
#[derive(Debug, Serialize)]
pub struct Counterfactuals {
    pub policy: PolicyKind,
    /// Which index the overlaps come from: always `recorded`, the index at decision time.
    pub index: &'static str,
    /// One per matching decision, oldest first.
    pub decisions: Vec<Counterfactual>,
}

/// One decision re-scored.
#[derive(Debug, Serialize)]
pub struct Counterfactual {
    pub id: u64,
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choice: Option<u32>,
    pub model: String,
    pub stage: crate::observe::audit::decisions::Stage,
    pub attempt: u32,
    pub at_unix_ms: u64,
    /// The live decision: its policy and worker.
    pub live: LiveChoice,
    /// What `policy` chooses, with its per-worker explanation.
    pub counterfactual: Decision,
    /// Whether `policy` chooses another worker than the live decision did.
    pub differs: bool,
}

#[derive(Debug, Serialize)]
pub struct LiveChoice {
    pub policy: &'static str,
    pub worker: String,
}

/// Re-scores the decisions `query` names under its policy, built from `config` (the gateway's
/// policy settings).
pub fn counterfactuals(
    log: &DecisionLog,
    query: &CounterfactualQuery,
    config: &PolicyConfig,
) -> Result<Counterfactuals, ApiError> {
    let policy: PolicyKind = query
        .policy
        .parse()
        .map_err(|e: RouteError| ApiError::bad_param("policy", e.to_string()))?;
    if query.request_id.is_none() && query.decision_id.is_none() {
        return Err(ApiError::bad_request(
            "name the decision to re-score: `request_id` (every decision of the request) or `decision_id`",
        ));
    }
    let wanted = |e: &DecisionEntry| {
        query
            .request_id
            .as_deref()
            .is_none_or(|id| e.tags.request_id == id)
            && query.decision_id.is_none_or(|id| e.id == id)
    };
    let mut decisions = Vec::new();
    for entry in log.entries().iter().filter(|e| wanted(e)) {
        let Some(basis) = &entry.basis else { continue };
        let block_size = BlockSize::new(entry.block_size)
            .map_err(|e| ApiError::Internal(format!("decision {}: {e}", entry.id)))?;
        let decision = &entry.decision;
        let counterfactual = rescore(policy, config, block_size, decision, basis)
            .map_err(|e| ApiError::Internal(format!("re-scoring decision {}: {e}", entry.id)))?;
        decisions.push(Counterfactual {
            id: entry.id,
            request_id: entry.tags.request_id.clone(),
            choice: entry.tags.choice,
            model: entry.model.clone(),
            stage: entry.stage,
            attempt: entry.attempt,
            at_unix_ms: entry.at_unix_ms,
            live: LiveChoice {
                policy: decision.explanation.policy,
                worker: decision.worker.to_string(),
            },
            differs: counterfactual.worker != decision.worker,
            counterfactual,
        });
    }
    if decisions.is_empty() {
        let what = match (&query.request_id, query.decision_id) {
            (Some(request), Some(id)) => format!("decision {id} of request {request:?}"),
            (Some(request), None) => format!("decision of request {request:?}"),
            (None, Some(id)) => format!("decision {id}"),
            (None, None) => "decision".to_owned(),
        };
        return Err(ApiError::NotFound(format!(
            "no {what} among the last {} decisions this gateway keeps in memory (decision_log_size); only those can be re-scored",
            log.capacity()
        )));
    }
    Ok(Counterfactuals {
        policy,
        index: "recorded",
        decisions,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use switchyard_core::WorkerId;
    use switchyard_router::serve::{RescoreBasis, ServingCore, route_request};
    use switchyard_router::{Candidate, IndexConfig, LoadConfig};

    use super::*;
    use crate::observe::audit::RequestTags;
    use crate::observe::audit::decisions::Stage;

    fn query(request_id: Option<&str>, policy: &str) -> CounterfactualQuery {
        CounterfactualQuery {
            request_id: request_id.map(str::to_owned),
            decision_id: None,
            policy: policy.into(),
        }
    }

    #[test]
    fn a_logged_decision_is_rescored_and_unknown_ones_or_policies_are_refused() {
        let bs = BlockSize::new(16).unwrap();
        let mut core = ServingCore::new(
            bs,
            IndexConfig::new(bs),
            LoadConfig::default(),
            PolicyKind::RoundRobin,
            &PolicyConfig::default(),
        )
        .unwrap();
        let busy = switchyard_core::LoadStats {
            queued_prefill_tokens: 900,
            ..Default::default()
        };
        core.load.report(&WorkerId::new("a").unwrap(), busy, 1);
        let request = route_request(&[1; 40], bs, None, 5);
        let candidates: Vec<Candidate> = ["a", "b"]
            .iter()
            .map(|n| Candidate::from(WorkerId::new(*n).unwrap()))
            .collect();
        let (decision, _) = core.route_decode(&request, &candidates, 4).unwrap();
        assert_eq!(decision.worker.as_str(), "a", "round robin's first turn");
        let basis = RescoreBasis::capture(&request, &decision, &core.index, &core.load);
        let log = DecisionLog::new(4, None);
        log.push(
            DecisionEntry::new(
                Arc::new(RequestTags::new("r1")),
                "m".into(),
                16,
                1,
                Stage::Decode,
                Arc::new(decision),
                None,
            )
            .with_basis(basis),
        );
        let config = PolicyConfig::default();
        let answer = counterfactuals(&log, &query(Some("r1"), "least-loaded"), &config).unwrap();
        let only = &answer.decisions[0];
        assert_eq!(only.counterfactual.worker.as_str(), "b");
        assert!(only.differs);
        assert_eq!(only.live.policy, "round-robin");
        let same = counterfactuals(&log, &query(Some("r1"), "round-robin"), &config).unwrap();
        assert!(!same.decisions[0].differs);

        let missing = counterfactuals(&log, &query(Some("r2"), "kv"), &config).unwrap_err();
        assert!(matches!(missing, ApiError::NotFound(m) if m.contains("\"r2\"")));
        let bad = counterfactuals(&log, &query(Some("r1"), "best"), &config).unwrap_err();
        assert!(matches!(bad, ApiError::BadRequest { param: Some(p), .. } if p == "policy"));
        assert!(counterfactuals(&log, &query(None, "kv"), &config).is_err());
    }
}
