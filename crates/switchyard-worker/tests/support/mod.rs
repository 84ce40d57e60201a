//! A worker agent run in-process on a loopback port, for the gRPC tests of this crate.

#![allow(dead_code)]

pub mod fake_trtllm;
pub mod fake_vllm;

use std::net::SocketAddr;
use std::sync::Arc;

use futures::StreamExt;
use switchyard_proto::v1::{self, LoadStatsRequest, worker_client::WorkerClient};
use switchyard_registry::Registry;
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// A running `switchyard_worker::run` and a client connected to it.
pub struct InProcessWorker {
    pub addr: SocketAddr,
    /// Where `/metrics` is served, when the config asked for it.
    pub metrics_addr: Option<SocketAddr>,
    pub client: WorkerClient<Channel>,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<Result<(), switchyard_worker::AgentError>>,
}

/// Starts a worker with `config` (registered in `registry`, if any) and connects to it.
pub async fn spawn_worker(
    config: WorkerConfig,
    registry: Option<Arc<dyn Registry>>,
) -> InProcessWorker {
    let shutdown = CancellationToken::new();
    let (ready_tx, ready_rx) = oneshot::channel();
    let task = tokio::spawn(switchyard_worker::run(
        config,
        registry,
        shutdown.clone(),
        move |running| {
            let _ = ready_tx.send((running.local_addr, running.metrics_addr));
        },
    ));
    let (addr, metrics_addr) = ready_rx.await.expect("worker ready");
    let client = WorkerClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    InProcessWorker {
        addr,
        metrics_addr,
        client,
        shutdown,
        task,
    }
}

impl InProcessWorker {
    /// Shuts the worker down and checks it stopped cleanly.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.expect("join").expect("clean shutdown");
    }

    /// The worker's `/metrics` text, fetched over HTTP.
    pub async fn scrape(&self) -> String {
        let addr = self.metrics_addr.expect("started with metrics_listen");
        let response = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .expect("metrics answer");
        assert!(response.status().is_success(), "{response:?}");
        let content_type = response.headers()[reqwest::header::CONTENT_TYPE].clone();
        assert!(
            content_type
                .to_str()
                .unwrap()
                .starts_with("application/openmetrics-text"),
            "{content_type:?}"
        );
        response.text().await.expect("metrics text")
    }

    /// One load report, fresh.
    pub async fn load(&mut self) -> v1::LoadReport {
        let mut stream = self
            .client
            .load_stats(LoadStatsRequest {
                interval_ms: 10,
                ..Default::default()
            })
            .await
            .expect("load stream")
            .into_inner();
        stream.next().await.expect("report").expect("ok")
    }
}
