//! TTFT of one prompt on an idle cluster, aggregated (prefill and decode on one worker) against
//! disaggregated (Prefill on a prefill worker, then Generate with a `KvSource` on a decode
//! worker, which pulls and imports the KV and charges its transfer). Ignored by default: it is a
//! measurement, run by hand (see docs/BENCHMARKS.md "Disaggregation"):
//!
//! ```text
//! cargo test --release -p switchyard-worker --test disagg_ttft -- --ignored --nocapture
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::net::SocketAddr;
use std::time::Instant;

use futures::StreamExt;
use switchyard_core::{BlockSize, Role};
use switchyard_proto::v1::{
    GenerateRequest, KvSource, PrefillRequest, SamplingParams, worker_client::WorkerClient,
};
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Simulated time runs this much faster than real time; measured times are scaled back.
const SPEEDUP: f64 = 5.0;

async fn start(id: &str, role: Role) -> (SocketAddr, WorkerClient<Channel>, CancellationToken) {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup: SPEEDUP,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 8192;
    config.sim.max_context_tokens = 40_000;
    let shutdown = CancellationToken::new();
    let (ready_tx, ready_rx) = oneshot::channel();
    tokio::spawn(switchyard_worker::run(
        config,
        None,
        shutdown.clone(),
        move |running| {
            let _ = ready_tx.send(running.local_addr);
        },
    ));
    let addr = ready_rx.await.expect("worker ready");
    let client = WorkerClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    (addr, client, shutdown)
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

fn request(prompt: Vec<u32>, kv_source: Option<KvSource>) -> GenerateRequest {
    GenerateRequest {
        request_id: "bench".into(),
        prompt_token_ids: prompt,
        sampling: Some(SamplingParams {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source,
    }
}

/// Simulated milliseconds from `start` to the first token of `req` on `client`.
async fn first_token_ms(
    client: &mut WorkerClient<Channel>,
    req: GenerateRequest,
    start: Instant,
) -> f64 {
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let first = stream.next().await.expect("first").expect("ok");
    assert!(!first.token_ids.is_empty());
    let ms = start.elapsed().as_secs_f64() * 1_000.0 * SPEEDUP;
    while stream.next().await.is_some() {}
    ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement; run by hand"]
async fn ttft_aggregated_vs_disaggregated() {
    let (_, mut both, s1) = start("both", Role::Both).await;
    let (prefill_addr, mut prefill, s2) = start("prefill", Role::Prefill).await;
    let (_, mut decode, s3) = start("decode", Role::Decode).await;
    println!(
        "| prompt tokens | aggregated TTFT (ms) | disaggregated TTFT (ms) | of which KV pull + transfer (ms) |"
    );
    println!("|---:|---:|---:|---:|");
    for (i, len) in [8_192u32, 32_768].into_iter().enumerate() {
        let seed = i as u32 * 3;
        let aggregated =
            first_token_ms(&mut both, request(prompt(seed, len), None), Instant::now()).await;
        let p = prompt(seed + 1, len);
        let start = Instant::now();
        let pre = prefill
            .prefill(PrefillRequest {
                request_id: "bench".into(),
                prompt_token_ids: p.clone(),
                hold_ms: 0,
                pipelined: false,
            })
            .await
            .expect("prefill")
            .into_inner();
        let prefill_ms = start.elapsed().as_secs_f64() * 1_000.0 * SPEEDUP;
        let source = KvSource {
            address: prefill_addr.to_string(),
            handle: pre.handle,
            first_token_id: pre.first_token_id,
            cached_prompt_tokens: pre.cached_prompt_tokens,
            ..Default::default()
        };
        let disaggregated = first_token_ms(&mut decode, request(p, Some(source)), start).await;
        println!(
            "| {len} | {aggregated:.0} | {disaggregated:.0} | {:.0} |",
            disaggregated - prefill_ms
        );
    }
    for s in [s1, s2, s3] {
        s.cancel();
    }
}
