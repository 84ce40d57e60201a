//! A retention hint sent to a worker whose engine has no such control (vLLM through its
//! OpenAI API, here the protocol-faithful stand-in): the request is served, the hint is not
//! pretended to be honoured but counted `unhonoured`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use futures::StreamExt;
use switchyard_core::{BlockSize, EngineKind, Role};
use switchyard_proto::v1::{GenerateRequest, RetentionHint, SamplingParams};
use switchyard_worker::WorkerConfig;

use crate::support;

use support::fake_vllm::Fake;
use support::spawn_worker;

#[tokio::test]
async fn an_engine_without_a_retention_control_serves_the_request_and_counts_the_hint() {
    let fake = Fake::start(&[]).await;
    let mut config = WorkerConfig {
        id: Some("vllm-retain".into()),
        role: Role::Both,
        model: "fake-model".into(),
        engine: fake.config(EngineKind::Vllm, 1, false),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(4).unwrap();
    let mut worker = spawn_worker(config, None).await;
    let request = GenerateRequest {
        request_id: "r".into(),
        prompt_token_ids: (1..=12).collect(),
        sampling: Some(SamplingParams {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        }),
        retention: Some(RetentionHint {
            ttl_ms: 60_000,
            priority: 1,
        }),
        ..Default::default()
    };
    let mut stream = worker.client.generate(request).await.unwrap().into_inner();
    let mut tokens = 0;
    while let Some(message) = stream.next().await {
        tokens += message.unwrap().token_ids.len();
    }
    assert_eq!(tokens, 2);
    let scrape = worker.scrape().await;
    let hints = "switchyard_worker_retention_hints_total";
    let get = |outcome| switchyard_worker::metrics::sample(&scrape, hints, &[("outcome", outcome)]);
    assert_eq!(get("unhonoured"), Some(1.0), "{scrape}");
    assert_eq!(get("passed"), Some(0.0));
    // No retained-blocks gauge: the adapter cannot know of any.
    assert!(!scrape.contains("kv_retained_blocks"));
    worker.stop().await;
}
