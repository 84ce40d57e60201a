//! `switchyard replay` and `switchyard bench`: the replay lab's command line.
//!
//! `replay` runs a workload (Mooncake open loop, or AgentX/Weka closed-loop sessions) offline
//! on a simulated cluster under several policies and load levels, or live against an
//! OpenAI-compatible endpoint, and prints/writes the comparison. `bench` runs the same offline
//! replays and reports how fast the replayer itself is (wall-clock time, steps per second).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::knobs::{self, EngineKnobs, KnobSettings, Mechanisms};
use switchyard_replay::live::{LiveConfig, replay_live};
use switchyard_replay::workload::mooncake::{self, MooncakeWorkload};
use switchyard_replay::workload::weka::{self, WekaConfig, WekaWorkload};
use switchyard_replay::workload::weka_filter::{self, CallSizes};
use switchyard_replay::{
    ClusterConfig, ProgressGroup, ReplayError, Report, RouteFilter, Summary, Workload, parallel,
    progress_bar, replay_offline, replay_recording_for,
};
use switchyard_router::{PolicyConfig, PolicyKind};

use crate::EXIT_CONFIG;
use crate::shared_data::{self, resolve_trace};

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(subcommand)]
    workload: WorkloadCommand,
}

#[derive(Debug, clap::Subcommand)]
enum WorkloadCommand {
    /// Mooncake trace, open loop at the recorded timestamps (block size 512).
    Mooncake(MooncakeArgs),
    /// AgentX/Weka agent sessions, closed loop (concurrency = live session trees).
    Agentx(AgentxArgs),
    /// A gateway's KV recording (admin API), replayed against several policies side by side.
    Events(EventsArgs),
    /// The same open-loop workload served aggregated and disaggregated (fixed splits,
    /// `enforce` and `auto`) on the same simulated workers: TTFT, ITL, attainment, throughput.
    Disagg(crate::disagg_cmd::DisaggArgs),
    /// Every policy across worker counts and arrival rates on the Mooncake and agent-session
    /// traces; marks each cell where kv trails another policy on hit rate or TTFT p99.
    Sweep(crate::sweep_cmd::SweepArgs),
}

#[derive(Debug, clap::Args)]
struct EventsArgs {
    /// Recording written by `POST /admin/recording/start` (docs/kv-recording.md).
    #[arg(long)]
    recording: PathBuf,
    /// Routing policies to compare with the live decisions.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,round-robin,random,least-loaded,approx-kv"
    )]
    policies: Vec<PolicyKind>,
    /// Seed of the sampling policies (default: the recorded gateway's).
    #[arg(long)]
    seed: Option<u64>,
    /// Count only the decisions of this session (the `x-session-id` it was routed with);
    /// every request is still replayed.
    #[arg(long)]
    session: Option<String>,
    /// Count only the decisions of this tenant (`user:NAME`, `key:HASH`, `ip:ADDR`,
    /// `anonymous`; recordings of version 2 on).
    #[arg(long)]
    tenant: Option<String>,
    /// Write <name>.json and <name>.csv here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// File stem of the written reports.
    #[arg(long, default_value = "events")]
    name: String,
}

#[derive(Debug, clap::Args)]
struct MooncakeArgs {
    /// Mooncake JSONL trace (default: traces/mooncake/conversation_trace.jsonl in the shared
    /// data directory).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The shared data directory the default trace is read from (default: ../shared/data from
    /// the current directory, else beside the checkout the binary was built from).
    #[arg(long, env = "SWITCHYARD_DATA")]
    data_dir: Option<PathBuf>,
    /// Arrival-rate multipliers to sweep (1 = recorded timestamps).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    speed: Vec<f64>,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Debug, clap::Args)]
struct AgentxArgs {
    /// Weka-format traces, one per line (`.jsonl` or `.jsonl.gz`; default:
    /// agentx/weka_kv_cache_tester/dev_120.jsonl.gz in the shared data directory).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The shared data directory the default trace is read from (default: ../shared/data from
    /// the current directory, else beside the checkout the binary was built from).
    #[arg(long, env = "SWITCHYARD_DATA")]
    data_dir: Option<PathBuf>,
    /// Concurrency levels (live session trees) to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Multiplies recorded think times and gaps (0 = back to back).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Longest gap after scaling, in seconds.
    #[arg(long, default_value_t = 300.0)]
    max_gap_s: f64,
    /// Sessions per run (default: every trace once).
    #[arg(long)]
    sessions: Option<usize>,
    /// Read only the first N traces.
    #[arg(long)]
    limit: Option<usize>,
    /// Draw traces in a seeded shuffled order instead of file order.
    #[arg(long)]
    shuffle: bool,
    /// Drop every call whose input plus output exceeds N tokens, as the `-256k` AgentX corpora
    /// do (256000); a session left with no call is dropped.
    #[arg(long, value_name = "N")]
    truncate_tokens: Option<u64>,
    /// Keep only the calls of at least N input plus output tokens (a long-context case:
    /// 262144 keeps the 256k–1M-token requests).
    #[arg(long, value_name = "N")]
    min_call_tokens: Option<u64>,
    /// Run the mechanism ablation limited to what this engine supports (`vllm`, `sglang`,
    /// `trtllm`, `sim`): round-robin and kv alone, each of the engine's mechanisms added to
    /// kv alone, all of them, and all but each one (docs/engines.md, "Agent KV mechanisms per
    /// engine"). Replaces --policies and --variants.
    #[arg(long, value_name = "ENGINE", value_parser = parse_engine_knobs)]
    engine_knobs: Option<EngineKnobs>,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Debug, clap::Args)]
struct CommonArgs {
    /// Routing policies to compare (offline).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,round-robin,random,approx-kv"
    )]
    policies: Vec<PolicyKind>,
    /// Simulated workers (offline).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Seed of the simulators and the sampling policies.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// KV cache per worker, in blocks (default: 4096 for mooncake, 16384 for agentx).
    #[arg(long)]
    kv_blocks: Option<u64>,
    /// Simulator block size (default: the trace's, 512 for mooncake, 64 for agentx).
    #[arg(long)]
    sim_block_size: Option<u32>,
    /// Longest prompt plus output a worker accepts, in tokens.
    #[arg(long)]
    max_context: Option<u64>,
    /// Offline runs (policies × levels) replayed at once, one thread each (0 = one per core;
    /// 1 = one after another). The figures do not depend on it.
    #[arg(long)]
    threads: Option<usize>,
    /// Delay before a step's KV events reach the router's index, in ms (offline).
    #[arg(long, default_value_t = 0.0)]
    event_delay_ms: f64,
    /// Workers report load at most this often, in ms (0 = before every decision).
    #[arg(long, default_value_t = 0.0)]
    load_report_ms: f64,
    /// Live mode: an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.
    #[arg(long)]
    endpoint: Option<String>,
    /// Live mode: more base URLs of the same deployment (gateway replicas), comma-separated;
    /// requests are spread over --endpoint and these in turn, as a Service would.
    #[arg(long, value_delimiter = ',')]
    spread_over: Vec<String>,
    /// Live mode: the model name (default: the endpoint's first model).
    #[arg(long)]
    model: Option<String>,
    /// Live mode: per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Write <name>.json, <name>.csv, <name>.svg and <name>.png here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// File stem of the written reports (default: the workload name).
    #[arg(long)]
    name: Option<String>,
    /// Cache variants to run each policy with (offline): `base` (device cache only), `host`
    /// (plus a host tier that evicted blocks move to), `retention` (retention hints from each
    /// session's think times), `host+retention`, `placement` (a worker may copy the prefix a
    /// peer holds on device over the workers' KV link instead of recomputing it: sub-agents of
    /// a saturated parent's worker), `full` (host + retention + placement).
    #[arg(long, value_delimiter = ',', default_value = "base")]
    variants: Vec<Variant>,
    /// Host KV tier per worker, in blocks, for the `host` variants (default: twice the device
    /// cache).
    #[arg(long)]
    host_kv_blocks: Option<u64>,
    /// Host-to-device link of the `host` variants, in Gbit/s: a host hit costs its bytes over
    /// it (128 KiB of KV per token) instead of a recompute.
    #[arg(long, default_value_t = 400.0)]
    host_gbps: f64,
    /// Longest retention hint of the `retention` variants, in seconds.
    #[arg(long, default_value_t = 300.0)]
    retention_cap_s: f64,
    /// Share of each worker's device blocks retention hints may keep pinned, in [0, 1].
    #[arg(long, default_value_t = 0.5)]
    retention_budget: f64,
}

fn parse_engine_knobs(name: &str) -> Result<EngineKnobs, String> {
    EngineKnobs::parse(name).ok_or_else(|| {
        format!("unknown engine {name:?}: expected one of vllm, sglang, trtllm, sim")
    })
}

/// A cache configuration a policy runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Variant {
    Base,
    Host,
    Retention,
    #[value(name = "host+retention")]
    HostRetention,
    Placement,
    Full,
}

impl Variant {
    fn host(self) -> bool {
        matches!(self, Variant::Host | Variant::HostRetention | Variant::Full)
    }

    fn retention(self) -> bool {
        matches!(
            self,
            Variant::Retention | Variant::HostRetention | Variant::Full
        )
    }

    fn placement(self) -> bool {
        matches!(self, Variant::Placement | Variant::Full)
    }

    /// The mechanisms of this variant.
    fn mechanisms(self) -> Mechanisms {
        Mechanisms {
            host: self.host(),
            retention: self.retention(),
            placement: self.placement(),
            sessions: false,
        }
    }
}

impl CommonArgs {
    fn knob_settings(&self) -> KnobSettings {
        KnobSettings {
            host_kv_blocks: self.host_kv_blocks,
            host_gbps: self.host_gbps,
            retention_cap_s: self.retention_cap_s,
            retention_budget: self.retention_budget,
        }
    }
}

/// A loaded workload source that can build fresh workloads for each run.
enum Source {
    Mooncake {
        records: Vec<mooncake::MooncakeRecord>,
        speeds: Vec<f64>,
    },
    Agentx {
        traces: Vec<weka::WekaTrace>,
        config: WekaConfig,
        levels: Vec<usize>,
    },
}

impl Source {
    fn levels(&self) -> Vec<f64> {
        match self {
            Source::Mooncake { speeds, .. } => speeds.clone(),
            Source::Agentx { levels, .. } => levels.iter().map(|&c| c as f64).collect(),
        }
    }

    fn build(&self, level: f64, seed: u64) -> Result<Box<dyn Workload>, ReplayError> {
        Ok(match self {
            Source::Mooncake { records, .. } => {
                Box::new(MooncakeWorkload::new(records.clone(), level)?)
            }
            Source::Agentx { traces, config, .. } => Box::new(WekaWorkload::new(
                traces.clone(),
                WekaConfig {
                    concurrency: level as usize,
                    shuffle_seed: config.shuffle_seed.map(|_| seed),
                    ..config.clone()
                },
            )?),
        })
    }
}

struct Plan {
    name: &'static str,
    /// The mechanism ablation for this engine instead of policies × variants.
    engine_knobs: Option<EngineKnobs>,
    trace: PathBuf,
    level_kind: &'static str,
    source: Source,
    cluster: ClusterConfig,
    common: CommonArgs,
    extra: serde_json::Value,
}

pub(crate) fn ms_to_us(ms: f64) -> Result<u64, ReplayError> {
    if ms.is_finite() && ms >= 0.0 {
        Ok((ms * 1000.0).round() as u64)
    } else {
        Err(ReplayError::InvalidConfig(format!(
            "{ms} ms is not a valid delay"
        )))
    }
}

/// The cluster every run starts from; `host_tier` says whether some run has a host tier
/// besides what `--variants` asks for (an engine's knobs).
fn cluster_config(
    common: &CommonArgs,
    block_size: u32,
    kv_blocks: u64,
    max_context: u64,
    host_tier: bool,
) -> Result<ClusterConfig, ReplayError> {
    let block_size = BlockSize::new(common.sim_block_size.unwrap_or(block_size))
        .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
    let sim = SimConfig {
        block_size,
        num_device_blocks: common.kv_blocks.unwrap_or(kv_blocks),
        max_context_tokens: common.max_context.unwrap_or(max_context),
        seed: common.seed,
        ..SimConfig::default()
    };
    sim.validate()
        .map_err(|e| ReplayError::InvalidConfig(e.to_string()))?;
    if common.policies.is_empty() {
        return Err(ReplayError::InvalidConfig("--policies is empty".into()));
    }
    if common.variants.is_empty() {
        return Err(ReplayError::InvalidConfig("--variants is empty".into()));
    }
    if common.host_kv_blocks.is_some() && !host_tier && !common.variants.iter().any(|v| v.host()) {
        return Err(ReplayError::InvalidConfig(
            "--host-kv-blocks needs a host variant in --variants (host, host+retention or full)"
                .into(),
        ));
    }
    Ok(ClusterConfig {
        workers: common.workers,
        sim,
        policy: common.policies[0],
        policy_config: PolicyConfig {
            seed: common.seed,
            ..PolicyConfig::default()
        },
        event_delay_us: ms_to_us(common.event_delay_ms)?,
        load_report_interval_us: ms_to_us(common.load_report_ms)?,
        disagg: None,
        token_gaps: false,
        retention: None,
        session_scheduling: false,
    })
}

fn plan(args: ReplayArgs) -> Result<Plan, ReplayError> {
    match args.workload {
        WorkloadCommand::Mooncake(a) => {
            if a.speed.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
                return Err(ReplayError::InvalidConfig(
                    "--speed must be positive".into(),
                ));
            }
            let cluster = cluster_config(
                &a.common,
                mooncake::MOONCAKE_BLOCK_SIZE,
                4096,
                262_144,
                false,
            )?;
            let trace = resolve_trace(
                a.trace,
                shared_data::MOONCAKE_TRACE,
                a.data_dir.as_deref(),
                "--trace",
            )
            .map_err(ReplayError::InvalidConfig)?;
            let records = mooncake::load(&trace, a.limit)?;
            Ok(Plan {
                name: "mooncake",
                engine_knobs: None,
                trace,
                level_kind: "speed",
                extra: json!({ "limit": a.limit, "requests": records.len() }),
                source: Source::Mooncake {
                    records,
                    speeds: a.speed,
                },
                cluster,
                common: a.common,
            })
        }
        WorkloadCommand::Disagg(_) => Err(ReplayError::InvalidConfig(
            "the disaggregation comparison has its own plan; see `replay disagg`".into(),
        )),
        WorkloadCommand::Events(_) => Err(ReplayError::InvalidConfig(
            "a recording has no workload plan; see `replay events`".into(),
        )),
        WorkloadCommand::Sweep(_) => Err(ReplayError::InvalidConfig(
            "the sweep has its own plan; see `replay sweep`".into(),
        )),
        WorkloadCommand::Agentx(a) => {
            if a.engine_knobs.is_some()
                && (a.common.variants != [Variant::Base] || a.common.endpoint.is_some())
            {
                return Err(ReplayError::InvalidConfig(
                    "--engine-knobs runs its own variants offline: drop --variants and --endpoint"
                        .into(),
                ));
            }
            if a.concurrency.contains(&0) {
                return Err(ReplayError::InvalidConfig(
                    "--concurrency levels must be at least 1".into(),
                ));
            }
            let cluster = cluster_config(
                &a.common,
                64,
                16_384,
                1_048_576,
                a.engine_knobs.is_some_and(|e| e.mechanisms().host),
            )?;
            let trace = resolve_trace(
                a.trace,
                shared_data::AGENTX_TRACE,
                a.data_dir.as_deref(),
                "--trace",
            )
            .map_err(ReplayError::InvalidConfig)?;
            let traces = weka::load(&trace, a.limit)?;
            let (traces, kept) = if a.truncate_tokens.is_some() || a.min_call_tokens.is_some() {
                let sizes = CallSizes {
                    min_tokens: a.min_call_tokens.unwrap_or(0),
                    max_tokens: a.truncate_tokens,
                };
                let (traces, kept) = weka_filter::keep_calls(traces, sizes)?;
                (traces, Some(kept))
            } else {
                (traces, None)
            };
            let config = WekaConfig {
                concurrency: 1,
                time_scale: a.time_scale,
                max_gap_s: a.max_gap_s,
                sessions: a.sessions,
                shuffle_seed: a.shuffle.then_some(a.common.seed),
            };
            Ok(Plan {
                name: "agentx",
                engine_knobs: a.engine_knobs,
                trace,
                level_kind: "concurrency",
                extra: json!({
                    "traces": traces.len(),
                    "time_scale": a.time_scale,
                    "max_gap_s": a.max_gap_s,
                    "sessions": a.sessions,
                    "shuffle": a.shuffle,
                    "truncate_tokens": a.truncate_tokens,
                    "min_call_tokens": a.min_call_tokens,
                    "calls_kept": kept.map(|k| k.calls),
                    "calls_dropped": kept.map(|k| k.dropped_calls),
                    "sessions_dropped": kept.map(|k| k.dropped_sessions),
                }),
                source: Source::Agentx {
                    traces,
                    config,
                    levels: a.concurrency,
                },
                cluster,
                common: a.common,
            })
        }
    }
}

fn settings(plan: &Plan, live: bool) -> serde_json::Value {
    let c = &plan.cluster;
    let mut s = json!({
        "workload": plan.extra,
        "levels": plan.source.levels(),
    });
    if live {
        s["endpoint"] = json!(plan.common.endpoint);
        s["model"] = json!(plan.common.model);
    } else {
        s["workers"] = json!(c.workers);
        s["policies"] = json!(
            plan.common
                .policies
                .iter()
                .map(|p| p.as_str())
                .collect::<Vec<_>>()
        );
        s["sim"] = serde_json::to_value(&c.sim).unwrap_or_default();
        s["event_delay_us"] = json!(c.event_delay_us);
        s["variants"] = json!(
            plan.common
                .variants
                .iter()
                .map(|v| format!("{v:?}").to_lowercase())
                .collect::<Vec<_>>()
        );
        s["host_kv_blocks"] = json!(plan.common.host_kv_blocks);
        s["host_gbps"] = json!(plan.common.host_gbps);
        s["retention_cap_s"] = json!(plan.common.retention_cap_s);
        s["retention_budget"] = json!(plan.common.retention_budget);
        s["engine_knobs"] = json!(plan.engine_knobs.map(EngineKnobs::as_str));
        s["load_report_interval_us"] = json!(c.load_report_interval_us);
    }
    s
}

/// Runs `switchyard replay` (or `bench` when `bench` is set).
pub fn run(args: ReplayArgs, bench: bool) -> ExitCode {
    let command = if bench { "bench" } else { "replay" };
    if let WorkloadCommand::Events(events) = &args.workload {
        return exit(command, run_events(events));
    }
    if let WorkloadCommand::Disagg(disagg) = &args.workload {
        return exit(command, crate::disagg_cmd::run(disagg));
    }
    if let WorkloadCommand::Sweep(sweep) = &args.workload {
        if bench {
            return exit(
                command,
                Err(ReplayError::InvalidConfig(
                    "bench measures the replayer on one workload; run the sweep with `switchyard replay sweep`".into(),
                )),
            );
        }
        return crate::sweep_cmd::run(sweep);
    }
    let plan = match plan(args) {
        Ok(plan) => plan,
        Err(err @ (ReplayError::InvalidConfig(_) | ReplayError::Cluster(_))) => {
            eprintln!("switchyard {command}: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(err) => {
            eprintln!("switchyard {command}: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = match (&plan.common.endpoint, bench) {
        (Some(_), true) => Err(ReplayError::InvalidConfig(
            "bench measures the offline replayer; drop --endpoint".into(),
        )),
        (Some(_), false) if plan.common.threads.is_some() => Err(ReplayError::InvalidConfig(
            "--threads applies to offline replays; a live replay sends one level at a time".into(),
        )),
        (Some(endpoint), false) => run_live(&plan, endpoint),
        (None, _) if !plan.common.spread_over.is_empty() => Err(ReplayError::InvalidConfig(
            "--spread-over spreads a live replay: give --endpoint too".into(),
        )),
        (None, _) => run_offline(&plan, bench),
    };
    exit(command, result)
}

pub(crate) fn exit(command: &str, result: Result<(), ReplayError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err @ ReplayError::InvalidConfig(_)) => {
            eprintln!("switchyard {command}: {err}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(err) => {
            eprintln!("switchyard {command}: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `switchyard replay events`: no simulator, the recording is the input.
fn run_events(args: &EventsArgs) -> Result<(), ReplayError> {
    let filter = RouteFilter {
        session: args.session.clone(),
        tenant: args.tenant.clone(),
    };
    let report = replay_recording_for(&args.recording, &args.policies, args.seed, &filter)?;
    print!("{}", report.table());
    if let Some(dir) = &args.out {
        for path in report.write_files(dir, &args.name)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn finish(plan: &Plan, report: &Report) -> Result<(), ReplayError> {
    print!("{}", report.table());
    if let Some(dir) = &plan.common.out {
        let stem = plan
            .common
            .name
            .clone()
            .unwrap_or_else(|| plan.name.to_owned());
        for path in report.write_files(dir, &stem)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn report(plan: &Plan, mode: &str, runs: Vec<Summary>, live: bool) -> Report {
    Report {
        workload: plan.name.to_owned(),
        trace: plan.trace.display().to_string(),
        mode: mode.to_owned(),
        level_kind: plan.level_kind.to_owned(),
        seed: plan.common.seed,
        settings: settings(plan, live),
        runs,
    }
}

/// One offline run's figures and how long it took.
struct Timing {
    policy: PolicyKind,
    level: f64,
    wall: Duration,
    steps: u64,
    kv_events: u64,
    requests: usize,
}

/// One offline run: its level, policy, mechanisms and the label its summary gets (`None`:
/// the configuration's own).
type Job = (f64, PolicyKind, Mechanisms, Option<String>);

fn jobs(plan: &Plan) -> Vec<Job> {
    let levels = plan.source.levels();
    match plan.engine_knobs {
        Some(engine) => {
            let rows = knobs::ablation(engine);
            levels
                .into_iter()
                .flat_map(|level| {
                    rows.iter()
                        .map(move |r| (level, r.policy, r.mechanisms, Some(r.name.clone())))
                })
                .collect()
        }
        None => levels
            .into_iter()
            .flat_map(|level| {
                plan.common.variants.iter().flat_map(move |&v| {
                    plan.common
                        .policies
                        .iter()
                        .map(move |&p| (level, p, v.mechanisms(), None))
                })
            })
            .collect(),
    }
}

fn run_offline(plan: &Plan, bench: bool) -> Result<(), ReplayError> {
    let jobs = jobs(plan);
    let settings = plan.common.knob_settings();
    let threads = parallel::threads_for(jobs.len(), plan.common.threads.unwrap_or(0));
    let bars = ProgressGroup::new();
    let started = Instant::now();
    // Each run owns its workload and cluster; results come back in job order, so the report
    // is the one a serial loop writes.
    let results = parallel::run_ordered(jobs.len(), threads, |i| {
        let (level, policy, mechanisms, ref label) = jobs[i];
        let mut workload = plan.source.build(level, plan.common.seed)?;
        let config = ClusterConfig {
            policy,
            ..mechanisms.apply(&plan.cluster, &settings)?
        };
        let label = label.clone().unwrap_or_else(|| config.label());
        let bar = bars.bar(
            workload.expected_requests(),
            format!("{label} @ {}={level}", plan.level_kind),
        );
        let run_started = Instant::now();
        let mut run = replay_offline(workload.as_mut(), &config, level, &bar)?;
        run.summary.label = label;
        let timing = Timing {
            policy,
            level,
            wall: run_started.elapsed(),
            steps: run.run.steps,
            kv_events: run.run.kv_events,
            requests: run.run.records.len(),
        };
        bar.finish_and_clear();
        Ok::<_, ReplayError>((run.summary, timing))
    });
    let total = started.elapsed();
    let mut runs = Vec::with_capacity(results.len());
    let mut timings = Vec::with_capacity(results.len());
    for result in results {
        let (summary, timing) = result?;
        runs.push(summary);
        timings.push(timing);
    }
    let report = report(plan, "offline", runs, false);
    if let Some(engine) = plan.engine_knobs {
        let table = knobs::ablation_table(engine, &report.runs);
        finish(plan, &report)?;
        println!();
        print!("{table}");
        if let Some(dir) = &plan.common.out {
            let stem = plan.common.name.as_deref().unwrap_or(plan.name);
            let path = dir.join(format!("{stem}-ablation.md"));
            std::fs::write(&path, &table).map_err(|e| {
                ReplayError::Report(format!("cannot write {}: {e}", path.display()))
            })?;
            println!("wrote {}", path.display());
        }
        if bench {
            print_bench(plan, &timings, total, threads);
        }
        return Ok(());
    }
    if bench {
        print_bench(plan, &timings, total, threads);
        if plan.common.out.is_some() {
            finish(plan, &report)?;
        }
        return Ok(());
    }
    finish(plan, &report)
}

fn print_bench(plan: &Plan, timings: &[Timing], total: Duration, threads: usize) {
    println!(
        "{} offline replay speed ({} workers, trace {}, {threads} thread{})",
        plan.name,
        plan.cluster.workers,
        Path::new(&plan.trace).display(),
        if threads == 1 { "" } else { "s" }
    );
    println!(
        "{:>12} {:>7} {:>9} {:>9} {:>10} {:>10} {:>12}",
        "policy", "level", "requests", "wall s", "steps", "kv events", "steps/s"
    );
    for t in timings {
        let secs = t.wall.as_secs_f64();
        println!(
            "{:>12} {:>7} {:>9} {:>9.3} {:>10} {:>10} {:>12.0}",
            t.policy.as_str(),
            t.level,
            t.requests,
            secs,
            t.steps,
            t.kv_events,
            t.steps as f64 / secs.max(1e-9)
        );
    }
    println!("all runs: {:.3} s wall", total.as_secs_f64());
}

fn run_live(plan: &Plan, endpoint: &str) -> Result<(), ReplayError> {
    if plan.common.variants != [Variant::Base] {
        return Err(ReplayError::InvalidConfig(
            "--variants applies to the offline cluster; a live endpoint has its own cache".into(),
        ));
    }
    let config = LiveConfig {
        endpoint: endpoint.to_owned(),
        spread: plan.common.spread_over.clone(),
        model: plan.common.model.clone(),
        request_timeout: Duration::from_secs(plan.common.timeout_s),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| ReplayError::Http(format!("cannot start the async runtime: {e}")))?;
    let mut runs = Vec::new();
    for level in plan.source.levels() {
        let mut workload = plan.source.build(level, plan.common.seed)?;
        let bar = progress_bar(
            workload.expected_requests(),
            format!("live @ {}={level}", plan.level_kind),
        );
        let records = runtime.block_on(replay_live(workload.as_mut(), &config, &bar))?;
        bar.finish_and_clear();
        runs.push(Summary::from_records(
            "live",
            level,
            1,
            workload.sessions_completed(),
            &records,
        ));
    }
    let report = report(plan, "live", runs, true);
    finish(plan, &report)
}
