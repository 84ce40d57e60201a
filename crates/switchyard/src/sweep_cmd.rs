//! `switchyard replay sweep`: every policy across worker counts and arrival rates on the
//! Mooncake trace and the agent-session traces, and in each cell whether kv leads, ties or
//! trails the others on hit rate and TTFT p99 (issue 45). The runs, the verdicts and the
//! renderings are `switchyard_replay::sweep`'s; this file only reads flags and traces.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;

use switchyard_core::BlockSize;
use switchyard_engine_sim::SimConfig;
use switchyard_replay::sweep::{self, SweepConfig, SweepReport, SweepTrace, TraceSource};
use switchyard_replay::workload::mooncake;
use switchyard_replay::workload::weka::{self, WekaConfig};
use switchyard_replay::{ClusterConfig, ProgressGroup, ReplayError};
use switchyard_router::{PolicyConfig, PolicyKind};

use crate::replay_cmd::{exit, ms_to_us};
use crate::shared_data::{self, resolve_trace};

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// Traces to sweep: `mooncake` (the shared conversation trace), `dev_120` and `dev_b_120`
    /// (the shared agent sessions), or `mooncake:PATH` and `agentx:PATH` for other files.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "mooncake,dev_120,dev_b_120"
    )]
    traces: Vec<TraceSpec>,
    /// The shared data directory the named traces are read from (default: ../shared/data from
    /// the current directory, else beside the checkout the binary was built from).
    #[arg(long, env = "SWITCHYARD_DATA")]
    data_dir: Option<PathBuf>,
    /// Routing policies run in every cell; kv, the judged one, and at least one other.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,approx-kv,dynamo-kv,sglang-ca"
    )]
    policies: Vec<PolicyKind>,
    /// Simulated worker counts.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    workers: Vec<usize>,
    /// Arrival-rate multipliers: Mooncake's recorded rate, or the agent traces' base
    /// concurrency, times each.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,1.5,2,3")]
    rates: Vec<f64>,
    /// Mooncake traces: replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Agent traces: read only the first N sessions.
    #[arg(long)]
    sessions: Option<usize>,
    /// Agent traces: live session trees at rate 1 (rate r runs r times as many, at least 1).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Agent traces: multiplies recorded think times and gaps (0 = back to back).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Agent traces: longest gap after scaling, in seconds.
    #[arg(long, default_value_t = 300.0)]
    max_gap_s: f64,
    /// KV cache per worker, in blocks.
    #[arg(long, default_value_t = 16_384)]
    kv_blocks: u64,
    /// Simulator block size, in tokens.
    #[arg(long, default_value_t = 64)]
    sim_block_size: u32,
    /// Longest prompt plus output a worker accepts, in tokens.
    #[arg(long, default_value_t = 1_048_576)]
    max_context: u64,
    /// Seed of the simulators and the sampling policies.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Delay before a step's KV events reach the router's index, in ms.
    #[arg(long, default_value_t = 0.0)]
    event_delay_ms: f64,
    /// Workers report load at most this often, in ms (0 = before every decision).
    #[arg(long, default_value_t = 0.0)]
    load_report_ms: f64,
    /// Runs replayed at once, one thread each (0 = one per core). The figures do not depend
    /// on it.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Figures within this share of the larger one are a tie.
    #[arg(long, default_value_t = sweep::DEFAULT_TIE)]
    tie: f64,
    /// Runs per policy per cell (odd), each with the trace's timing scaled by 1, 0.999, 1.001,
    /// 0.998, …; a cell keeps each policy's run with the median TTFT p99, and the JSON lists
    /// every replica's figures. One run's p99 moves by 5-70 % under a 0.2 % change of timing.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// What to print: the table, the Markdown grid, or the JSON report.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Write <name>.json, <name>.csv and <name>.md here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// File stem of the written reports.
    #[arg(long, default_value = "sweep")]
    name: String,
    /// Exit with status 1 when kv trails in any cell (after printing the report).
    #[arg(long)]
    fail_on_trail: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Table,
    Markdown,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TraceKind {
    Mooncake,
    Agentx,
}

/// One `--traces` entry: a shared trace by name, or a kind and a path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TraceSpec {
    name: String,
    kind: TraceKind,
    /// `None`: `default` in the shared data directory.
    path: Option<PathBuf>,
    default: &'static str,
}

impl FromStr for TraceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let shared = |name: &str, kind, default| TraceSpec {
            name: name.to_owned(),
            kind,
            path: None,
            default,
        };
        let given = |kind, path: &str| {
            if path.is_empty() {
                return Err(format!("`{s}` names no file"));
            }
            let file = Path::new(path)
                .file_name()
                .map_or(path, |f| f.to_str().unwrap_or(path));
            let name = file
                .trim_end_matches(".gz")
                .trim_end_matches(".jsonl")
                .to_owned();
            Ok(TraceSpec {
                name,
                kind,
                path: Some(PathBuf::from(path)),
                default: "",
            })
        };
        match s.split_once(':') {
            None if s == "mooncake" => {
                Ok(shared(s, TraceKind::Mooncake, shared_data::MOONCAKE_TRACE))
            }
            None if s == "dev_120" => Ok(shared(s, TraceKind::Agentx, shared_data::AGENTX_TRACE)),
            None if s == "dev_b_120" => {
                Ok(shared(s, TraceKind::Agentx, shared_data::AGENTX_B_TRACE))
            }
            Some(("mooncake", path)) => given(TraceKind::Mooncake, path),
            Some(("agentx", path)) => given(TraceKind::Agentx, path),
            _ => Err(format!(
                "unknown trace `{s}`: give mooncake, dev_120, dev_b_120, mooncake:PATH or agentx:PATH"
            )),
        }
    }
}

/// Runs the sweep, prints it, writes its files; exit status 64 for bad flags, 1 for a trace
/// that cannot be read or (with `--fail-on-trail`) a cell kv trails.
pub fn run(args: &SweepArgs) -> ExitCode {
    let report = match sweep(args) {
        Ok(report) => report,
        Err(err) => return exit("replay sweep", Err(err)),
    };
    if args.fail_on_trail && report.tally.trails > 0 {
        eprintln!(
            "switchyard replay sweep: {} trails in {} of {} cells",
            report.reference,
            report.tally.trails,
            report.tally.cells()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn sweep(args: &SweepArgs) -> Result<SweepReport, ReplayError> {
    let config = config(args)?;
    let traces = load(args)?;
    let bars = ProgressGroup::new();
    let report = sweep::run_sweep(&traces, &config, args.threads, |len, label| {
        bars.bar(len, label)
    })?;
    match args.format {
        Format::Table => print!("{}", report.table()),
        Format::Markdown => print!("{}", report.markdown()),
        Format::Json => println!("{}", report.to_json()?),
    }
    if let Some(dir) = &args.out {
        for path in report.write_files(dir, &args.name)? {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(report)
}

/// The sweep's axes and cluster, checked before any trace is read.
fn config(args: &SweepArgs) -> Result<SweepConfig, ReplayError> {
    let invalid = |msg: String| ReplayError::InvalidConfig(msg);
    let block_size = BlockSize::new(args.sim_block_size)
        .map_err(|e| invalid(format!("--sim-block-size: {e}")))?;
    let sim = SimConfig {
        block_size,
        num_device_blocks: args.kv_blocks,
        max_context_tokens: args.max_context,
        seed: args.seed,
        ..SimConfig::default()
    };
    sim.validate().map_err(|e| invalid(e.to_string()))?;
    if args.traces.is_empty() {
        return Err(invalid("--traces is empty".into()));
    }
    for (i, t) in args.traces.iter().enumerate() {
        if args.traces[..i].iter().any(|u| u.name == t.name) {
            return Err(invalid(format!(
                "--traces names `{}` twice; each trace is one row of the report",
                t.name
            )));
        }
    }
    if args.concurrency == 0 {
        return Err(invalid("--concurrency must be at least 1".into()));
    }
    let non_negative = |v: f64| v.is_finite() && v >= 0.0;
    if !(non_negative(args.time_scale) && non_negative(args.max_gap_s)) {
        return Err(invalid(
            "--time-scale and --max-gap-s must be finite and non-negative".into(),
        ));
    }
    let config = SweepConfig {
        policies: args.policies.clone(),
        workers: args.workers.clone(),
        rates: args.rates.clone(),
        cluster: ClusterConfig {
            workers: 1,
            sim,
            policy: sweep::REFERENCE,
            policy_config: PolicyConfig {
                seed: args.seed,
                ..PolicyConfig::default()
            },
            event_delay_us: ms_to_us(args.event_delay_ms)?,
            load_report_interval_us: ms_to_us(args.load_report_ms)?,
            disagg: None,
            token_gaps: false,
            retention: None,
            session_scheduling: false,
        },
        tie: args.tie,
        replicas: args.replicas,
    };
    config.validate()?;
    Ok(config)
}

/// Where `spec` is read from: its path, or its default in the shared data directory.
fn trace_path(spec: &TraceSpec, data_dir: Option<&Path>) -> Result<PathBuf, ReplayError> {
    match &spec.path {
        Some(path) => Ok(path.clone()),
        None => resolve_trace(None, spec.default, data_dir, "--data-dir")
            .map_err(|e| ReplayError::InvalidConfig(format!("trace {}: {e}", spec.name))),
    }
}

/// Reads every trace of `--traces`.
fn load(args: &SweepArgs) -> Result<Vec<SweepTrace>, ReplayError> {
    let mut traces = Vec::with_capacity(args.traces.len());
    for spec in &args.traces {
        let path = trace_path(spec, args.data_dir.as_deref())?;
        let source = match spec.kind {
            TraceKind::Mooncake => TraceSource::Mooncake(mooncake::load(&path, args.limit)?),
            TraceKind::Agentx => TraceSource::Agentx {
                traces: weka::load(&path, args.sessions)?,
                config: WekaConfig {
                    concurrency: args.concurrency,
                    time_scale: args.time_scale,
                    max_gap_s: args.max_gap_s,
                    sessions: None,
                    shuffle_seed: None,
                },
            },
        };
        traces.push(SweepTrace {
            name: spec.name.clone(),
            path: path.display().to_string(),
            source,
        });
    }
    Ok(traces)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use clap::Parser;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: SweepArgs,
    }

    fn parse(args: &[&str]) -> Result<SweepArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("sweep").chain(args.iter().copied())).map(|c| c.args)
    }

    fn config_error(args: &[&str]) -> String {
        match config(&parse(args).unwrap()) {
            Err(ReplayError::InvalidConfig(msg)) => msg,
            other => panic!("{args:?} gave {other:?}"),
        }
    }

    #[test]
    fn the_defaults_are_issue_45s_grid() {
        let args = parse(&[]).unwrap();
        let names: Vec<&str> = args.traces.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["mooncake", "dev_120", "dev_b_120"]);
        let config = config(&args).unwrap();
        assert_eq!(config.workers, [2, 4, 8]);
        assert_eq!(config.rates, [0.5, 1.0, 1.5, 2.0, 3.0]);
        assert_eq!(
            config.policies,
            [
                PolicyKind::Kv,
                PolicyKind::ApproxKv,
                PolicyKind::DynamoKv,
                PolicyKind::SglangCa
            ]
        );
        assert_eq!(config.tie, 0.02);
        assert_eq!(config.cluster.sim.num_device_blocks, 16_384);
        assert_eq!(config.cluster.sim.block_size.get(), 64);
    }

    #[test]
    fn a_bad_workers_list_is_refused_with_the_flag_named() {
        let err = parse(&["--workers", "2,four"]).unwrap_err().to_string();
        assert!(err.contains("--workers"), "{err}");
        let err = parse(&["--workers", "2,,4"]).unwrap_err().to_string();
        assert!(err.contains("--workers"), "{err}");
        let msg = config_error(&["--workers", "2,0"]);
        assert!(msg.contains("--workers"), "{msg}");
    }

    #[test]
    fn a_sweep_without_kv_or_without_a_rival_or_with_a_bad_rate_is_refused() {
        assert!(config_error(&["--policies", "approx-kv,sglang-ca"]).contains("kv"));
        assert!(config_error(&["--policies", "kv"]).contains("at least one"));
        assert!(config_error(&["--policies", "kv,kv"]).contains("twice"));
        assert!(config_error(&["--rates", "1,0"]).contains("--rates"));
        assert!(config_error(&["--rates", "1,inf"]).contains("--rates"));
        assert!(config_error(&["--tie", "1.5"]).contains("--tie"));
        assert!(config_error(&["--concurrency", "0"]).contains("--concurrency"));
        assert!(config_error(&["--traces", "dev_120,dev_120"]).contains("twice"));
        assert!(config_error(&["--kv-blocks", "0"]).contains("block"));
    }

    #[test]
    fn traces_are_named_or_given_with_their_kind() {
        let args = parse(&[
            "--traces",
            "mooncake:/data/other_trace.jsonl,agentx:/data/held_out.jsonl.gz,dev_b_120",
        ])
        .unwrap();
        let got: Vec<(&str, TraceKind, Option<&Path>)> = args
            .traces
            .iter()
            .map(|t| (t.name.as_str(), t.kind, t.path.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "other_trace",
                    TraceKind::Mooncake,
                    Some(Path::new("/data/other_trace.jsonl"))
                ),
                (
                    "held_out",
                    TraceKind::Agentx,
                    Some(Path::new("/data/held_out.jsonl.gz"))
                ),
                ("dev_b_120", TraceKind::Agentx, None),
            ]
        );
        let err = parse(&["--traces", "sharegpt"]).unwrap_err().to_string();
        assert!(err.contains("unknown trace `sharegpt`"), "{err}");
        let err = parse(&["--traces", "agentx:"]).unwrap_err().to_string();
        assert!(err.contains("names no file"), "{err}");
    }

    /// A small trace of its own: the sweep runs end to end, writes its three files, and its
    /// exit status follows the verdicts with `--fail-on-trail`.
    #[test]
    fn a_sweep_writes_its_report_and_fails_on_a_trailing_cell_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("tiny.jsonl");
        let lines: Vec<String> = (0..16)
            .map(|i| {
                let ids = if i % 2 == 0 {
                    "[1,2,3]".to_owned()
                } else {
                    format!("[{},{}]", 100 + i, 200 + i)
                };
                format!(
                    r#"{{"timestamp":{},"input_length":1500,"output_length":8,"hash_ids":{ids}}}"#,
                    i * 50
                )
            })
            .collect();
        std::fs::write(&trace, lines.join("\n")).unwrap();
        let out = dir.path().join("out");
        let trace_arg = format!("mooncake:{}", trace.display());
        let sweep = |extra: &[&str]| {
            let mut args = vec![
                "--traces",
                &trace_arg,
                "--policies",
                "kv,round-robin",
                "--kv-blocks",
                "256",
                "--threads",
                "1",
                "--format",
                "json",
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            run(&parse(&args).unwrap())
        };
        assert_eq!(
            sweep(&["--workers", "1", "--rates", "1,2"]),
            ExitCode::SUCCESS
        );
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap())
                .unwrap();
        // One worker: both policies send everything to it.
        assert_eq!(report["tally"]["ties"], 2, "{report}");
        assert!(out.join("sweep.csv").is_file() && out.join("sweep.md").is_file());

        let status = sweep(&[
            "--workers",
            "2",
            "--rates",
            "4",
            "--tie",
            "0",
            "--fail-on-trail",
        ]);
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap())
                .unwrap();
        let trails = report["tally"]["trails"].as_u64().unwrap();
        let expected = if trails > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
        assert_eq!(status, expected, "{report}");
        assert_eq!(report["cells"][0]["runs"].as_array().unwrap().len(), 2);
        assert!(report["traces"][0].get("concurrency").is_none(), "{report}");

        // An agent trace: the report says what its rates meant.
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/agentx/fixtures/weka-two-plays.jsonl");
        let agent_arg = format!("agentx:{}", fixture.display());
        let status = run(&parse(&[
            "--traces",
            &agent_arg,
            "--policies",
            "kv,round-robin",
            "--workers",
            "1",
            "--rates",
            "0.5,2",
            "--concurrency",
            "1",
            "--format",
            "json",
            "--out",
            out.to_str().unwrap(),
        ])
        .unwrap());
        assert_eq!(status, ExitCode::SUCCESS);
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap())
                .unwrap();
        let trace = &report["traces"][0];
        assert_eq!(trace["name"], "weka-two-plays", "{trace}");
        assert_eq!(trace["level_kind"], "concurrency", "{trace}");
        assert_eq!(trace["concurrency"], 1, "{trace}");
        assert_eq!(trace["time_scale"], 1.0, "{trace}");
        let levels: Vec<f64> = report["cells"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["level"].as_f64().unwrap())
            .collect();
        assert_eq!(levels, [1.0, 2.0], "at least one live session");
    }

    #[test]
    fn a_missing_trace_file_names_the_file() {
        let args = parse(&["--traces", "mooncake:/nonexistent/trace.jsonl"]).unwrap();
        let err = load(&args).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let unknown = TraceSpec {
            default: "agentx/no_such_corpus.jsonl.gz",
            ..parse(&[]).unwrap().traces[1].clone()
        };
        let err = trace_path(&unknown, Some(dir.path()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("trace dev_120"), "{err}");
        assert!(err.contains("pass --data-dir PATH"), "{err}");
    }
}
