//! The observer against a real HTTP server standing in for a gateway's `/metrics` (the
//! exposition a gateway serves, advanced between two scrapes) and a gateway that is down:
//! the interval's figures are the differences, summed over the gateways that answered.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::routing::get;
use switchyard_planner::observe::Observer;
use switchyard_registry::{MemoryRegistry, Registry};

/// A gateway exposition after `requests` requests of 1,000 prompt tokens (250 of them cached)
/// and 10 output tokens each, with first tokens after 0.05–0.1 s (0.08 s on average).
fn exposition(requests: u64) -> String {
    let r = requests;
    format!(
        "# TYPE switchyard_request_prompt_tokens histogram\n\
switchyard_request_prompt_tokens_sum {}\n\
switchyard_request_prompt_tokens_count {r}\n\
switchyard_request_prompt_tokens_bucket{{le=\"512.0\"}} 0\n\
switchyard_request_prompt_tokens_bucket{{le=\"1024.0\"}} {r}\n\
switchyard_request_prompt_tokens_bucket{{le=\"+Inf\"}} {r}\n\
switchyard_request_completion_tokens_sum {}\n\
switchyard_request_completion_tokens_count {r}\n\
switchyard_request_completion_tokens_bucket{{le=\"8.0\"}} 0\n\
switchyard_request_completion_tokens_bucket{{le=\"16.0\"}} {r}\n\
switchyard_request_completion_tokens_bucket{{le=\"+Inf\"}} {r}\n\
switchyard_cached_prompt_tokens_total {}\n\
switchyard_time_to_first_token_seconds_sum {}\n\
switchyard_time_to_first_token_seconds_count {r}\n\
switchyard_time_to_first_token_seconds_bucket{{le=\"0.05\"}} 0\n\
switchyard_time_to_first_token_seconds_bucket{{le=\"0.1\"}} {r}\n\
switchyard_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {r}\n\
switchyard_requests_queued 3\n\
switchyard_requests_in_flight 4\n\
# EOF\n",
        r * 1000,
        r * 10,
        r * 250,
        r as f64 * 0.08
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interval_figures_are_the_differences_between_scrapes() {
    let body = Arc::new(Mutex::new(exposition(100)));
    let served = Arc::clone(&body);
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let text = served.lock().unwrap().clone();
            async move { text }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    // A port nobody listens on: a gateway that is down.
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_url = format!("http://{}", down.local_addr().unwrap());
    drop(down);

    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let mut observer = Observer::new(
        vec![format!("http://{addr}/"), down_url],
        registry,
        Arc::new(Mutex::new(BTreeMap::new())),
    );
    let first = observer.observe().await;
    assert_eq!(first.seconds, 0.0, "the first scrape is the baseline");
    assert_eq!((first.gateways_answered, first.gateways_failed), (1, 1));
    assert_eq!(first.queue_depth, 7.0);

    *body.lock().unwrap() = exposition(140);
    let second = observer.observe().await;
    assert!(second.seconds > 0.0);
    assert_eq!(
        second.requests, 40.0,
        "only the 40 requests since the baseline"
    );
    assert_eq!(second.load.input_tokens, 1000.0);
    assert_eq!(second.load.output_tokens, 10.0);
    assert_eq!(second.load.cache_hit_rate, 0.25);
    assert!((second.load.request_rate * second.seconds - 40.0).abs() < 1e-9);
    let ttft = second.ttft_p50_seconds.unwrap();
    assert!(ttft > 0.05 && ttft <= 0.1, "{ttft}");
    let mean = second.ttft_mean_seconds.unwrap();
    assert!(
        (mean - 0.08).abs() < 1e-9,
        "the interval's mean TTFT: {mean}"
    );
    assert_eq!(second.itl_mean_seconds, None);
    let input = second.input_tokens_p50.unwrap();
    assert!(input > 512.0 && input <= 1024.0, "{input}");
    assert_eq!(
        second.itl_p50_seconds, None,
        "no ITL observations in the interval"
    );
    assert_eq!(
        second.workers.prefill + second.workers.decode,
        0,
        "no workers registered"
    );
}
