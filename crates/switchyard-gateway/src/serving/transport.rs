//! The seam between dispatch and the workers: the two calls the request path makes on a
//! worker, named by its id. Production uses [`GrpcTransport`] (the workers' tonic clients, by
//! id, as the pool's followers connect and disconnect them); dispatch's unit tests
//! use scripted transports, so every retry, migration, reroute and failure path is tested
//! without killing processes. (KV pulls are the workers' own: a decode worker pulls from the
//! prefill worker, and a pull's failure reaches the gateway as a `Generate` error marked as the
//! KV source's fault.)

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use switchyard_proto::v1::{GenerateRequest, GenerateResponse, PrefillRequest, PrefillResponse};

use std::sync::Arc;

use switchyard_core::WorkerId;

use crate::cluster::pool::connections::WorkerConnections;

/// A generation's messages, as the worker streams them.
pub type GenerateStream = BoxStream<'static, Result<GenerateResponse, tonic::Status>>;

/// The calls dispatch makes on a worker.
pub trait WorkerTransport: Send + Sync + std::fmt::Debug {
    /// Starts a generation; the stream ends after the message with a finish reason, or with an
    /// error. Dropping the stream aborts the generation on the worker.
    /// A worker that is not connected (it left) fails the call as `unavailable`.
    fn generate(
        &self,
        worker: &WorkerId,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>>;

    /// Runs (or starts, pipelined) a prompt's prefill and returns the KV handle.
    fn prefill(
        &self,
        worker: &WorkerId,
        request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>>;
}

/// The workers' gRPC service, through each worker's lazily connected client, looked up by id
/// in the connections the pool's followers keep.
#[derive(Debug, Clone)]
pub struct GrpcTransport {
    connections: Arc<WorkerConnections>,
}

impl GrpcTransport {
    pub fn new(connections: Arc<WorkerConnections>) -> Self {
        Self { connections }
    }
}

impl WorkerTransport for GrpcTransport {
    fn generate(
        &self,
        worker: &WorkerId,
        request: tonic::Request<GenerateRequest>,
    ) -> BoxFuture<'static, Result<GenerateStream, tonic::Status>> {
        let client = self.connections.client_or_status(worker);
        Box::pin(async move {
            let mut client = client?;
            let response = client.generate(request).await?;
            Ok(response.into_inner().boxed())
        })
    }

    fn prefill(
        &self,
        worker: &WorkerId,
        request: tonic::Request<PrefillRequest>,
    ) -> BoxFuture<'static, Result<PrefillResponse, tonic::Status>> {
        let client = self.connections.client_or_status(worker);
        Box::pin(async move { Ok(client?.prefill(request).await?.into_inner()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::health::is_transport_failure;
    use crate::cluster::pool::test_pool::{TestPool, worker_info};

    fn prefill_call() -> tonic::Request<PrefillRequest> {
        tonic::Request::new(PrefillRequest {
            request_id: "r1".into(),
            prompt_token_ids: vec![1, 2, 3],
            ..PrefillRequest::default()
        })
    }

    #[tokio::test]
    async fn calls_reach_a_worker_by_id_while_it_is_in_the_pool() {
        let pool = TestPool::new(8, &[worker_info("w1", "m")]);
        let transport = GrpcTransport::new(Arc::clone(&pool.followers.context().connections));
        let id = WorkerId::new("w1").unwrap();

        // Connected: the call dials the worker's address (nothing listens on port 1), so it
        // fails in the transport, not for want of a client.
        let status = transport.prefill(&id, prefill_call()).await.unwrap_err();
        assert!(is_transport_failure(&status), "{status:?}");

        // Gone: the client went with it; the call fails at once, naming the worker.
        pool.remove_worker(&id);
        for status in [
            transport.prefill(&id, prefill_call()).await.unwrap_err(),
            transport
                .generate(&id, tonic::Request::new(GenerateRequest::default()))
                .await
                .err()
                .expect("no client"),
        ] {
            assert_eq!(status.code(), tonic::Code::Unavailable);
            assert!(!is_transport_failure(&status), "{status:?}");
            assert!(
                status.message().contains("w1 is not connected"),
                "{status:?}"
            );
        }
        pool.shutdown().await;
    }
}
