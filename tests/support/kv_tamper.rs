//! A gRPC proxy in front of one worker that passes every call through but can tamper with the
//! KV event stream on its way to the gateway (the worker advertises the proxy's address):
//!
//! - [`Tamper::Pass`] forwards everything as it comes;
//! - [`Tamper::EmptyRemovals`] forwards every event but strips the blocks out of `Removed`
//!   events, keeping their sequence numbers, so the loss is invisible to gap detection: the
//!   gateway's index keeps blocks the worker evicted (a lost removal, as in aibrix#2287);
//! - [`Tamper::Cut`] forwards nothing on the KV event stream (events and digests), keeping the
//!   stream open, as a publisher that stopped would.
//!
//! The server task is owned by the [`KvTamper`]: dropping it ends the proxy.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use futures::{Stream, StreamExt};
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_proto::v1::worker_server::{Worker, WorkerServer};
use switchyard_proto::v1::{self, kv_event, kv_events_response::Payload};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// What the proxy does to the KV event stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tamper {
    Pass = 0,
    EmptyRemovals = 1,
    Cut = 2,
}

#[derive(Debug, Default)]
struct Shared {
    mode: AtomicU8,
    /// `Removed` events whose blocks were stripped, and payloads swallowed by a cut.
    emptied: AtomicU64,
    swallowed: AtomicU64,
}

/// The running proxy.
pub struct KvTamper {
    address: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KvTamper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KvTamper {
    /// Starts a proxy on a free loopback port in front of the worker at `upstream`.
    pub async fn start(upstream: SocketAddr, mode: Tamper) -> KvTamper {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the tamper proxy");
        let address = listener.local_addr().expect("proxy address");
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{upstream}"))
            .expect("upstream address")
            .connect_lazy();
        let shared = Arc::new(Shared::default());
        shared.mode.store(mode as u8, Ordering::Relaxed);
        let proxy = Proxy {
            upstream: WorkerClient::new(channel),
            shared: Arc::clone(&shared),
        };
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(WorkerServer::new(proxy))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        KvTamper {
            address,
            shared,
            task,
        }
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    pub fn set(&self, mode: Tamper) {
        self.shared.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// `Removed` events whose blocks the proxy stripped so far.
    pub fn emptied(&self) -> u64 {
        self.shared.emptied.load(Ordering::Relaxed)
    }
}

struct Proxy {
    upstream: WorkerClient<Channel>,
    shared: Arc<Shared>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Worker for Proxy {
    async fn info(&self, r: Request<v1::InfoRequest>) -> Result<Response<v1::WorkerInfo>, Status> {
        self.upstream.clone().info(r.into_inner()).await
    }

    type GenerateStream = Streaming<v1::GenerateResponse>;

    async fn generate(
        &self,
        r: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.upstream.clone().generate(r.into_inner()).await
    }

    async fn prefill(
        &self,
        r: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        self.upstream.clone().prefill(r.into_inner()).await
    }

    type PullKvStream = Streaming<v1::KvChunk>;

    async fn pull_kv(
        &self,
        r: Request<v1::PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        self.upstream.clone().pull_kv(r.into_inner()).await
    }

    type KvEventsStream = BoxStream<v1::KvEventsResponse>;

    async fn kv_events(
        &self,
        r: Request<v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        let upstream = self.upstream.clone().kv_events(r.into_inner()).await?;
        let shared = Arc::clone(&self.shared);
        let stream = upstream.into_inner().filter_map(move |item| {
            let shared = Arc::clone(&shared);
            async move {
                let Ok(mut message) = item else {
                    return Some(item);
                };
                match shared.mode.load(Ordering::Relaxed) {
                    m if m == Tamper::Cut as u8 => {
                        shared.swallowed.fetch_add(1, Ordering::Relaxed);
                        return None;
                    }
                    m if m == Tamper::EmptyRemovals as u8 => {
                        // Alone or in a batch (the gateway asks for batches).
                        let events = match message.payload.as_mut() {
                            Some(Payload::Event(event)) => std::slice::from_mut(event),
                            Some(Payload::Batch(batch)) => batch.events.as_mut_slice(),
                            _ => &mut [],
                        };
                        for event in events {
                            if let Some(kv_event::Kind::Removed(removed)) = event.kind.as_mut()
                                && !removed.blocks.is_empty()
                            {
                                removed.blocks.clear();
                                shared.emptied.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    _ => {}
                }
                Some(Ok(message))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type LoadStatsStream = Streaming<v1::LoadReport>;

    async fn load_stats(
        &self,
        r: Request<v1::LoadStatsRequest>,
    ) -> Result<Response<Self::LoadStatsStream>, Status> {
        self.upstream.clone().load_stats(r.into_inner()).await
    }

    async fn control(
        &self,
        r: Request<v1::ControlRequest>,
    ) -> Result<Response<v1::ControlResponse>, Status> {
        self.upstream.clone().control(r.into_inner()).await
    }
}
