//! A stand-in for Envoy's ext_proc filter in front of an InferencePool, for tests without a
//! cluster: it drives an endpoint picker over the official ext_proc protos exactly as Envoy
//! does (request headers with the subset hint and protocol config, the body whole or in chunks
//! by the configured body mode, the destination read from the `envoy.lb` dynamic metadata, the
//! response headers with the served endpoint, the response body, end of stream, or a stream
//! dropped half-way for a cancelled request), and sends the request to the endpoints it was
//! given, in order, going to the next when one cannot be connected to (Envoy's retry on
//! connect failure).
//!
//! Used by `tests/epp_e2e.rs` (the real binaries) and `crates/switchyard-epp/tests/protocol.rs`
//! (the picker in-process), by path.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use prost_types::value::Kind;
use switchyard_epp::proto::core::{HeaderMap, HeaderValue, Metadata};
use switchyard_epp::proto::ext_proc::external_processor_client::ExternalProcessorClient;
use switchyard_epp::proto::ext_proc::processing_request::Request;
use switchyard_epp::proto::ext_proc::processing_response::Response;
use switchyard_epp::proto::ext_proc::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    body_mutation,
};
use switchyard_epp::proto::mode::processing_mode::BodySendMode;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// How the stand-in is configured, as an Envoy `ext_proc` filter would be.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub request_body: BodySendMode,
    pub response_body: BodySendMode,
    /// Send `protocol_config` in the first message (Envoy 1.34 and later).
    pub protocol_config: bool,
    /// Bytes per request body chunk in the streamed modes.
    pub chunk: usize,
    /// Envoy's `failure_mode_allow`: when the picker cannot be reached (or fails the stream),
    /// send the request to `pool[0]` instead of answering 500.
    pub failure_mode_allow: bool,
    /// The InferencePool's endpoints, for `failure_mode_allow`.
    pub pool: Vec<String>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            request_body: BodySendMode::FullDuplexStreamed,
            response_body: BodySendMode::FullDuplexStreamed,
            protocol_config: true,
            chunk: 16,
            failure_mode_allow: false,
            pool: Vec::new(),
        }
    }
}

/// One client request.
#[derive(Debug, Clone, Default)]
pub struct ClientRequest {
    pub path: String,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// The subset hint (`envoy.lb.subset_hint`), when the proxy sends one.
    pub subset: Option<Vec<String>>,
}

impl ClientRequest {
    pub fn post(path: &str, body: &serde_json::Value) -> Self {
        Self {
            path: path.to_owned(),
            body: body.to_string().into_bytes(),
            headers: Vec::new(),
            subset: None,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn subset(mut self, endpoints: &[&str]) -> Self {
        self.subset = Some(endpoints.iter().map(|e| (*e).to_owned()).collect());
        self
    }
}

/// What happened to one request.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The status the client got.
    pub status: u16,
    /// The body the client got.
    pub body: Vec<u8>,
    /// The endpoints the picker named, in order (empty when it answered itself).
    pub destination: Vec<String>,
    /// The endpoint that served the request.
    pub served: Option<String>,
    /// Whether the picker answered with an immediate response.
    pub immediate: bool,
    /// The headers the picker set on its immediate response (lower-case names).
    pub immediate_headers: Vec<(String, String)>,
    /// The request body as forwarded upstream (after the picker's mutations).
    pub forwarded: Vec<u8>,
}

impl Outcome {
    /// The value of the immediate response's header `name`, if set.
    pub fn immediate_header(&self, name: &str) -> Option<&str> {
        self.immediate_headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// The stand-in proxy.
#[derive(Debug, Clone)]
pub struct EnvoyProxy {
    picker: String,
    pub config: ProxyConfig,
    http: reqwest::Client,
}

/// An open ext_proc stream.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn send(&self, request: Request, metadata: Option<Metadata>) {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..ProcessingRequest::default()
        };
        self.tx.send(message).await.expect("picker stream open");
    }

    async fn next(&mut self) -> Result<ProcessingResponse, String> {
        match tokio::time::timeout(Duration::from_secs(20), self.rx.next()).await {
            Err(_) => Err("the picker did not answer within 20 s".into()),
            Ok(None) => Err("the picker closed the stream".into()),
            Ok(Some(Err(status))) => Err(format!("the picker failed the stream: {status}")),
            Ok(Some(Ok(answer))) => Ok(answer),
        }
    }
}

impl EnvoyProxy {
    /// A proxy calling the picker at `picker` (`host:port`).
    pub fn new(picker: &str, config: ProxyConfig) -> Self {
        Self {
            picker: format!("http://{picker}"),
            config,
            http: reqwest::Client::new(),
        }
    }

    async fn open(&self) -> Result<Stream, String> {
        let mut client = ExternalProcessorClient::connect(self.picker.clone())
            .await
            .map_err(|e| format!("cannot reach the picker: {e}"))?;
        let (tx, rx) = mpsc::channel(64);
        let inbound = client
            .process(ReceiverStream::new(rx))
            .await
            .map_err(|e| format!("the picker refused the stream: {e}"))?
            .into_inner();
        Ok(Stream { tx, rx: inbound })
    }

    /// Sends `request` through the picker to a model server and back.
    pub async fn send(&self, request: ClientRequest) -> Outcome {
        match self.route(&request).await {
            Ok(Routed::Immediate(outcome)) => outcome,
            Ok(Routed::To {
                stream,
                destination,
                forwarded,
            }) => {
                self.forward(Some(stream), &request, destination, forwarded)
                    .await
            }
            Err(failure) if self.config.failure_mode_allow => {
                let destination = self.config.pool.iter().take(1).cloned().collect();
                let mut outcome = self
                    .forward(None, &request, destination, request.body.clone())
                    .await;
                outcome.destination.clear();
                let _ = failure;
                outcome
            }
            Err(failure) => Outcome {
                status: 500,
                body: failure.into_bytes(),
                ..Outcome::default()
            },
        }
    }

    /// Sends the request part and drops the stream before any response, as Envoy does when
    /// the client goes away while the request is upstream. Returns the destination named.
    pub async fn send_and_cancel(&self, request: ClientRequest) -> Vec<String> {
        match self.route(&request).await {
            Ok(Routed::To { destination, .. }) => destination,
            Ok(Routed::Immediate(outcome)) => panic!("the picker refused: {outcome:?}"),
            Err(failure) => panic!("{failure}"),
        }
    }

    /// The request half: headers and body to the picker, its destination back.
    async fn route(&self, request: &ClientRequest) -> Result<Routed, String> {
        let mut stream = self.open().await?;
        let mode = self.config.request_body;
        let has_body = !request.body.is_empty();
        let mut headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), request.path.clone()),
            (":authority".to_owned(), "inference.example".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ];
        headers.extend(request.headers.iter().cloned());
        let first = ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&headers)),
                end_of_stream: !has_body,
                ..HttpHeaders::default()
            })),
            metadata_context: request.subset.as_ref().map(|s| {
                switchyard_epp::envoy::subset_metadata(
                    &s.iter().map(String::as_str).collect::<Vec<_>>(),
                )
            }),
            protocol_config: self
                .config
                .protocol_config
                .then_some(ProtocolConfiguration {
                    request_body_mode: mode as i32,
                    response_body_mode: self.config.response_body as i32,
                    send_body_without_waiting_for_header_response: false,
                }),
            ..ProcessingRequest::default()
        };
        stream
            .tx
            .send(first)
            .await
            .map_err(|_| "picker stream closed".to_string())?;
        let mut forwarded = request.body.clone();
        let chosen;
        if !has_body {
            chosen = Some(stream.next().await?);
        } else {
            match mode {
                BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                    let headers_answer = stream.next().await?;
                    if is_immediate(&headers_answer) {
                        return Ok(Routed::Immediate(immediate(&headers_answer)));
                    }
                    stream
                        .send(
                            Request::RequestBody(HttpBody {
                                body: request.body.clone(),
                                end_of_stream: true,
                                ..HttpBody::default()
                            }),
                            None,
                        )
                        .await;
                    chosen = Some(stream.next().await?);
                }
                BodySendMode::Streamed => {
                    chosen = Some(stream.next().await?);
                    if chosen.as_ref().is_some_and(is_immediate) {
                        return Ok(Routed::Immediate(immediate(chosen.as_ref().unwrap())));
                    }
                    let chunks: Vec<&[u8]> = request.body.chunks(self.config.chunk).collect();
                    for (i, chunk) in chunks.iter().enumerate() {
                        stream
                            .send(
                                Request::RequestBody(HttpBody {
                                    body: chunk.to_vec(),
                                    end_of_stream: i + 1 == chunks.len(),
                                    ..HttpBody::default()
                                }),
                                None,
                            )
                            .await;
                        let answer = stream.next().await?;
                        assert!(
                            matches!(answer.response, Some(Response::RequestBody(_))),
                            "a body chunk is answered with a body response: {answer:?}"
                        );
                    }
                }
                BodySendMode::FullDuplexStreamed => {
                    let chunks: Vec<&[u8]> = request.body.chunks(self.config.chunk).collect();
                    for (i, chunk) in chunks.iter().enumerate() {
                        stream
                            .send(
                                Request::RequestBody(HttpBody {
                                    body: chunk.to_vec(),
                                    end_of_stream: i + 1 == chunks.len(),
                                    ..HttpBody::default()
                                }),
                                None,
                            )
                            .await;
                    }
                    let headers_answer = stream.next().await?;
                    if is_immediate(&headers_answer) {
                        return Ok(Routed::Immediate(immediate(&headers_answer)));
                    }
                    // The body comes back streamed; Envoy forwards what the picker returns.
                    forwarded.clear();
                    loop {
                        let answer = stream.next().await?;
                        let Some(Response::RequestBody(body)) = &answer.response else {
                            return Err(format!("expected the streamed body, got {answer:?}"));
                        };
                        let mutation = body
                            .response
                            .as_ref()
                            .and_then(|c| c.body_mutation.as_ref())
                            .and_then(|m| m.mutation.as_ref());
                        let Some(body_mutation::Mutation::StreamedResponse(part)) = mutation else {
                            return Err(format!(
                                "expected a streamed body response, got {answer:?}"
                            ));
                        };
                        forwarded.extend_from_slice(&part.body);
                        if part.end_of_stream {
                            break;
                        }
                    }
                    chosen = Some(headers_answer);
                }
                BodySendMode::None | BodySendMode::Grpc => {
                    chosen = Some(stream.next().await?);
                }
            }
        }
        let chosen = chosen.ok_or("no answer carried a destination")?;
        if is_immediate(&chosen) {
            return Ok(Routed::Immediate(immediate(&chosen)));
        }
        let destination = destination_of(&chosen)?;
        Ok(Routed::To {
            stream,
            destination,
            forwarded,
        })
    }

    /// The response half: upstream in the destination's order, the response through the
    /// picker's stream (when there is one) to the client.
    async fn forward(
        &self,
        stream: Option<Stream>,
        request: &ClientRequest,
        destination: Vec<String>,
        forwarded: Vec<u8>,
    ) -> Outcome {
        let mut upstream = None;
        for endpoint in &destination {
            let url = format!("http://{endpoint}{}", request.path);
            match self
                .http
                .post(url)
                .header("content-type", "application/json")
                .body(forwarded.clone())
                .send()
                .await
            {
                Ok(response) => {
                    upstream = Some((endpoint.clone(), response));
                    break;
                }
                // No response (connect failure, or a reset of a kept-alive connection): Envoy's
                // retry policy (`retry_on: connect-failure,reset`) moves to the next endpoint.
                Err(_) => continue,
            }
        }
        let Some((served, response)) = upstream else {
            return Outcome {
                status: 503,
                body: b"no healthy upstream".to_vec(),
                destination,
                forwarded,
                ..Outcome::default()
            };
        };
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/json")
            .to_owned();
        let mut outcome = Outcome {
            status,
            destination,
            served: Some(served.clone()),
            forwarded,
            ..Outcome::default()
        };
        let Some(mut stream) = stream else {
            outcome.body = response
                .bytes()
                .await
                .map(|b| b.to_vec())
                .unwrap_or_default();
            return outcome;
        };
        let served_md = switchyard_epp::envoy::served_metadata(&served);
        stream
            .send(
                Request::ResponseHeaders(HttpHeaders {
                    headers: Some(header_map(&[
                        (":status".to_owned(), status.to_string()),
                        ("content-type".to_owned(), content_type),
                    ])),
                    end_of_stream: false,
                    ..HttpHeaders::default()
                }),
                Some(served_md.clone()),
            )
            .await;
        let answer = stream.next().await.expect("response headers answered");
        assert!(
            matches!(answer.response, Some(Response::ResponseHeaders(_))),
            "response headers are answered in kind: {answer:?}"
        );
        let duplex = self.config.response_body == BodySendMode::FullDuplexStreamed;
        let mut chunks = response.bytes_stream();
        let mut upstream_body = Vec::new();
        let sends_body = self.config.response_body != BodySendMode::None;
        loop {
            let chunk = chunks.next().await;
            let (bytes, end) = match chunk {
                Some(Ok(bytes)) => (bytes.to_vec(), false),
                Some(Err(_)) | None => (Vec::new(), true),
            };
            upstream_body.extend_from_slice(&bytes);
            if sends_body {
                stream
                    .send(
                        Request::ResponseBody(HttpBody {
                            body: bytes.clone(),
                            end_of_stream: end,
                            ..HttpBody::default()
                        }),
                        Some(served_md.clone()),
                    )
                    .await;
                let answer = stream.next().await.expect("response body answered");
                let Some(Response::ResponseBody(body)) = &answer.response else {
                    panic!("a response body chunk is answered with a body response: {answer:?}");
                };
                if duplex {
                    let mutation = body
                        .response
                        .as_ref()
                        .and_then(|c| c.body_mutation.as_ref())
                        .and_then(|m| m.mutation.as_ref());
                    let Some(body_mutation::Mutation::StreamedResponse(part)) = mutation else {
                        panic!("full duplex: the chunk comes back streamed: {answer:?}");
                    };
                    outcome.body.extend_from_slice(&part.body);
                }
            }
            if end {
                break;
            }
        }
        if !duplex {
            outcome.body = upstream_body;
        }
        // The HTTP stream is over: Envoy half-closes the ext_proc stream.
        drop(stream);
        outcome
    }
}

enum Routed {
    Immediate(Outcome),
    To {
        stream: Stream,
        destination: Vec<String>,
        forwarded: Vec<u8>,
    },
}

fn header_map(headers: &[(String, String)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.clone(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn is_immediate(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Response::ImmediateResponse(_)))
}

fn immediate(answer: &ProcessingResponse) -> Outcome {
    let Some(Response::ImmediateResponse(immediate)) = &answer.response else {
        unreachable!("checked by is_immediate");
    };
    let immediate_headers = immediate
        .headers
        .iter()
        .flat_map(|mutation| &mutation.set_headers)
        .filter_map(|option| option.header.as_ref())
        .map(|h| {
            let value = if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            };
            (h.key.to_ascii_lowercase(), value)
        })
        .collect();
    Outcome {
        status: immediate.status.as_ref().map_or(0, |s| s.code as u16),
        body: immediate.body.clone(),
        immediate: true,
        immediate_headers,
        ..Outcome::default()
    }
}

/// The destination from the `envoy.lb` dynamic metadata, checked against the header mutation
/// (the protocol forbids the two to differ).
fn destination_of(answer: &ProcessingResponse) -> Result<Vec<String>, String> {
    let metadata = answer
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("envoy.lb"))
        .and_then(|v| match &v.kind {
            Some(Kind::StructValue(s)) => s.fields.get("x-gateway-destination-endpoint"),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })
        .ok_or_else(|| format!("no envoy.lb destination in {answer:?}"))?;
    let common = match &answer.response {
        Some(Response::RequestHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b)) => b.response.as_ref(),
        _ => None,
    };
    let header = common
        .and_then(|c| c.header_mutation.as_ref())
        .and_then(|m| {
            m.set_headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == "x-gateway-destination-endpoint")
        })
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    if header.as_deref() != Some(metadata.as_str()) {
        return Err(format!(
            "header {header:?} and metadata {metadata:?} name different destinations"
        ));
    }
    if !common.is_some_and(|c| c.clear_route_cache) {
        return Err("the destination must clear the route cache".into());
    }
    Ok(metadata.split(',').map(str::to_owned).collect())
}
