//! Session affinity: keep a session's turns on the worker that holds its growing prefix.
//!
//! A request with a session id goes to the worker the session is pinned to while the pin is
//! fresh (used within `ttl`), the worker is among the candidates, and it is not overloaded
//! (queued prefill tokens at most `max_queued_prefill_tokens` and KV utilisation at most
//! `max_kv_utilisation`). Otherwise, and for requests without a session id, the `kv` policy
//! decides, and the session is (re)pinned to its choice. At most `max_sessions` pins are kept:
//! expired pins go first, then the least recently used.

use serde::{Deserialize, Serialize};
use switchyard_core::WorkerId;

use super::kv::{KvPolicy, check_inputs, index_overlap, kv_why};
use super::{Candidate, Decision, Policy, RouteRequest};
use crate::error::RouteError;
use crate::hasher::FxHashMap;
use crate::index::PrefixIndex;
use crate::load::{LoadView, Tick};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// A pin not used for this long (microseconds) is forgotten.
    pub ttl: Tick,
    pub max_sessions: usize,
    pub max_queued_prefill_tokens: u64,
    pub max_kv_utilisation: f64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            ttl: 600_000_000,
            max_sessions: 100_000,
            max_queued_prefill_tokens: 65_536,
            max_kv_utilisation: 0.95,
        }
    }
}

#[derive(Debug, Clone)]
struct Pin {
    worker: WorkerId,
    last_used: Tick,
}

/// The `session` policy; see the module docs.
#[derive(Debug, Clone)]
pub struct SessionPolicy {
    config: SessionConfig,
    kv: KvPolicy,
    pins: FxHashMap<String, Pin>,
}

impl SessionPolicy {
    pub fn new(config: SessionConfig, kv: KvPolicy) -> Result<Self, RouteError> {
        if config.max_sessions == 0 || config.ttl == 0 {
            return Err(RouteError::InvalidConfig(
                "session ttl and max sessions must be positive".into(),
            ));
        }
        Ok(Self {
            config,
            kv,
            pins: FxHashMap::default(),
        })
    }

    /// Sessions currently pinned.
    pub fn pinned(&self) -> usize {
        self.pins.len()
    }

    fn pin(&mut self, session: &str, worker: &WorkerId, now: Tick) {
        if !self.pins.contains_key(session) && self.pins.len() >= self.config.max_sessions {
            let ttl = self.config.ttl;
            self.pins
                .retain(|_, p| now.saturating_sub(p.last_used) < ttl);
            if self.pins.len() >= self.config.max_sessions {
                let lru = self
                    .pins
                    .iter()
                    .min_by(|a, b| (a.1.last_used, a.0).cmp(&(b.1.last_used, b.0)))
                    .map(|(k, _)| k.clone());
                if let Some(k) = lru {
                    self.pins.remove(&k);
                }
            }
        }
        self.pins.insert(
            session.to_owned(),
            Pin {
                worker: worker.clone(),
                last_used: now,
            },
        );
    }
}

impl Policy for SessionPolicy {
    fn name(&self) -> &'static str {
        "session"
    }

    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        index: &PrefixIndex,
        load: &LoadView,
    ) -> Result<Decision, RouteError> {
        check_inputs(request, candidates, index)?;
        let Some(session) = request.session.as_deref() else {
            let mut d = self.kv.decide(
                "session",
                request,
                candidates,
                load,
                index_overlap(request, index),
            )?;
            d.explanation.why = format!("no session id, decided by kv: {}", d.explanation.why);
            return Ok(d);
        };
        let mut d = self.kv.decide(
            "session",
            request,
            candidates,
            load,
            index_overlap(request, index),
        )?;
        let now = request.now;
        let fallback = match self.pins.get(session) {
            None => "new session".to_owned(),
            Some(p) if now.saturating_sub(p.last_used) >= self.config.ttl => {
                format!("pin to {} expired", p.worker)
            }
            Some(p) => match d
                .explanation
                .workers
                .iter()
                .position(|w| w.worker == p.worker)
            {
                None => format!("pinned worker {} is not a candidate", p.worker),
                Some(i) => {
                    let w = &d.explanation.workers[i];
                    if w.queued_prefill_tokens > self.config.max_queued_prefill_tokens
                        || w.kv_utilisation > self.config.max_kv_utilisation
                    {
                        format!(
                            "pinned worker {} is overloaded ({} queued prefill tokens, kv utilisation {:.2})",
                            p.worker, w.queued_prefill_tokens, w.kv_utilisation
                        )
                    } else {
                        let age_ms = now.saturating_sub(p.last_used) / 1000;
                        let worker = p.worker.clone();
                        let kv_choice = d.worker.clone();
                        d.worker = worker.clone();
                        d.explanation.chosen = worker.clone();
                        d.explanation.sampled = false;
                        d.explanation.why = format!(
                            "{worker}: session {session:?} is pinned here (last used {age_ms} ms ago; {} uncached prompt tokens); kv alone would pick {kv_choice}",
                            w.uncached_prompt_tokens
                        );
                        self.pin(session, &worker, now);
                        return Ok(d);
                    }
                }
            },
        };
        let chosen = d.worker.clone();
        let idx = d
            .explanation
            .workers
            .iter()
            .position(|w| w.worker == chosen)
            .unwrap_or(0);
        let why = kv_why(request, &d.explanation.workers, idx, d.explanation.sampled);
        d.explanation.why = format!("session {session:?}: {fallback}, pinned by kv: {why}");
        self.pin(session, &chosen, now);
        Ok(d)
    }

    fn worker_removed(&mut self, worker: &WorkerId) {
        self.pins.retain(|_, p| &p.worker != worker);
    }
}
