//! The ext_proc gRPC service: one [`Exchange`] per stream, driven by a task the server owns,
//! with the gRPC health service the protocol asks for (`liveness`, `readiness` and the
//! ext_proc service's own name).

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use switchyard_gateway::api::http::AppState;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};

use crate::config::EppConfig;
use crate::exchange::Exchange;
use crate::proto::ext_proc::external_processor_server::ExternalProcessor;
use crate::proto::ext_proc::{ProcessingRequest, ProcessingResponse};

/// The service name Envoy's ext_proc filter calls (and the health service reports).
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The endpoint picker's ext_proc service.
#[derive(Debug, Clone)]
pub struct EndpointPicker {
    state: Arc<AppState>,
    config: Arc<EppConfig>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl EndpointPicker {
    pub fn new(
        state: Arc<AppState>,
        config: Arc<EppConfig>,
        tasks: TaskTracker,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            state,
            config,
            tasks,
            shutdown,
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        // Answers wait here while the proxy reads them; a few per message at most.
        let (answers_tx, answers_rx) = mpsc::channel(16);
        let exchange = Exchange::new(Arc::clone(&self.state), Arc::clone(&self.config));
        self.tasks
            .spawn(drive(exchange, inbound, answers_tx, self.shutdown.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(answers_rx))))
    }
}

/// Runs one stream until the request's response ends, the proxy goes away or the picker
/// shuts down. The exchange (its booking, its admission slot) is dropped when this returns.
async fn drive(
    mut exchange: Exchange,
    mut inbound: Streaming<ProcessingRequest>,
    answers_tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    shutdown: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            message = inbound.next() => message,
            // The client side of the answer stream closed: the proxy cancelled.
            () = answers_tx.closed() => return,
            () = shutdown.cancelled() => {
                let _ = answers_tx
                    .send(Err(Status::unavailable("the endpoint picker is shutting down")))
                    .await;
                return;
            }
        };
        let message = match message {
            Some(Ok(message)) => message,
            // The stream ended (the HTTP request is over) or was cancelled.
            None => return,
            Some(Err(status)) => {
                tracing::debug!(error = %status, "ext_proc stream ended with an error");
                return;
            }
        };
        let step = tokio::select! {
            step = exchange.on_message(message) => step,
            // A request waiting for admission or tokenization whose proxy went away.
            () = answers_tx.closed() => return,
        };
        match step {
            Ok(step) => {
                for answer in step.answers {
                    if answers_tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
                if step.done {
                    return;
                }
            }
            Err(status) => {
                tracing::warn!(error = %status, "ext_proc stream refused");
                let _ = answers_tx.send(Err(status)).await;
                return;
            }
        }
    }
}
