//! Disaggregated serving between two real workers over loopback gRPC: worker A prefills and
//! holds, worker B generates with a `KvSource` naming A, pulls the blocks, announces them in
//! its own KV events and continues after A's first token.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::time::Duration;

use crate::support;

use futures::StreamExt;
use support::{InProcessWorker as Worker, spawn_worker};
use switchyard_core::{BlockSize, Role, block_hashes};
use switchyard_proto::fault::{Fault, fault_of};
use switchyard_proto::v1::{
    self, GenerateRequest, KvEventsRequest, KvHandle, KvSource, PrefillRequest, PullKvRequest,
    SamplingParams, kv_event, kv_events_response, worker_client::WorkerClient,
};
use switchyard_worker::WorkerConfig;
use tonic::Code;
use tonic::transport::Channel;

async fn start(id: &str, role: Role) -> Worker {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup: 100.0,
        drain_timeout_secs: 5,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 256;
    config.sim.max_context_tokens = 8192;
    spawn_worker(config, None).await
}

impl Worker {
    async fn prefill(&mut self, prompt: &[u32]) -> v1::PrefillResponse {
        self.client
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
            .into_inner()
    }
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 700 + i * 7).collect()
}

fn request(prompt: &[u32], max_tokens: u32, source: KvSource) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "d".into(),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source: Some(source),
        identity: None,
        retention: None,
    }
}

fn source(from: &Worker, prefill: &v1::PrefillResponse) -> KvSource {
    KvSource {
        address: from.addr.to_string(),
        handle: prefill.handle.clone(),
        first_token_id: prefill.first_token_id,
        cached_prompt_tokens: prefill.cached_prompt_tokens,
        ..Default::default()
    }
}

/// Every (token ids, completion tokens, cached prompt tokens, finish) message of a generation.
async fn collect(
    client: &mut WorkerClient<Channel>,
    req: GenerateRequest,
) -> Result<Vec<v1::GenerateResponse>, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(message) = stream.next().await {
        out.push(message?);
    }
    Ok(out)
}

#[tokio::test]
async fn decode_pulls_the_prefill_blocks_announces_them_and_continues_after_the_first_token() {
    let mut a = start("prefill-a", Role::Prefill).await;
    let mut b = start("decode-b", Role::Decode).await;
    let p = prompt(320); // 20 full blocks
    let hashes = block_hashes(&p, BlockSize::new(16).unwrap());
    let mut events = b
        .client
        .kv_events(KvEventsRequest {
            digest_interval_ms: 0,
            max_batch_events: 0,
            from_seq: None,
            incarnation: 0,
        })
        .await
        .expect("events")
        .into_inner();

    let pre = a.prefill(&p).await;
    assert_eq!(pre.block_hashes.len(), 20);
    let out = collect(&mut b.client, request(&p, 5, source(&a, &pre)))
        .await
        .expect("disaggregated generate");
    let tokens: Vec<u32> = out.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!(tokens.len(), 5, "{out:?}");
    assert_eq!(
        tokens[0], pre.first_token_id,
        "the prefill's token comes first"
    );
    let last = out.last().unwrap();
    assert_eq!(last.completion_tokens, 5);
    assert_eq!(last.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(out[0].prompt_tokens, 320);
    assert_eq!(out[0].cached_prompt_tokens, pre.cached_prompt_tokens);

    // B announced every prompt block as Stored on its own stream.
    let mut seen = std::collections::HashSet::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        while !hashes.iter().all(|h| seen.contains(&h.get())) {
            let message = events.next().await.expect("event").expect("ok");
            if let Some(kv_events_response::Payload::Event(v1::KvEvent {
                kind: Some(kv_event::Kind::Stored(stored)),
                ..
            })) = message.payload
            {
                seen.extend(stored.blocks.iter().map(|b| b.hash));
            }
        }
    })
    .await
    .expect("B's events show the transferred blocks");

    // B's continuation hit the imported blocks instead of recomputing the prompt.
    let load = b.load().await;
    assert!(load.cached_prompt_tokens_total >= 320, "{load:?}");
    // A's hold ended with the pull: nothing pinned, and the handle is gone.
    let load = a.load().await;
    assert_eq!(load.active_blocks, 0, "{load:?}");
    let err = a
        .client
        .pull_kv(PullKvRequest {
            handle: pre.handle.clone(),
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("handle was consumed");
    assert_eq!(err.code(), Code::NotFound);
    // An open event stream would hold B's graceful shutdown open.
    drop(events);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn one_token_requests_and_stop_tokens_end_with_the_prefill_token() {
    let mut a = start("prefill-a", Role::Prefill).await;
    let mut b = start("decode-b", Role::Decode).await;
    let p = prompt(100);
    let pre = a.prefill(&p).await;
    let out = collect(&mut b.client, request(&p, 1, source(&a, &pre)))
        .await
        .expect("generate");
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].token_ids, vec![pre.first_token_id]);
    assert_eq!(out[0].completion_tokens, 1);

    let pre = a.prefill(&p).await;
    let mut req = request(&p, 8, source(&a, &pre));
    if let Some(s) = req.sampling.as_mut() {
        s.stop_token_ids = vec![pre.first_token_id];
    }
    let out = collect(&mut b.client, req).await.expect("generate");
    assert_eq!(out.len(), 1);
    assert!(out[0].token_ids.is_empty());
    assert_eq!(out[0].finish_reason, v1::FinishReason::Stop as i32);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_missing_handle_or_a_dead_prefill_worker_is_unavailable() {
    let a = start("prefill-a", Role::Prefill).await;
    let mut b = start("decode-b", Role::Decode).await;
    let p = prompt(64);
    let bogus = KvSource {
        address: a.addr.to_string(),
        handle: Some(KvHandle {
            id: "kv-never-issued".into(),
        }),
        first_token_id: 1,
        cached_prompt_tokens: 0,
        ..Default::default()
    };
    let err = collect(&mut b.client, request(&p, 4, bogus.clone()))
        .await
        .expect_err("unknown handle");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // Over real gRPC the failure arrives marked as the prefill side's, which is what the
    // gateway goes by.
    assert_eq!(fault_of(&err), Some(Fault::KvSource), "{err:?}");

    let dead = a.addr;
    a.stop().await;
    let started = std::time::Instant::now();
    let err = collect(
        &mut b.client,
        request(
            &p,
            4,
            KvSource {
                address: dead.to_string(),
                ..bogus
            },
        ),
    )
    .await
    .expect_err("dead prefill worker");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(fault_of(&err), Some(Fault::KvSource), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Nothing stuck on B.
    assert_eq!(b.load().await.running_requests, 0);
    b.stop().await;
}
