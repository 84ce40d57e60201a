//! `switchyard up`: the whole system in one process, ready for an OpenAI client.
//!
//! Starts a registry (in memory, or etcd with `--etcd`), N simulated workers registered in it,
//! and the gateway that watches it; with `--gateways N`, N gateway replicas on their own ports
//! (consecutive from `--http`'s, or each a free one for port 0) that share sessions through
//! the registry as a deployment's replicas do. Each worker serves its own `/metrics` on a free loopback
//! port, printed in the banner. Ctrl-C or SIGTERM stops the gateway first, then drains the
//! workers.
//!
//! With `--planner` the workers start split between a prefill and a decode pool, the gateway
//! serves disaggregated (`auto` unless told otherwise), and a planner moves workers between
//! the pools; its admin API is mounted at the gateway's `/admin/planner` and its metrics are
//! appended to the gateway's `/metrics`.
//!
//! With `--event-plane embedded` it also starts a `nats-server` with JetStream on a free
//! loopback port (its store in a temporary directory, removed at exit) and runs the workers and
//! gateways on it as the KV event plane; `--event-plane nats://…` uses an existing server.

use std::net::SocketAddr;
use std::sync::Arc;

use switchyard_core::{BlockSize, Role};
use switchyard_gateway::serving::disagg::Disaggregation;
use switchyard_gateway::{Extensions, GatewayArgs, GatewayConfig};
use switchyard_planner::{PlannerArgs, PlannerConfig};
use switchyard_registry::{MemoryRegistry, Registry};
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Flags of `switchyard up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Simulated workers to start.
    #[arg(long, default_value_t = 4, env = "SWITCHYARD_WORKERS")]
    pub workers: usize,
    /// Gateway replicas to start over the same registry and workers; more than one share
    /// sessions (each turn is served by the replica that owns its `x-session-id`).
    #[arg(long, default_value_t = 1, env = "SWITCHYARD_GATEWAYS")]
    pub gateways: usize,
    /// Model name the workers serve.
    #[arg(long, default_value = "sim-8b", env = "SWITCHYARD_MODEL")]
    pub model: String,
    /// LoRA adapters every simulated worker serves besides the model (repeat, or
    /// comma-separated): clients ask for one as `model`, and its KV is kept apart.
    #[arg(
        long = "lora-adapter",
        value_delimiter = ',',
        env = "SWITCHYARD_LORA_ADAPTERS"
    )]
    pub lora_adapters: Vec<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: u32,
    /// KV cache size of each worker, in blocks.
    #[arg(long, default_value_t = 8192, env = "SWITCHYARD_KV_BLOCKS")]
    pub kv_blocks: u64,
    /// Longest prompt plus output, in tokens (today's models take 128k and more; agent
    /// clients ask for 32k of output on top of prompts of tens of thousands).
    #[arg(long, default_value_t = 131_072, env = "SWITCHYARD_MAX_CONTEXT")]
    pub max_context: u64,
    /// Simulated answers end as a model's do, this many tokens long on average (each token
    /// ends the answer with probability 1/N, with the model's end-of-sequence token, finishing
    /// `stop`); 0 runs every answer to its `max_tokens`.
    #[arg(long, default_value_t = 256, env = "SWITCHYARD_MEAN_OUTPUT_TOKENS")]
    pub mean_output_tokens: u32,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0, env = "SWITCHYARD_SPEEDUP")]
    pub speedup: f64,
    /// Use etcd at these endpoints instead of the in-memory registry.
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_ETCD")]
    pub etcd: Vec<String>,
    /// Registry namespace (default: the gateway config file's, else `default`).
    #[arg(long, env = "SWITCHYARD_CLUSTER")]
    pub cluster: Option<String>,
    /// Workers that start in the prefill pool (the rest decode); default: none, or half of
    /// them with --planner.
    #[arg(long, env = "SWITCHYARD_PREFILL_WORKERS")]
    pub prefill_workers: Option<usize>,
    /// Run the planner too: it moves the workers between the prefill and decode pools.
    #[arg(long, env = "SWITCHYARD_PLANNER")]
    pub planner: bool,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    #[command(flatten)]
    pub planning: PlannerArgs,
}

/// Everything `switchyard up` starts, checked.
#[derive(Debug)]
pub struct Resolved {
    /// One configuration per gateway replica.
    pub gateways: Vec<GatewayConfig>,
    pub workers: Vec<WorkerConfig>,
    pub planner: Option<PlannerConfig>,
    /// `--event-plane embedded`: start a nats-server and put every process on it.
    pub embedded_plane: bool,
}

/// `--event-plane embedded`: `up` starts the event plane's server itself.
const EMBEDDED_PLANE: &str = "embedded";

/// Checks the flags and builds the gateway, worker and planner configurations.
pub fn resolve(args: &UpArgs) -> Result<Resolved, String> {
    if args.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    if args.gateways == 0 || args.gateways > MAX_GATEWAYS {
        return Err(format!("--gateways must be 1 to {MAX_GATEWAYS}"));
    }
    // `embedded` is not a URL: it is taken out before the flags are checked, and the URL of
    // the server `run` starts is put in its place.
    let mut gateway_args = args.gateway.clone();
    let embedded_plane = gateway_args.event_plane.event_plane.as_deref() == Some(EMBEDDED_PLANE);
    if embedded_plane {
        gateway_args.event_plane.event_plane = None;
    }
    let mut gateway = gateway_args
        .resolve_onto(GatewayConfig::default())
        .map_err(|e| e.to_string())?;
    // Like every flag, --etcd and --cluster win over the gateway's config file.
    if !args.etcd.is_empty() {
        gateway.etcd_endpoints = args.etcd.clone();
    }
    if let Some(cluster) = &args.cluster {
        gateway.cluster = cluster.clone();
    }
    // One process runs every role, so one certificate cannot name them all: the cluster secret
    // is how `up` secures its workers' ports (reached over loopback anyway by default).
    if gateway.security.tls_cert.is_some() {
        return Err(
            "switchyard up runs every role in one process: secure it with --cluster-secret-file, not certificates".into(),
        );
    }
    gateway.check_security_files().map_err(|e| e.to_string())?;
    let planner = if args.planner {
        let mut config = args
            .planning
            .resolve_onto(PlannerConfig::default())
            .map_err(|e| e.to_string())?;
        if config.connector != switchyard_planner::ConnectorKind::Local {
            return Err(
                "switchyard up --planner moves its own workers: use --connector local".into(),
            );
        }
        config.sim_speedup = args.speedup;
        config.admin_token = gateway.admin_token.clone();
        config.security = gateway.security.clone();
        config.gateway_metrics_token = gateway.access.metrics_token.clone();
        config.validate(false).map_err(|e| e.to_string())?;
        if args.gateway.disaggregation.is_none() {
            gateway.disaggregation = Disaggregation::Auto;
        }
        config.disagg_min_uncached_tokens = gateway.disagg_min_uncached_tokens;
        Some(config)
    } else {
        None
    };
    let prefill_workers = match (args.prefill_workers, args.planner) {
        (Some(n), _) => n,
        (None, true) => args.workers / 2,
        (None, false) => 0,
    };
    if prefill_workers > args.workers {
        return Err("--prefill-workers cannot exceed --workers".into());
    }
    let block_size = BlockSize::new(args.block_size).map_err(|e| e.to_string())?;
    let mut workers = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let role = if i < prefill_workers {
            Role::Prefill
        } else if prefill_workers > 0 || args.planner {
            Role::Decode
        } else {
            Role::Both
        };
        let mut config = WorkerConfig {
            id: Some(format!("sim-{i}")),
            role,
            model: args.model.clone(),
            lora_adapters: args.lora_adapters.clone(),
            cluster: gateway.cluster.clone(),
            etcd_endpoints: gateway.etcd_endpoints.clone(),
            speedup: args.speedup,
            otlp_endpoint: gateway.otlp_endpoint.clone(),
            // One process, many workers: each gets its own free port for /metrics.
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            security: gateway.security.clone(),
            event_plane: gateway.event_plane.clone(),
            ..WorkerConfig::default()
        };
        config.sim.block_size = block_size;
        config.sim.num_device_blocks = args.kv_blocks;
        config.sim.max_context_tokens = args.max_context;
        config.sim.mean_output_tokens = args.mean_output_tokens;
        config.sim.seed = i as u64;
        config.validate().map_err(|e| e.to_string())?;
        workers.push(config);
    }
    Ok(Resolved {
        gateways: replicas(gateway, args.gateways)?,
        workers,
        planner,
        embedded_plane,
    })
}

/// Most gateway replicas `up` starts (they share two cores with the workers).
const MAX_GATEWAYS: usize = 16;

/// `count` gateway configurations from `gateway`: replica `i` listens on the port after
/// replica `i - 1`'s (all on free ports when the port is 0) and, with more than one, shares
/// sessions as `gw-<i>`.
fn replicas(gateway: GatewayConfig, count: usize) -> Result<Vec<GatewayConfig>, String> {
    if count == 1 {
        return Ok(vec![gateway]);
    }
    let base = gateway.listen;
    (0..count)
        .map(|i| {
            let mut replica = gateway.clone();
            if base.port() != 0 {
                let port = u16::try_from(usize::from(base.port()) + i).map_err(|_| {
                    format!(
                        "--gateways {count} from port {} runs past 65535",
                        base.port()
                    )
                })?;
                replica.listen.set_port(port);
            }
            replica.fleet.share_sessions = true;
            replica.fleet.replica_id = Some(format!("gw-{i}"));
            replica.fleet.advertise = None;
            Ok(replica)
        })
        .collect()
}

pub async fn run(resolved: Resolved, shutdown: CancellationToken) -> anyhow::Result<()> {
    let Resolved {
        mut gateways,
        mut workers,
        planner,
        embedded_plane,
    } = resolved;
    // Lives as long as `up`: dropped at the end, it stops the server and removes its store.
    let _plane_server = if embedded_plane {
        let server = tokio::task::spawn_blocking(|| {
            switchyard_event_plane::server::NatsServer::start(
                switchyard_event_plane::server::ServerAuth::Open,
            )
        })
        .await??;
        let url = server.url();
        tracing::info!(%url, "embedded event plane (nats-server with JetStream) started");
        for config in &mut gateways {
            config.event_plane.url = Some(url.clone());
        }
        for config in &mut workers {
            config.event_plane.url = Some(url.clone());
        }
        Some(server)
    } else {
        None
    };
    let Some(gateway) = gateways.first() else {
        return Err(anyhow::anyhow!("no gateway to start"));
    };
    let registry: Arc<dyn Registry> = if gateway.etcd_endpoints.is_empty() {
        Arc::new(MemoryRegistry::new())
    } else {
        match crate::connect_etcd(
            &gateway.etcd_endpoints,
            &gateway.cluster,
            &gateway.security,
            &shutdown,
        )
        .await?
        {
            Some(registry) => Arc::new(registry),
            None => return Ok(()),
        }
    };
    let model = workers.first().map(|w| w.model.clone()).unwrap_or_default();
    let worker_count = workers.len();
    let worker_stop = CancellationToken::new();
    let planner_cancel = CancellationToken::new();
    let planner_stop = planner_cancel.clone();
    let tasks = TaskTracker::new();
    let mut ready = Vec::new();
    for config in workers {
        let (tx, rx) = oneshot::channel();
        ready.push(rx);
        let registry = Arc::clone(&registry);
        let stop = worker_stop.clone();
        tasks.spawn(async move {
            let result = switchyard_worker::run(config, Some(registry), stop, move |w| {
                let _ = tx.send((w.info.id.to_string(), w.metrics_addr));
            })
            .await;
            if let Err(err) = &result {
                tracing::error!(error = %err, "worker failed");
            }
            result
        });
    }
    let mut worker_metrics = Vec::with_capacity(ready.len());
    for rx in ready {
        let (id, metrics) = rx
            .await
            .map_err(|_| anyhow::anyhow!("a worker failed to start; see the log above"))?;
        if let Some(addr) = metrics {
            worker_metrics.push((id, format!("http://{addr}/metrics")));
        }
    }
    let planning = planner.is_some();
    let mut extensions = Extensions::default();
    let mut planner = match &planner {
        Some(config) => {
            let planner = switchyard_planner::build(config, Arc::clone(&registry))
                .await
                .map_err(|e| anyhow::anyhow!("cannot start the planner: {e}"))?;
            let admin = switchyard_planner::admin::router(Arc::clone(&planner.state));
            extensions.admin.push(("planner", admin));
            let metrics = Arc::clone(&planner.metrics);
            extensions.metrics.push(Arc::new(move || metrics.encode()));
            Some(planner)
        }
        None => None,
    };
    extensions.replicas = Some(Arc::clone(&registry) as Arc<dyn switchyard_registry::Replicas>);
    let mut gateway_tasks = tokio::task::JoinSet::new();
    let mut addresses = Vec::with_capacity(gateways.len());
    for gateway in gateways {
        let (addr_tx, addr_rx) = oneshot::channel::<SocketAddr>();
        gateway_tasks.spawn(switchyard_gateway::run_with(
            gateway,
            Arc::clone(&registry) as Arc<dyn switchyard_registry::Discovery>,
            shutdown.clone(),
            extensions.clone(),
            move |addr| {
                let _ = addr_tx.send(addr);
            },
        ));
        match addr_rx.await {
            Ok(addr) => addresses.push(addr),
            Err(_) => {
                worker_stop.cancel();
                shutdown.cancel();
                while let Some(result) = gateway_tasks.join_next().await {
                    if let Ok(Err(err)) = result {
                        return Err(err.into());
                    }
                }
                return Err(anyhow::anyhow!("a gateway failed to start"));
            }
        }
    }
    if let Some(mut planner) = planner.take() {
        // The planner reads the gateways' /metrics, known once they listen.
        planner.set_gateways(addresses.iter().map(|a| format!("http://{a}")).collect());
        tasks.spawn(planner.run(planner_stop));
    }
    print_banner(&addresses, worker_count, &model, planning, &worker_metrics);
    let mut gateway_result = Ok(Ok(()));
    while let Some(result) = gateway_tasks.join_next().await {
        // One replica failing stops the others: `up` is one system.
        if !matches!(result, Ok(Ok(()))) {
            shutdown.cancel();
            if gateway_result.as_ref().is_ok_and(|r| r.is_ok()) {
                gateway_result = result;
            }
        }
    }
    // The planner stops before the workers so no move is under way while they drain.
    planner_cancel.cancel();
    worker_stop.cancel();
    tasks.close();
    tasks.wait().await;
    match gateway_result {
        Ok(result) => result.map_err(Into::into),
        Err(join) => Err(anyhow::anyhow!("gateway task failed: {join}")),
    }
}

fn print_banner(
    addresses: &[SocketAddr],
    workers: usize,
    model: &str,
    planner: bool,
    worker_metrics: &[(String, String)],
) {
    let Some(addr) = addresses.first() else {
        return;
    };
    let url = format!("http://{addr}/v1");
    let ready = serde_json::json!({
        "event": "ready",
        "url": url,
        "address": addr.to_string(),
        "gateways": addresses.iter().map(|a| format!("http://{a}/v1")).collect::<Vec<_>>(),
        "workers": workers,
        "model": model,
        "worker_metrics": worker_metrics
            .iter()
            .map(|(id, url)| (id.clone(), serde_json::Value::from(url.as_str())))
            .collect::<serde_json::Map<_, _>>(),
    });
    println!("{ready}");
    println!(
        "Switchyard is up: {workers} simulated workers serving `{model}`, OpenAI API at {url}"
    );
    println!(
        "  curl {url}/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":16}}'"
    );
    println!(
        "  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}', api_key='none'); print(c.chat.completions.create(model='{model}', messages=[{{'role':'user','content':'Hello!'}}], max_tokens=16).choices[0].message.content)\""
    );
    println!(
        "  admin: http://{addr}/admin/workers   metrics: http://{addr}/metrics   stop: Ctrl-C"
    );
    if planner {
        println!("  planner: http://{addr}/admin/planner (plan and decisions)");
    }
    if addresses.len() > 1 {
        println!(
            "  {} gateway replicas sharing sessions by x-session-id:",
            addresses.len()
        );
        for (i, a) in addresses.iter().enumerate() {
            println!("    gw-{i}: http://{a}/v1   metrics: http://{a}/metrics");
        }
    }
    for (id, url) in worker_metrics {
        println!("  worker {id} metrics: {url}");
    }
}
