//! What the gateway crate's integration tests share: a real worker agent in this process.

use switchyard_core::WorkerInfo;
use switchyard_worker::WorkerConfig;
use tokio_util::sync::CancellationToken;

/// Starts a worker agent with `config` on loopback until `stop`; what it registers as.
pub async fn start_worker(config: WorkerConfig, stop: &CancellationToken) -> WorkerInfo {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(switchyard_worker::run(
        config,
        None,
        stop.clone(),
        move |w| {
            let _ = tx.send(w.info.clone());
        },
    ));
    rx.await.expect("worker ready")
}
