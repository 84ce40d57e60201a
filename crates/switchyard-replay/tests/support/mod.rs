//! Setup shared by the replay crate's integration tests: where the shared traces live and the
//! four-worker simulated cluster they replay on.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::ClusterConfig;
use switchyard_replay::workload::weka::{self, WekaConfig, WekaWorkload};
use switchyard_router::{PolicyConfig, PolicyKind};

/// A file under the workspace's sibling `shared/data` directory.
pub fn shared(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(path)
}

/// Four simulated workers of `kv_blocks` device blocks each, routed by `policy`, with events and
/// load reports applied at once and no disaggregation or retention.
pub fn cluster(policy: PolicyKind, block_size: u32, kv_blocks: u64, seed: u64) -> ClusterConfig {
    ClusterConfig {
        workers: 4,
        sim: SimConfig {
            block_size: BlockSize::new(block_size).expect("test block sizes are valid"),
            num_device_blocks: kv_blocks,
            max_context_tokens: 1 << 20,
            seed,
            ..SimConfig::default()
        },
        policy,
        policy_config: PolicyConfig {
            seed,
            ..PolicyConfig::default()
        },
        ..ClusterConfig::default()
    }
}

/// The first `sessions` traces of the shared corpus `corpus` (a path under `agentx/`), replayed
/// closed loop at `concurrency` with think times × `time_scale`.
pub fn weka_sessions(
    corpus: &str,
    sessions: usize,
    concurrency: usize,
    time_scale: f64,
) -> WekaWorkload {
    let traces = weka::load(&shared(&format!("agentx/{corpus}")), Some(sessions))
        .expect("the shared corpus loads");
    WekaWorkload::new(
        traces,
        WekaConfig {
            concurrency,
            time_scale,
            ..WekaConfig::default()
        },
    )
    .expect("a valid closed-loop configuration")
}

/// Four short whole sessions of `dev_b_120` (among its first 40; the sweep's golden slice),
/// replayed closed loop at `concurrency` with think times × `time_scale`.
pub fn dev_b_short(concurrency: usize, time_scale: f64) -> WekaWorkload {
    let path = shared("agentx/weka_kv_cache_tester/dev_b_120.jsonl.gz");
    let mut traces = weka::load(&path, Some(40)).expect("the shared corpus loads");
    let ids = ["trace_0248", "trace_0251", "trace_0265", "trace_0288"];
    traces.retain(|t| ids.contains(&t.id.as_str()));
    assert_eq!(
        traces.len(),
        ids.len(),
        "every named session is in the slice"
    );
    WekaWorkload::new(
        traces,
        WekaConfig {
            concurrency,
            time_scale,
            ..WekaConfig::default()
        },
    )
    .expect("a valid closed-loop configuration")
}
