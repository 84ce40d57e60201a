//! What the router is told of the simulators' KV tiers: they announce no tier costs, so the
//! cost model would price their host hits with the typical figures' link (25 GB/s) while the
//! simulators load them over their own (400 Gbit/s by default, `replay agentx --host-gbps`).

use switchyard_core::TierLink;
use switchyard_engine_sim::{KvLayout, SimConfig};

/// The link the simulators load host-tier hits over (`KvConfig::host_link`): a block of KV in
/// `host_to_device_block_us`; `None` without a host tier, or when a copy costs nothing.
pub(super) fn host_link(sim: &SimConfig) -> Option<TierLink> {
    let us = sim.timing.host_to_device_block_us;
    if sim.num_host_blocks == 0 || !(us.is_finite() && us > 0.0) {
        return None;
    }
    let block_bytes = u64::from(sim.block_size.get()) * KvLayout::default().bytes_per_token();
    Some(TierLink {
        bytes_per_s: (block_bytes as f64 * 1e6 / us).round().max(1.0) as u64,
        latency_us: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_engine_sim::TimingModel;

    #[test]
    fn the_priced_host_link_loads_a_block_in_the_simulators_time() {
        let mut sim = SimConfig::default();
        assert_eq!(host_link(&sim), None, "no host tier, nothing to price");
        sim.num_host_blocks = 100;
        let block_bytes = u64::from(sim.block_size.get()) * KvLayout::default().bytes_per_token();
        sim.timing.host_to_device_block_us = TimingModel::host_block_us(block_bytes, 400.0);
        let link = host_link(&sim).unwrap();
        assert_eq!(link.bytes_per_s, 50_000_000_000);
        let seconds = link.seconds(block_bytes, 0);
        assert!((seconds * 1e6 - sim.timing.host_to_device_block_us).abs() < 1e-6);
        sim.timing.host_to_device_block_us = 0.0;
        assert_eq!(host_link(&sim), None, "a free copy has no rate");
    }
}
