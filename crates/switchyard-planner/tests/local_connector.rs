//! The local connector against real workers (in-process agents over loopback gRPC) registered
//! in a real etcd: a decode worker moved to the prefill pool finishes the sequence it is
//! decoding first; the new role reaches the registry and the worker; desired roles are
//! recorded; a worker that does not go idle within the drain timeout is given back, unmoved.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use switchyard_core::{BlockSize, Role, WorkerId};
use switchyard_planner::connector::local::LocalConnector;
use switchyard_planner::{Connector, PoolSizes};
use switchyard_proto::v1::{self, worker_client::WorkerClient};
use switchyard_registry::{EtcdRegistry, Registry};
use switchyard_testkit::EtcdServer;
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

struct Worker {
    client: WorkerClient<Channel>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), switchyard_worker::AgentError>>,
}

async fn spawn_worker(id: &str, role: Role, speedup: f64, registry: Arc<dyn Registry>) -> Worker {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup,
        lease_ttl_secs: 5,
        drain_timeout_secs: 5,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 512;
    config.sim.max_context_tokens = 8192;
    let shutdown = CancellationToken::new();
    let (ready_tx, ready_rx) = oneshot::channel();
    let task = tokio::spawn(switchyard_worker::run(
        config,
        Some(registry),
        shutdown.clone(),
        move |running| {
            let _ = ready_tx.send(running.local_addr);
        },
    ));
    let addr = ready_rx.await.expect("worker ready");
    let client = WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    Worker {
        client,
        shutdown,
        task,
    }
}

/// Starts a generation and returns a task yielding (tokens received, finish reason), once
/// the first token has arrived (so the request is in flight on the worker).
async fn in_flight_generation(
    client: &mut WorkerClient<Channel>,
    max_tokens: u32,
) -> tokio::task::JoinHandle<(u32, i32)> {
    let mut stream = client
        .generate(v1::GenerateRequest {
            priority: None,
            request_id: "long".into(),
            prompt_token_ids: (1..=64).collect(),
            sampling: Some(v1::SamplingParams {
                max_tokens,
                ignore_eos: true,
                ..Default::default()
            }),
            kv_source: None,
            identity: None,
            retention: None,
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    tokio::spawn(async move {
        let mut tokens = first.token_ids.len() as u32;
        let mut finish = first.finish_reason;
        while let Some(message) = stream.next().await {
            let message = message.unwrap();
            tokens += message.token_ids.len() as u32;
            finish = message.finish_reason;
        }
        (tokens, finish)
    })
}

fn board() -> switchyard_planner::observe::WorkerBoard {
    Arc::new(Mutex::new(BTreeMap::new()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_decode_worker_finishes_its_sequence_and_takes_the_new_role() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = format!("local-connector-{}", std::process::id());
    let registry: Arc<dyn Registry> = Arc::new(
        EtcdRegistry::connect(&[etcd.endpoint()], &cluster)
            .await
            .unwrap(),
    );
    let mut decode = spawn_worker("d-0", Role::Decode, 2.0, Arc::clone(&registry)).await;
    let prefill = spawn_worker("p-0", Role::Prefill, 2.0, Arc::clone(&registry)).await;
    let connector = LocalConnector::new(Arc::clone(&registry), board(), Duration::from_secs(60));
    assert_eq!(connector.name(), "local");
    assert_eq!(
        connector.current().await.unwrap(),
        PoolSizes {
            prefill: 1,
            decode: 1
        }
    );
    assert_eq!(connector.capacity().await.unwrap(), Some(2));

    let generation = in_flight_generation(&mut decode.client, 150).await;
    connector
        .scale_to(PoolSizes {
            prefill: 2,
            decode: 0,
        })
        .await
        .unwrap();
    // The move waited for the sequence: the engine has nothing running any more.
    let mut reports = decode
        .client
        .load_stats(v1::LoadStatsRequest {
            interval_ms: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let report = reports.next().await.unwrap().unwrap();
    // An open stream would hold the worker's graceful shutdown at the end.
    drop(reports);
    assert_eq!(report.running_requests, 0, "{report:?}");
    let (tokens, finish) = generation.await.unwrap();
    assert_eq!(tokens, 150, "the sequence was decoded to the end");
    assert_eq!(finish, v1::FinishReason::Length as i32);

    assert_eq!(
        connector.current().await.unwrap(),
        PoolSizes {
            prefill: 2,
            decode: 0
        }
    );
    for id in ["d-0", "p-0"] {
        let desired = registry
            .desired_role(&WorkerId::new(id).unwrap())
            .await
            .unwrap();
        assert_eq!(desired, Some(Role::Prefill), "{id}");
    }
    let info = decode
        .client
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.role, v1::Role::Prefill as i32);
    assert!(!info.draining, "resumed after the move");
    let refused = decode
        .client
        .generate(v1::GenerateRequest {
            priority: None,
            request_id: "after".into(),
            prompt_token_ids: vec![1, 2, 3],
            sampling: Some(v1::SamplingParams {
                max_tokens: 1,
                ..Default::default()
            }),
            kv_source: None,
            identity: None,
            retention: None,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    // A target with a different number of workers is not the local connector's to make (the
    // set changed since the planner read it: the next interval plans again).
    let err = connector
        .scale_to(PoolSizes {
            prefill: 3,
            decode: 0,
        })
        .await
        .unwrap_err();
    assert!(err.retryable(), "{err}");
    assert!(
        err.to_string().contains("cannot make 3 prefill + 0 decode"),
        "{err}"
    );

    for worker in [decode, prefill] {
        worker.shutdown.cancel();
        worker.task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_does_not_drain_in_time_stays_where_it_was() {
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = format!("local-connector-timeout-{}", std::process::id());
    let registry: Arc<dyn Registry> = Arc::new(
        EtcdRegistry::connect(&[etcd.endpoint()], &cluster)
            .await
            .unwrap(),
    );
    // Slowed down tenfold: 2,000 tokens take minutes, far past the one-second drain timeout.
    let mut decode = spawn_worker("d-0", Role::Decode, 0.1, Arc::clone(&registry)).await;
    let prefill = spawn_worker("p-0", Role::Prefill, 0.1, Arc::clone(&registry)).await;
    let connector = LocalConnector::new(Arc::clone(&registry), board(), Duration::from_secs(1));
    let generation = in_flight_generation(&mut decode.client, 2000).await;
    let err = connector
        .scale_to(PoolSizes {
            prefill: 2,
            decode: 0,
        })
        .await
        .unwrap_err();
    assert!(err.retryable(), "{err}");
    assert!(err.to_string().contains("still running"), "{err}");
    let info = decode
        .client
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.role, v1::Role::Decode as i32, "not moved");
    assert!(!info.draining, "given back to its pool");
    assert_eq!(
        registry
            .desired_role(&WorkerId::new("d-0").unwrap())
            .await
            .unwrap(),
        Some(Role::Decode)
    );
    generation.abort();
    for worker in [decode, prefill] {
        worker.shutdown.cancel();
        let _ = worker.task.await;
    }
}
