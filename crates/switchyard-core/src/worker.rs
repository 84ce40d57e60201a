//! Worker identity, role and description.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{BlockSize, CoreError, KvTierCosts, TierLink};

/// A worker's stable name. It appears in etcd keys, metrics labels and logs, so it is limited to
/// `[A-Za-z0-9._-]`, 1 to 128 characters. Shared, not copied, when cloned: a routing decision
/// names every candidate (a thousand ids at a thousand workers), and a clone is a count.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(Arc<str>);

impl WorkerId {
    pub const MAX_LEN: usize = 128;

    pub fn new(id: impl Into<String>) -> Result<Self, CoreError> {
        let id = id.into();
        let reason = if id.is_empty() {
            Some("it is empty")
        } else if id.len() > Self::MAX_LEN {
            Some("it is longer than 128 characters")
        } else if !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            Some("only ASCII letters, digits, '.', '_' and '-' are allowed")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(CoreError::InvalidWorkerId { id, reason }),
            None => Ok(Self(Arc::from(id))),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for WorkerId {
    type Error = CoreError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<WorkerId> for String {
    fn from(value: WorkerId) -> Self {
        value.0.as_ref().to_owned()
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for WorkerId {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// Which phase of inference a worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    /// Aggregated serving: prefill and decode on the same worker.
    #[default]
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    pub fn serves_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn serves_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

impl std::str::FromStr for Role {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" | "aggregated" => Ok(Role::Both),
            _ => Err(CoreError::UnknownRole(s.to_owned())),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The engine behind a worker agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    #[default]
    Sim,
    Vllm,
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`.
    Trtllm,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Sim => "sim",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Trtllm => "trtllm",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a worker is: the value it registers under `workers/<id>` in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// gRPC address clients dial, `host:port`.
    pub address: String,
    /// Model name as clients ask for it.
    pub model: String,
    pub role: Role,
    pub block_size: BlockSize,
    /// KV cache capacity in blocks (device tier).
    pub kv_capacity_blocks: u64,
    /// Longest prompt plus output the engine accepts, in tokens.
    pub max_context_tokens: u64,
    pub engine: EngineKind,
    /// Changes every time the engine restarts; event sequence numbers restart with it.
    pub incarnation: u64,
    /// LoRA adapters the engine serves besides the base model, by the names clients ask for
    /// them as `model` (vLLM's `--lora-modules` names, SGLang's `--lora-paths` names). A request
    /// naming one runs on the base model's workers that serve it, with the adapter's KV.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// `host:port` of the engine's own OpenAI HTTP API (the model server) as a proxy reaches
    /// it: what the endpoint picker (`switchyard epp`) hands to Envoy. None for the simulator,
    /// which serves only through the worker's gRPC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_endpoint: Option<String>,
    /// What loading KV from each non-device tier costs the worker, against recomputing it
    /// (see [`KvTierCosts`]). None from workers that predate it: routers assume
    /// [`KvTierCosts::typical`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tiers: Option<KvTierCosts>,
    /// The link this worker pulls KV from a peer of its engine kind over while it serves
    /// aggregated (its engine can both hand its KV to another engine and take another's: vLLM
    /// with a KV connector in `kv_both`, TensorRT-LLM with its cache transceiver, the
    /// simulator): with it the router may place a request whose prefix a busy peer holds here,
    /// the prefix pulled from that peer instead of recomputed (sub-agent placement). None: the
    /// worker exchanges KV only as one side of a prefill/decode pair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_peer: Option<TierLink>,
}

impl WorkerInfo {
    /// Checks the fields a registry or a router relies on.
    pub fn validate(&self) -> Result<(), CoreError> {
        if self.address.is_empty() {
            return Err(CoreError::InvalidWorkerInfo("address is empty".into()));
        }
        if self.model.is_empty() {
            return Err(CoreError::InvalidWorkerInfo("model is empty".into()));
        }
        if self.kv_capacity_blocks == 0 {
            return Err(CoreError::InvalidWorkerInfo(
                "kv capacity must be at least one block".into(),
            ));
        }
        if self.max_context_tokens == 0 {
            return Err(CoreError::InvalidWorkerInfo(
                "max context must be at least one token".into(),
            ));
        }
        if let Some(endpoint) = &self.engine_endpoint {
            validate_endpoint(endpoint).map_err(CoreError::InvalidWorkerInfo)?;
        }
        validate_adapters(&self.model, &self.adapters).map_err(CoreError::InvalidWorkerInfo)?;
        if let Some(costs) = &self.kv_tiers {
            costs.validate()?;
        }
        if self.kv_peer.is_some_and(|l| l.bytes_per_s == 0) {
            return Err(CoreError::InvalidWorkerInfo(
                "the kv peer link's bandwidth must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Checks a worker's adapter names: each a valid KV identity part (non-empty, at most
/// [`crate::MAX_IDENTITY_PART_BYTES`] bytes), none twice and none the base model's own name
/// (a request naming it would be ambiguous).
pub fn validate_adapters(model: &str, adapters: &[String]) -> Result<(), String> {
    for (i, name) in adapters.iter().enumerate() {
        crate::KvIdentity::new(Some(name.clone()), None)
            .map_err(|e| format!("LoRA adapter {name:?}: {e}"))?;
        if name == model {
            return Err(format!("LoRA adapter {name:?} has the base model's name"));
        }
        if adapters[..i].contains(name) {
            return Err(format!("LoRA adapter {name:?} is listed twice"));
        }
    }
    Ok(())
}

/// Checks that `endpoint` is `host:port` with a port number, as a proxy dials it (an IPv6
/// host in brackets).
pub fn validate_endpoint(endpoint: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "engine endpoint {endpoint:?} {why} (expected host:port)"
        ))
    };
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return bad("has no port");
    };
    if host.is_empty() || host.contains('/') || (host.contains(':') && !host.starts_with('[')) {
        return bad("has no valid host");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => bad("has no valid port"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_validated() {
        assert!(WorkerId::new("worker-1.a_b").is_ok());
        assert!(WorkerId::new("").is_err());
        assert!(WorkerId::new("a/b").is_err());
        assert!(WorkerId::new("x".repeat(129)).is_err());
        assert!(serde_json::from_str::<WorkerId>("\"bad id\"").is_err());
    }

    #[test]
    fn roles_parse_and_print() {
        for role in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(role.as_str().parse::<Role>().unwrap(), role);
        }
        assert!("prefil".parse::<Role>().is_err());
        assert!(Role::Both.serves_prefill() && Role::Both.serves_decode());
        assert!(!Role::Prefill.serves_decode());
    }

    #[test]
    fn worker_info_round_trips_through_json() {
        let info = WorkerInfo {
            id: WorkerId::new("w1").unwrap(),
            address: "127.0.0.1:5000".into(),
            model: "sim-8b".into(),
            role: Role::Decode,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 1000,
            max_context_tokens: 32768,
            engine: EngineKind::Sim,
            incarnation: 7,
            adapters: Vec::new(),
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        };
        let json = serde_json::to_string(&info).unwrap();
        assert!(!json.contains("adapters"), "absent when none: {json}");
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).unwrap(), info);
        assert!(info.validate().is_ok());
        let with_adapters = WorkerInfo {
            adapters: vec!["sql-lora".into(), "chat-lora".into()],
            ..info.clone()
        };
        let json = serde_json::to_string(&with_adapters).unwrap();
        assert_eq!(
            serde_json::from_str::<WorkerInfo>(&json).unwrap(),
            with_adapters
        );
        assert!(with_adapters.validate().is_ok());
        for (adapters, why) in [
            (vec!["a".to_owned(), "a".to_owned()], "listed twice"),
            (vec![String::new()], "empty"),
            (vec!["sim-8b".to_owned()], "base model's name"),
            (vec!["x".repeat(300)], "more than"),
        ] {
            let bad = WorkerInfo {
                adapters,
                ..info.clone()
            };
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
        let bad = WorkerInfo {
            kv_capacity_blocks: 0,
            ..info
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn an_engine_endpoint_is_host_and_port_and_absent_from_json_when_unset() {
        let info = WorkerInfo {
            id: WorkerId::new("w1").unwrap(),
            address: "127.0.0.1:5000".into(),
            model: "m".into(),
            role: Role::Both,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 1000,
            max_context_tokens: 32768,
            engine: EngineKind::Vllm,
            incarnation: 7,
            adapters: Vec::new(),
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        };
        // Entries without one read as before (older gateways refuse unknown fields).
        assert!(
            !serde_json::to_string(&info)
                .unwrap()
                .contains("engine_endpoint")
        );
        let with = WorkerInfo {
            engine_endpoint: Some("10.0.0.7:8000".into()),
            ..info.clone()
        };
        let json = serde_json::to_string(&with).unwrap();
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).unwrap(), with);
        assert!(with.validate().is_ok());
        for bad in [
            "10.0.0.7",
            "10.0.0.7:0",
            ":8000",
            "http://x:80",
            "::1:80",
            "h:port",
        ] {
            let info = WorkerInfo {
                engine_endpoint: Some(bad.into()),
                ..info.clone()
            };
            assert!(info.validate().is_err(), "{bad}");
        }
        assert!(validate_endpoint("[::1]:8000").is_ok());
    }
}
