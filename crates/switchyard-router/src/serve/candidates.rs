//! Which workers a request may go to: the one candidate filter of the gateway, the replay lab
//! and the planner's bench. The model is the caller's to match (routing state is per model).

use switchyard_core::{EngineKind, Role, WorkerId};

/// What candidate filtering needs to know of a worker.
#[derive(Debug, Clone, Copy)]
pub struct WorkerFacts<'a> {
    pub id: &'a WorkerId,
    pub role: Role,
    pub engine: EngineKind,
    /// Draining (or being moved to another role): it takes no new work.
    pub draining: bool,
    /// The LoRA adapters its engine serves (`WorkerInfo::adapters`).
    pub adapters: &'a [String],
}

impl WorkerFacts<'_> {
    /// Whether the worker can run a request under `adapter` (every worker runs the base model).
    pub fn serves(&self, adapter: Option<&str>) -> bool {
        adapter.is_none_or(|a| self.adapters.iter().any(|s| s == a))
    }
}

/// Whether a worker can generate only from a prefill worker's KV, never from a bare prompt.
/// An SGLang worker of role `decode` fronts a server started with `--disaggregation-mode
/// decode`, which rejects requests without bootstrap fields, so it must never be sent an
/// aggregated request. vLLM decode engines and the simulator compute a prompt themselves when
/// no KV comes, and role `both` serves anything.
pub fn needs_prefill(role: Role, engine: EngineKind) -> bool {
    engine == EngineKind::Sglang && role == Role::Decode
}

/// Which generating workers an attempt may use.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeFilter<'a> {
    /// Workers that failed this request already.
    pub exclude: &'a [WorkerId],
    /// The attempt will not get a prefill worker (disaggregation off, a migration, a reroute):
    /// leave out the workers that [`needs_prefill`].
    pub aggregated_only: bool,
    /// The LoRA adapter the request runs under: only workers that serve it.
    pub adapter: Option<&'a str>,
}

/// Whether `worker` may generate for the request.
pub fn may_decode(worker: WorkerFacts<'_>, filter: DecodeFilter<'_>) -> bool {
    let unusable_aggregated = filter.aggregated_only && needs_prefill(worker.role, worker.engine);
    !worker.draining
        && worker.role.serves_decode()
        && !unusable_aggregated
        && worker.serves(filter.adapter)
        && !filter.exclude.contains(worker.id)
}

/// Whether `worker` may prefill for a decode worker in front of `engine`. Only workers of the
/// same engine kind pair up: the KV moves between the engines (the simulator's blocks over
/// `PullKv`, vLLM's, SGLang's and TensorRT-LLM's through the engines' own transfer), and no
/// side can read another kind's. A request under a LoRA adapter needs a prefill worker that serves it too.
pub fn may_prefill_for(
    worker: WorkerFacts<'_>,
    engine: EngineKind,
    exclude: &[WorkerId],
    adapter: Option<&str>,
) -> bool {
    !worker.draining
        && worker.role == Role::Prefill
        && worker.engine == engine
        && worker.serves(adapter)
        && !exclude.contains(worker.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(id: &WorkerId, role: Role, engine: EngineKind) -> WorkerFacts<'_> {
        WorkerFacts {
            id,
            role,
            engine,
            draining: false,
            adapters: &[],
        }
    }

    #[test]
    fn decode_candidates_follow_role_draining_exclusion_and_pairing() {
        let w = WorkerId::new("w").unwrap();
        let open = DecodeFilter::default();
        assert!(may_decode(facts(&w, Role::Both, EngineKind::Sim), open));
        assert!(may_decode(facts(&w, Role::Decode, EngineKind::Vllm), open));
        assert!(!may_decode(facts(&w, Role::Prefill, EngineKind::Sim), open));
        let draining = WorkerFacts {
            draining: true,
            ..facts(&w, Role::Both, EngineKind::Sim)
        };
        assert!(!may_decode(draining, open));
        let excluded = [w.clone()];
        let filter = DecodeFilter {
            exclude: &excluded,
            aggregated_only: false,
            adapter: None,
        };
        assert!(!may_decode(facts(&w, Role::Both, EngineKind::Sim), filter));
        // SGLang decode servers only with a prefill worker.
        let sglang_decode = facts(&w, Role::Decode, EngineKind::Sglang);
        assert!(may_decode(sglang_decode, open));
        let aggregated = DecodeFilter {
            exclude: &[],
            aggregated_only: true,
            adapter: None,
        };
        assert!(!may_decode(sglang_decode, aggregated));
        assert!(may_decode(
            facts(&w, Role::Decode, EngineKind::Vllm),
            aggregated
        ));
    }

    #[test]
    fn prefill_candidates_pair_engine_kinds() {
        let p = WorkerId::new("p").unwrap();
        assert!(may_prefill_for(
            facts(&p, Role::Prefill, EngineKind::Vllm),
            EngineKind::Vllm,
            &[],
            None
        ));
        assert!(!may_prefill_for(
            facts(&p, Role::Prefill, EngineKind::Vllm),
            EngineKind::Sglang,
            &[],
            None
        ));
        // TensorRT-LLM's cache transceiver exchanges KV with TensorRT-LLM engines only.
        let kinds = [
            EngineKind::Sim,
            EngineKind::Vllm,
            EngineKind::Sglang,
            EngineKind::Trtllm,
        ];
        for prefill in kinds {
            for decode in kinds {
                assert_eq!(
                    may_prefill_for(facts(&p, Role::Prefill, prefill), decode, &[], None),
                    prefill == decode,
                    "{prefill} prefill for a {decode} decode worker"
                );
            }
        }
        assert!(
            !needs_prefill(Role::Decode, EngineKind::Trtllm),
            "serves aggregated too"
        );
        assert!(!may_prefill_for(
            facts(&p, Role::Both, EngineKind::Sim),
            EngineKind::Sim,
            &[],
            None
        ));
        assert!(!may_prefill_for(
            facts(&p, Role::Prefill, EngineKind::Sim),
            EngineKind::Sim,
            std::slice::from_ref(&p),
            None
        ));
    }

    #[test]
    fn a_request_under_an_adapter_goes_only_to_workers_that_serve_it() {
        let w = WorkerId::new("w").unwrap();
        let served = ["sql-lora".to_owned()];
        let with = WorkerFacts {
            adapters: &served,
            ..facts(&w, Role::Both, EngineKind::Vllm)
        };
        let without = facts(&w, Role::Both, EngineKind::Vllm);
        let sql = DecodeFilter {
            adapter: Some("sql-lora"),
            ..DecodeFilter::default()
        };
        let other = DecodeFilter {
            adapter: Some("chat-lora"),
            ..DecodeFilter::default()
        };
        assert!(may_decode(with, sql));
        assert!(!may_decode(without, sql));
        assert!(!may_decode(with, other));
        // The base model runs everywhere.
        assert!(may_decode(with, DecodeFilter::default()));
        assert!(may_decode(without, DecodeFilter::default()));
        let prefill = WorkerFacts {
            adapters: &served,
            ..facts(&w, Role::Prefill, EngineKind::Vllm)
        };
        assert!(may_prefill_for(
            prefill,
            EngineKind::Vllm,
            &[],
            Some("sql-lora")
        ));
        assert!(!may_prefill_for(
            prefill,
            EngineKind::Vllm,
            &[],
            Some("chat-lora")
        ));
        assert!(!may_prefill_for(
            facts(&w, Role::Prefill, EngineKind::Vllm),
            EngineKind::Vllm,
            &[],
            Some("sql-lora")
        ));
    }
}
