//! `switchyard`: the one binary. Each subcommand is one role of the system.
//!
//! Exit codes: 0 on a clean shutdown, 64 for bad configuration (one sentence on stderr), 1 for
//! a runtime failure.

use std::process::ExitCode;
use std::sync::Arc;

mod disagg_cmd;
mod etcd_auth_cmd;
mod planner_cmd;
mod replay_cmd;
mod shared_data;
mod sweep_cmd;
mod up;
mod workers_cmd;

use clap::{Parser, Subcommand};
use switchyard_gateway::{GatewayArgs, GatewayConfig};
use switchyard_registry::{EtcdRegistry, Registry};
use switchyard_worker::{WorkerArgs, WorkerConfig};
use tokio_util::sync::CancellationToken;

/// Every role allocates on its hot path (the gateway's JSON, templates, token vectors and gRPC
/// frames per request); mimalloc's per-thread heaps take less CPU for that than the system's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for configuration errors (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

/// `switchyard --version`: the crate version and the git revision it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("SWITCHYARD_GIT_REV"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "switchyard",
    version = VERSION,
    about = "Prefill/decode orchestration for LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Gateway + registry + simulated workers in one process, ready for an OpenAI client.
    Up(Box<up::UpArgs>),
    /// Run the gateway alone, finding workers through etcd.
    Gateway(GatewayCommand),
    /// Run a worker agent in front of an engine (the built-in simulator).
    Worker(WorkerArgs),
    /// Run many simulated workers in one process (fleet tests, scale benchmarks).
    Workers(workers_cmd::WorkersArgs),
    /// Run as the endpoint picker of a Kubernetes Gateway (Gateway API Inference Extension):
    /// an Envoy ext_proc server choosing the model server pod for each request.
    Epp(EppCommand),
    /// Size the prefill and decode pools to the load (or `planner profile`: measure a worker).
    Planner(planner_cmd::PlannerCommand),
    /// Turn on etcd's users for a cluster: a user limited to the cluster's prefix, root, auth.
    EtcdAuth(etcd_auth_cmd::EtcdAuthCommand),
    /// Replay a trace offline (simulated cluster, several policies) or against an endpoint.
    Replay(replay_cmd::ReplayArgs),
    /// Measure the offline replayer's own speed on a trace.
    Bench(replay_cmd::ReplayArgs),
}

#[derive(Debug, clap::Args)]
struct GatewayCommand {
    /// etcd endpoints, comma-separated (needed unless `--discovery kubernetes`).
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_ETCD")]
    etcd: Vec<String>,
    /// Registry namespace (default: the config file's, else `default`).
    #[arg(long, env = "SWITCHYARD_CLUSTER")]
    cluster: Option<String>,
    #[command(flatten)]
    gateway: GatewayArgs,
}

impl GatewayCommand {
    /// The gateway's configuration: defaults, then the config file, then flags and environment
    /// (`--etcd` and `--cluster` included: they win over the file like every other flag).
    fn resolve(&self) -> Result<GatewayConfig, switchyard_gateway::ConfigError> {
        let mut config = self.gateway.resolve_onto(GatewayConfig::default())?;
        if !self.etcd.is_empty() {
            config.etcd_endpoints = self.etcd.clone();
        }
        config.etcd_endpoints.retain(|e| !e.trim().is_empty());
        if let Some(cluster) = &self.cluster {
            config.cluster = cluster.clone();
        }
        if config.discovery.source.uses_etcd() && config.etcd_endpoints.is_empty() {
            return Err(switchyard_gateway::ConfigError::Invalid(
                "the workers are found in etcd: give its endpoints (--etcd), or find them in Kubernetes (--discovery kubernetes)".into(),
            ));
        }
        config.check_security_files()?;
        Ok(config)
    }
}

#[derive(Debug, clap::Args)]
struct EppCommand {
    #[command(flatten)]
    registry: GatewayCommand,
    #[command(flatten)]
    epp: switchyard_epp::EppArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => {
            let resolved = match up::resolve(&args) {
                Ok(resolved) => resolved,
                Err(err) => {
                    eprintln!("switchyard up: {err}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            // One process, both roles: its spans are exported as the gateway's and the workers'.
            let otlp = resolved
                .gateways
                .first()
                .and_then(|g| g.otlp_endpoint.clone());
            let traces = trace_export(
                &otlp,
                &[switchyard_telemetry::GATEWAY, switchyard_telemetry::WORKER],
            );
            run_async(traces, async move {
                up::run(resolved, shutdown_on_signal()).await
            })
        }
        Command::Gateway(args) => {
            let config = match args.resolve() {
                Ok(config) => config,
                Err(err) => {
                    eprintln!("switchyard gateway: {err}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let traces = trace_export(&config.otlp_endpoint, &[switchyard_telemetry::GATEWAY]);
            run_async(traces, run_gateway(config))
        }
        Command::Epp(args) => {
            let configs = args
                .registry
                .resolve()
                .and_then(|gateway| Ok((gateway, args.epp.resolve()?)));
            let (gateway, epp) = match configs {
                Ok(configs) => configs,
                Err(err) => {
                    eprintln!("switchyard epp: {err}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            // The picker answers a proxy and serves no turns, so it has none to forward.
            if gateway.fleet.share_sessions {
                eprintln!(
                    "switchyard epp: [fleet] share_sessions is for gateway replicas serving the API; the endpoint picker cannot forward turns"
                );
                return ExitCode::from(EXIT_CONFIG);
            }
            let traces = trace_export(&gateway.otlp_endpoint, &[switchyard_telemetry::GATEWAY]);
            run_async(traces, run_epp(gateway, epp))
        }
        Command::Worker(args) => {
            let config = match args.resolve() {
                Ok(config) => config,
                Err(err) => {
                    eprintln!("switchyard worker: {err}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let traces = trace_export(&config.otlp_endpoint, &[switchyard_telemetry::WORKER]);
            run_async(traces, run_worker(config))
        }
        Command::Workers(args) => {
            let configs = match workers_cmd::resolve(&args) {
                Ok(configs) => configs,
                Err(err) => {
                    eprintln!("switchyard workers: {err}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            run_async(None, async move {
                workers_cmd::run(configs, shutdown_on_signal()).await
            })
        }
        Command::Planner(command) => match init_telemetry(None) {
            Ok(_logs_only) => planner_cmd::run(command),
            Err(code) => code,
        },
        Command::EtcdAuth(command) => match init_telemetry(None) {
            Ok(_logs_only) => etcd_auth_cmd::run(command),
            Err(code) => code,
        },
        Command::Replay(args) => match init_telemetry(None) {
            Ok(_logs_only) => replay_cmd::run(args, false),
            Err(code) => code,
        },
        Command::Bench(args) => match init_telemetry(None) {
            Ok(_logs_only) => replay_cmd::run(args, true),
            Err(code) => code,
        },
    }
}

fn trace_export(
    endpoint: &Option<String>,
    services: &[switchyard_telemetry::Service],
) -> Option<switchyard_telemetry::TraceExport> {
    endpoint
        .as_ref()
        .map(|endpoint| switchyard_telemetry::TraceExport {
            endpoint: endpoint.clone(),
            services: services.to_vec(),
        })
}

/// Logs on stderr under `SWITCHYARD_LOG`, and traces to `traces` when given (which needs the
/// Tokio runtime entered).
fn init_telemetry(
    traces: Option<switchyard_telemetry::TraceExport>,
) -> Result<switchyard_telemetry::Telemetry, ExitCode> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SWITCHYARD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    switchyard_telemetry::init(filter, traces).map_err(|err| {
        eprintln!("switchyard: {err}");
        ExitCode::from(EXIT_CONFIG)
    })
}

/// The multi-threaded runtime every role runs on; `None` (reported) when it cannot start.
fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(err) => {
            eprintln!("switchyard: cannot start the async runtime: {err}");
            None
        }
    }
}

fn run_async(
    traces: Option<switchyard_telemetry::TraceExport>,
    fut: impl std::future::Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    // The exporter's gRPC channel is spawned on this runtime.
    let telemetry = match runtime.block_on(async { init_telemetry(traces) }) {
        Ok(telemetry) => telemetry,
        Err(code) => return code,
    };
    let result = runtime.block_on(fut);
    // Flush the last spans (the request that was running at SIGTERM, the shutdown itself) while
    // the runtime still drives the exporter's connection.
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("switchyard: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Cancels the returned token on SIGTERM or Ctrl-C.
fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        trigger.cancel();
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch SIGTERM; only Ctrl-C stops the process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Connects to etcd, waiting (and saying so in the log) while it is unreachable; `None` when a
/// shutdown signal comes first. A bad cluster name fails at once.
pub(crate) async fn connect_etcd(
    endpoints: &[String],
    cluster: &str,
    security: &switchyard_security::SecurityConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<EtcdRegistry>> {
    let auth = security.etcd_auth()?;
    let what = format!("connect to etcd at {}", endpoints.join(","));
    switchyard_registry::retry::until_available(&what, shutdown, || {
        EtcdRegistry::connect_with(endpoints, cluster, &auth)
    })
    .await
    .map_err(|e| anyhow::anyhow!("cannot use etcd at {}: {e}", endpoints.join(",")))
}

async fn run_worker(config: WorkerConfig) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let registry: Option<Arc<dyn Registry>> = if config.etcd_endpoints.is_empty() {
        None
    } else {
        match connect_etcd(
            &config.etcd_endpoints,
            &config.cluster,
            &config.security,
            &shutdown,
        )
        .await?
        {
            Some(registry) => Some(Arc::new(registry)),
            None => return Ok(()),
        }
    };
    let metrics_scheme = if config.metrics_tls_cert.is_some() {
        "https"
    } else {
        "http"
    };
    switchyard_worker::run(config, registry, shutdown, |running| {
        // One JSON line on stdout tells scripts and tests where the worker is.
        let ready = serde_json::json!({
            "event": "ready",
            "id": running.info.id.as_str(),
            "address": running.info.address,
            "role": running.info.role.as_str(),
            "model": running.info.model,
            "block_size": running.info.block_size.get(),
            "kv_capacity_blocks": running.info.kv_capacity_blocks,
            "incarnation": running.info.incarnation,
            "metrics": running.metrics_addr.map(|a| format!("{metrics_scheme}://{a}/metrics")),
        });
        println!("{ready}");
    })
    .await?;
    Ok(())
}

async fn run_gateway(config: GatewayConfig) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let mut extensions = switchyard_gateway::Extensions::default();
    let registry = if config.discovery.source.uses_etcd() {
        let Some(registry) = connect_etcd(
            &config.etcd_endpoints,
            &config.cluster,
            &config.security,
            &shutdown,
        )
        .await?
        else {
            return Ok(());
        };
        // Worker entries without a valid proof are ignored by the registry client; say how many.
        let unverified = registry.unverified();
        extensions.metrics.push(Arc::new(move || {
            format!(
                "# HELP switchyard_registry_unverified_entries Worker entries ignored for want of a valid proof of who wrote them.\n# TYPE switchyard_registry_unverified_entries counter\nswitchyard_registry_unverified_entries_total {}\n# EOF\n",
                unverified.count()
            )
        }));
        let registry = Arc::new(registry);
        // The gateway replicas find each other where the workers are (`[fleet]`).
        extensions.replicas = Some(Arc::clone(&registry) as Arc<dyn switchyard_registry::Replicas>);
        Some(registry as Arc<dyn Registry>)
    } else {
        None
    };
    let discovery = switchyard_gateway::cluster::discovery::build(
        &config.discovery,
        &config.security,
        &config.cluster,
        registry,
    )
    .await?;
    switchyard_gateway::run_with(config, discovery, shutdown, extensions, |addr| {
        let ready = serde_json::json!({
            "event": "ready",
            "url": format!("http://{addr}/v1"),
            "address": addr.to_string(),
        });
        println!("{ready}");
    })
    .await?;
    Ok(())
}

async fn run_epp(gateway: GatewayConfig, epp: switchyard_epp::EppConfig) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let registry = if gateway.discovery.source.uses_etcd() {
        let Some(registry) = connect_etcd(
            &gateway.etcd_endpoints,
            &gateway.cluster,
            &gateway.security,
            &shutdown,
        )
        .await?
        else {
            return Ok(());
        };
        Some(Arc::new(registry) as Arc<dyn Registry>)
    } else {
        None
    };
    let discovery = switchyard_gateway::cluster::discovery::build(
        &gateway.discovery,
        &gateway.security,
        &gateway.cluster,
        registry,
    )
    .await?;
    switchyard_epp::run(gateway, epp, discovery, shutdown, |listening| {
        let ready = serde_json::json!({
            "event": "ready",
            "grpc": listening.grpc.to_string(),
            "address": listening.http.to_string(),
        });
        println!("{ready}");
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn every_subcommand_has_a_consistent_command_line() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from([
            "switchyard",
            "epp",
            "--etcd",
            "http://etcd:2379",
            "--grpc",
            "127.0.0.1:9002",
            "--http",
            "127.0.0.1:9090",
            "--failure-mode",
            "open",
        ])
        .unwrap();
        let Command::Epp(epp) = parsed.command else {
            panic!("parsed {:?}", parsed.command);
        };
        let config = epp.epp.resolve().unwrap();
        assert_eq!(config.listen.port(), 9002);
        assert_eq!(config.failure_mode, switchyard_epp::FailureMode::Open);
        assert_eq!(epp.registry.resolve().unwrap().listen.port(), 9090);
    }

    #[test]
    fn gateway_flags_win_over_the_config_file_for_etcd_and_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gateway.toml");
        std::fs::write(
            &file,
            "etcd_endpoints = [\"http://file:2379\"]\ncluster = \"from-file\"\npolicy = \"round-robin\"\n",
        )
        .unwrap();
        let file = file.to_str().unwrap();
        let parse = |args: &[&str]| match Cli::try_parse_from(args).unwrap().command {
            Command::Gateway(command) => command.resolve().unwrap(),
            other => panic!("parsed {other:?}"),
        };
        let config = parse(&[
            "switchyard",
            "gateway",
            "--etcd",
            "http://flag:2379",
            "--cluster",
            "from-flag",
            "--gateway-config",
            file,
        ]);
        assert_eq!(config.etcd_endpoints, vec!["http://flag:2379".to_string()]);
        assert_eq!(config.cluster, "from-flag");
        assert_eq!(
            config.policy.to_string(),
            "round-robin",
            "the file still applies"
        );
        let config = parse(&[
            "switchyard",
            "gateway",
            "--etcd",
            "http://flag:2379",
            "--gateway-config",
            file,
        ]);
        assert_eq!(config.cluster, "from-file", "no --cluster keeps the file's");
    }
}
