//! Replay and policy lab: drive recorded workloads through a simulated cluster or a live
//! endpoint, and report how routing policies compare.
//!
//! - [`synth`]: deterministic synthetic prompts from trace hash ids (same id, same tokens).
//! - [`workload`]: what to send when — [`workload::mooncake`] (open loop at recorded
//!   timestamps) and [`workload::weka`] (closed-loop agent session trees with subagents and
//!   think times) and [`workload::mix`] (synthetic chat plus long prompts, open loop) —
//!   behind the completion-driven [`Workload`] trait.
//! - [`cluster`]: the offline [`Cluster`]: N engine simulators behind the real prefix index,
//!   load view and policy, in deterministic virtual time; optionally with prefill and decode
//!   pools served disaggregated, the KV transfer costed as the workers cost it.
//! - [`disagg_bench`]: the same open-loop workload served aggregated and disaggregated
//!   (fixed splits, `enforce` and `auto`) on the same workers, compared on TTFT, ITL, target
//!   attainment and throughput (`switchyard replay disagg`).
//! - [`live`]: the same workloads against an OpenAI-compatible endpoint over HTTP (the only
//!   network code here).
//! - [`metrics`], [`report`], [`plot`]: per-request records, per-run [`Summary`] figures,
//!   tables, JSON/CSV files and the interactivity-vs-throughput Pareto plot (SVG).
//! - [`events`]: a gateway's KV recording replayed against several policies side by side
//!   (no simulator: the recorded caches, load reports and candidates are the input);
//!   [`events_filter`] narrows its figures to one session or tenant.
//! - [`sweep`]: every policy across traces, worker counts and arrival rates, and in each cell
//!   whether `kv` leads, ties or trails the others on hit rate and TTFT p99 (issue 45;
//!   `switchyard replay sweep`).
//! - [`knobs`]: the agent-KV mechanisms (host tier, retention, placement, session
//!   scheduling), the set each engine really supports, and the ablation runs that tell which
//!   mechanism bought what (`switchyard replay agentx --engine-knobs`).
//! - [`parallel`]: independent runs (policies, load levels) on several threads, results in
//!   the order a serial loop gives them.
//! - [`error`] holds [`ReplayError`].

pub mod cluster;
pub mod disagg_bench;
pub mod error;
pub mod events;
pub mod events_filter;
pub mod knobs;
pub mod live;
pub mod metrics;
pub mod parallel;
pub mod plot;
pub mod progress;
pub mod report;
pub mod sweep;
pub mod synth;
pub mod workload;

use indicatif::ProgressBar;

pub use cluster::{
    Cluster, ClusterConfig, ClusterRun, Control, Controller, DisaggConfig, DisaggMode, DisaggStats,
    TokenGap, WorkerStats,
};
pub use error::ReplayError;
pub use events::{EventsReport, replay_recording, replay_recording_for};
pub use events_filter::RouteFilter;
pub use metrics::{Percentiles, RequestRecord, Summary};
pub use progress::{ProgressGroup, progress_bar};
pub use report::Report;
pub use workload::{Micros, Outbox, RequestSpec, Workload};

/// One offline run: its summary and the raw run.
#[derive(Debug, Clone, PartialEq)]
pub struct OfflineRun {
    pub summary: Summary,
    pub run: ClusterRun,
}

/// Replays `workload` on a simulated cluster; `level` labels the load level in the summary.
pub fn replay_offline(
    workload: &mut dyn Workload,
    config: &ClusterConfig,
    level: f64,
    progress: &ProgressBar,
) -> Result<OfflineRun, ReplayError> {
    let run = Cluster::new(config.clone())?.run(workload, progress)?;
    let mut summary = Summary::from_records(
        &config.label(),
        level,
        config.workers,
        workload.sessions_completed(),
        &run.records,
    );
    let host_hit_blocks: u64 = run.workers.iter().map(|w| w.host_hit_blocks).sum();
    let block_tokens = u64::from(config.sim.block_size.get());
    let block_bytes = block_tokens * switchyard_engine_sim::KvLayout::default().bytes_per_token();
    if summary.prompt_tokens > 0 {
        summary.host_hit_rate =
            (host_hit_blocks * block_tokens) as f64 / summary.prompt_tokens as f64;
        summary.peer_hit_rate =
            (run.disagg.peer_blocks * block_tokens) as f64 / summary.prompt_tokens as f64;
    }
    let mut floors: Vec<f64> = run
        .records
        .iter()
        .zip(&run.ttft_floor_us)
        .filter(|(r, _)| r.ok && r.first_token.is_some())
        .map(|(_, &us)| us as f64 / 1e3)
        .collect();
    summary.ttft_floor_ms = Some(Percentiles::of(&mut floors));
    summary.recomputed_tokens = run.workers.iter().map(|w| w.prefill_tokens).sum();
    summary.held_turns = run.sessions.held_turns;
    summary.transferred_bytes =
        host_hit_blocks * block_bytes + run.disagg.bytes + run.disagg.peer_bytes;
    Ok(OfflineRun { summary, run })
}
