//! End to end: a real etcd, two real `switchyard worker` processes, real gRPC over loopback.
//!
//! Checks what the foundation promises: registration with the right description, streamed
//! generation, KV events with increasing sequence numbers, resumption and snapshots, input
//! validation, drain on SIGTERM, and disappearance of a SIGKILLed worker after its lease TTL.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use futures::StreamExt;
use support::{Launch, WorkerProcess, eventually};
use switchyard_core::{Role, WorkerId};
use switchyard_proto::v1::{
    self, GenerateRequest, KvEventsRequest, SamplingParams, kv_events_response::Payload,
    worker_client::WorkerClient,
};
use switchyard_registry::{EtcdRegistry, Registry};
use switchyard_testkit::EtcdServer;
use tonic::Code;

const TTL_SECS: u64 = 2;

async fn client(worker: &WorkerProcess) -> WorkerClient<tonic::transport::Channel> {
    WorkerClient::connect(worker.endpoint())
        .await
        .expect("connect to worker")
}

fn generate_request(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        priority: None,
        request_id: "t".into(),
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

/// Generates and returns (tokens, finish reason, cached prompt tokens).
async fn generate(
    client: &mut WorkerClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> (Vec<u32>, i32, u32) {
    let mut stream = client
        .generate(generate_request(prompt, max_tokens))
        .await
        .expect("generate accepted")
        .into_inner();
    let mut tokens = Vec::new();
    let mut finish = 0;
    let mut cached = 0;
    while let Some(msg) = stream.next().await {
        let msg = msg.expect("stream item");
        if tokens.is_empty() {
            cached = msg.cached_prompt_tokens;
        }
        tokens.extend(msg.token_ids);
        if msg.finish_reason != 0 {
            finish = msg.finish_reason;
        }
    }
    (tokens, finish, cached)
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1000 + seed * 7919 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_register_generate_publish_events_and_expire() {
    let etcd = EtcdServer::start().expect("start etcd");
    let cluster = format!("e2e-{}", std::process::id());
    let ttl = TTL_SECS.to_string();
    let endpoint = etcd.endpoint();
    let common = Launch::worker(&endpoint, &cluster)
        .arg("--lease-ttl-secs", &ttl)
        .arg("--listen", "127.0.0.1:0")
        .arg("--speedup", "50")
        .arg("--block-size", "16")
        .arg("--kv-blocks", "64")
        .arg("--max-context", "4096")
        .arg("--event-buffer", "8");
    let mut a = common.clone().id("worker-a").role("both").start().await;
    let mut b = common.id("worker-b").role("decode").start().await;

    // Both are registered with what they are.
    let registry = EtcdRegistry::connect(std::slice::from_ref(&endpoint), &cluster)
        .await
        .expect("connect registry");
    let workers = registry.list_workers().await.expect("list workers");
    assert_eq!(workers.len(), 2, "{workers:?}");
    for (proc_, role) in [(&a, Role::Both), (&b, Role::Decode)] {
        let info = workers
            .iter()
            .find(|w| w.id.as_str() == proc_.id)
            .expect("worker listed");
        assert_eq!(info.address, proc_.address);
        assert_eq!(info.role, role);
        assert_eq!(info.block_size.get(), 16);
        assert_eq!(info.kv_capacity_blocks, 64);
        assert_eq!(info.max_context_tokens, 4096);
        assert_eq!(info.model, "sim-8b");
    }

    // Health: SERVING.
    let channel = tonic::transport::Endpoint::from_shared(a.endpoint())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect health");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "switchyard.v1.Worker".into(),
        })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Each streams a generation.
    let mut ca = client(&a).await;
    let mut cb = client(&b).await;
    for c in [&mut ca, &mut cb] {
        let (tokens, finish, _) = generate(c, prompt(1, 40), 12).await;
        assert_eq!(tokens.len(), 12);
        assert_eq!(finish, v1::FinishReason::Length as i32);
    }

    // Events: a fresh subscription starts with a snapshot, then live events in order.
    let mut events = ca
        .kv_events(KvEventsRequest {
            digest_interval_ms: 0,
            max_batch_events: 0,
            from_seq: None,
            incarnation: 0,
        })
        .await
        .expect("subscribe")
        .into_inner();
    let first = events.next().await.expect("first message").expect("ok");
    let incarnation = first.incarnation;
    assert_eq!(first.worker_id, "worker-a");
    let Some(Payload::Snapshot(snapshot)) = first.payload else {
        panic!("expected a snapshot first, got {:?}", first.payload)
    };
    // 40 prompt + 12 generated tokens fill 3 blocks of 16.
    assert_eq!(snapshot.blocks.len(), 3, "{snapshot:?}");
    let mut expected_seq = snapshot.next_seq;
    let (_, _, cached) = generate(&mut ca, prompt(2, 64), 4).await;
    assert_eq!(cached, 0);
    let mut stored_blocks = 0;
    while stored_blocks < 4 {
        let msg = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .expect("events keep coming")
            .expect("stream open")
            .expect("ok");
        let Some(Payload::Event(event)) = msg.payload else {
            panic!("expected events after the snapshot")
        };
        assert_eq!(event.seq, expected_seq, "sequence numbers grow by one");
        expected_seq += 1;
        if let Some(v1::kv_event::Kind::Stored(stored)) = event.kind {
            stored_blocks += stored.blocks.len();
        }
    }
    drop(events);

    // A repeated prefix is served from the cache.
    let (_, _, cached) = generate(&mut ca, prompt(2, 64), 4).await;
    assert!(
        cached >= 48,
        "expected a prefix hit, got {cached} cached tokens"
    );

    // Resume inside the buffer: exactly the missing events, starting at from_seq.
    let head = expected_seq;
    let resume_from = head.saturating_sub(2);
    let mut resumed = ca
        .kv_events(KvEventsRequest {
            digest_interval_ms: 0,
            max_batch_events: 0,
            from_seq: Some(resume_from),
            incarnation,
        })
        .await
        .expect("resume")
        .into_inner();
    let msg = resumed.next().await.expect("message").expect("ok");
    match msg.payload {
        Some(Payload::Event(e)) => assert_eq!(e.seq, resume_from),
        other => panic!("expected a replayed event, got {other:?}"),
    }
    drop(resumed);

    // Resume from a sequence number the buffer (8 events) no longer holds: a snapshot.
    let mut next_seq = head;
    let mut round = 0;
    while next_seq <= 9 {
        generate(&mut ca, prompt(10 + round, 48), 2).await;
        round += 1;
        assert!(round < 50, "workload produces no events");
        let mut probe = ca
            .kv_events(KvEventsRequest {
                digest_interval_ms: 0,
                max_batch_events: 0,
                from_seq: None,
                incarnation,
            })
            .await
            .expect("probe")
            .into_inner();
        if let Some(Ok(v1::KvEventsResponse {
            payload: Some(Payload::Snapshot(s)),
            ..
        })) = probe.next().await
        {
            next_seq = s.next_seq;
        }
    }
    let mut too_old = ca
        .kv_events(KvEventsRequest {
            digest_interval_ms: 0,
            max_batch_events: 0,
            from_seq: Some(0),
            incarnation,
        })
        .await
        .expect("resume old")
        .into_inner();
    let msg = too_old.next().await.expect("message").expect("ok");
    assert!(
        matches!(msg.payload, Some(Payload::Snapshot(_))),
        "expected a snapshot for a too-old sequence number, got {:?}",
        msg.payload
    );
    drop(too_old);

    // Bad input: INVALID_ARGUMENT with a message, and the worker keeps serving.
    let bad = [
        (generate_request(vec![], 4), "empty"),
        (generate_request(prompt(3, 5000), 4), "context"),
        (generate_request(prompt(3, 10), 0), "max_tokens"),
    ];
    for (request, needle) in bad {
        let err = match ca.generate(request).await {
            Ok(_) => panic!("bad request accepted ({needle})"),
            Err(err) => err,
        };
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
    let (tokens, _, _) = generate(&mut ca, prompt(4, 20), 3).await;
    assert_eq!(tokens.len(), 3);

    // SIGKILL worker b: its lease expires and it vanishes.
    let mut watch = registry.watch_workers().await.expect("watch");
    b.kill_hard().await;
    let gone = eventually(Duration::from_secs(TTL_SECS * 10), || async {
        registry
            .list_workers()
            .await
            .map(|ws| ws.iter().all(|w| w.id.as_str() != "worker-b"))
            .unwrap_or(false)
    })
    .await;
    assert!(gone, "killed worker still listed after its lease TTL");
    let removed = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(change) = watch.next().await {
            if let switchyard_registry::WorkerChange::Removed(id) = change
                && id == WorkerId::new("worker-b").expect("id")
            {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(removed, "watch reported the removal of worker-b");

    // SIGTERM worker a: it drains, deregisters at once and exits cleanly.
    let status = a.terminate().await;
    assert!(status.success(), "worker a exit status {status:?}");
    let workers = registry.list_workers().await.expect("list");
    assert!(workers.is_empty(), "{workers:?}");
}
