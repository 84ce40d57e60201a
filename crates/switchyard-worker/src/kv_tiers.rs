//! `[kv_tiers]`: what loading KV from each non-device tier costs this worker, announced at
//! registration ([`KvTierCosts`] in its registry record) so routers price a tier hit in time
//! against recomputing it. Every figure is optional: the simulator's defaults come from its
//! own timing model (its prefill rate and host-to-device copy time), a real engine's from
//! [`KvTierCosts::typical`]; bytes per block always come from the worker's KV layout.

use serde::Deserialize;
use switchyard_core::{EngineKind, KvTierCosts, TierLink};
use switchyard_engine_sim::TimingModel;

use crate::config::ConfigError;

/// The `[kv_tiers]` section and its flags (`--kv-prefill-tokens-per-s`,
/// `--kv-host-gbytes-per-s`, `--kv-host-latency-us`, and the same for `disk` and `remote`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvTierConfig {
    /// Prompt tokens the engine computes per second.
    pub prefill_tokens_per_s: Option<u64>,
    /// Host memory to device, in gigabytes (10⁹ bytes) per second.
    pub host_gbytes_per_s: Option<f64>,
    pub host_latency_us: Option<u64>,
    /// Local disk to device.
    pub disk_gbytes_per_s: Option<f64>,
    pub disk_latency_us: Option<u64>,
    /// A store off the node (LMCache remote, Mooncake, SGLang's `EXTERNAL` pool) to device.
    pub remote_gbytes_per_s: Option<f64>,
    pub remote_latency_us: Option<u64>,
    /// Another worker's device to this one's, when this worker's engine can pull a peer's KV
    /// while serving aggregated (vLLM with a KV connector in `kv_both`, TensorRT-LLM with its
    /// cache transceiver, the simulator): announced as the worker's peer link
    /// (`WorkerInfo::kv_peer`), so the gateway may place a request whose prefix a busy peer
    /// holds here, its KV pulled instead of recomputed. Unset: no peer link is announced.
    pub peer_gbytes_per_s: Option<f64>,
    /// Fixed cost of one pull from a peer, microseconds (default 100).
    pub peer_latency_us: Option<u64>,
}

/// Default [`KvTierConfig::peer_latency_us`]: a connector's handshake and first byte.
pub const DEFAULT_PEER_LATENCY_US: u64 = 100;

impl KvTierConfig {
    /// Refuses rates that are zero, negative or not numbers, naming the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.prefill_tokens_per_s == Some(0) {
            return Err(ConfigError::Invalid(
                "kv_tiers.prefill_tokens_per_s must be at least 1".into(),
            ));
        }
        for (key, value) in [
            ("host_gbytes_per_s", self.host_gbytes_per_s),
            ("disk_gbytes_per_s", self.disk_gbytes_per_s),
            ("remote_gbytes_per_s", self.remote_gbytes_per_s),
            ("peer_gbytes_per_s", self.peer_gbytes_per_s),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0 && bytes_per_s(v) > 0)
            {
                return Err(ConfigError::Invalid(format!(
                    "kv_tiers.{key} must be a positive number of gigabytes per second, got {v}"
                )));
            }
        }
        if self.peer_latency_us.is_some() && self.peer_gbytes_per_s.is_none() {
            return Err(ConfigError::Invalid(
                "kv_tiers.peer_latency_us is set without kv_tiers.peer_gbytes_per_s: give the peer link's rate too".into(),
            ));
        }
        Ok(())
    }

    /// Refuses a peer link on an engine that cannot pull a peer's KV while serving aggregated.
    pub fn check_peer_engine(&self, engine: EngineKind) -> Result<(), ConfigError> {
        if self.peer_gbytes_per_s.is_some() && engine == EngineKind::Sglang {
            return Err(ConfigError::Invalid(
                "kv_tiers.peer_gbytes_per_s is set for an sglang engine: an SGLang server exchanges KV only in --disaggregation-mode prefill or decode, where it does not serve aggregated, so it cannot take a peer's prefix; leave it unset".into(),
            ));
        }
        Ok(())
    }

    /// The peer link this worker announces (`WorkerInfo::kv_peer`), when configured.
    pub fn peer_link(&self) -> Option<TierLink> {
        self.peer_gbytes_per_s.map(|g| TierLink {
            bytes_per_s: bytes_per_s(g),
            latency_us: self.peer_latency_us.unwrap_or(DEFAULT_PEER_LATENCY_US),
        })
    }

    /// The figures this worker announces: its KV block's bytes, the configured figures, and
    /// for the rest the engine's defaults (see the module docs).
    pub fn announce(
        &self,
        engine: EngineKind,
        bytes_per_block: u64,
        timing: &TimingModel,
    ) -> KvTierCosts {
        let mut costs = KvTierCosts::typical(bytes_per_block);
        if engine == EngineKind::Sim {
            // The simulator's own figures, so the router prices what the simulator does.
            if timing.prefill_token_us > 0.0 {
                costs.prefill_tokens_per_s =
                    (1e6 / timing.prefill_token_us).round().max(1.0) as u64;
            }
            if timing.host_to_device_block_us > 0.0 {
                let per_s = bytes_per_block as f64 * 1e6 / timing.host_to_device_block_us;
                costs.host = TierLink {
                    bytes_per_s: per_s.round().clamp(1.0, u64::MAX as f64) as u64,
                    latency_us: 0,
                };
            }
        }
        if let Some(rate) = self.prefill_tokens_per_s {
            costs.prefill_tokens_per_s = rate;
        }
        for (link, gbytes, latency) in [
            (
                &mut costs.host,
                self.host_gbytes_per_s,
                self.host_latency_us,
            ),
            (
                &mut costs.disk,
                self.disk_gbytes_per_s,
                self.disk_latency_us,
            ),
            (
                &mut costs.remote,
                self.remote_gbytes_per_s,
                self.remote_latency_us,
            ),
        ] {
            if let Some(g) = gbytes {
                link.bytes_per_s = bytes_per_s(g);
            }
            if let Some(us) = latency {
                link.latency_us = us;
            }
        }
        costs
    }
}

/// Flags of `[kv_tiers]` (see [`KvTierConfig`]).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KvTierArgs {
    /// Prompt tokens the engine computes per second (default: the simulator's timing, or
    /// 16000 for vLLM/SGLang).
    #[arg(long, env = "SWITCHYARD_KV_PREFILL_TOKENS_PER_S")]
    pub kv_prefill_tokens_per_s: Option<u64>,
    /// Host-to-device KV bandwidth, GB/s (default: the simulator's copy time, or 25).
    #[arg(long, env = "SWITCHYARD_KV_HOST_GBYTES_PER_S")]
    pub kv_host_gbytes_per_s: Option<f64>,
    /// Latency of one host-tier load, microseconds.
    #[arg(long, env = "SWITCHYARD_KV_HOST_LATENCY_US")]
    pub kv_host_latency_us: Option<u64>,
    /// Disk-to-device KV bandwidth, GB/s (default 5).
    #[arg(long, env = "SWITCHYARD_KV_DISK_GBYTES_PER_S")]
    pub kv_disk_gbytes_per_s: Option<f64>,
    /// Latency of one disk-tier load, microseconds.
    #[arg(long, env = "SWITCHYARD_KV_DISK_LATENCY_US")]
    pub kv_disk_latency_us: Option<u64>,
    /// Remote-store-to-device KV bandwidth, GB/s (LMCache remote, SGLang EXTERNAL; default 10).
    #[arg(long, env = "SWITCHYARD_KV_REMOTE_GBYTES_PER_S")]
    pub kv_remote_gbytes_per_s: Option<f64>,
    /// Latency of one remote-tier load, microseconds (default 1000).
    #[arg(long, env = "SWITCHYARD_KV_REMOTE_LATENCY_US")]
    pub kv_remote_latency_us: Option<u64>,
    /// Peer-to-this-worker KV bandwidth, GB/s, for an engine that pulls a peer's KV while
    /// serving aggregated (vLLM with a `kv_both` connector, TensorRT-LLM, the simulator):
    /// announces the worker for sub-agent placement. Unset: none announced.
    #[arg(long, env = "SWITCHYARD_KV_PEER_GBYTES_PER_S")]
    pub kv_peer_gbytes_per_s: Option<f64>,
    /// Latency of one pull from a peer, microseconds (default 100).
    #[arg(long, env = "SWITCHYARD_KV_PEER_LATENCY_US")]
    pub kv_peer_latency_us: Option<u64>,
}

impl KvTierArgs {
    pub(crate) fn apply(&self, config: &mut KvTierConfig) {
        let pick = |flag: Option<u64>, file: Option<u64>| flag.or(file);
        let pickf = |flag: Option<f64>, file: Option<f64>| flag.or(file);
        *config = KvTierConfig {
            prefill_tokens_per_s: pick(self.kv_prefill_tokens_per_s, config.prefill_tokens_per_s),
            host_gbytes_per_s: pickf(self.kv_host_gbytes_per_s, config.host_gbytes_per_s),
            host_latency_us: pick(self.kv_host_latency_us, config.host_latency_us),
            disk_gbytes_per_s: pickf(self.kv_disk_gbytes_per_s, config.disk_gbytes_per_s),
            disk_latency_us: pick(self.kv_disk_latency_us, config.disk_latency_us),
            remote_gbytes_per_s: pickf(self.kv_remote_gbytes_per_s, config.remote_gbytes_per_s),
            remote_latency_us: pick(self.kv_remote_latency_us, config.remote_latency_us),
            peer_gbytes_per_s: pickf(self.kv_peer_gbytes_per_s, config.peer_gbytes_per_s),
            peer_latency_us: pick(self.kv_peer_latency_us, config.peer_latency_us),
        };
    }
}

fn bytes_per_s(gbytes_per_s: f64) -> u64 {
    (gbytes_per_s * 1e9).round().clamp(0.0, u64::MAX as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulator_announces_its_own_timing_and_flags_override_it() {
        let timing = TimingModel {
            prefill_token_us: 50.0,
            host_to_device_block_us: 40.0,
            ..TimingModel::default()
        };
        let sim = KvTierConfig::default().announce(EngineKind::Sim, 2_000_000, &timing);
        assert_eq!(sim.prefill_tokens_per_s, 20_000);
        assert_eq!(sim.host.bytes_per_s, 50_000_000_000);
        assert_eq!(sim.bytes_per_block, 2_000_000);
        assert!(sim.validate().is_ok());
        let set = KvTierConfig {
            prefill_tokens_per_s: Some(7),
            remote_gbytes_per_s: Some(1.5),
            remote_latency_us: Some(2_000),
            ..KvTierConfig::default()
        };
        let c = set.announce(EngineKind::Sim, 2_000_000, &timing);
        assert_eq!(c.prefill_tokens_per_s, 7);
        assert_eq!(c.remote.bytes_per_s, 1_500_000_000);
        assert_eq!(c.remote.latency_us, 2_000);
        assert_eq!(c.host, sim.host, "unset figures keep their defaults");
        // A real engine starts from the typical figures, not the simulator's timing.
        let vllm = KvTierConfig::default().announce(EngineKind::Vllm, 2_000_000, &timing);
        assert_eq!(vllm, KvTierCosts::typical(2_000_000));
    }

    #[test]
    fn the_file_sets_tiers_flags_override_it_and_bad_values_stop_the_worker() {
        use crate::config::WorkerArgs;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "[kv_tiers]\nremote_gbytes_per_s = 2.0\nremote_latency_us = 300\nhost_gbytes_per_s = 9.0\n",
        )
        .unwrap();
        let config = WorkerArgs {
            config: Some(path.clone()),
            kv_tiers: KvTierArgs {
                kv_host_gbytes_per_s: Some(30.0),
                ..KvTierArgs::default()
            },
            ..WorkerArgs::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(config.kv_tiers.remote_gbytes_per_s, Some(2.0));
        assert_eq!(config.kv_tiers.remote_latency_us, Some(300));
        assert_eq!(config.kv_tiers.host_gbytes_per_s, Some(30.0));
        std::fs::write(&path, "[kv_tiers]\nremote_gbytes_per_s = -1.0\n").unwrap();
        let err = WorkerArgs {
            config: Some(path.clone()),
            ..WorkerArgs::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("remote_gbytes_per_s"), "{err}");
        std::fs::write(&path, "[kv_tiers]\nhost_hit_factor = 0.5\n").unwrap();
        assert!(
            WorkerArgs {
                config: Some(path),
                ..WorkerArgs::default()
            }
            .resolve()
            .is_err()
        );
    }

    #[test]
    fn a_peer_link_is_announced_only_when_configured_and_never_for_sglang() {
        assert_eq!(KvTierConfig::default().peer_link(), None);
        let peer = KvTierConfig {
            peer_gbytes_per_s: Some(12.5),
            ..KvTierConfig::default()
        };
        assert_eq!(
            peer.peer_link(),
            Some(TierLink {
                bytes_per_s: 12_500_000_000,
                latency_us: DEFAULT_PEER_LATENCY_US
            })
        );
        assert!(peer.validate().is_ok());
        for engine in [EngineKind::Vllm, EngineKind::Trtllm, EngineKind::Sim] {
            assert!(peer.check_peer_engine(engine).is_ok());
        }
        let err = peer.check_peer_engine(EngineKind::Sglang).unwrap_err();
        assert!(err.to_string().contains("disaggregation-mode"), "{err}");
        assert!(
            KvTierConfig::default()
                .check_peer_engine(EngineKind::Sglang)
                .is_ok()
        );
        let latency_only = KvTierConfig {
            peer_latency_us: Some(5),
            ..KvTierConfig::default()
        };
        assert!(latency_only.validate().is_err());
        let zero = KvTierConfig {
            peer_gbytes_per_s: Some(0.0),
            ..KvTierConfig::default()
        };
        assert!(
            zero.validate()
                .unwrap_err()
                .to_string()
                .contains("peer_gbytes_per_s")
        );
    }

    #[test]
    fn bad_rates_are_refused_naming_the_key() {
        assert!(KvTierConfig::default().validate().is_ok());
        for (cfg, key) in [
            (
                KvTierConfig {
                    disk_gbytes_per_s: Some(0.0),
                    ..KvTierConfig::default()
                },
                "disk_gbytes_per_s",
            ),
            (
                KvTierConfig {
                    host_gbytes_per_s: Some(f64::NAN),
                    ..KvTierConfig::default()
                },
                "host_gbytes_per_s",
            ),
            (
                KvTierConfig {
                    prefill_tokens_per_s: Some(0),
                    ..KvTierConfig::default()
                },
                "prefill_tokens_per_s",
            ),
        ] {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
