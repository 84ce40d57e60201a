//! The real binary's worker metrics: `switchyard worker --metrics-listen` serves `/metrics` and
//! says where in its ready line; `switchyard up` gives every simulated worker its own.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use futures::StreamExt;
use support::{SwitchyardProcess, WorkerProcess};
use switchyard_proto::v1::{GenerateRequest, SamplingParams, worker_client::WorkerClient};
use switchyard_worker::metrics::sample;

/// Fetches a `/metrics` URL and checks it is the OpenMetrics exposition.
async fn scrape(url: &str) -> String {
    let response = reqwest::get(url).await.expect("metrics answer");
    assert_eq!(response.status(), 200);
    let content_type = response.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    let text = response.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_serves_metrics_on_its_own_port_and_counts_a_generation() {
    let mut worker = WorkerProcess::start(&[
        "--id",
        "e2e-metrics",
        "--speedup",
        "50",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .await;
    let url = worker.ready["metrics"]
        .as_str()
        .expect("the ready line names the metrics URL")
        .to_owned();
    assert!(!url.contains(&worker.address), "{url} is not the gRPC port");
    let before = scrape(&url).await;
    let ok = [
        ("worker", "e2e-metrics"),
        ("kind", "generate"),
        ("code", "ok"),
    ];
    assert_eq!(
        sample(&before, "switchyard_worker_requests_total", &ok),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &before,
            "switchyard_worker_role",
            &[("worker", "e2e-metrics"), ("role", "both")]
        ),
        Some(1.0)
    );

    let mut client = WorkerClient::connect(worker.endpoint()).await.unwrap();
    let mut stream = client
        .generate(GenerateRequest {
            priority: None,
            request_id: "m".into(),
            prompt_token_ids: (1..=48).collect(),
            sampling: Some(SamplingParams {
                max_tokens: 4,
                ignore_eos: true,
                ..Default::default()
            }),
            kv_source: None,
            identity: None,
            retention: None,
        })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = 0;
    while let Some(message) = stream.next().await {
        tokens += message.unwrap().token_ids.len();
    }
    assert_eq!(tokens, 4);

    let after = scrape(&url).await;
    assert_eq!(
        sample(&after, "switchyard_worker_requests_total", &ok),
        Some(1.0)
    );
    assert_eq!(
        sample(&after, "switchyard_worker_completion_tokens_total", &[]),
        Some(4.0)
    );
    assert_eq!(
        sample(
            &after,
            "switchyard_worker_prompt_tokens_total",
            &[("kind", "generate")]
        ),
        Some(48.0)
    );
    assert_eq!(
        sample(
            &after,
            "switchyard_worker_time_to_first_token_seconds_count",
            &[]
        ),
        Some(1.0)
    );
    assert!(worker.terminate().await.success());
}

#[tokio::test]
async fn metrics_on_the_grpc_port_is_refused_with_exit_64() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "worker",
            "--listen",
            "127.0.0.1:47011",
            "--metrics-listen",
            "127.0.0.1:47011",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("own port"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_gives_every_simulated_worker_its_metrics() {
    let up = SwitchyardProcess::spawn("up", &["--http", "127.0.0.1:0", "--workers", "2"]).await;
    let urls = up.ready["worker_metrics"]
        .as_object()
        .expect("the banner lists the workers' metrics")
        .clone();
    assert_eq!(urls.len(), 2, "{urls:?}");
    for id in ["sim-0", "sim-1"] {
        let text = scrape(urls[id].as_str().unwrap()).await;
        assert_eq!(
            sample(
                &text,
                "switchyard_worker_kv_capacity_blocks",
                &[("worker", id)]
            ),
            Some(8192.0)
        );
    }
}
