//! `switchyard planner`: the planner alone (etcd, gateways' `/metrics`, its own admin
//! listener), and `switchyard planner profile`: measure a worker's performance profile.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use switchyard_planner::measure::{self, MeasureSettings};
use switchyard_planner::{PlannerArgs, PlannerConfig, PlannerError};
use switchyard_registry::Registry;

use crate::{EXIT_CONFIG, runtime, shutdown_on_signal};

#[derive(Debug, clap::Args)]
pub struct PlannerCommand {
    #[command(subcommand)]
    action: Option<PlannerAction>,
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_ETCD")]
    etcd: Vec<String>,
    /// Registry namespace.
    #[arg(long, env = "SWITCHYARD_CLUSTER")]
    cluster: Option<String>,
    /// A gateway's base URL whose /metrics to read (repeatable, or comma-separated).
    #[arg(long = "gateway", value_delimiter = ',', env = "SWITCHYARD_GATEWAYS")]
    gateways: Vec<String>,
    /// Listen address of the planner's admin API (/admin/planner) and /metrics.
    #[arg(long, env = "SWITCHYARD_PLANNER_ADMIN_LISTEN", value_parser = switchyard_config::parse_listen_addr)]
    admin_listen: Option<SocketAddr>,
    /// Bearer token the admin API requires.
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN")]
    admin_token: Option<String>,
    /// Bearer token the planner's own /metrics requires (default: open).
    #[arg(long, env = "SWITCHYARD_METRICS_TOKEN")]
    metrics_token: Option<String>,
    /// Serve the admin listener over HTTPS with this certificate chain (PEM; re-read when it
    /// changes).
    #[arg(long, env = "SWITCHYARD_PLANNER_ADMIN_TLS_CERT")]
    admin_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --admin-tls-cert.
    #[arg(long, env = "SWITCHYARD_PLANNER_ADMIN_TLS_KEY")]
    admin_tls_key: Option<PathBuf>,
    /// CA (PEM) of the gateways' HTTPS certificates, for https:// --gateway URLs.
    #[arg(long, env = "SWITCHYARD_GATEWAY_CA")]
    gateway_ca: Option<PathBuf>,
    /// The gateways' disaggregation threshold (their --disagg-min-uncached-tokens).
    #[arg(long, env = "SWITCHYARD_DISAGG_MIN_UNCACHED_TOKENS")]
    disagg_min_uncached_tokens: Option<u64>,
    /// Without --profile: the simulated workers' speedup.
    #[arg(long, env = "SWITCHYARD_SIM_SPEEDUP")]
    sim_speedup: Option<f64>,
    #[command(flatten)]
    planner: PlannerArgs,
    /// The planner's credentials toward the workers (`[security]`).
    #[command(flatten)]
    security: switchyard_security::SecurityArgs,
}

#[derive(Debug, clap::Subcommand)]
enum PlannerAction {
    /// Measure a worker's performance profile over gRPC Generate and write it as JSON.
    Profile(Box<ProfileArgs>),
    /// Offline benchmark in virtual time: TTFT/ITL target attainment of the planner and of
    /// every fixed split over a decode-heavy then prefill-heavy workload.
    Bench(BenchArgs),
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Seconds of each phase (decode-heavy, then prefill-heavy).
    #[arg(long, default_value_t = 180.0)]
    phase_secs: f64,
    /// Workers in both pools together.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Workload seed (arrivals and prompts).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How many times faster than the simulated engine the planner's profile believes it is
    /// (1: the profile is right; 2: twice too optimistic).
    #[arg(long, default_value_t = 1.0)]
    profile_error: f64,
    /// Write the outcomes (with each run's pool timeline) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ProfileArgs {
    /// The worker's gRPC address, host:port. Measure an idle worker.
    #[arg(long)]
    worker: String,
    /// The worker's cluster (its credentials are a gateway's of this cluster).
    #[arg(long, env = "SWITCHYARD_CLUSTER", default_value = "default")]
    cluster: String,
    /// The cluster secret or a gateway certificate, for a secured worker.
    #[command(flatten)]
    security: switchyard_security::SecurityArgs,
    /// Where to write the profile.
    #[arg(long)]
    out: PathBuf,
    /// Prompt lengths to time the prefill of.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096,8192")]
    prefill_lengths: Vec<u64>,
    /// Context lengths of the decode measurements.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    contexts: Vec<u64>,
    /// Sequences decoding together in the decode measurements.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    concurrency: Vec<u64>,
    /// Tokens each decode measurement generates per sequence.
    #[arg(long, default_value_t = 64)]
    decode_tokens: u32,
    /// Prefill runs per length (the median is kept).
    #[arg(long, default_value_t = 3)]
    repeats: u32,
}

impl PlannerCommand {
    fn resolve(&self) -> Result<PlannerConfig, switchyard_planner::ConfigError> {
        let mut config = self.planner.resolve_onto(PlannerConfig::default())?;
        if !self.etcd.is_empty() {
            config.etcd_endpoints = self.etcd.clone();
        }
        if let Some(cluster) = &self.cluster {
            config.cluster = cluster.clone();
        }
        if !self.gateways.is_empty() {
            config.gateways = self.gateways.clone();
        }
        if let Some(addr) = self.admin_listen {
            config.admin_listen = Some(addr);
        }
        if let Some(token) = &self.admin_token {
            config.admin_token = Some(token.clone());
        }
        for (flag, target) in [
            (&self.admin_tls_cert, &mut config.admin_tls_cert),
            (&self.admin_tls_key, &mut config.admin_tls_key),
            (&self.gateway_ca, &mut config.gateway_ca),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        if self.metrics_token.is_some() {
            config.metrics_token.clone_from(&self.metrics_token);
        }
        if let Some(tokens) = self.disagg_min_uncached_tokens {
            config.disagg_min_uncached_tokens = tokens;
        }
        if let Some(speedup) = self.sim_speedup {
            config.sim_speedup = speedup;
        }
        self.security.apply(&mut config.security);
        config.validate(true)?;
        // Read the secret and certificates now, so a bad file is a configuration error.
        config
            .security
            .build(&config.cluster, switchyard_security::PeerRole::Planner)
            .map_err(|e| switchyard_planner::ConfigError::Invalid(e.to_string()))?;
        config.admin_tls()?;
        if let Some(ca) = &config.gateway_ca {
            switchyard_security::tls::https_client_config(ca)
                .map_err(|e| switchyard_planner::ConfigError::Invalid(e.to_string()))?;
        }
        Ok(config)
    }
}

pub fn run(command: PlannerCommand) -> ExitCode {
    match command.action {
        Some(PlannerAction::Profile(args)) => return profile(*args),
        Some(PlannerAction::Bench(args)) => return bench(args),
        None => {}
    }
    let config = match command.resolve() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("switchyard planner: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    runtime.block_on(async move {
        match serve(config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(Failure::Planner(err)) if err.is_config() => {
                eprintln!("switchyard planner: {err}");
                ExitCode::from(EXIT_CONFIG)
            }
            Err(err) => {
                eprintln!("switchyard planner: {err}");
                ExitCode::FAILURE
            }
        }
    })
}

#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Planner(#[from] PlannerError),
    #[error("cannot reach etcd at {endpoints}: {message}")]
    Etcd { endpoints: String, message: String },
}

async fn serve(config: PlannerConfig) -> Result<(), Failure> {
    let shutdown = shutdown_on_signal();
    let connected = crate::connect_etcd(
        &config.etcd_endpoints,
        &config.cluster,
        &config.security,
        &shutdown,
    )
    .await
    .map_err(|e| Failure::Etcd {
        endpoints: config.etcd_endpoints.join(","),
        message: format!("{e:#}"),
    })?;
    let Some(registry) = connected else {
        return Ok(());
    };
    let registry: Arc<dyn Registry> = Arc::new(registry);
    let planner = switchyard_planner::build(&config, registry).await?;
    let admin_tls = config.admin_tls().map_err(PlannerError::from)?;
    let mut admin_addr = None;
    let admin_task = match config.admin_listen {
        Some(listen) => {
            let (listener, addr) = switchyard_planner::admin::bind(listen)
                .await
                .map_err(PlannerError::from)?;
            admin_addr = Some(addr);
            tracing::info!(
                address = %addr,
                https = admin_tls.is_some(),
                metrics_token = config.metrics_token.is_some(),
                "planner admin listener"
            );
            Some(tokio::spawn(switchyard_planner::admin::serve(
                listener,
                switchyard_planner::admin::AdminAccess {
                    admin_token: config.admin_token.clone(),
                    metrics_token: config.metrics_token.clone(),
                    tls: admin_tls,
                },
                Arc::clone(&planner.state),
                Arc::clone(&planner.metrics),
                shutdown.clone(),
            )))
        }
        None => None,
    };
    let ready = serde_json::json!({
        "event": "ready",
        "address": admin_addr.map(|a| a.to_string()).unwrap_or_default(),
        "connector": planner.state.settings.connector,
        "predictor": planner.state.settings.predictor,
        "gateways": config.gateways,
    });
    println!("{ready}");
    planner.run(shutdown.clone()).await;
    if let Some(task) = admin_task
        && let Err(err) = task.await
    {
        tracing::warn!(error = %err, "planner admin task failed");
    }
    Ok(())
}

fn profile(args: ProfileArgs) -> ExitCode {
    let mut security = switchyard_security::SecurityConfig::default();
    args.security.apply(&mut security);
    let dialer = match security.build(&args.cluster, switchyard_security::PeerRole::Gateway) {
        Ok(built) => built.dialer,
        Err(err) => {
            eprintln!("switchyard planner profile: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let settings = MeasureSettings {
        prefill_lengths: args.prefill_lengths,
        decode_contexts: args.contexts,
        decode_concurrency: args.concurrency,
        decode_tokens: args.decode_tokens,
        repeats: args.repeats,
        dialer,
    };
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    let result = runtime.block_on(measure::measure(&args.worker, &settings, |line| {
        eprintln!("{line}")
    }));
    let profile = match result {
        Ok(profile) => profile,
        Err(err) => {
            eprintln!("switchyard planner profile: {err}");
            return ExitCode::FAILURE;
        }
    };
    let json = match serde_json::to_string_pretty(&profile) {
        Ok(json) => json,
        Err(err) => {
            eprintln!("switchyard planner profile: cannot encode the profile: {err}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(err) = std::fs::write(&args.out, json + "\n") {
        eprintln!(
            "switchyard planner profile: cannot write {}: {err}",
            args.out.display()
        );
        return ExitCode::FAILURE;
    }
    eprintln!("profile written to {}", args.out.display());
    ExitCode::SUCCESS
}

fn bench(args: BenchArgs) -> ExitCode {
    use switchyard_planner::shift::{self, ShiftSettings};
    let mut settings = ShiftSettings {
        workers: args.workers,
        seed: args.seed,
        profile_speedup: args.profile_error,
        ..ShiftSettings::default()
    };
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(args.phase_secs) || !positive(args.profile_error) || args.workers < 2 {
        eprintln!(
            "switchyard planner bench: --phase-secs and --profile-error must be positive and --workers at least 2"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    for phase in &mut settings.phases {
        phase.seconds = args.phase_secs;
    }
    eprintln!("phases: {:?}", settings.phases);
    let outcomes = match shift::run_all(&settings) {
        Ok(outcomes) => outcomes,
        Err(err) => {
            eprintln!("switchyard planner bench: {err}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", shift::markdown(&settings, &outcomes));
    for o in outcomes.iter().filter(|o| o.moves > 0) {
        let steps: Vec<String> = o
            .timeline
            .windows(2)
            .filter(|w| (w[0].1, w[0].2) != (w[1].1, w[1].2))
            .map(|w| format!("t={:.0}s {}/{}", w[1].0, w[1].1, w[1].2))
            .collect();
        println!(
            "{}: pools (prefill/decode) changed at {}",
            o.label,
            steps.join(", ")
        );
    }
    for o in &outcomes {
        if let Some(c) = o.correction.filter(|c| c.enabled) {
            println!("{}: {}", o.label, c.describe());
        }
    }
    if let Some(path) = args.json {
        let json = serde_json::json!({"targets": settings.targets, "phases": settings.phases, "profile_error": settings.profile_speedup, "outcomes": outcomes});
        if let Err(err) = std::fs::write(&path, json.to_string()) {
            eprintln!(
                "switchyard planner bench: cannot write {}: {err}",
                path.display()
            );
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
