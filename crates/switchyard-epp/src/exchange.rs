//! One HTTP request's ext_proc stream, as a state machine over the messages Envoy sends: the
//! request headers, the body (whole or in chunks), trailers, then the response's headers, body
//! and trailers. Each message gets the answers the proxy's mode expects:
//!
//! | request body mode | when the destination is chosen | where it is sent |
//! |---|---|---|
//! | `buffered`, `buffered-partial` | at the body (headers answered "continue" first) | the body's answer |
//! | `full-duplex-streamed` | at the body's end (nothing answered before) | the headers' answer, then the body streamed back |
//! | `streamed`, or a request without a body | at the headers (the prompt unseen: by load) | the headers' answer |
//!
//! After the pick the request is booked on its worker ([`Picked`]). The proxy reports the
//! endpoint that served it with the response; a fallback moves the booking there. The first
//! response body byte ends the prefill; the response's end (or the stream's, if the proxy goes
//! away) ends the booking and frees the admission slot.

use std::sync::Arc;

use switchyard_gateway::api::http::AppState;
use switchyard_gateway::error::ApiError;

use crate::config::{BodyMode, EppConfig};
use crate::envoy::{self, Headers};
use crate::pick::{PickInput, Picked, pick};
use crate::proto::ext_proc::processing_request::Request;
use crate::proto::ext_proc::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use crate::usage::UsageScan;

/// What the stream is waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing seen yet.
    Start,
    /// Headers seen; the body is being gathered for the pick.
    Gathering,
    /// Destination chosen; the request is on its way.
    Picked,
    /// The response has started.
    Responding,
    /// The response ended (or an immediate response was sent): nothing more to do.
    Done,
}

/// The outcome of one message: answers to send, and whether the stream is over.
#[derive(Debug, Default)]
pub struct Step {
    pub answers: Vec<ProcessingResponse>,
    pub done: bool,
}

/// One request's exchange with the proxy.
#[derive(Debug)]
pub struct Exchange {
    state: Arc<AppState>,
    config: Arc<EppConfig>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    phase: Phase,
    headers: Headers,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    picked: Option<Picked>,
    settled: bool,
    /// The completion tokens the response reports, as it streams through.
    usage: UsageScan,
}

impl Exchange {
    pub fn new(state: Arc<AppState>, config: Arc<EppConfig>) -> Self {
        Self {
            request_mode: config.request_body_mode,
            response_mode: config.response_body_mode,
            state,
            config,
            phase: Phase::Start,
            headers: Headers::default(),
            subset: None,
            body: Vec::new(),
            picked: None,
            settled: false,
            usage: UsageScan::default(),
        }
    }

    /// The booked destination, once chosen.
    pub fn picked(&self) -> Option<&Picked> {
        self.picked.as_ref()
    }

    /// Handles one message from the proxy. A message out of order is the proxy's error
    /// (`Err`, a gRPC status that ends the stream).
    pub async fn on_message(&mut self, message: ProcessingRequest) -> Result<Step, tonic::Status> {
        if let Some(protocol) = &message.protocol_config {
            self.adopt_modes(protocol.request_body_mode, protocol.response_body_mode)?;
        }
        if self.picked.is_some() && !self.settled {
            self.settle(message.metadata_context.as_ref());
        }
        let Some(request) = message.request else {
            return Err(tonic::Status::invalid_argument(
                "processing request without a request part",
            ));
        };
        match request {
            Request::RequestHeaders(headers) => {
                self.on_request_headers(headers, message.metadata_context.as_ref())
                    .await
            }
            Request::RequestBody(body) => self.on_request_body(body).await,
            Request::RequestTrailers(_) => self.on_request_trailers().await,
            Request::ResponseHeaders(headers) => Ok(self.on_response_headers(&headers)),
            Request::ResponseBody(body) => Ok(self.on_response_body(body)),
            Request::ResponseTrailers(_) => {
                self.finish();
                Ok(Step {
                    answers: vec![envoy::trailers(false)],
                    done: true,
                })
            }
        }
    }

    fn adopt_modes(&mut self, request: i32, response: i32) -> Result<(), tonic::Status> {
        let mode = |which: &str, wire: i32| {
            BodyMode::from_wire(wire).ok_or_else(|| {
                tonic::Status::invalid_argument(format!(
                    "{which} body mode {wire} is not one the endpoint picker serves (gRPC bodies are not)"
                ))
            })
        };
        self.request_mode = mode("request", request)?;
        self.response_mode = mode("response", response)?;
        Ok(())
    }

    async fn on_request_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: Option<&crate::proto::core::Metadata>,
    ) -> Result<Step, tonic::Status> {
        if self.phase != Phase::Start {
            return Err(out_of_order("request headers"));
        }
        self.headers = Headers::from_wire(headers.headers.as_ref());
        self.subset = envoy::subset_hint(metadata);
        let no_body = headers.end_of_stream || self.request_mode == BodyMode::None;
        if no_body || self.request_mode == BodyMode::Streamed {
            // The destination is needed now, before any of the prompt.
            return Ok(match self.pick(None).await {
                Ok(destination) => {
                    self.phase = Phase::Picked;
                    Step {
                        answers: vec![envoy::request_headers(
                            envoy::destination_mutation(&destination),
                            Some(envoy::destination_metadata(&destination)),
                        )],
                        done: false,
                    }
                }
                Err(err) => self.refuse(&err),
            });
        }
        self.phase = Phase::Gathering;
        let answers = match self.request_mode {
            // Envoy waits for this answer before it sends the body.
            BodyMode::Buffered | BodyMode::BufferedPartial => {
                vec![envoy::request_headers(Default::default(), None)]
            }
            _ => Vec::new(),
        };
        Ok(Step {
            answers,
            done: false,
        })
    }

    async fn on_request_body(&mut self, body: HttpBody) -> Result<Step, tonic::Status> {
        match self.phase {
            // `streamed`: chosen at the headers; each chunk goes on unchanged.
            Phase::Picked if self.request_mode == BodyMode::Streamed => {
                return Ok(Step {
                    answers: vec![envoy::request_body(Default::default(), None)],
                    done: false,
                });
            }
            Phase::Gathering => {}
            _ => return Err(out_of_order("request body")),
        }
        let limit = self.state.config.max_body_bytes;
        if self.body.len() + body.body.len() > limit {
            self.phase = Phase::Done;
            return Ok(self.refuse(&ApiError::PayloadTooLarge(limit)));
        }
        self.body.extend_from_slice(&body.body);
        let whole = body.end_of_stream
            || body.end_of_stream_without_message
            || matches!(
                self.request_mode,
                BodyMode::Buffered | BodyMode::BufferedPartial
            );
        if !whole {
            return Ok(Step::default());
        }
        Ok(self.pick_at_body(true).await)
    }

    /// Trailers end a body that did not say it ended.
    async fn on_request_trailers(&mut self) -> Result<Step, tonic::Status> {
        let mut step = match self.phase {
            Phase::Gathering => self.pick_at_body(false).await,
            Phase::Picked => Step::default(),
            _ => return Err(out_of_order("request trailers")),
        };
        if !step.done {
            step.answers.push(envoy::trailers(true));
        }
        Ok(step)
    }

    /// Chooses with the whole body and answers as the request mode wants.
    async fn pick_at_body(&mut self, end_of_stream: bool) -> Step {
        let body = std::mem::take(&mut self.body);
        let destination = match self.pick(Some(&body)).await {
            Ok(destination) => destination,
            Err(err) => return self.refuse(&err),
        };
        self.phase = Phase::Picked;
        let mutation = envoy::destination_mutation(&destination);
        let metadata = Some(envoy::destination_metadata(&destination));
        let answers = if self.request_mode == BodyMode::FullDuplexStreamed {
            let mut answers = vec![envoy::request_headers(mutation, metadata)];
            answers.extend(envoy::streamed_request_body(&body, end_of_stream));
            answers
        } else {
            vec![envoy::request_body(mutation, metadata)]
        };
        Step {
            answers,
            done: false,
        }
    }

    async fn pick(&mut self, body: Option<&[u8]>) -> Result<String, ApiError> {
        let input = PickInput {
            headers: &self.headers,
            body,
            subset: self.subset.as_deref(),
        };
        let picked = pick(&self.state, &self.config, input).await?;
        tracing::debug!(
            request_id = %picked.request_id,
            worker = %picked.routed.worker_id,
            destination = %picked.destination,
            cached_blocks = picked.routed.cached_blocks,
            "endpoint picked"
        );
        let destination = picked.destination.clone();
        self.picked = Some(picked);
        Ok(destination)
    }

    /// An immediate response with `err`'s status and OpenAI error object; the stream is over.
    fn refuse(&mut self, err: &ApiError) -> Step {
        self.phase = Phase::Done;
        self.picked = None;
        tracing::info!(status = err.status().as_u16(), error = %err, "endpoint picker refused the request");
        Step {
            answers: vec![envoy::immediate(
                err.status().as_u16(),
                &err.to_json(),
                &format!("switchyard_epp: {err}"),
                &err.headers(),
            )],
            done: true,
        }
    }

    /// The proxy says which endpoint served the request: a fallback moves the booking.
    fn settle(&mut self, metadata: Option<&crate::proto::core::Metadata>) {
        let Some(served) = envoy::served_endpoint(metadata) else {
            return;
        };
        self.settled = true;
        let Some(picked) = self.picked.as_mut() else {
            return;
        };
        match self.state.pool.worker_at_endpoint(&served) {
            Some(worker) => {
                if worker.id() != picked.routed.worker_id {
                    tracing::info!(request_id = %picked.request_id, chosen = %picked.routed.worker_id, served = %worker.id(), "served by a fallback; booking moved");
                }
                picked
                    .routed
                    .served_by(worker, &picked.request, picked.max_tokens);
            }
            None => tracing::warn!(
                request_id = %picked.request_id,
                served,
                "the proxy reports an endpoint no registered worker has; the booking stays on the chosen worker"
            ),
        }
    }

    fn on_response_headers(&mut self, headers: &HttpHeaders) -> Step {
        self.phase = Phase::Responding;
        let done = headers.end_of_stream;
        if done {
            self.finish();
        }
        Step {
            answers: vec![envoy::response_headers()],
            done,
        }
    }

    fn on_response_body(&mut self, body: HttpBody) -> Step {
        if let Some(picked) = self.picked.as_mut() {
            // The first response bytes: the engine is past the prompt.
            picked.routed.prefill_done();
            self.usage.feed(&body.body);
        }
        let end = body.end_of_stream || body.end_of_stream_without_message;
        let answer = if self.response_mode == BodyMode::FullDuplexStreamed {
            envoy::streamed_response_body(&body.body, body.end_of_stream)
        } else {
            envoy::response_body(Default::default())
        };
        if end {
            self.finish();
        }
        Step {
            answers: vec![answer],
            done: end,
        }
    }

    /// The response ended: the booking and the admission slot go, and the tenant's quota is
    /// charged the completion (as the engine reported it, else the `max_tokens` it was allowed:
    /// the picker sees no usage when the proxy does not send it the response body, or the
    /// response has none).
    fn finish(&mut self) {
        self.phase = Phase::Done;
        self.release();
    }

    /// Ends the request's hold on its worker, admission slot and quota, charging its completion.
    fn release(&mut self) {
        if let Some(picked) = self.picked.take() {
            let completion = self
                .usage
                .completion_tokens()
                .unwrap_or(u64::from(picked.max_tokens));
            picked.quota.charge(completion);
        }
    }
}

impl Drop for Exchange {
    /// The proxy went away mid-request (a cancelled client): the request is charged as if it
    /// had ended, so cancelling is no way around a token limit.
    fn drop(&mut self) {
        self.release();
    }
}

fn out_of_order(what: &str) -> tonic::Status {
    tonic::Status::failed_precondition(format!(
        "{what} out of order in the ext_proc stream (each HTTP request has one stream: request headers, body, trailers, then the response's)"
    ))
}
