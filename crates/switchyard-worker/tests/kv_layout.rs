//! KV layout negotiation between two real workers over loopback gRPC: the prefill worker
//! announces its layout on the first chunk of `PullKv`, and the decode worker plans its copy
//! descriptors from that, not from its own configuration; a layout of another model shape is
//! refused before a block is imported; a source that announces nothing (a worker from before the
//! announcement, stood in for by a proxy that strips it) is planned from the configured
//! `prefill_tensor_parallel`, as before. The descriptor counts in the decode worker's `/metrics`
//! show which plan ran.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::net::SocketAddr;
use std::pin::Pin;

use futures::{Stream, StreamExt};
use support::{InProcessWorker as Worker, spawn_worker};
use switchyard_core::{BlockSize, Role};
use switchyard_proto::fault::{Fault, fault_of};
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_proto::v1::worker_server::{Worker as WorkerRpc, WorkerServer};
use switchyard_proto::v1::{self, GenerateRequest, KvSource, PrefillRequest, SamplingParams};
use switchyard_worker::WorkerConfig;
use switchyard_worker::metrics::sample;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

const BLOCK: u32 = 16;
/// Default layout (8 KV heads of 128 dims, fp16, 32 layers), TP1 → TP2: each destination rank
/// takes 4 of the 8 heads, a 1 KiB run per (layer, K/V, token): 32 × 2 × 16 × 2 fragments.
const STRIDED_FRAGMENTS_PER_BLOCK: f64 = 2048.0;
/// Same split on both sides: one contiguous region per rank and block.
const MATCHING_FRAGMENTS_PER_BLOCK: f64 = 2.0;

fn config(id: &str, role: Role, tensor_parallel: u32) -> WorkerConfig {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup: 100.0,
        drain_timeout_secs: 5,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(BLOCK).unwrap();
    config.sim.num_device_blocks = 256;
    config.sim.max_context_tokens = 8192;
    config.kv_layout.tensor_parallel = tensor_parallel;
    config
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|i| 500 + salt * 10_000 + i * 3).collect()
}

/// Prefills `prompt` on `prefill` and generates it on `decode` from that KV.
async fn disaggregated(
    prefill: &mut Worker,
    decode: &mut Worker,
    prompt: &[u32],
) -> Result<Vec<u32>, tonic::Status> {
    let address = prefill.addr;
    disaggregated_via(prefill, address, decode, prompt).await
}

/// [`disaggregated`], with the decode worker pulling from `pull_from` (the prefill worker, or a
/// proxy in front of it).
async fn disaggregated_via(
    prefill: &mut Worker,
    pull_from: SocketAddr,
    decode: &mut Worker,
    prompt: &[u32],
) -> Result<Vec<u32>, tonic::Status> {
    let pre = prefill
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p".into(),
            prompt_token_ids: prompt.to_vec(),
            hold_ms: 0,
            pipelined: false,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    let request = GenerateRequest {
        request_id: "d".into(),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(SamplingParams {
            max_tokens: 3,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source: Some(KvSource {
            address: pull_from.to_string(),
            handle: pre.handle,
            first_token_id: pre.first_token_id,
            cached_prompt_tokens: pre.cached_prompt_tokens,
            ..Default::default()
        }),
        identity: None,
        retention: Default::default(),
        priority: None,
    };
    let mut stream = decode.client.generate(request).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(message) = stream.next().await {
        tokens.extend(message?.token_ids);
    }
    Ok(tokens)
}

/// `switchyard_worker_kv_transfer_descriptors_total{stage}` on `worker` (0 when absent).
async fn descriptors(worker: &Worker, stage: &str) -> f64 {
    let scrape = worker.scrape().await;
    sample(
        &scrape,
        "switchyard_worker_kv_transfer_descriptors_total",
        &[("stage", stage)],
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn the_decode_worker_plans_from_the_layout_the_prefill_worker_announces() {
    let mut prefill = start(config("prefill-tp1", Role::Prefill, 1)).await;
    // TP=2 and nothing said about the prefill side: before the announcement this planned
    // TP2 → TP2 (2 regions a block); now it must plan the strided TP1 → TP2 copy.
    let mut decode = start(config("decode-tp2", Role::Decode, 2)).await;
    // TP=2 configured with a wrong guess of the prefill side: the announcement wins.
    let mut wrong = config("decode-tp2-misconfigured", Role::Decode, 2);
    wrong.kv_transfer.prefill_tensor_parallel = Some(2);
    let mut misconfigured = start(wrong).await;

    for (n, worker) in [&mut decode, &mut misconfigured].into_iter().enumerate() {
        let p = prompt(20 * BLOCK, n as u32);
        let tokens = disaggregated(&mut prefill, worker, &p).await.unwrap();
        assert_eq!(tokens.len(), 3);
        assert_eq!(
            descriptors(worker, "planned").await,
            20.0 * STRIDED_FRAGMENTS_PER_BLOCK,
            "20 blocks planned as TP1 → TP2"
        );
        // Coalesced through the staging area into a handful, far below one per fragment.
        let issued = descriptors(worker, "issued").await;
        assert!(
            (2.0..20.0 * MATCHING_FRAGMENTS_PER_BLOCK).contains(&issued),
            "{issued}"
        );
    }
    for w in [prefill, decode, misconfigured] {
        w.shutdown.cancel();
    }
}

#[tokio::test]
async fn matching_splits_still_move_whole_regions() {
    let mut prefill = start(config("prefill-tp2", Role::Prefill, 2)).await;
    // Configured as if the prefill side ran TP=1: the announced TP=2 is what counts.
    let mut c = config("decode-tp2", Role::Decode, 2);
    c.kv_transfer.prefill_tensor_parallel = Some(1);
    let mut decode = start(c).await;
    disaggregated(&mut prefill, &mut decode, &prompt(20 * BLOCK, 7))
        .await
        .unwrap();
    assert_eq!(
        descriptors(&decode, "planned").await,
        20.0 * MATCHING_FRAGMENTS_PER_BLOCK
    );
    for w in [prefill, decode] {
        w.shutdown.cancel();
    }
}

#[tokio::test]
async fn a_layout_of_another_model_shape_is_refused_naming_both_sides() {
    let mut deep = config("prefill-40-layers", Role::Prefill, 1);
    deep.kv_layout.layers = 40;
    let mut prefill = start(deep).await;
    let mut decode = start(config("decode", Role::Decode, 1)).await;
    let status = disaggregated(&mut prefill, &mut decode, &prompt(10 * BLOCK, 9))
        .await
        .expect_err("another model shape's KV is refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(fault_of(&status), Some(Fault::KvLayout));
    let message = status.message();
    assert!(
        message.contains(&format!(
            "prefill worker {} holds KV for 40 layers",
            prefill.addr
        )),
        "{message}"
    );
    assert!(
        message.contains("this decode worker holds 32 layers"),
        "{message}"
    );
    let scrape = decode.scrape().await;
    assert_eq!(
        sample(
            &scrape,
            "switchyard_worker_kv_pull_failures_total",
            &[("reason", "layout_mismatch")]
        ),
        Some(1.0)
    );
    // Nothing was imported.
    assert_eq!(descriptors(&decode, "planned").await, 0.0);
    for w in [prefill, decode] {
        w.shutdown.cancel();
    }
}

async fn start(config: WorkerConfig) -> Worker {
    spawn_worker(config, None).await
}

type Chunks = Pin<Box<dyn Stream<Item = Result<v1::KvChunk, Status>> + Send + 'static>>;

/// A prefill worker from before the announcement: forwards `PullKv` to a real one and strips
/// the layout from its chunks. Nothing else is asked of it.
struct SilentPeer {
    upstream: WorkerClient<Channel>,
}

fn not_here<T>() -> Result<T, Status> {
    Err(Status::unimplemented(
        "the silent peer only forwards PullKv",
    ))
}

#[tonic::async_trait]
impl WorkerRpc for SilentPeer {
    type GenerateStream =
        Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send + 'static>>;
    type PullKvStream = Chunks;
    type KvEventsStream =
        Pin<Box<dyn Stream<Item = Result<v1::KvEventsResponse, Status>> + Send + 'static>>;
    type LoadStatsStream =
        Pin<Box<dyn Stream<Item = Result<v1::LoadReport, Status>> + Send + 'static>>;

    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::WorkerInfo>, Status> {
        not_here()
    }
    async fn generate(
        &self,
        _: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        not_here()
    }
    async fn prefill(
        &self,
        _: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        not_here()
    }
    async fn pull_kv(
        &self,
        request: Request<v1::PullKvRequest>,
    ) -> Result<Response<Chunks>, Status> {
        let chunks = self
            .upstream
            .clone()
            .pull_kv(request.into_inner())
            .await?
            .into_inner()
            .map(|chunk| chunk.map(|c| v1::KvChunk { layout: None, ..c }));
        Ok(Response::new(Box::pin(chunks)))
    }
    async fn kv_events(
        &self,
        _: Request<v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        not_here()
    }
    async fn load_stats(
        &self,
        _: Request<v1::LoadStatsRequest>,
    ) -> Result<Response<Self::LoadStatsStream>, Status> {
        not_here()
    }
    async fn control(
        &self,
        _: Request<v1::ControlRequest>,
    ) -> Result<Response<v1::ControlResponse>, Status> {
        not_here()
    }
}

/// Serves a [`SilentPeer`] in front of `upstream` on a loopback port until `stop`.
async fn silent_peer(upstream: &Worker, stop: CancellationToken) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = SilentPeer {
        upstream: upstream.client.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServer::new(peer))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.cancelled_owned(),
            ),
    );
    addr
}

#[tokio::test]
async fn a_source_that_announces_nothing_is_planned_from_the_configured_split() {
    let mut prefill = start(config("prefill-tp1", Role::Prefill, 1)).await;
    let stop = CancellationToken::new();
    let silent = silent_peer(&prefill, stop.clone()).await;
    // Told the truth about the (silent) prefill side: the strided TP1 → TP2 plan.
    let mut told = config("decode-told", Role::Decode, 2);
    told.kv_transfer.prefill_tensor_parallel = Some(1);
    let mut told = start(told).await;
    // Told nothing: it assumes its own split, as it always did.
    let mut untold = start(config("decode-untold", Role::Decode, 2)).await;

    disaggregated_via(&mut prefill, silent, &mut told, &prompt(20 * BLOCK, 11))
        .await
        .unwrap();
    assert_eq!(
        descriptors(&told, "planned").await,
        20.0 * STRIDED_FRAGMENTS_PER_BLOCK
    );
    disaggregated_via(&mut prefill, silent, &mut untold, &prompt(20 * BLOCK, 12))
        .await
        .unwrap();
    assert_eq!(
        descriptors(&untold, "planned").await,
        20.0 * MATCHING_FRAGMENTS_PER_BLOCK
    );
    stop.cancel();
    for w in [prefill, told, untold] {
        w.shutdown.cancel();
    }
}
