//! `switchyard workers`: many simulated workers in one process, for fleet tests and scale
//! benchmarks (a thousand workers on one machine; see `docs/scaling.md`).
//!
//! Every worker is the real worker agent (its own gRPC server on a free loopback port, its own
//! simulated engine, its own etcd lease and registration); they share the process's runtime
//! and one etcd connection. Ids are `<id-prefix>-<first + i>`, so several such processes can
//! fill one cluster. One JSON ready line goes out once every worker is registered.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use switchyard_registry::Registry;
use switchyard_worker::{WorkerArgs, WorkerConfig};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Flags of `switchyard workers`.
#[derive(Debug, clap::Args)]
pub struct WorkersArgs {
    /// Simulated workers to run in this process.
    #[arg(long, default_value_t = 100, env = "SWITCHYARD_WORKER_COUNT")]
    pub count: usize,
    /// Worker ids are `<id-prefix>-<index>`.
    #[arg(long, default_value = "sim", env = "SWITCHYARD_WORKER_ID_PREFIX")]
    pub id_prefix: String,
    /// Index of the first worker (so several processes can share a cluster).
    #[arg(long, default_value_t = 0)]
    pub first: usize,
    /// Every other worker flag, applied to each worker.
    #[command(flatten)]
    pub worker: WorkerArgs,
}

/// Each worker's configuration, checked: one process cannot give many workers one port or one
/// id, and workers nobody can find are of no use, so etcd is needed.
pub fn resolve(args: &WorkersArgs) -> Result<Vec<WorkerConfig>, String> {
    if args.count == 0 {
        return Err("--count must be at least 1".into());
    }
    let base = args.worker.resolve().map_err(|e| e.to_string())?;
    if base.id.is_some() {
        return Err(
            "--id names one worker; switchyard workers names them --id-prefix-<index>".into(),
        );
    }
    if base.listen.port() != 0 {
        return Err("--listen must use port 0 (any free port): every worker needs its own".into());
    }
    if base.advertise_address.is_some() {
        return Err(
            "--advertise-address names one worker's address; workers here advertise their own"
                .into(),
        );
    }
    if base.metrics_listen.is_some_and(|addr| addr.port() != 0) {
        return Err(
            "--metrics-listen must use port 0 (any free port): every worker needs its own".into(),
        );
    }
    if base.etcd_endpoints.is_empty() {
        return Err("switchyard workers registers its workers in etcd: give --etcd".into());
    }
    let seed = base.sim.seed;
    Ok((args.first..args.first + args.count)
        .map(|index| {
            let mut config = base.clone();
            config.id = Some(format!("{}-{index}", args.id_prefix));
            config.sim.seed = seed.wrapping_add(index as u64);
            config
        })
        .collect())
}

/// Runs `configs` until `shutdown`, then drains them all.
pub async fn run(configs: Vec<WorkerConfig>, shutdown: CancellationToken) -> anyhow::Result<()> {
    let Some(first) = configs.first() else {
        return Ok(());
    };
    let started = Instant::now();
    let registry: Arc<dyn Registry> = match crate::connect_etcd(
        &first.etcd_endpoints,
        &first.cluster,
        &first.security,
        &shutdown,
    )
    .await?
    {
        Some(registry) => Arc::new(registry),
        None => return Ok(()),
    };
    let count = configs.len();
    let (ready_tx, mut ready_rx) = mpsc::channel::<(String, SocketAddr)>(count);
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    for config in configs {
        let (registry, stop, ready_tx) = (Arc::clone(&registry), stop.clone(), ready_tx.clone());
        tasks.spawn(async move {
            let result = switchyard_worker::run(config, Some(registry), stop, move |w| {
                let _ = ready_tx.try_send((w.info.id.to_string(), w.local_addr));
            })
            .await;
            if let Err(err) = &result {
                tracing::error!(error = %err, "worker failed");
            }
        });
    }
    drop(ready_tx);
    let mut ready = 0;
    let mut first_address = None;
    while ready < count {
        tokio::select! {
            () = shutdown.cancelled() => break,
            up = ready_rx.recv() => match up {
                Some((_, address)) => {
                    ready += 1;
                    first_address.get_or_insert(address);
                }
                None => break,
            },
        }
    }
    if ready < count && !shutdown.is_cancelled() {
        stop.cancel();
        tasks.close();
        tasks.wait().await;
        anyhow::bail!(
            "{} of {count} workers failed to start; see the log above",
            count - ready
        );
    }
    if ready == count {
        let line = serde_json::json!({
            "event": "ready",
            "workers": count,
            "start_secs": started.elapsed().as_secs_f64(),
            // One worker's address stands for the process.
            "address": first_address.map(|a| a.to_string()),
        });
        println!("{line}");
    }
    shutdown.cancelled().await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: WorkersArgs,
    }

    fn parse(args: &[&str]) -> Result<Vec<WorkerConfig>, String> {
        let cli = Cli::try_parse_from(std::iter::once("workers").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        resolve(&cli.args)
    }

    #[test]
    fn each_worker_gets_its_own_id_and_seed() {
        let configs = parse(&[
            "--count",
            "3",
            "--first",
            "10",
            "--etcd",
            "http://127.0.0.1:2379",
        ])
        .unwrap();
        let ids: Vec<_> = configs.iter().filter_map(|c| c.id.clone()).collect();
        assert_eq!(ids, ["sim-10", "sim-11", "sim-12"]);
        assert_ne!(configs[0].sim.seed, configs[1].sim.seed);
    }

    #[test]
    fn one_port_or_one_id_for_many_is_refused() {
        let etcd = ["--etcd", "http://127.0.0.1:2379"];
        for (flags, named) in [
            (vec!["--id", "w"], "--id"),
            (vec!["--listen", "127.0.0.1:7000"], "--listen"),
            (
                vec!["--metrics-listen", "127.0.0.1:9000"],
                "--metrics-listen",
            ),
            (vec!["--count", "0"], "--count"),
        ] {
            let args: Vec<&str> = flags.iter().copied().chain(etcd).collect();
            let err = parse(&args).unwrap_err();
            assert!(err.contains(named), "{err}");
        }
        assert!(parse(&["--count", "2"]).unwrap_err().contains("--etcd"));
    }
}
