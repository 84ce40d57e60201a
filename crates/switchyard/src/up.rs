//! `switchyard up`: the whole system in one process, ready for an OpenAI client.
//!
//! Starts a registry (in memory, or etcd with `--etcd`), N simulated workers registered in it,
//! and the gateway that watches it. Each worker serves its own `/metrics` on a free loopback
//! port, printed in the banner. Ctrl-C or SIGTERM stops the gateway first, then drains the
//! workers.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use switchyard_core::BlockSize;
use switchyard_gateway::{GatewayArgs, GatewayConfig};
use switchyard_registry::{EtcdRegistry, MemoryRegistry, Registry};
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
    /// Model name the workers serve.
    #[arg(long, default_value = "sim-8b", env = "SWITCHYARD_MODEL")]
    pub model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: u32,
    /// KV cache size of each worker, in blocks.
    #[arg(long, default_value_t = 8192, env = "SWITCHYARD_KV_BLOCKS")]
    pub kv_blocks: u64,
    /// Longest prompt plus output, in tokens.
    #[arg(long, default_value_t = 32768, env = "SWITCHYARD_MAX_CONTEXT")]
    pub max_context: u64,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0, env = "SWITCHYARD_SPEEDUP")]
    pub speedup: f64,
    /// Use etcd at these endpoints instead of the in-memory registry.
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_ETCD")]
    pub etcd: Vec<String>,
    /// Registry namespace.
    #[arg(long, default_value = "default", env = "SWITCHYARD_CLUSTER")]
    pub cluster: String,
    #[command(flatten)]
    pub gateway: GatewayArgs,
}

/// Checks the flags and builds the gateway and worker configurations.
pub fn resolve(args: &UpArgs) -> Result<(GatewayConfig, Vec<WorkerConfig>), String> {
    if args.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    let base = GatewayConfig {
        etcd_endpoints: args.etcd.clone(),
        cluster: args.cluster.clone(),
        ..GatewayConfig::default()
    };
    let gateway = args.gateway.resolve_onto(base).map_err(|e| e.to_string())?;
    let block_size = BlockSize::new(args.block_size).map_err(|e| e.to_string())?;
    let mut workers = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let mut config = WorkerConfig {
            id: Some(format!("sim-{i}")),
            model: args.model.clone(),
            cluster: args.cluster.clone(),
            etcd_endpoints: args.etcd.clone(),
            speedup: args.speedup,
            otlp_endpoint: gateway.otlp_endpoint.clone(),
            // One process, many workers: each gets its own free port for /metrics.
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..WorkerConfig::default()
        };
        config.sim.block_size = block_size;
        config.sim.num_device_blocks = args.kv_blocks;
        config.sim.max_context_tokens = args.max_context;
        config.sim.seed = i as u64;
        config.validate().map_err(|e| e.to_string())?;
        workers.push(config);
    }
    Ok((gateway, workers))
}

pub async fn run(
    gateway: GatewayConfig,
    workers: Vec<WorkerConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let registry: Arc<dyn Registry> = if gateway.etcd_endpoints.is_empty() {
        Arc::new(MemoryRegistry::new())
    } else {
        Arc::new(
            EtcdRegistry::connect(&gateway.etcd_endpoints, &gateway.cluster)
                .await
                .with_context(|| {
                    format!("cannot reach etcd at {}", gateway.etcd_endpoints.join(","))
                })?,
        )
    };
    let model = workers.first().map(|w| w.model.clone()).unwrap_or_default();
    let worker_count = workers.len();
    let worker_stop = CancellationToken::new();
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
    let (addr_tx, addr_rx) = oneshot::channel::<SocketAddr>();
    let gateway_task = tokio::spawn(switchyard_gateway::run(
        gateway,
        registry,
        shutdown.clone(),
        move |addr| {
            let _ = addr_tx.send(addr);
        },
    ));
    match addr_rx.await {
        Ok(addr) => print_banner(addr, worker_count, &model, &worker_metrics),
        Err(_) => {
            worker_stop.cancel();
            return match gateway_task.await {
                Ok(Err(err)) => Err(err.into()),
                _ => Err(anyhow::anyhow!("the gateway failed to start")),
            };
        }
    }
    let gateway_result = gateway_task.await;
    worker_stop.cancel();
    tasks.close();
    tasks.wait().await;
    match gateway_result {
        Ok(result) => result.map_err(Into::into),
        Err(join) => Err(anyhow::anyhow!("gateway task failed: {join}")),
    }
}

fn print_banner(
    addr: SocketAddr,
    workers: usize,
    model: &str,
    worker_metrics: &[(String, String)],
) {
    let url = format!("http://{addr}/v1");
    let ready = serde_json::json!({
        "event": "ready",
        "url": url,
        "address": addr.to_string(),
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
    for (id, url) in worker_metrics {
        println!("  worker {id} metrics: {url}");
    }
}
