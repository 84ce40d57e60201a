//! The seam between dispatch and the workers: the two calls the request path makes on a
//! worker. Production uses [`GrpcTransport`] (the worker's tonic client); dispatch's unit tests
//! use scripted transports, so every retry, migration, reroute and failure path is tested
//! without killing processes. (KV pulls are the workers' own: a decode worker pulls from the
//! prefill worker, and a pull's failure reaches the gateway as a `Generate` error marked as the
//! KV source's fault.)

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use switchyard_proto::v1::{GenerateRequest, GenerateResponse, PrefillRequest, PrefillResponse};

use crate::cluster::pool::WorkerHandle;

/// A generation's messages, as the worker streams them.
pub type GenerateStream = BoxStream<'static, Result<GenerateResponse, tonic::Status>>;

/// The calls dispatch makes on a worker.
pub trait WorkerTransport: Send + Sync + std::fmt::Debug {
    /// Starts a generation; the stream ends after the message with a finish reason, or with an
    /// error. Dropping the stream aborts the generation on the worker.
    fn generate(
        &self,
        worker: &WorkerHandle,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>>;

    /// Runs (or starts, pipelined) a prompt's prefill and returns the KV handle.
    fn prefill(
        &self,
        worker: &WorkerHandle,
        request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>>;
}

/// The workers' gRPC service, through each worker's lazily connected client.
#[derive(Debug, Default, Clone, Copy)]
pub struct GrpcTransport;

impl WorkerTransport for GrpcTransport {
    fn generate(
        &self,
        worker: &WorkerHandle,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>> {
        let mut client = worker.client.clone();
        Box::pin(async move {
            let response = client.generate(request).await?;
            Ok(response.into_inner().boxed())
        })
    }

    fn prefill(
        &self,
        worker: &WorkerHandle,
        request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>> {
        let mut client = worker.client.clone();
        Box::pin(async move { Ok(client.prefill(request).await?.into_inner()) })
    }
}
