//! Pipelined KV transfer between real workers over loopback gRPC: the prefill worker answers at
//! once and streams each prefill chunk's blocks as it is computed; the decode worker imports
//! them chunk by chunk. A prefill worker cut off or hung mid-pipeline fails the decode request
//! as unavailable, and neither side keeps anything pinned.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::net::SocketAddr;
use std::time::Duration;

use crate::support;

use futures::StreamExt;
use support::{InProcessWorker as Worker, spawn_worker};
use switchyard_core::{BlockSize, Role, block_hashes};
use switchyard_proto::fault::{Fault, fault_of};
use switchyard_proto::v1::{
    self, GenerateRequest, KvEventsRequest, KvSource, PrefillRequest, PullKvRequest,
    SamplingParams, kv_event, kv_events_response,
};
use switchyard_worker::WorkerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tonic::Code;

/// 8 blocks per prefill step, real time: a 4096-token prompt prefills in 32 steps of about
/// 16 ms, long enough to watch it stream.
async fn start(id: &str, role: Role, pull_timeout_ms: u64) -> Worker {
    let mut config = WorkerConfig {
        id: Some(id.into()),
        role,
        speedup: 1.0,
        drain_timeout_secs: 5,
        kv_pull_timeout_ms: pull_timeout_ms,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 1024;
    config.sim.max_batched_tokens = 128;
    config.sim.max_context_tokens = 8192;
    spawn_worker(config, None).await
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 300 + i * 11).collect()
}

async fn prefill(worker: &mut Worker, prompt: &[u32], pipelined: bool) -> v1::PrefillResponse {
    worker
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p".into(),
            prompt_token_ids: prompt.to_vec(),
            hold_ms: 0,
            pipelined,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner()
}

fn generate(prompt: &[u32], address: String, pre: &v1::PrefillResponse) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "d".into(),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(SamplingParams {
            max_tokens: 5,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source: Some(KvSource {
            address,
            handle: pre.handle.clone(),
            first_token_id: pre.first_token_id,
            cached_prompt_tokens: pre.cached_prompt_tokens,
            pipelined: pre.pipelined,
            ..Default::default()
        }),
        identity: None,
        retention: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_prefill_streams_each_chunk_as_it_is_computed() {
    let mut a = start("prefill-a", Role::Prefill, 30_000).await;
    let mut reference = start("prefill-ref", Role::Prefill, 30_000).await;
    let p = prompt(4096);
    let pre = prefill(&mut a, &p, true).await;
    assert!(pre.pipelined);
    assert_eq!(pre.block_hashes.len(), 256);
    let mut chunks = a
        .client
        .pull_kv(PullKvRequest {
            handle: pre.handle.clone(),
            blocks_per_chunk: 0,
        })
        .await
        .expect("pull")
        .into_inner();
    let first = chunks.next().await.expect("a chunk").expect("ok");
    // The first blocks arrive while the prefill is still running.
    assert!(!first.blocks.is_empty() && !first.last);
    let load = a.load().await;
    assert_eq!(load.running_requests, 1, "{load:?}");
    let mut received = vec![first];
    while !received.last().unwrap().last {
        received.push(chunks.next().await.expect("chunk").expect("ok"));
    }
    // One chunk per prefill step (8 blocks each), not one list at the end.
    assert!(received.len() >= 32, "{} chunks", received.len());
    let mut next = 0;
    for chunk in &received {
        assert_eq!(chunk.first_block, next);
        next += chunk.blocks.len() as u32;
        assert_eq!(chunk.first_token_id.is_some(), chunk.last);
    }
    let hashes: Vec<u64> = received
        .iter()
        .flat_map(|c| c.blocks.iter().map(|b| b.hash))
        .collect();
    assert_eq!(hashes, pre.block_hashes);
    // The token is the one a prefill that is not pipelined samples (same seed, same id).
    let plain = prefill(&mut reference, &p, false).await;
    assert!(!plain.pipelined);
    let last = received.last().unwrap();
    assert_eq!(last.first_token_id, Some(plain.first_token_id));
    assert_eq!(last.cached_prompt_tokens, plain.cached_prompt_tokens);
    drop(chunks);
    a.stop().await;
    reference.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_imports_a_pipelined_prefill_chunk_by_chunk_and_announces_it() {
    let mut a = start("prefill-a", Role::Prefill, 30_000).await;
    let mut b = start("decode-b", Role::Decode, 30_000).await;
    let p = prompt(2048);
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
    let pre = prefill(&mut a, &p, true).await;
    let mut stream = b
        .client
        .generate(generate(&p, a.addr.to_string(), &pre))
        .await
        .expect("generate")
        .into_inner();
    let mut out = Vec::new();
    while let Some(message) = stream.next().await {
        out.push(message.expect("ok"));
    }
    let tokens: Vec<u32> = out.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!(tokens.len(), 5, "{out:?}");
    assert_eq!(out[0].prompt_tokens, 2048);

    // B announced the blocks as they came: several Stored events, chained, covering them all.
    let mut seen = Vec::new();
    let mut stored_events = 0;
    tokio::time::timeout(Duration::from_secs(5), async {
        while seen.len() < hashes.len() {
            let message = events.next().await.expect("event").expect("ok");
            if let Some(kv_events_response::Payload::Event(v1::KvEvent {
                kind: Some(kv_event::Kind::Stored(stored)),
                ..
            })) = message.payload
            {
                stored_events += 1;
                seen.extend(stored.blocks.iter().map(|b| b.hash));
            }
        }
    })
    .await
    .expect("B's events show the transferred blocks");
    let want: Vec<u64> = hashes.iter().map(|h| h.get()).collect();
    assert_eq!(seen[..want.len()], want[..]);
    assert!(stored_events > 1, "imported chunk by chunk");
    // The continuation hit the imported blocks; nothing stays held on either side.
    let load = b.load().await;
    assert!(load.cached_prompt_tokens_total >= 2048, "{load:?}");
    assert_eq!(load.active_blocks, 0, "{load:?}");
    assert_eq!(a.load().await.active_blocks, 0);
    drop(events);
    a.stop().await;
    b.stop().await;
}

/// What the proxy between the decode and the prefill worker does with the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Forward,
    /// Keeps the connections open but passes nothing: a hung prefill worker.
    Freeze,
    /// Closes every connection: a dead prefill worker.
    Cut,
}

async fn proxy(target: SocketAddr) -> (SocketAddr, watch::Sender<Link>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (link_tx, link_rx) = watch::channel(Link::Forward);
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(target).await else {
                continue;
            };
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            let (up, down) = (link_rx.clone(), link_rx.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = copy(ir, ow, up) => {}
                    _ = copy(or, iw, down) => {}
                }
            });
        }
    });
    (addr, link_tx)
}

async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: watch::Receiver<Link>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            changed = link.changed() => {
                if changed.is_err() || *link.borrow() == Link::Cut {
                    return;
                }
                continue;
            }
        };
        loop {
            let state = *link.borrow();
            match state {
                Link::Forward => break,
                Link::Cut => return,
                Link::Freeze => {
                    if link.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until the decode worker holds some imported blocks: the pipeline is mid-way.
async fn until_mid_pipeline(b: &mut Worker, a: &mut Worker) {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if b.load().await.active_blocks > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the decode worker starts importing");
    assert_eq!(a.load().await.running_requests, 1, "the prefill still runs");
}

async fn nothing_held(worker: &mut Worker) -> bool {
    for _ in 0..200 {
        let load = worker.load().await;
        if load.active_blocks == 0 && load.running_requests == 0 && load.waiting_requests == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_lost_mid_pipeline_fails_the_pull_and_frees_both_sides() {
    for link in [Link::Cut, Link::Freeze] {
        let mut a = start("prefill-a", Role::Prefill, 30_000).await;
        let mut b = start("decode-b", Role::Decode, 500).await;
        let (via, link_tx) = proxy(a.addr).await;
        let p = prompt(4096);
        let pre = prefill(&mut a, &p, true).await;
        let mut client = b.client.clone();
        let request = generate(&p, via.to_string(), &pre);
        let call = tokio::spawn(async move {
            let mut stream = client.generate(request).await?.into_inner();
            while let Some(message) = stream.next().await {
                message?;
            }
            Ok::<_, tonic::Status>(())
        });
        until_mid_pipeline(&mut b, &mut a).await;
        link_tx.send(link).unwrap();
        let err = call.await.unwrap().expect_err("the pull cannot finish");
        assert_eq!(err.code(), Code::Unavailable, "{link:?}: {err:?}");
        assert!(err.message().starts_with("pulling kv"), "{err:?}");
        assert_eq!(fault_of(&err), Some(Fault::KvSource), "{link:?}: {err:?}");
        // The decode side released what it had imported; nothing runs there.
        assert!(nothing_held(&mut b).await, "{link:?}: {:?}", b.load().await);
        if link == Link::Cut {
            // The prefill worker saw its puller go: it aborted the prefill and released the
            // hold. (A frozen link keeps the connection, so the prefill finishes into it.)
            assert!(nothing_held(&mut a).await, "{:?}", a.load().await);
        }
        drop(link_tx);
        a.shutdown.cancel();
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpulled_pipelined_handle_expires_and_stops_the_prefill() {
    let mut a = start("prefill-a", Role::Prefill, 30_000).await;
    let pre = a
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p".into(),
            prompt_token_ids: prompt(4096),
            hold_ms: 50,
            pipelined: true,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    assert!(pre.pipelined);
    let mut running = false;
    for _ in 0..100 {
        if a.load().await.running_requests == 1 {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(running, "the prefill runs");
    // Nobody pulls: the hold expires while the prefill still runs, which aborts it.
    assert!(nothing_held(&mut a).await, "{:?}", a.load().await);
    let err = a
        .client
        .pull_kv(PullKvRequest {
            handle: pre.handle,
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("expired");
    assert_eq!(err.code(), Code::NotFound);
    a.stop().await;
}
