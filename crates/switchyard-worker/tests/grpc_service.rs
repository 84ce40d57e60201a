//! The worker agent over real gRPC on loopback: prefill and KV pull, hold expiry, cancellation,
//! control (role, drain, resume) and its reflection in the registry, load stats, bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::sync::Arc;
use std::time::Duration;

use crate::support;

use futures::StreamExt;
use support::{InProcessWorker, spawn_worker};
use switchyard_core::{BlockSize, Role, WorkerId, block_hashes};
use switchyard_proto::v1::{
    self, ControlRequest, GenerateRequest, KvHandle, PrefillRequest, PullKvRequest, SamplingParams,
    control_request::Command,
};
use switchyard_registry::{MemoryRegistry, Registry};
use switchyard_worker::WorkerConfig;
use tonic::Code;

/// A worker with the in-memory registry it registered in.
struct Harness {
    worker: InProcessWorker,
    registry: Arc<MemoryRegistry>,
}

impl std::ops::Deref for Harness {
    type Target = InProcessWorker;
    fn deref(&self) -> &InProcessWorker {
        &self.worker
    }
}

impl std::ops::DerefMut for Harness {
    fn deref_mut(&mut self) -> &mut InProcessWorker {
        &mut self.worker
    }
}

async fn start_worker(role: Role) -> Harness {
    start_worker_at(role, 100.0).await
}

async fn start_worker_at(role: Role, speedup: f64) -> Harness {
    let mut config = WorkerConfig {
        id: Some("worker-t".into()),
        role,
        speedup,
        lease_ttl_secs: 5,
        drain_timeout_secs: 5,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 128;
    config.sim.max_context_tokens = 8192;
    let registry = Arc::new(MemoryRegistry::new());
    let worker = spawn_worker(config, Some(registry.clone() as Arc<dyn Registry>)).await;
    Harness { worker, registry }
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 500 + i * 3).collect()
}

fn gen_req(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "r".into(),
        prompt_token_ids: prompt,
        sampling: Some(SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        kv_source: None,
        identity: None,
        retention: None,
    }
}

#[tokio::test]
async fn prefill_holds_blocks_until_pulled_once() {
    let mut h = start_worker(Role::Prefill).await;
    let tokens = prompt(100);
    let resp = h
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p1".into(),
            prompt_token_ids: tokens.clone(),
            hold_ms: 60_000,
            pipelined: false,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    let expected: Vec<u64> = block_hashes(&tokens, BlockSize::new(16).unwrap())
        .iter()
        .map(|h| h.get())
        .collect();
    assert_eq!(resp.block_hashes, expected);
    assert_eq!(resp.prompt_tokens, 100);
    let handle = resp.handle.expect("handle");
    // Held blocks stay referenced.
    assert!(h.load().await.active_blocks >= 6);

    let mut pull = h
        .client
        .pull_kv(PullKvRequest {
            handle: Some(handle.clone()),
            blocks_per_chunk: 4,
        })
        .await
        .expect("pull")
        .into_inner();
    let mut pulled = Vec::new();
    let mut chunks = 0;
    let mut saw_last = false;
    while let Some(chunk) = pull.next().await {
        let chunk = chunk.expect("chunk");
        assert_eq!(chunk.first_block as usize, pulled.len());
        assert_eq!(chunk.bytes, chunk.blocks.len() as u64 * 16 * 131_072);
        saw_last = chunk.last;
        pulled.extend(chunk.blocks);
        chunks += 1;
    }
    assert!(saw_last);
    assert_eq!(chunks, 2, "6 blocks in chunks of 4");
    let pulled_hashes: Vec<u64> = pulled.iter().map(|b| b.hash).collect();
    assert_eq!(pulled_hashes, expected);
    assert_eq!(pulled[1].token_ids, tokens[16..32].to_vec());

    // A handle is pulled once.
    let err = h
        .client
        .pull_kv(PullKvRequest {
            handle: Some(handle),
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("second pull refused");
    assert_eq!(err.code(), Code::NotFound);
    // After the pull, nothing stays pinned.
    let mut released = false;
    for _ in 0..100 {
        if h.load().await.active_blocks == 0 {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(released, "pulled blocks were released");
    h.worker.stop().await;
}

#[tokio::test]
async fn an_unpulled_handle_expires_and_releases_its_blocks() {
    let mut h = start_worker(Role::Both).await;
    let resp = h
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p2".into(),
            prompt_token_ids: prompt(64),
            hold_ms: 200,
            pipelined: false,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    assert!(h.load().await.active_blocks >= 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let err = h
        .client
        .pull_kv(PullKvRequest {
            handle: resp.handle,
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("expired handle");
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(h.load().await.active_blocks, 0);
    h.worker.stop().await;
}

#[tokio::test]
async fn dropping_a_generation_stream_aborts_the_request() {
    // Real time: left alone, this request would run for about 15 s.
    let mut h = start_worker_at(Role::Both, 1.0).await;
    let mut stream = h
        .client
        .generate(gen_req(prompt(32), 1500))
        .await
        .expect("generate")
        .into_inner();
    stream.next().await.expect("first token").expect("ok");
    assert_eq!(h.load().await.running_requests, 1);
    drop(stream);
    let mut aborted = false;
    for _ in 0..100 {
        if h.load().await.running_requests == 0 {
            aborted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(aborted, "the engine still runs a request nobody reads");
    h.worker.stop().await;
}

#[tokio::test]
async fn control_changes_role_drains_and_resumes() {
    let mut h = start_worker(Role::Both).await;
    let id = WorkerId::new("worker-t").unwrap();

    let resp = h
        .client
        .control(ControlRequest {
            command: Some(Command::SetRole(v1::SetRole {
                role: v1::Role::Prefill as i32,
            })),
        })
        .await
        .expect("set role")
        .into_inner();
    assert_eq!(resp.role, v1::Role::Prefill as i32);
    let err = h
        .client
        .generate(gen_req(prompt(20), 2))
        .await
        .expect_err("prefill worker refuses generate");
    assert_eq!(err.code(), Code::FailedPrecondition);
    // The registry follows the role.
    let mut recorded = false;
    for _ in 0..100 {
        let workers = h.registry.list_workers().await.unwrap();
        if workers
            .iter()
            .any(|w| w.id == id && w.role == Role::Prefill)
        {
            recorded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recorded, "registry entry shows the new role");

    h.client
        .control(ControlRequest {
            command: Some(Command::SetRole(v1::SetRole {
                role: v1::Role::Both as i32,
            })),
        })
        .await
        .expect("set role back");
    let drained = h
        .client
        .control(ControlRequest {
            command: Some(Command::Drain(v1::Drain { wait_ms: 1000 })),
        })
        .await
        .expect("drain")
        .into_inner();
    assert!(drained.draining);
    assert_eq!(drained.in_flight, 0);
    let err = h
        .client
        .generate(gen_req(prompt(20), 2))
        .await
        .expect_err("draining worker refuses work");
    assert_eq!(err.code(), Code::Unavailable);
    // The worker itself refuses: nothing to blame on a KV source.
    assert_eq!(switchyard_proto::fault::fault_of(&err), None, "{err:?}");
    let info = h
        .client
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(info.draining);

    h.client
        .control(ControlRequest {
            command: Some(Command::Resume(v1::Resume {})),
        })
        .await
        .expect("resume");
    let mut stream = h
        .client
        .generate(gen_req(prompt(20), 2))
        .await
        .expect("accepts again")
        .into_inner();
    let mut n = 0;
    while let Some(msg) = stream.next().await {
        n += msg.expect("ok").token_ids.len();
    }
    assert_eq!(n, 2);

    let err = h
        .client
        .control(ControlRequest { command: None })
        .await
        .expect_err("empty control");
    assert_eq!(err.code(), Code::InvalidArgument);
    h.worker.stop().await;
}

#[tokio::test]
async fn bad_prefill_and_pull_requests_are_invalid_arguments() {
    let mut h = start_worker(Role::Both).await;
    let err = h
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "x".into(),
            prompt_token_ids: vec![],
            hold_ms: 0,
            pipelined: false,
            identity: None,
            retention: None,
            sampling: None,
        })
        .await
        .expect_err("empty prompt");
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = h
        .client
        .pull_kv(PullKvRequest {
            handle: None,
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("no handle");
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = h
        .client
        .pull_kv(PullKvRequest {
            handle: Some(KvHandle { id: "nope".into() }),
            blocks_per_chunk: 0,
        })
        .await
        .expect_err("unknown handle");
    assert_eq!(err.code(), Code::NotFound);
    let err = h
        .client
        .generate(GenerateRequest {
            priority: None,
            request_id: "x".into(),
            prompt_token_ids: prompt(4),
            sampling: Some(SamplingParams {
                max_tokens: 1,
                temperature: Some(f32::NAN),
                ..Default::default()
            }),
            kv_source: None,
            identity: None,
            retention: None,
        })
        .await
        .expect_err("nan temperature");
    assert_eq!(err.code(), Code::InvalidArgument);
    h.worker.stop().await;
}

#[tokio::test]
async fn a_worker_registers_its_adapters_and_refuses_any_other() {
    let mut config = WorkerConfig {
        id: Some("worker-lora".into()),
        lora_adapters: vec!["sql-lora".into()],
        speedup: 100.0,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    let registry = Arc::new(MemoryRegistry::new());
    let mut worker = spawn_worker(config, Some(registry.clone() as Arc<dyn Registry>)).await;
    let listed = registry.list_workers().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].adapters, ["sql-lora"]);
    let under = |adapter: &str| GenerateRequest {
        identity: Some(v1::KvIdentity {
            adapter: Some(adapter.into()),
            cache_salt: None,
        }),
        ..gen_req(prompt(40), 2)
    };
    let mut stream = worker
        .client
        .generate(under("sql-lora"))
        .await
        .expect("a served adapter runs")
        .into_inner();
    while let Some(chunk) = stream.next().await {
        chunk.expect("chunk");
    }
    let err = worker
        .client
        .generate(under("chat-lora"))
        .await
        .expect_err("an adapter the engine does not serve");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("\"chat-lora\"") && err.message().contains("sql-lora"),
        "{err:?}"
    );
    let err = worker
        .client
        .prefill(PrefillRequest {
            priority: None,
            request_id: "p".into(),
            prompt_token_ids: prompt(40),
            hold_ms: 0,
            pipelined: false,
            identity: Some(v1::KvIdentity {
                adapter: Some("chat-lora".into()),
                cache_salt: None,
            }),
            retention: None,
            sampling: None,
        })
        .await
        .expect_err("nor prefills under it");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    worker.stop().await;
}

#[tokio::test]
async fn shutdown_waits_for_in_flight_requests_and_deregisters() {
    let mut h = start_worker(Role::Both).await;
    let mut stream = h
        .client
        .generate(gen_req(prompt(16), 40))
        .await
        .expect("generate")
        .into_inner();
    stream.next().await.expect("first").expect("ok");
    h.shutdown.cancel();
    // The in-flight request still finishes.
    let mut tokens = 1;
    let mut finish = 0;
    while let Some(msg) = stream.next().await {
        let msg = msg.expect("stream continues during drain");
        tokens += msg.token_ids.len();
        finish = msg.finish_reason;
    }
    assert_eq!(tokens, 40);
    assert_eq!(finish, v1::FinishReason::Length as i32);
    h.worker.task.await.expect("join").expect("clean shutdown");
    assert!(h.registry.list_workers().await.unwrap().is_empty());
}
