//! A request's scheduling `priority` in front of vLLM and SGLang (the protocol-faithful
//! stand-in, which refuses a priority its engine would refuse): sent in the engine's own field
//! when the worker was started saying the engine schedules by priority, never sent otherwise
//! (the request is served and the priority counted unhonoured).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard_core::{BlockSize, EngineKind, Role};
use switchyard_proto::v1::{GenerateRequest, SamplingParams};
use switchyard_worker::WorkerConfig;

use crate::support;

use support::fake_vllm::Fake;
use support::{InProcessWorker, spawn_worker};

/// A worker in front of `fake` (of `kind`), saying the engine schedules by priority or not.
async fn worker(fake: &Fake, kind: EngineKind, priority_scheduling: bool) -> InProcessWorker {
    let mut engine = fake.config(kind, 1, false);
    engine.priority_scheduling = priority_scheduling;
    let mut config = WorkerConfig {
        id: Some(format!("{kind}-priority")),
        role: Role::Both,
        model: "fake-model".into(),
        engine,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(4).unwrap();
    spawn_worker(config, None).await
}

/// Generates two tokens at `priority`; the tokens, or the refusal's status.
async fn generate(
    worker: &mut InProcessWorker,
    priority: Option<i32>,
) -> Result<usize, tonic::Status> {
    let request = GenerateRequest {
        request_id: "p".into(),
        prompt_token_ids: (1..=12).collect(),
        sampling: Some(SamplingParams {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        }),
        priority,
        ..Default::default()
    };
    let mut stream = worker.client.generate(request).await?.into_inner();
    let mut tokens = 0;
    while let Some(message) = stream.next().await {
        tokens += message?.token_ids.len();
    }
    Ok(tokens)
}

async fn last_body(fake: &Fake) -> Value {
    let requests = fake.admin("requests", json!({})).await;
    requests["requests"]
        .as_array()
        .and_then(|r| r.last())
        .cloned()
        .expect("the engine received a request")
}

/// `switchyard_worker_request_priorities_total{outcome}` on the worker's `/metrics`.
async fn counted(worker: &InProcessWorker, outcome: &str) -> Option<f64> {
    let scrape = worker.scrape().await;
    switchyard_worker::metrics::sample(
        &scrape,
        "switchyard_worker_request_priorities_total",
        &[("outcome", outcome)],
    )
}

#[tokio::test]
async fn an_engine_scheduling_by_priority_receives_it_in_its_own_field() {
    for (kind, flags) in [
        (EngineKind::Vllm, vec!["--scheduling-policy", "priority"]),
        (
            EngineKind::Sglang,
            vec!["--flavor", "sglang", "--enable-priority-scheduling"],
        ),
    ] {
        let fake = Fake::start(&flags).await;
        let mut worker = worker(&fake, kind, true).await;
        assert_eq!(generate(&mut worker, Some(-3)).await.unwrap(), 2, "{kind}");
        // vLLM's completion body and SGLang's `GenerateReqInput` both name it `priority`, at
        // the top level (not among SGLang's sampling_params).
        let body = last_body(&fake).await;
        assert_eq!(body["priority"], json!(-3), "{kind}: {body}");
        assert!(body["sampling_params"].get("priority").is_none());
        // No priority asked: none sent, the engine's default applies.
        assert_eq!(generate(&mut worker, None).await.unwrap(), 2);
        assert!(last_body(&fake).await.get("priority").is_none(), "{kind}");
        assert_eq!(counted(&worker, "passed").await, Some(1.0), "{kind}");
        assert_eq!(counted(&worker, "unhonoured").await, Some(0.0), "{kind}");
        worker.stop().await;
    }
}

#[tokio::test]
async fn without_priority_scheduling_the_request_is_served_and_its_priority_counted_unhonoured() {
    for (kind, flags) in [
        (EngineKind::Vllm, vec![]),
        (EngineKind::Sglang, vec!["--flavor", "sglang"]),
    ] {
        let fake = Fake::start(&flags).await;
        let mut worker = worker(&fake, kind, false).await;
        assert_eq!(generate(&mut worker, Some(5)).await.unwrap(), 2, "{kind}");
        let body = last_body(&fake).await;
        assert!(body.get("priority").is_none(), "{kind}: {body}");
        // The default priority is nothing to honour: not counted.
        assert_eq!(generate(&mut worker, Some(0)).await.unwrap(), 2, "{kind}");
        assert_eq!(counted(&worker, "unhonoured").await, Some(1.0), "{kind}");
        assert_eq!(counted(&worker, "passed").await, Some(0.0), "{kind}");
        worker.stop().await;
    }
}

#[tokio::test]
async fn a_worker_claiming_priority_scheduling_for_an_engine_without_it_gets_the_engines_refusal() {
    // vLLM started without `--scheduling-policy priority` refuses a non-zero priority: the
    // worker's flag must match the engine's, and the refusal reaches the caller as the
    // request's fault rather than a hang or a silent drop.
    let fake = Fake::start(&[]).await;
    let mut worker = worker(&fake, EngineKind::Vllm, true).await;
    let status = generate(&mut worker, Some(2)).await.unwrap_err();
    assert!(
        status
            .message()
            .contains("Priority scheduling is not enabled"),
        "{status:?}"
    );
    // Priority 0 is vLLM's default and accepted by any vLLM.
    assert_eq!(generate(&mut worker, Some(0)).await.unwrap(), 2);
    assert_eq!(last_body(&fake).await["priority"], json!(0));
    worker.stop().await;
}
