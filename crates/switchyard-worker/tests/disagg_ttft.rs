//! TTFT of one prompt on an idle cluster: aggregated (prefill and decode on one worker) against
//! disaggregated (Prefill on a prefill worker, then Generate with a `KvSource` on a decode
//! worker, which pulls and imports the KV and charges its transfer), with the KV moved after the
//! prefill or pipelined chunk by chunk while it runs; and, for a prefill at TP=1 feeding a
//! decode worker at TP=2, the transfer descriptors per request with and without coalescing and
//! what they cost in TTFT. Ignored by default: it is a measurement, run by hand (see
//! docs/BENCHMARKS.md "Disaggregation"):
//!
//! ```text
//! cargo test --release -p switchyard-worker --test it disagg_ttft -- --ignored --nocapture
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::net::SocketAddr;
use std::time::Instant;

use futures::StreamExt;
use switchyard_core::{BlockSize, Role};
use switchyard_engine_sim::StagingArea;
use switchyard_proto::v1::{
    GenerateRequest, KvSource, PrefillRequest, SamplingParams, worker_client::WorkerClient,
};
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Simulated time runs this much faster than real time; measured times are scaled back.
const SPEEDUP: f64 = 5.0;

/// Blocks per `KvChunk` (the worker's default): the unit the decode worker plans and imports.
const BLOCKS_PER_CHUNK: u32 = 32;

fn config(id: &str, role: Role) -> WorkerConfig {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup: SPEEDUP,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 20_000;
    config.sim.max_context_tokens = 140_000;
    config
}

struct Worker {
    addr: SocketAddr,
    client: WorkerClient<Channel>,
    shutdown: CancellationToken,
}

async fn start(config: WorkerConfig) -> Worker {
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
    Worker {
        addr,
        client,
        shutdown,
    }
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + (seed * 7919 + i * 13) % 20000)
        .collect()
}

fn request(prompt: Vec<u32>, kv_source: Option<KvSource>) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "bench".into(),
        prompt_token_ids: prompt,
        sampling: Some(SamplingParams {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source,
        identity: None,
        retention: None,
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

/// TTFT of a disaggregated request: Prefill on `prefill`, then Generate on `decode`.
async fn disaggregated_ms(
    prefill: &mut Worker,
    decode: &mut Worker,
    p: Vec<u32>,
    pipelined: bool,
) -> f64 {
    let start = Instant::now();
    let pre = prefill
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "bench".into(),
            prompt_token_ids: p.clone(),
            hold_ms: 0,
            pipelined,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    assert_eq!(pre.pipelined, pipelined);
    let source = KvSource {
        address: prefill.addr.to_string(),
        handle: pre.handle,
        first_token_id: pre.first_token_id,
        cached_prompt_tokens: pre.cached_prompt_tokens,
        pipelined: pre.pipelined,
        ..Default::default()
    };
    first_token_ms(&mut decode.client, request(p, Some(source)), start).await
}

/// Descriptors of moving `tokens` into a worker configured as `config`, planned chunk by chunk
/// as its imports plan them: (without coalescing, with).
fn descriptors(config: &WorkerConfig, tokens: u32) -> (u64, u64) {
    let setup = config.transfer_setup();
    let mut staging = StagingArea::new(setup.staging_bytes);
    let mut blocks = tokens / 16;
    let (mut raw, mut coalesced) = (0, 0);
    while blocks > 0 {
        let n = blocks.min(BLOCKS_PER_CHUNK);
        let plan = staging.plan(&setup.source, &setup.dest, 16, n);
        raw += plan.raw_descriptors;
        coalesced += plan.descriptors;
        blocks -= n;
    }
    (raw, coalesced)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement; run by hand"]
async fn ttft_aggregated_vs_disaggregated() {
    let mut both = start(config("both", Role::Both)).await;
    let mut prefill = start(config("prefill", Role::Prefill)).await;
    let mut decode = start(config("decode", Role::Decode)).await;
    // Decode at TP=2 pulling from prefill at TP=1: every block splits into strided head groups.
    let tp2 = |id: &str, coalesce: bool| {
        let mut c = config(id, Role::Decode);
        c.kv_layout.tensor_parallel = 2;
        c.kv_transfer.prefill_tensor_parallel = Some(1);
        c.kv_transfer.coalesce = coalesce;
        c
    };
    let mut tp2_raw = start(tp2("decode-tp2-raw", false)).await;
    let mut tp2_coalesced = start(tp2("decode-tp2", true)).await;
    let lengths = [8_192u32, 32_768, 131_072];
    let mut seed = 0;
    let mut fresh = |len| {
        seed += 1;
        prompt(seed, len)
    };

    println!(
        "| prompt tokens | aggregated TTFT (ms) | disaggregated, after prefill (ms) | disaggregated, pipelined (ms) |"
    );
    println!("|---:|---:|---:|---:|");
    for len in lengths {
        let aggregated =
            first_token_ms(&mut both.client, request(fresh(len), None), Instant::now()).await;
        let after = disaggregated_ms(&mut prefill, &mut decode, fresh(len), false).await;
        let pipelined = disaggregated_ms(&mut prefill, &mut decode, fresh(len), true).await;
        println!("| {len} | {aggregated:.0} | {after:.0} | {pipelined:.0} |");
    }

    println!();
    println!(
        "| prompt tokens | layouts (prefill → decode) | descriptors, raw | descriptors, coalesced | pipelined TTFT, raw (ms) | pipelined TTFT, coalesced (ms) |"
    );
    println!("|---:|---|---:|---:|---:|---:|");
    for len in lengths {
        let (raw, coalesced) = descriptors(&config("decode", Role::Decode), len);
        println!("| {len} | TP1 → TP1 | {raw} | {coalesced} | | |");
        let (raw, coalesced) = descriptors(&tp2("decode-tp2", true), len);
        let slow = disaggregated_ms(&mut prefill, &mut tp2_raw, fresh(len), true).await;
        let fast = disaggregated_ms(&mut prefill, &mut tp2_coalesced, fresh(len), true).await;
        println!("| {len} | TP1 → TP2 | {raw} | {coalesced} | {slow:.0} | {fast:.0} |");
    }
    for w in [both, prefill, decode, tp2_raw, tp2_coalesced] {
        w.shutdown.cancel();
    }
}
