//! Which agent-KV mechanism bought what, and what each engine can really use.
//!
//! The simulated cluster has four mechanisms on top of `kv` routing: a host tier that evicted
//! blocks move to ([`Mechanism::Host`]), retention hints from each session's think times
//! ([`Mechanism::Retention`]), sub-agent placement by copying a peer's prefix
//! ([`Mechanism::Placement`]) and sessions scheduled as programs ([`Mechanism::Sessions`]).
//! Real engines have only some of them ([`EngineKnobs`], `docs/engines.md`, "Agent KV
//! mechanisms per engine"): vLLM has a CPU offloading tier and a disaggregated KV pull
//! (`kv_transfer_params`) but nothing that keeps a prefix for a session; SGLang has HiCache and,
//! under `--radix-eviction-policy priority`, eviction by priority, but no placement (an
//! aggregated SGLang server can neither hand over nor take KV, and its prefill/decode servers do
//! not serve aggregated, so its bootstrap pull cannot place a sub-agent);
//! TensorRT-LLM a secondary (host) pool and `disaggregated_params` but no retention control.
//! Session scheduling is admission on our side and needs nothing of an engine.
//!
//! Request priority scheduling (vLLM, SGLang) is not a mechanism here: agent clients send no
//! priority, the traces carry none, and the simulator schedules first come, first served.
//!
//! [`ablation`] lists the runs that tell the mechanisms apart for one engine: round-robin and
//! `kv` alone for reference, each mechanism added to `kv` alone, the engine's whole set, and
//! the whole set with each mechanism removed; [`ablation_table`] lays their figures side by side.

use std::fmt::Write as _;

use switchyard_engine_sim::{KvLayout, TimingModel};
use switchyard_router::PolicyKind;
use switchyard_router::serve::RetentionConfig;

use crate::cluster::ClusterConfig;
use crate::error::ReplayError;
use crate::metrics::Summary;

/// One mechanism on top of `kv` routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mechanism {
    Host,
    Retention,
    Placement,
    Sessions,
}

impl Mechanism {
    pub const ALL: [Mechanism; 4] = [
        Mechanism::Host,
        Mechanism::Retention,
        Mechanism::Placement,
        Mechanism::Sessions,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Mechanism::Host => "host",
            Mechanism::Retention => "retention",
            Mechanism::Placement => "placement",
            Mechanism::Sessions => "sessions",
        }
    }
}

/// A set of mechanisms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mechanisms {
    pub host: bool,
    pub retention: bool,
    pub placement: bool,
    pub sessions: bool,
}

impl Mechanisms {
    pub fn has(&self, m: Mechanism) -> bool {
        match m {
            Mechanism::Host => self.host,
            Mechanism::Retention => self.retention,
            Mechanism::Placement => self.placement,
            Mechanism::Sessions => self.sessions,
        }
    }

    pub fn with(mut self, m: Mechanism, on: bool) -> Self {
        match m {
            Mechanism::Host => self.host = on,
            Mechanism::Retention => self.retention = on,
            Mechanism::Placement => self.placement = on,
            Mechanism::Sessions => self.sessions = on,
        }
        self
    }

    /// The mechanisms in the set, in [`Mechanism::ALL`]'s order.
    pub fn list(&self) -> Vec<Mechanism> {
        Mechanism::ALL
            .into_iter()
            .filter(|&m| self.has(m))
            .collect()
    }

    /// `base` with these mechanisms, configured from `settings`.
    pub fn apply(
        &self,
        base: &ClusterConfig,
        settings: &KnobSettings,
    ) -> Result<ClusterConfig, ReplayError> {
        let mut config = base.clone();
        if self.host {
            config.sim.num_host_blocks = settings
                .host_kv_blocks
                .unwrap_or(config.sim.num_device_blocks.saturating_mul(2));
            if !(settings.host_gbps.is_finite() && settings.host_gbps > 0.0) {
                return Err(ReplayError::InvalidConfig(format!(
                    "--host-gbps must be a positive number, got {}",
                    settings.host_gbps
                )));
            }
            let block_bytes =
                u64::from(config.sim.block_size.get()) * KvLayout::default().bytes_per_token();
            config.sim.timing.host_to_device_block_us =
                TimingModel::host_block_us(block_bytes, settings.host_gbps);
        }
        if self.retention {
            if !(settings.retention_cap_s.is_finite() && settings.retention_cap_s >= 0.001) {
                return Err(ReplayError::InvalidConfig(format!(
                    "--retention-cap-s must be at least 0.001, got {}",
                    settings.retention_cap_s
                )));
            }
            let cap_ms = (settings.retention_cap_s * 1000.0).round() as u64;
            let defaults = RetentionConfig::default();
            config.retention = Some(RetentionConfig {
                cap_ms,
                initial_ms: defaults.initial_ms.min(cap_ms),
                ..defaults
            });
            config.sim.retention_budget_fraction = settings.retention_budget;
        }
        if self.placement {
            config = config.with_placement();
        }
        config.session_scheduling = self.sessions;
        config
            .sim
            .validate()
            .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
        Ok(config)
    }
}

/// How the host tier and retention are set up when a set has them.
#[derive(Debug, Clone, PartialEq)]
pub struct KnobSettings {
    /// Host tier per worker, in blocks (`None`: twice the device cache).
    pub host_kv_blocks: Option<u64>,
    /// Host-to-device link, Gbit/s.
    pub host_gbps: f64,
    /// Longest retention hint, seconds.
    pub retention_cap_s: f64,
    /// Share of each worker's device blocks hints may keep pinned.
    pub retention_budget: f64,
}

impl Default for KnobSettings {
    /// `switchyard replay`'s defaults.
    fn default() -> Self {
        Self {
            host_kv_blocks: None,
            host_gbps: 400.0,
            retention_cap_s: 300.0,
            retention_budget: 0.5,
        }
    }
}

/// An engine whose mechanisms a run is limited to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKnobs {
    Vllm,
    Sglang,
    Trtllm,
    Sim,
}

impl EngineKnobs {
    pub const ALL: [EngineKnobs; 4] = [
        EngineKnobs::Vllm,
        EngineKnobs::Sglang,
        EngineKnobs::Trtllm,
        EngineKnobs::Sim,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EngineKnobs::Vllm => "vllm",
            EngineKnobs::Sglang => "sglang",
            EngineKnobs::Trtllm => "trtllm",
            EngineKnobs::Sim => "sim",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == name)
    }

    /// What the engine supports (see the module docs and `docs/engines.md`).
    pub fn mechanisms(self) -> Mechanisms {
        let all = Mechanisms {
            host: true,
            retention: true,
            placement: true,
            sessions: true,
        };
        match self {
            // CPU offloading (native connector, LMCache); kv_transfer_params; no retention.
            EngineKnobs::Vllm => all.with(Mechanism::Retention, false),
            // HiCache; retention as radix-eviction priority; no placement between aggregated
            // servers.
            EngineKnobs::Sglang => all.with(Mechanism::Placement, false),
            // Secondary pool; disaggregated_params; no retention control.
            EngineKnobs::Trtllm => all.with(Mechanism::Retention, false),
            EngineKnobs::Sim => all,
        }
    }
}

/// One run of an ablation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AblationRow {
    /// What the row is called in the report: `round-robin`, `kv`, `kv+host`, `vllm`,
    /// `vllm-host`.
    pub name: String,
    pub policy: PolicyKind,
    pub mechanisms: Mechanisms,
}

/// The runs that tell `engine`'s mechanisms apart (see the module docs).
pub fn ablation(engine: EngineKnobs) -> Vec<AblationRow> {
    let set = engine.mechanisms();
    let row = |name: String, policy, mechanisms| AblationRow {
        name,
        policy,
        mechanisms,
    };
    let none = Mechanisms::default();
    let mut rows = vec![
        row("round-robin".into(), PolicyKind::RoundRobin, none),
        row("kv".into(), PolicyKind::Kv, none),
    ];
    let list = set.list();
    for &m in &list {
        rows.push(row(
            format!("kv+{}", m.as_str()),
            PolicyKind::Kv,
            none.with(m, true),
        ));
    }
    if list.len() > 1 {
        rows.push(row(engine.as_str().into(), PolicyKind::Kv, set));
        for &m in &list {
            rows.push(row(
                format!("{}-{}", engine.as_str(), m.as_str()),
                PolicyKind::Kv,
                set.with(m, false),
            ));
        }
    }
    rows
}

/// The ablation's figures as a Markdown table, one block of rows per load level: `runs` holds
/// one summary per row and level, labelled with the row's name.
pub fn ablation_table(engine: EngineKnobs, runs: &[Summary]) -> String {
    let mut s = String::new();
    let set = engine.mechanisms();
    let _ = writeln!(
        s,
        "{} knobs: {}",
        engine.as_str(),
        set.list()
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        s,
        "| level | run | mechanisms | TTFT p50 | TTFT p99 | p99 kv / run | TPOT p50 | hit | out tok/s/worker | floor p99 | p99 / floor | held turns |"
    );
    let _ = writeln!(
        s,
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let rows = ablation(engine);
    let mut levels: Vec<f64> = runs.iter().map(|r| r.level).collect();
    levels.dedup();
    for level in levels {
        let at = |name: &str| runs.iter().find(|r| r.level == level && r.label == name);
        let kv_p99 = at("kv").map(|r| r.ttft_ms.p99);
        for row in &rows {
            let Some(r) = at(&row.name) else {
                continue;
            };
            let mechanisms = row
                .mechanisms
                .list()
                .iter()
                .map(|m| m.as_str())
                .collect::<Vec<_>>()
                .join("+");
            let floor = r.ttft_floor_ms.map(|f| f.p99);
            let ratio = |a: Option<f64>, b: f64| match a {
                Some(a) if b > 0.0 => format!("{:.2}×", a / b),
                _ => "–".into(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.0} ms | {:.0} ms | {} | {:.1} ms | {:.1} % | {:.1} | {} | {} | {} |",
                level,
                row.name,
                if mechanisms.is_empty() {
                    "–"
                } else {
                    &mechanisms
                },
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                ratio(kv_p99, r.ttft_ms.p99),
                r.tpot_ms.p50,
                r.cache_hit_rate * 100.0,
                r.output_tok_s_per_worker,
                floor.map_or_else(|| "–".into(), |f| format!("{f:.0} ms")),
                floor.map_or_else(|| "–".into(), |f| ratio(Some(r.ttft_ms.p99), f)),
                r.held_turns,
            );
        }
    }
    s
}
