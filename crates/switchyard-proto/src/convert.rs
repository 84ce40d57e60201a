//! Conversions between protocol messages and core types.

use switchyard_core::{
    BlockHash, BlockSize, CoreError, EngineKind, Guided, KvEvent, KvIdentity, KvTierCosts,
    LoadStats, Retention, Role, Sampling, SamplingError, SnapshotBlock, StorageTier, StoredBlock,
    TierLink, TokenLogprob, TopLogprob, WorkerId, WorkerInfo,
};

use crate::v1;

/// A protocol message that cannot become a core value. Always the sender's fault.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("missing field {0}")]
    MissingField(&'static str),
    #[error("unknown engine {0:?}")]
    UnknownEngine(String),
    #[error(transparent)]
    Invalid(#[from] CoreError),
    #[error("invalid sampling: {0}")]
    Sampling(#[from] SamplingError),
    #[error("{0}")]
    Guided(&'static str),
    #[error("retention priority {0} is out of range (0 to 255)")]
    RetentionPriority(u32),
}

impl From<ProtoError> for tonic::Status {
    fn from(err: ProtoError) -> Self {
        tonic::Status::invalid_argument(err.to_string())
    }
}

impl From<&Sampling> for v1::SamplingParams {
    fn from(s: &Sampling) -> Self {
        Self {
            max_tokens: s.max_tokens,
            temperature: s.temperature,
            seed: s.seed,
            ignore_eos: s.ignore_eos,
            stop_token_ids: s.stop_token_ids.clone(),
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            logit_bias: s.logit_bias.iter().map(|(t, b)| (*t, *b)).collect(),
            stop: s.stop.clone(),
            min_tokens: s.min_tokens,
            skip_special_tokens: s.skip_special_tokens,
            include_stop_str_in_output: s.include_stop_str_in_output,
            logprobs: s.logprobs,
            guided: s.guided.as_ref().map(guided_to_proto),
        }
    }
}

fn guided_to_proto(g: &Guided) -> v1::GuidedDecoding {
    use v1::guided_decoding::Kind;
    let kind = match g {
        Guided::JsonObject => Kind::JsonObject(true),
        Guided::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Guided::Regex(s) => Kind::Regex(s.clone()),
        Guided::Choice(c) => Kind::Choice(v1::ChoiceList { choices: c.clone() }),
        Guided::Grammar(s) => Kind::Grammar(s.clone()),
    };
    v1::GuidedDecoding { kind: Some(kind) }
}

/// A guided-decoding message off the wire: exactly one constraint.
fn guided_from_proto(g: v1::GuidedDecoding) -> Result<Guided, ProtoError> {
    use v1::guided_decoding::Kind;
    match g.kind {
        Some(Kind::JsonObject(true)) => Ok(Guided::JsonObject),
        Some(Kind::JsonSchema(s)) => Ok(Guided::JsonSchema(s)),
        Some(Kind::Regex(s)) => Ok(Guided::Regex(s)),
        Some(Kind::Choice(c)) => Ok(Guided::Choice(c.choices)),
        Some(Kind::Grammar(s)) => Ok(Guided::Grammar(s)),
        Some(Kind::JsonObject(false)) | None => {
            Err(ProtoError::Guided("guided decoding names no constraint"))
        }
    }
}

impl From<&TokenLogprob> for v1::TokenLogprob {
    fn from(l: &TokenLogprob) -> Self {
        Self {
            token_id: l.token,
            logprob: l.logprob,
            top: l
                .top
                .iter()
                .map(|t| v1::TopLogprob {
                    token_id: t.token,
                    logprob: t.logprob,
                })
                .collect(),
        }
    }
}

impl From<v1::TokenLogprob> for TokenLogprob {
    fn from(l: v1::TokenLogprob) -> Self {
        Self {
            token: l.token_id,
            logprob: l.logprob,
            top: l
                .top
                .into_iter()
                .map(|t| TopLogprob {
                    token: t.token_id,
                    logprob: t.logprob,
                })
                .collect(),
        }
    }
}

/// A request's KV identity on the wire; the plain identity is sent as no message at all.
pub fn identity_to_proto(identity: &KvIdentity) -> Option<v1::KvIdentity> {
    (!identity.is_plain()).then(|| v1::KvIdentity {
        adapter: identity.adapter.clone(),
        cache_salt: identity.salt.clone(),
    })
}

/// A request's KV identity off the wire, validated ([`KvIdentity::new`]); absent is plain.
pub fn identity_from_proto(identity: Option<v1::KvIdentity>) -> Result<KvIdentity, ProtoError> {
    match identity {
        None => Ok(KvIdentity::PLAIN),
        Some(i) => Ok(KvIdentity::new(i.adapter, i.cache_salt)?),
    }
}

/// A request's retention hint on the wire; a hint that asks for nothing is sent as no message.
pub fn retention_to_proto(retention: &Retention) -> Option<v1::RetentionHint> {
    retention.is_some().then(|| v1::RetentionHint {
        ttl_ms: retention.ttl_ms,
        priority: u32::from(retention.priority),
    })
}

/// A request's retention hint off the wire; absent asks for nothing, a priority past 255 is
/// refused.
pub fn retention_from_proto(hint: Option<v1::RetentionHint>) -> Result<Retention, ProtoError> {
    let Some(hint) = hint else {
        return Ok(Retention::default());
    };
    let priority =
        u8::try_from(hint.priority).map_err(|_| ProtoError::RetentionPriority(hint.priority))?;
    Ok(Retention {
        ttl_ms: hint.ttl_ms,
        priority,
    })
}

/// The sampling of a request off the wire, validated ([`Sampling::validate`]).
impl TryFrom<v1::SamplingParams> for Sampling {
    type Error = ProtoError;

    fn try_from(p: v1::SamplingParams) -> Result<Self, ProtoError> {
        let sampling = Sampling {
            max_tokens: p.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            repetition_penalty: p.repetition_penalty,
            logit_bias: p.logit_bias.into_iter().collect(),
            seed: p.seed,
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            min_tokens: p.min_tokens,
            ignore_eos: p.ignore_eos,
            skip_special_tokens: p.skip_special_tokens,
            include_stop_str_in_output: p.include_stop_str_in_output,
            logprobs: p.logprobs,
            guided: p.guided.map(guided_from_proto).transpose()?,
        };
        sampling.validate()?;
        Ok(sampling)
    }
}

impl From<Role> for v1::Role {
    fn from(role: Role) -> Self {
        match role {
            Role::Prefill => v1::Role::Prefill,
            Role::Decode => v1::Role::Decode,
            Role::Both => v1::Role::Both,
        }
    }
}

/// Maps a wire role; `ROLE_UNSPECIFIED` (and unknown future values) are refused.
pub fn role_from_wire(value: i32) -> Result<Role, ProtoError> {
    match v1::Role::try_from(value) {
        Ok(v1::Role::Prefill) => Ok(Role::Prefill),
        Ok(v1::Role::Decode) => Ok(Role::Decode),
        Ok(v1::Role::Both) => Ok(Role::Both),
        Ok(v1::Role::Unspecified) | Err(_) => Err(ProtoError::MissingField("role")),
    }
}

impl From<StorageTier> for v1::StorageTier {
    fn from(tier: StorageTier) -> Self {
        match tier {
            StorageTier::Device => v1::StorageTier::Device,
            StorageTier::Host => v1::StorageTier::Host,
            StorageTier::Disk => v1::StorageTier::Disk,
            StorageTier::Remote => v1::StorageTier::Remote,
        }
    }
}

/// Maps a wire tier; unknown future tiers are refused rather than guessed.
pub fn tier_from_wire(value: i32) -> Result<StorageTier, ProtoError> {
    match v1::StorageTier::try_from(value) {
        Ok(v1::StorageTier::Device) => Ok(StorageTier::Device),
        Ok(v1::StorageTier::Host) => Ok(StorageTier::Host),
        Ok(v1::StorageTier::Disk) => Ok(StorageTier::Disk),
        Ok(v1::StorageTier::Remote) => Ok(StorageTier::Remote),
        Err(_) => Err(ProtoError::MissingField("tier")),
    }
}

fn tier_costs_to_wire(c: &KvTierCosts) -> v1::KvTierCosts {
    let link = |l: &TierLink| v1::TierLink {
        bytes_per_s: l.bytes_per_s,
        latency_us: l.latency_us,
    };
    v1::KvTierCosts {
        bytes_per_block: c.bytes_per_block,
        prefill_tokens_per_s: c.prefill_tokens_per_s,
        host: Some(link(&c.host)),
        disk: Some(link(&c.disk)),
        remote: Some(link(&c.remote)),
    }
}

/// Every tier's link is required: a cost the worker did not give is not guessed.
fn tier_costs_from_wire(c: v1::KvTierCosts) -> Result<KvTierCosts, ProtoError> {
    let link = |l: Option<v1::TierLink>, field| {
        l.map(|l| TierLink {
            bytes_per_s: l.bytes_per_s,
            latency_us: l.latency_us,
        })
        .ok_or(ProtoError::MissingField(field))
    };
    Ok(KvTierCosts {
        bytes_per_block: c.bytes_per_block,
        prefill_tokens_per_s: c.prefill_tokens_per_s,
        host: link(c.host, "kv_tiers.host")?,
        disk: link(c.disk, "kv_tiers.disk")?,
        remote: link(c.remote, "kv_tiers.remote")?,
    })
}

/// Wire form of a worker's description, plus whether it is draining.
pub fn worker_info_to_wire(info: &WorkerInfo, draining: bool) -> v1::WorkerInfo {
    v1::WorkerInfo {
        id: info.id.to_string(),
        address: info.address.clone(),
        model: info.model.clone(),
        role: v1::Role::from(info.role).into(),
        block_size: info.block_size.get(),
        kv_capacity_blocks: info.kv_capacity_blocks,
        max_context_tokens: info.max_context_tokens,
        engine: info.engine.as_str().to_owned(),
        incarnation: info.incarnation,
        draining,
        engine_endpoint: info.engine_endpoint.clone().unwrap_or_default(),
        kv_tiers: info.kv_tiers.as_ref().map(tier_costs_to_wire),
        adapters: info.adapters.clone(),
        kv_peer: info.kv_peer.map(|l| v1::TierLink {
            bytes_per_s: l.bytes_per_s,
            latency_us: l.latency_us,
        }),
    }
}

impl TryFrom<v1::WorkerInfo> for WorkerInfo {
    type Error = ProtoError;
    fn try_from(w: v1::WorkerInfo) -> Result<Self, Self::Error> {
        let engine = match w.engine.as_str() {
            "sim" => EngineKind::Sim,
            "vllm" => EngineKind::Vllm,
            "sglang" => EngineKind::Sglang,
            "trtllm" => EngineKind::Trtllm,
            other => return Err(ProtoError::UnknownEngine(other.to_owned())),
        };
        let info = WorkerInfo {
            id: WorkerId::new(w.id)?,
            address: w.address,
            model: w.model,
            role: role_from_wire(w.role)?,
            block_size: BlockSize::new(w.block_size)?,
            kv_capacity_blocks: w.kv_capacity_blocks,
            max_context_tokens: w.max_context_tokens,
            engine,
            incarnation: w.incarnation,
            adapters: w.adapters,
            engine_endpoint: Some(w.engine_endpoint).filter(|e| !e.is_empty()),
            kv_tiers: w.kv_tiers.map(tier_costs_from_wire).transpose()?,
            kv_peer: w.kv_peer.map(|l| TierLink {
                bytes_per_s: l.bytes_per_s,
                latency_us: l.latency_us,
            }),
        };
        info.validate()?;
        Ok(info)
    }
}

/// Wire form of one event at sequence number `seq`.
pub fn kv_event_to_wire(seq: u64, event: &KvEvent) -> v1::KvEvent {
    let kind = match event {
        KvEvent::Stored {
            parent,
            blocks,
            tier,
        } => v1::kv_event::Kind::Stored(v1::Stored {
            parent: parent.map(BlockHash::get),
            blocks: blocks
                .iter()
                .map(|b| v1::StoredBlock {
                    hash: b.hash.get(),
                    token_ids: b.tokens.clone(),
                })
                .collect(),
            tier: v1::StorageTier::from(*tier).into(),
        }),
        KvEvent::Removed { blocks, tier } => v1::kv_event::Kind::Removed(v1::Removed {
            blocks: blocks.iter().map(|b| b.get()).collect(),
            tier: v1::StorageTier::from(*tier).into(),
        }),
        KvEvent::Cleared => v1::kv_event::Kind::Cleared(v1::Cleared {}),
    };
    v1::KvEvent {
        seq,
        kind: Some(kind),
    }
}

/// Core form of a wire event: its sequence number and the event.
pub fn kv_event_from_wire(event: v1::KvEvent) -> Result<(u64, KvEvent), ProtoError> {
    let kind = event
        .kind
        .ok_or(ProtoError::MissingField("kv_event.kind"))?;
    let core = match kind {
        v1::kv_event::Kind::Stored(s) => KvEvent::Stored {
            parent: s.parent.map(BlockHash),
            blocks: s
                .blocks
                .into_iter()
                .map(|b| StoredBlock {
                    hash: BlockHash(b.hash),
                    tokens: b.token_ids,
                })
                .collect(),
            tier: tier_from_wire(s.tier)?,
        },
        v1::kv_event::Kind::Removed(r) => KvEvent::Removed {
            blocks: r.blocks.into_iter().map(BlockHash).collect(),
            tier: tier_from_wire(r.tier)?,
        },
        v1::kv_event::Kind::Cleared(_) => KvEvent::Cleared,
    };
    Ok((event.seq, core))
}

pub fn snapshot_block_to_wire(block: &SnapshotBlock) -> v1::SnapshotBlock {
    v1::SnapshotBlock {
        hash: block.hash.get(),
        parent: block.parent.map(BlockHash::get),
        tier: v1::StorageTier::from(block.tier).into(),
    }
}

pub fn snapshot_block_from_wire(block: &v1::SnapshotBlock) -> Result<SnapshotBlock, ProtoError> {
    Ok(SnapshotBlock {
        hash: BlockHash(block.hash),
        parent: block.parent.map(BlockHash),
        tier: tier_from_wire(block.tier)?,
    })
}

/// Wire form of a load report.
pub fn load_to_wire(
    worker: &WorkerId,
    load: &LoadStats,
    role: Role,
    draining: bool,
    timestamp_unix_ms: u64,
) -> v1::LoadReport {
    v1::LoadReport {
        worker_id: worker.to_string(),
        queued_prefill_tokens: load.queued_prefill_tokens,
        waiting_requests: load.waiting_requests,
        running_requests: load.running_requests,
        active_decode_sequences: load.active_decode_sequences,
        active_blocks: load.active_blocks,
        used_blocks: load.used_blocks,
        capacity_blocks: load.capacity_blocks,
        preemptions_total: load.preemptions_total,
        cached_prompt_tokens_total: load.cached_prompt_tokens_total,
        prompt_tokens_total: load.prompt_tokens_total,
        role: v1::Role::from(role).into(),
        draining,
        timestamp_unix_ms,
    }
}

impl From<&v1::LoadReport> for LoadStats {
    fn from(r: &v1::LoadReport) -> Self {
        LoadStats {
            queued_prefill_tokens: r.queued_prefill_tokens,
            waiting_requests: r.waiting_requests,
            running_requests: r.running_requests,
            active_decode_sequences: r.active_decode_sequences,
            active_blocks: r.active_blocks,
            used_blocks: r.used_blocks,
            capacity_blocks: r.capacity_blocks,
            preemptions_total: r.preemptions_total,
            cached_prompt_tokens_total: r.cached_prompt_tokens_total,
            prompt_tokens_total: r.prompt_tokens_total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::block_hashes;

    #[test]
    fn guided_decoding_round_trips_and_an_empty_one_is_refused() {
        for guided in [
            Guided::JsonObject,
            Guided::JsonSchema(r#"{"type":"object"}"#.into()),
            Guided::Regex("[a-z]+".into()),
            Guided::Choice(vec!["yes".into(), "no".into()]),
            Guided::Grammar("root ::= \"a\"".into()),
        ] {
            let sampling = Sampling {
                max_tokens: 4,
                guided: Some(guided),
                ..Sampling::default()
            };
            let wire = v1::SamplingParams::from(&sampling);
            assert_eq!(Sampling::try_from(wire).unwrap(), sampling);
        }
        let mut wire = v1::SamplingParams::from(&Sampling {
            max_tokens: 4,
            ..Sampling::default()
        });
        wire.guided = Some(v1::GuidedDecoding { kind: None });
        assert!(Sampling::try_from(wire.clone()).is_err());
        wire.guided = Some(v1::GuidedDecoding {
            kind: Some(v1::guided_decoding::Kind::Choice(v1::ChoiceList {
                choices: vec![],
            })),
        });
        assert!(Sampling::try_from(wire).is_err(), "validated");
    }

    #[test]
    fn events_round_trip() {
        let bs = BlockSize::new(2).unwrap();
        let tokens = vec![1, 2, 3, 4];
        let hashes = block_hashes(&tokens, bs);
        let events = vec![
            KvEvent::Stored {
                parent: None,
                blocks: vec![
                    StoredBlock {
                        hash: hashes[0],
                        tokens: vec![1, 2],
                    },
                    StoredBlock {
                        hash: hashes[1],
                        tokens: vec![3, 4],
                    },
                ],
                tier: StorageTier::Device,
            },
            KvEvent::Stored {
                parent: Some(hashes[1]),
                blocks: vec![],
                tier: StorageTier::Host,
            },
            KvEvent::Removed {
                blocks: hashes.clone(),
                tier: StorageTier::Disk,
            },
            KvEvent::Cleared,
        ];
        for (seq, event) in events.into_iter().enumerate() {
            let wire = kv_event_to_wire(seq as u64, &event);
            let (back_seq, back) = kv_event_from_wire(wire).unwrap();
            assert_eq!(back_seq, seq as u64);
            assert_eq!(back, event);
        }
    }

    #[test]
    fn an_event_without_kind_is_refused() {
        let err = kv_event_from_wire(v1::KvEvent { seq: 1, kind: None }).unwrap_err();
        assert!(err.to_string().contains("kind"));
    }

    fn sample_info() -> WorkerInfo {
        WorkerInfo {
            adapters: vec!["sql-lora".into()],
            id: WorkerId::new("w-1").unwrap(),
            address: "127.0.0.1:1".into(),
            model: "m".into(),
            role: Role::Prefill,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: EngineKind::Sim,
            incarnation: 3,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    #[test]
    fn worker_info_round_trips_and_refuses_bad_values() {
        let info = sample_info();
        let wire = worker_info_to_wire(&info, false);
        assert_eq!(WorkerInfo::try_from(wire.clone()).unwrap(), info);
        let zero_block = v1::WorkerInfo {
            block_size: 0,
            ..wire.clone()
        };
        assert!(WorkerInfo::try_from(zero_block).is_err());
        let twice = v1::WorkerInfo {
            adapters: vec!["sql-lora".into(), "sql-lora".into()],
            ..wire.clone()
        };
        let err = WorkerInfo::try_from(twice).unwrap_err().to_string();
        assert!(err.contains("sql-lora") && err.contains("twice"), "{err}");
        let no_role = v1::WorkerInfo { role: 0, ..wire };
        assert!(WorkerInfo::try_from(no_role).is_err());
    }

    #[test]
    fn announced_tier_costs_round_trip_and_a_missing_link_is_named() {
        let mut info = sample_info();
        info.kv_tiers = Some(KvTierCosts::typical(2 << 20));
        let wire = worker_info_to_wire(&info, false);
        assert_eq!(WorkerInfo::try_from(wire.clone()).unwrap(), info);
        let mut no_remote = wire.clone();
        if let Some(c) = no_remote.kv_tiers.as_mut() {
            c.remote = None;
        }
        let err = WorkerInfo::try_from(no_remote).unwrap_err().to_string();
        assert!(err.contains("kv_tiers.remote"), "{err}");
        let mut zero_rate = wire;
        if let Some(c) = zero_rate.kv_tiers.as_mut() {
            c.prefill_tokens_per_s = 0;
        }
        assert!(
            WorkerInfo::try_from(zero_rate).is_err(),
            "validated on the way in"
        );
    }

    #[test]
    fn an_announced_peer_link_round_trips_and_an_older_worker_announces_none() {
        let mut info = sample_info();
        info.kv_peer = Some(TierLink {
            bytes_per_s: 10_000_000_000,
            latency_us: 100,
        });
        let wire = worker_info_to_wire(&info, false);
        assert_eq!(WorkerInfo::try_from(wire.clone()).unwrap(), info);
        // A worker that predates the field sends none: no link, never priced a copy.
        let older = v1::WorkerInfo {
            kv_peer: None,
            ..wire.clone()
        };
        assert_eq!(WorkerInfo::try_from(older).unwrap().kv_peer, None);
        let zero = v1::WorkerInfo {
            kv_peer: Some(v1::TierLink {
                bytes_per_s: 0,
                latency_us: 1,
            }),
            ..wire
        };
        let err = WorkerInfo::try_from(zero).unwrap_err().to_string();
        assert!(err.contains("peer link"), "{err}");
    }

    #[test]
    fn the_remote_tier_crosses_the_wire() {
        let tier: v1::StorageTier = StorageTier::Remote.into();
        assert_eq!(tier_from_wire(tier as i32).unwrap(), StorageTier::Remote);
    }

    #[test]
    fn retention_hints_cross_the_wire_and_bad_priorities_are_refused() {
        let hint = Retention {
            ttl_ms: 90_000,
            priority: 7,
        };
        let wire = retention_to_proto(&hint);
        assert_eq!(retention_from_proto(wire).unwrap(), hint);
        // Asking for nothing is sent as nothing, and nothing reads back as no hint.
        assert_eq!(retention_to_proto(&Retention::default()), None);
        assert_eq!(retention_from_proto(None).unwrap(), Retention::default());
        let err = retention_from_proto(Some(v1::RetentionHint {
            ttl_ms: 1,
            priority: 256,
        }))
        .unwrap_err();
        assert!(err.to_string().contains("256"), "{err}");
    }
}
