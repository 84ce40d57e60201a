//! OpenTelemetry traces end to end through the real binary: a minimal OTLP/gRPC receiver (the
//! collector's `TraceService/Export`) on a loopback port, and `switchyard` processes pointed at
//! it with `--otlp-endpoint`. Each request is one trace: the gateway's request span, its
//! `preprocess`, `route`, `prefill` and `decode` children, and under those the workers' spans
//! (`prefill` on the prefill worker; `generate` and its `transfer` on the decode worker, and
//! under the transfer the prefill worker's `serve_pull`),
//! exported by services named `switchyard-gateway` and `switchyard-worker`. The processes are
//! stopped with SIGTERM, which must flush their last spans.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use serde_json::{Value, json};
use support::{Api, Launch, register_ghost, tokens};
use switchyard_testkit::EtcdServer;
use tokio_util::sync::CancellationToken;

/// OTLP status code of a failed span.
const STATUS_ERROR: i32 = 2;

/// One received span, flattened.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: BTreeMap<String, Value>,
    status_code: i32,
}

impl Span {
    fn attr(&self, key: &str) -> &Value {
        self.attributes.get(key).unwrap_or(&Value::Null)
    }
}

/// The collector side of OTLP/gRPC: keeps every span it is sent.
#[derive(Debug, Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn value(v: &Option<AnyValue>) -> Value {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        other => json!(format!("{other:?}")),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value(&kv.value)))
        .collect()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut kept = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let resource = resource_spans
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service = resource
                .get("service.name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    kept.push(Span {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: attributes(&span.attributes),
                        status_code: span.status.map_or(0, |s| s.code),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves on a free loopback port until `stop`; returns the endpoint to give the processes.
    async fn start(stop: CancellationToken) -> (Self, String) {
        let receiver = Receiver::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                )
                .await
                .unwrap();
        });
        (receiver, endpoint)
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

/// The spans of one trace, looked up by name and parent.
struct Trace(Vec<Span>);

impl Trace {
    fn of(all: &[Span], trace_id: &str) -> Trace {
        Trace(
            all.iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect(),
        )
    }

    /// The children of `parent` named `name`, in start order as received.
    fn children(&self, parent: &Span, name: &str) -> Vec<Span> {
        self.0
            .iter()
            .filter(|s| s.parent_span_id == parent.span_id && s.name == name)
            .cloned()
            .collect()
    }

    /// The one child of `parent` named `name` whose attributes include `matching`.
    fn child(&self, parent: &Span, name: &str, matching: &[(&str, Value)]) -> Span {
        let found: Vec<Span> = self
            .children(parent, name)
            .into_iter()
            .filter(|s| matching.iter().all(|(k, v)| s.attr(k) == v))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one {name} {matching:?} under {} {}; trace: {:#?}",
            parent.name,
            parent.span_id,
            self.0
        );
        found.into_iter().next().unwrap()
    }
}

/// Request spans (the roots) of one route, one per request.
fn requests(all: &[Span], name: &str) -> Vec<Span> {
    all.iter()
        .filter(|s| s.name == name && s.parent_span_id.is_empty())
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchyard_up_exports_one_trace_per_request_as_gateway_and_worker() {
    let stop = CancellationToken::new();
    let (receiver, otlp) = Receiver::start(stop.clone()).await;
    // The standard variable names the collector as well as the flag does.
    let mut up = Launch::up(1)
        .arg("--speedup", "50")
        // Short enough that the long request below runs into it.
        .arg("--request-timeout-secs", "2")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
        .start()
        .await;
    let api = Api::new(&up);
    let mut messages = vec![json!({"role": "user", "content": "Tell me about rail yards."})];
    let turn = |messages: &Vec<Value>, stream: bool| {
        json!({"model": "sim-8b", "messages": messages, "max_tokens": 6, "ignore_eos": true,
               "stream": stream})
    };
    // Turn 1, streamed: the request span must cover the whole stream.
    let sent = api
        .http
        .post(format!("{}/v1/chat/completions", api.base))
        .header("x-session-id", "trace-session")
        .json(&turn(&messages, true))
        .send()
        .await
        .unwrap();
    assert_eq!(sent.status(), 200);
    let body = sent.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    // Turn 2 of the same session: the session cache reuses turn 1's tokens.
    messages.push(json!({"role": "assistant", "content": "They sort wagons."}));
    messages.push(json!({"role": "user", "content": "And switches?"}));
    let (status, body) = api
        .send(
            api.http
                .post(format!("{}/v1/chat/completions", api.base))
                .header("x-session-id", "trace-session")
                .json(&turn(&messages, false)),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let turn2_id = body["id"].as_str().unwrap().to_owned();
    // A client error is recorded, but is not the server's failure.
    let (status, _) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "no-such-model", "messages": messages}),
        )
        .await;
    assert_eq!(status, 404);
    // A tokenizer failure (here the request's own: a content part the template cannot take)
    // marks the `preprocess` span.
    let (status, body) = api
        .post(
            "/v1/chat/completions",
            &json!({"model": "sim-8b", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}]}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    // 30,000 tokens take the simulated worker many seconds even at speed-up 50: the gateway's
    // 2 s deadline ends the request mid-decode.
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": "Count the wagons.", "max_tokens": 30000,
                    "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 504, "{body}");

    // SIGTERM flushes the batch exporter: everything is there once the process has exited.
    assert!(up.terminate().await.success());
    let all = receiver.spans();
    stop.cancel();

    let roots = requests(&all, "POST /v1/chat/completions");
    assert_eq!(roots.len(), 4, "four requests, four traces: {all:#?}");

    let refused = roots
        .iter()
        .find(|r| r.attr("http.response.status_code") == &json!(400))
        .unwrap();
    assert_ne!(refused.status_code, STATUS_ERROR, "a client error");
    let trace = Trace::of(&all, &refused.trace_id);
    let preprocess = trace.child(refused, "preprocess", &[]);
    assert_eq!(preprocess.status_code, STATUS_ERROR, "{preprocess:?}");
    assert!(trace.children(refused, "decode").is_empty());

    let timed_out = requests(&all, "POST /v1/completions");
    assert_eq!(timed_out.len(), 1, "{all:#?}");
    let timed_out = &timed_out[0];
    assert_eq!(timed_out.attr("http.response.status_code"), &json!(504));
    assert_eq!(timed_out.status_code, STATUS_ERROR);
    let trace = Trace::of(&all, &timed_out.trace_id);
    let decode = trace.child(timed_out, "decode", &[]);
    assert_eq!(decode.status_code, STATUS_ERROR, "{decode:?}");
    assert_ne!(
        trace.child(timed_out, "preprocess", &[]).status_code,
        STATUS_ERROR
    );
    let not_found = roots
        .iter()
        .find(|r| r.attr("gen_ai.request.model") == "no-such-model")
        .unwrap();
    assert_eq!(not_found.attr("http.response.status_code"), &json!(404));
    assert_ne!(not_found.status_code, STATUS_ERROR);

    let served: Vec<&Span> = roots
        .iter()
        .filter(|r| r.attr("http.response.status_code") == &json!(200))
        .collect();
    assert_eq!(served.len(), 2);
    let mut hits = Vec::new();
    for root in served {
        let trace = Trace::of(&all, &root.trace_id);
        assert_eq!(root.service, "switchyard-gateway");
        assert_eq!(root.attr("http.request.method"), "POST");
        assert_eq!(root.attr("http.route"), "/v1/chat/completions");
        assert_eq!(root.attr("http.response.status_code"), &json!(200));
        assert!(
            root.attr("request_id")
                .as_str()
                .unwrap()
                .starts_with("chatcmpl-")
        );
        assert_ne!(root.status_code, STATUS_ERROR);

        let preprocess = trace.child(root, "preprocess", &[]);
        assert_eq!(preprocess.service, "switchyard-gateway");
        assert_eq!(preprocess.attr("input"), "chat");
        assert!(preprocess.attr("prompt_tokens").as_i64().unwrap() > 5);
        hits.push((
            root.attr("request_id").as_str().unwrap().to_owned(),
            preprocess.attr("session_cache_hit").clone(),
        ));
        trace.child(root, "admission", &[]);

        let route = trace.child(root, "route", &[]);
        assert_eq!(route.attr("policy"), "kv");
        assert_eq!(route.attr("worker"), "sim-0");
        assert_eq!(route.attr("mode"), "aggregated");
        assert_eq!(route.attr("attempt"), &json!(1));
        assert!(route.attr("overlap_blocks").is_i64(), "{route:?}");

        let decode = trace.child(root, "decode", &[]);
        // Its context was read (for traceparent) before it was entered: it must still be
        // exported by the gateway's provider, not the worker's, in a process that has both.
        assert_eq!(decode.service, "switchyard-gateway");
        assert_eq!(route.service, "switchyard-gateway");
        assert_eq!(decode.attr("worker"), "sim-0");
        assert_eq!(decode.attr("mode"), "aggregated");
        assert_eq!(decode.attr("completion_tokens"), &json!(6));
        assert_eq!(decode.attr("finish_reason"), "length");

        // The worker's span continues the same trace, under the call that caused it.
        let generate = trace.child(&decode, "generate", &[]);
        assert_eq!(generate.service, "switchyard-worker");
        assert_eq!(generate.attr("worker"), "sim-0");
        assert_eq!(generate.attr("request_id"), root.attr("request_id"));
        assert_eq!(generate.attr("completion_tokens"), &json!(6));
        assert_eq!(generate.attr("disaggregated"), &json!(false));
        assert!(trace.children(&generate, "transfer").is_empty());
    }
    hits.sort_by_key(|(id, _)| *id == turn2_id);
    assert_eq!(
        hits[0].1,
        json!(false),
        "turn 1 is new to the session cache"
    );
    assert_eq!(hits[1].1, json!(true), "turn 2 extends turn 1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_requests_trace_through_prefill_transfer_and_decode_and_retries() {
    let stop = CancellationToken::new();
    let (receiver, otlp) = Receiver::start(stop.clone()).await;
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("traces-{}", std::process::id());
    let start = |id: &str, role: &str| {
        Launch::worker(&endpoint, &cluster)
            .arg("--speedup", "20")
            .arg("--max-context", "8192")
            .role(role)
            .id(id)
            .arg("--otlp-endpoint", &otlp)
            .start()
    };
    let mut prefill = start("prefill-a", "prefill").await;
    let mut decode = start("decode-a", "decode").await;
    let mut gateway = Launch::gateway(&endpoint, &cluster)
        .arg("--disaggregation", "enforce")
        .arg("--policy", "round-robin")
        .arg("--otlp-endpoint", &otlp)
        .start()
        .await;
    let api = Api::new(&gateway);

    // A registered decode worker whose process is gone: round-robin sends some attempt to it,
    // which fails and is retried on decode-a as a second attempt.
    let _ghost = register_ghost(
        &endpoint,
        &cluster,
        "decode-ghost",
        switchyard_core::Role::Decode,
        Duration::from_secs(60),
    )
    .await;
    assert!(
        api.lists_workers(3).await,
        "gateway sees both workers and the ghost"
    );

    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, body) = api
            .post(
                "/v1/completions",
                &json!({"model": "sim-8b", "prompt": tokens(70 + i, 600), "max_tokens": 5,
                        "ignore_eos": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        ids.push(body["id"].as_str().unwrap().to_owned());
    }

    for process in [&mut gateway, &mut decode, &mut prefill] {
        assert!(process.terminate().await.success());
    }
    let all = receiver.spans();
    stop.cancel();

    let roots = requests(&all, "POST /v1/completions");
    assert_eq!(roots.len(), 3, "{all:#?}");
    let mut retried = 0;
    for root in &roots {
        assert!(ids.contains(&root.attr("request_id").as_str().unwrap().to_owned()));
        assert_eq!(root.service, "switchyard-gateway");
        assert_eq!(root.attr("http.response.status_code"), &json!(200));
        let trace = Trace::of(&all, &root.trace_id);
        let preprocess = trace.child(root, "preprocess", &[]);
        assert_eq!(preprocess.attr("input"), "tokens");
        assert_eq!(preprocess.attr("prompt_tokens"), &json!(600));

        // The attempt that served the request: decode-a, after a prefill on prefill-a.
        let decodes = trace.children(root, "decode");
        let served = trace.child(root, "decode", &[("worker", json!("decode-a"))]);
        let attempt = served.attr("attempt").clone();
        assert_eq!(served.attr("mode"), "disaggregated");
        assert_eq!(served.attr("prefill_worker"), "prefill-a");
        assert_eq!(served.attr("completion_tokens"), &json!(5));
        assert_ne!(served.status_code, STATUS_ERROR);
        let route = trace.child(root, "route", &[("attempt", attempt.clone())]);
        assert_eq!(route.attr("policy"), "round-robin");
        assert_eq!(route.attr("worker"), "decode-a");
        assert_eq!(route.attr("mode"), "disaggregated");
        assert_eq!(route.attr("prefill_worker"), "prefill-a");
        assert_eq!(route.attr("uncached_prompt_tokens"), &json!(600));
        // One prefill per attempt (a retried attempt prefills again), each with the prefill
        // worker's own span under it.
        let prefills = trace.children(root, "prefill");
        assert_eq!(prefills.len(), decodes.len(), "{:#?}", trace.0);
        for gateway_prefill in &prefills {
            assert_eq!(gateway_prefill.service, "switchyard-gateway");
            assert_eq!(gateway_prefill.attr("worker"), "prefill-a");
            assert_eq!(gateway_prefill.attr("prompt_tokens"), &json!(600));
            assert_eq!(gateway_prefill.attr("prefill_attempt"), &json!(1));
            let worker_prefill = trace.child(gateway_prefill, "prefill", &[]);
            assert_eq!(worker_prefill.service, "switchyard-worker");
            assert_eq!(worker_prefill.attr("worker"), "prefill-a");
            assert_eq!(worker_prefill.attr("prompt_tokens"), &json!(600));
            assert_eq!(worker_prefill.attr("request_id"), root.attr("request_id"));
        }

        // The decode worker's spans, in the same trace, under the gateway's call.
        let generate = trace.child(&served, "generate", &[]);
        assert_eq!(generate.service, "switchyard-worker");
        assert_eq!(generate.attr("worker"), "decode-a");
        assert_eq!(generate.attr("disaggregated"), &json!(true));
        assert_eq!(generate.attr("completion_tokens"), &json!(5));
        let transfer = trace.child(&generate, "transfer", &[]);
        assert_eq!(transfer.service, "switchyard-worker");
        assert_eq!(transfer.attr("source"), &json!(prefill.address));
        assert_eq!(transfer.attr("blocks"), &json!(600 / 16));
        assert_eq!(transfer.attr("tokens"), &json!(600 / 16 * 16));
        // The prefill worker served the pull under the decode worker's transfer.
        let serve_pull = trace.child(&transfer, "serve_pull", &[]);
        assert_eq!(serve_pull.service, "switchyard-worker");
        assert_eq!(serve_pull.attr("worker"), "prefill-a");
        assert_eq!(serve_pull.attr("blocks"), &json!(600 / 16));
        assert_eq!(serve_pull.attr("bytes"), transfer.attr("bytes"));
        assert_eq!(serve_pull.attr("pipelined"), transfer.attr("pipelined"));
        assert!(
            serve_pull.attr("chunks").as_i64().unwrap() >= 1,
            "{serve_pull:?}"
        );
        assert!(serve_pull.attr("handle").is_string(), "{serve_pull:?}");
        assert_ne!(serve_pull.status_code, STATUS_ERROR);

        // An attempt on the ghost failed, shows as its own failed span, and was retried.
        if decodes.len() > 1 {
            retried += 1;
            let failed = trace.child(root, "decode", &[("worker", json!("decode-ghost"))]);
            assert_eq!(failed.status_code, STATUS_ERROR, "{failed:?}");
            assert_eq!(failed.attr("attempt"), &json!(1));
            assert_eq!(served.attr("attempt"), &json!(2));
            assert_eq!(served.attr("attempt.kind"), "retry");
            assert!(trace.children(&failed, "generate").is_empty());
            assert_eq!(trace.children(root, "route").len(), 2);
        } else {
            assert_eq!(served.attr("attempt.kind"), "first");
        }
    }
    assert!(retried >= 1, "round-robin sent an attempt to the ghost");
}
