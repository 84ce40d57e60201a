//! `switchyard replay disagg`: aggregated against disaggregated serving under load.
//!
//! For each cluster size, the same open-loop requests (the synthetic chat + long-prompt mix,
//! or a Mooncake trace slice) are served by every [`Setup`]: all workers `both` with KV-aware
//! routing, then each prefill-pool size under `enforce` and `auto`. Offline, virtual time,
//! deterministic: the same flags give the same tables on any machine.

use std::path::PathBuf;

use serde_json::json;
use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::disagg_bench::{self, Row, Setup, Targets};
use switchyard_replay::workload::mix::{MixConfig, MixWorkload};
use switchyard_replay::workload::mooncake::{self, MooncakeRecord, MooncakeWorkload};
use switchyard_replay::{ClusterConfig, ReplayError, Workload};
use switchyard_router::{PolicyConfig, PolicyKind};

use crate::shared_data::{self, resolve_trace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Source {
    /// Synthetic: steady short chat requests plus long prompts (16k–32k tokens).
    Mix,
    /// The first `--limit` requests of a Mooncake trace at `--speed`.
    Mooncake,
}

#[derive(Debug, clap::Args)]
pub struct DisaggArgs {
    #[arg(long, value_enum, default_value = "mix")]
    workload: Source,
    /// Cluster sizes to compare at.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    workers: Vec<usize>,
    /// Prefill-pool sizes as fractions of the cluster (rounded, at least 1, fewer than all).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5")]
    prefill_fractions: Vec<f64>,
    /// `auto` sends a prompt to the prefill pool from this many uncached tokens (gateway
    /// default).
    #[arg(long, default_value_t = switchyard_router::serve::DEFAULT_MIN_UNCACHED_TOKENS)]
    min_uncached_tokens: u64,
    /// Mix: seconds of arrivals.
    #[arg(long, default_value_t = 120.0)]
    seconds: f64,
    /// Mix: chat requests per second per 4 workers (scaled with the cluster).
    #[arg(long, default_value_t = 6.0)]
    chat_rate: f64,
    /// Mix: long prompts per second per 4 workers (scaled with the cluster).
    #[arg(long, default_value_t = 0.25)]
    long_rate: f64,
    /// Mooncake JSONL trace (default: traces/mooncake/conversation_trace.jsonl in the shared
    /// data directory).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The shared data directory the default trace is read from (default: ../shared/data from
    /// the current directory, else beside the checkout the binary was built from).
    #[arg(long, env = "SWITCHYARD_DATA")]
    data_dir: Option<PathBuf>,
    /// Mooncake: requests from the start of the trace.
    #[arg(long, default_value_t = 1500)]
    limit: usize,
    /// Mooncake: arrival-rate multiplier per 4 workers (scaled with the cluster).
    #[arg(long, default_value_t = 0.5)]
    speed: f64,
    /// TTFT target of short prompts, ms.
    #[arg(long, default_value_t = 1000.0)]
    ttft_ms: f64,
    /// TTFT target of long prompts, ms.
    #[arg(long, default_value_t = 5000.0)]
    long_ttft_ms: f64,
    /// Target of a request's mean time per output token, ms.
    #[arg(long, default_value_t = 30.0)]
    itl_ms: f64,
    /// Prompts of at least this many tokens are long.
    #[arg(long, default_value_t = 8192)]
    long_tokens: u64,
    /// A gap between two tokens of at least this many ms counts as a stall.
    #[arg(long, default_value_t = 100.0)]
    stall_ms: f64,
    /// Seed of the workload and the simulators.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write every row as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Where the requests come from, scaled per cluster size.
enum Requests {
    Mix(MixConfig),
    Mooncake(Vec<MooncakeRecord>),
}

impl Requests {
    fn build(&self, args: &DisaggArgs, workers: usize) -> Result<Box<dyn Workload>, ReplayError> {
        let scale = workers as f64 / 4.0;
        Ok(match self {
            Requests::Mix(config) => Box::new(MixWorkload::new(&config.scaled(scale))?),
            Requests::Mooncake(records) => {
                Box::new(MooncakeWorkload::new(records.clone(), args.speed * scale)?)
            }
        })
    }
}

fn cluster(args: &DisaggArgs, workers: usize) -> Result<ClusterConfig, ReplayError> {
    // Mooncake ids name 512-token blocks; the replay runs it at that block size (and its
    // 2M-token caches) so prefix sharing is the trace's. The mix runs the default engine.
    let sim = match args.workload {
        Source::Mix => SimConfig {
            seed: args.seed,
            ..SimConfig::default()
        },
        Source::Mooncake => SimConfig {
            block_size: BlockSize::new(mooncake::MOONCAKE_BLOCK_SIZE)
                .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?,
            num_device_blocks: 4096,
            max_context_tokens: 262_144,
            seed: args.seed,
            ..SimConfig::default()
        },
    };
    Ok(ClusterConfig {
        workers,
        sim,
        policy: PolicyKind::Kv,
        policy_config: PolicyConfig {
            seed: args.seed,
            ..PolicyConfig::default()
        },
        event_delay_us: 0,
        load_report_interval_us: 0,
        disagg: None,
        token_gaps: true,
        retention: None,
        session_scheduling: false,
    })
}

fn prefill_pools(args: &DisaggArgs, workers: usize) -> Vec<usize> {
    let mut pools: Vec<usize> = args
        .prefill_fractions
        .iter()
        .map(|f| ((f * workers as f64).round() as usize).clamp(1, workers.saturating_sub(1)))
        .collect();
    pools.dedup();
    pools
}

/// Runs the comparison and prints one pair of tables per cluster size.
pub fn run(args: &DisaggArgs) -> Result<(), ReplayError> {
    if args.workers.iter().any(|&n| n < 2) {
        return Err(ReplayError::InvalidConfig(
            "--workers: a split needs at least 2 workers".into(),
        ));
    }
    if args
        .prefill_fractions
        .iter()
        .any(|f| !(f.is_finite() && *f > 0.0 && *f < 1.0))
    {
        return Err(ReplayError::InvalidConfig(
            "--prefill-fractions must be between 0 and 1".into(),
        ));
    }
    let targets = Targets {
        ttft_s: args.ttft_ms / 1e3,
        long_ttft_s: args.long_ttft_ms / 1e3,
        itl_s: args.itl_ms / 1e3,
        long_prompt_tokens: args.long_tokens,
        stall_s: args.stall_ms / 1e3,
    };
    let requests = match args.workload {
        Source::Mix => Requests::Mix(MixConfig {
            seconds: args.seconds,
            chat_rate: args.chat_rate,
            long_rate: args.long_rate,
            seed: args.seed,
            ..MixConfig::default()
        }),
        Source::Mooncake => {
            let trace = resolve_trace(
                args.trace.clone(),
                shared_data::MOONCAKE_TRACE,
                args.data_dir.as_deref(),
                "--trace",
            )
            .map_err(ReplayError::InvalidConfig)?;
            Requests::Mooncake(mooncake::load(&trace, Some(args.limit))?)
        }
    };
    let mut all: Vec<Row> = Vec::new();
    for &workers in &args.workers {
        let base = cluster(args, workers)?;
        let setups: Vec<Setup> = disagg_bench::setups(
            workers,
            &prefill_pools(args, workers),
            args.min_uncached_tokens,
        );
        let mut rows = Vec::new();
        for setup in &setups {
            let mut workload = requests.build(args, workers)?;
            let (row, _) = disagg_bench::run_setup(workload.as_mut(), &base, setup, &targets)?;
            rows.push(row);
        }
        println!("\n### {workers} workers\n");
        print!("{}", disagg_bench::markdown(&rows));
        all.extend(rows);
    }
    if let Some(path) = &args.json {
        let body = json!({ "targets": targets, "rows": all });
        let text =
            serde_json::to_string_pretty(&body).map_err(|e| ReplayError::Report(e.to_string()))?;
        std::fs::write(path, text)
            .map_err(|e| ReplayError::Report(format!("{}: {e}", path.display())))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: DisaggArgs,
    }

    fn parse(flags: &[&str]) -> DisaggArgs {
        Cli::try_parse_from(std::iter::once("disagg").chain(flags.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn prefill_pools_are_rounded_and_leave_a_decode_worker() {
        let args = parse(&["--prefill-fractions", "0.25,0.5,0.9"]);
        assert_eq!(prefill_pools(&args, 4), vec![1, 2, 3]);
        assert_eq!(prefill_pools(&args, 8), vec![2, 4, 7]);
        let args = parse(&["--prefill-fractions", "0.1,0.2"]);
        assert_eq!(prefill_pools(&args, 4), vec![1]);
    }

    #[test]
    fn bad_settings_are_configuration_errors() {
        for flags in [
            &["--workers", "1"][..],
            &["--prefill-fractions", "1.5"],
            &["--seconds", "0"],
            &["--chat-rate=-1"],
        ] {
            let err = run(&parse(flags)).unwrap_err();
            assert!(
                matches!(err, ReplayError::InvalidConfig(_)),
                "{flags:?}: {err}"
            );
        }
    }
}
