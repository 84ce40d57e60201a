//! What a cache hit outside device memory costs a worker, as the worker announces it at
//! registration: the bytes of one KV block, how fast it recomputes a prompt, and for each
//! non-device tier the latency and bandwidth of bringing blocks back to the device. The router
//! turns a tier hit into time with these figures (`switchyard_router::policy::cost`) and
//! compares it with recomputing the same tokens, instead of crediting hits with fixed factors.

use serde::{Deserialize, Serialize};

use crate::{CoreError, StorageTier};

/// One path from a tier to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierLink {
    /// Sustained bytes per second from the tier into device memory.
    pub bytes_per_s: u64,
    /// Fixed cost of one load from the tier (lookup, request, first byte), in microseconds.
    pub latency_us: u64,
}

impl TierLink {
    /// Seconds to bring `bytes` to the device when `queued_bytes` are ahead on the same path.
    pub fn seconds(&self, bytes: u64, queued_bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        self.latency_us as f64 / 1e6 + (bytes + queued_bytes) as f64 / self.bytes_per_s as f64
    }
}

/// A worker's announced KV tier costs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvTierCosts {
    /// KV bytes of one block on this worker (all layers, K and V, its tensor-parallel share
    /// summed over ranks): what moves when a block is loaded.
    pub bytes_per_block: u64,
    /// Prompt tokens the worker computes per second: what recomputing costs.
    pub prefill_tokens_per_s: u64,
    /// Host memory to device (PCIe, NVLink-C2C).
    pub host: TierLink,
    /// Local disk to device (NVMe through host memory, or GPUDirect Storage).
    pub disk: TierLink,
    /// A store off the node (LMCache remote, Mooncake, SGLang's `EXTERNAL` pool) to device.
    pub remote: TierLink,
}

impl KvTierCosts {
    /// Figures of a typical 8B-class fp16 model on one H100-class GPU with `bytes_per_block`
    /// per block: PCIe 5 host copies (25 GB/s), one NVMe drive (5 GB/s), a 100 Gb/s network
    /// store (10 GB/s effective, 1 ms per lookup), prefill at 16,000 tokens/s. What a worker
    /// that announces nothing is assumed to have, and the adapters' defaults.
    pub fn typical(bytes_per_block: u64) -> Self {
        Self {
            bytes_per_block,
            prefill_tokens_per_s: 16_000,
            host: TierLink {
                bytes_per_s: 25_000_000_000,
                latency_us: 20,
            },
            disk: TierLink {
                bytes_per_s: 5_000_000_000,
                latency_us: 100,
            },
            remote: TierLink {
                bytes_per_s: 10_000_000_000,
                latency_us: 1_000,
            },
        }
    }

    /// The path from `tier` to the device; none for the device itself.
    pub fn link(&self, tier: StorageTier) -> Option<&TierLink> {
        match tier {
            StorageTier::Device => None,
            StorageTier::Host => Some(&self.host),
            StorageTier::Disk => Some(&self.disk),
            StorageTier::Remote => Some(&self.remote),
        }
    }

    /// Seconds to compute `tokens` prompt tokens.
    pub fn recompute_seconds(&self, tokens: u64) -> f64 {
        tokens as f64 / self.prefill_tokens_per_s as f64
    }

    /// Refuses figures that would make a time infinite or meaningless.
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |m: String| Err(CoreError::InvalidWorkerInfo(m));
        if self.bytes_per_block == 0 {
            return bad("kv tier costs: bytes_per_block must be at least 1".into());
        }
        if self.prefill_tokens_per_s == 0 {
            return bad("kv tier costs: prefill_tokens_per_s must be at least 1".into());
        }
        for tier in [StorageTier::Host, StorageTier::Disk, StorageTier::Remote] {
            if self.link(tier).is_some_and(|l| l.bytes_per_s == 0) {
                return bad(format!(
                    "kv tier costs: the {} tier's bytes_per_s must be at least 1",
                    tier.as_str()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_costs_latency_plus_bytes_over_bandwidth_behind_the_queue() {
        let link = TierLink {
            bytes_per_s: 1_000_000,
            latency_us: 500,
        };
        assert_eq!(
            link.seconds(0, 10_000_000),
            0.0,
            "nothing to load, nothing to wait"
        );
        assert!((link.seconds(1_000_000, 0) - 1.0005).abs() < 1e-12);
        assert!((link.seconds(1_000_000, 1_000_000) - 2.0005).abs() < 1e-12);
        let costs = KvTierCosts::typical(2 << 20);
        assert!(costs.link(StorageTier::Device).is_none());
        assert_eq!(costs.link(StorageTier::Remote), Some(&costs.remote));
        assert!((costs.recompute_seconds(32_000) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn zero_rates_are_refused_naming_the_field() {
        assert!(KvTierCosts::typical(1).validate().is_ok());
        let mut c = KvTierCosts::typical(1);
        c.disk.bytes_per_s = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("disk tier's bytes_per_s"), "{err}");
        let c = KvTierCosts {
            prefill_tokens_per_s: 0,
            ..KvTierCosts::typical(1)
        };
        assert!(c.validate().unwrap_err().to_string().contains("prefill"));
        let c = KvTierCosts::typical(0);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("bytes_per_block")
        );
    }

    #[test]
    fn round_trips_through_json_and_refuses_unknown_keys() {
        let c = KvTierCosts::typical(4096);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<KvTierCosts>(&json).unwrap(), c);
        let extra = json.replacen('{', "{\"host_hit_factor\":0.5,", 1);
        assert!(serde_json::from_str::<KvTierCosts>(&extra).is_err());
    }
}
