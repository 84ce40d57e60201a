//! A retention hint sent to a worker whose engine has no such control (vLLM through its
//! OpenAI API, here the protocol-faithful stand-in): the request is served, the hint is not
//! pretended to be honoured but counted `unhonoured`. And one in front of SGLang with
//! `--engine-retention-priority`, sent as its eviction priority.

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

mod sglang {
    //! SGLang with `--engine-retention-priority`: both halves of a disaggregated request carry
    //! their keep-until time as SGLang's `priority` (send time plus the hint's TTL).

    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use futures::StreamExt;
    use serde_json::{Value, json};
    use switchyard_core::{EngineKind, Retention};
    use switchyard_worker::engine::{Engine, EngineTransfer, GenerateParams, PrefillParams};

    use crate::support::fake_vllm::{Fake, seq, start};

    fn now_ms() -> u64 {
        u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap()
    }

    /// The `priority` of the newest request the stand-in received with request id `rid`.
    async fn sent_priority(fake: &Fake, rid: &str) -> u64 {
        for _ in 0..100 {
            let requests = fake.admin("requests", json!({})).await;
            let found = requests["requests"]
                .as_array()
                .and_then(|r| r.iter().rev().find(|b| b["rid"] == rid).cloned());
            if let Some(body) = found {
                return body["priority"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("no eviction priority: {body}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the engine never received {rid}");
    }

    #[tokio::test]
    async fn both_halves_of_a_disaggregated_request_carry_the_hints_expiry() {
        let policy = ["--radix-eviction-policy", "priority"];
        let prefill_fake = Fake::start(
            &[
                &["--flavor", "sglang", "--disaggregation-mode", "prefill"][..],
                &["--transfer-timeout", "20"],
                &policy,
            ]
            .concat(),
        )
        .await;
        let decode_fake = Fake::start(
            &[
                &["--flavor", "sglang", "--disaggregation-mode", "decode"][..],
                &policy,
            ]
            .concat(),
        )
        .await;
        let mut config = prefill_fake.config(EngineKind::Sglang, 1, false);
        config.bootstrap_port = prefill_fake.bootstrap;
        config.retention_priority = true;
        let prefill = start(config).await;
        let mut config = decode_fake.config(EngineKind::Sglang, 1, false);
        config.retention_priority = true;
        let decode = start(config).await;
        assert!(prefill.honours_retention() && decode.honours_retention());
        let hint = Retention {
            ttl_ms: 60_000,
            priority: 1,
        };

        let before = now_ms();
        let outcome = prefill
            .prefill(PrefillParams {
                request_id: "pd-hinted".into(),
                prompt: seq(1, 9),
                hold: Duration::from_secs(20),
                pipelined: false,
                identity: Default::default(),
                retention: hint,
                priority: None,
                sampling: None,
            })
            .await
            .unwrap();
        let after = now_ms();
        let sent = sent_priority(&prefill_fake, "pd-hinted").await;
        assert!(
            (before + 60_000..=after + 60_000).contains(&sent),
            "{before} {sent} {after}"
        );

        let transfer = match serde_json::from_str(&outcome.engine_transfer_params.unwrap()) {
            Ok(Value::Object(map)) => map,
            other => panic!("not an object: {other:?}"),
        };
        let before = now_ms();
        let mut stream = decode
            .generate_with_transfer(
                GenerateParams {
                    request_id: "pd-hinted".into(),
                    prompt: seq(1, 9),
                    sampling: switchyard_core::Sampling {
                        max_tokens: 2,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    identity: Default::default(),
                    retention: hint,
                    priority: None,
                },
                transfer,
            )
            .await
            .unwrap();
        while let Some(chunk) = stream.next().await {
            if chunk.unwrap().finish.is_some() {
                break;
            }
        }
        let after = now_ms();
        let sent = sent_priority(&decode_fake, "pd-hinted").await;
        assert!(
            (before + 60_000..=after + 60_000).contains(&sent),
            "{before} {sent} {after}"
        );
        prefill.shutdown();
        decode.shutdown();
    }
}
