//! KV-event ingestion stage by stage, in one run (issue 43): a recorded-like stream of `Stored`
//! events of 16 blocks (and the `Removed` events that keep each worker under its capacity),
//! encoded as the `KvEventsResponse` messages a worker sends, applied three ways:
//!
//! 1. `index`: the core events straight into a `PrefixIndex` (hashes verified, as the gateway
//!    configures it): what the index alone costs;
//! 2. `decode + ingest`: each message decoded from its protobuf bytes (what tonic does for a
//!    stream message) and applied by `pool::ingest`, the subscriber's pure step;
//! 3. `subscriber`: the same bytes through `pool::subscriber::apply`, the gateway's own path
//!    (the model's routes lock, metrics, the audit's event note, the recorder's check, the
//!    indexed-blocks gauge), one event per message and in batches of 64
//!    (`KvEventsRequest.max_batch_events`, what the gateway asks for);
//! 4. `gRPC`: the messages streamed by a tonic server over loopback TCP to a tonic client, each
//!    through `subscriber::apply`, server and client on one thread (so the figure is the CPU
//!    of both ends: an upper bound of the gateway's own), one per message and batched.
//!
//! Each stage starts from an empty index. Each is timed by this thread's CPU time (the
//! scheduler's account, `/proc/thread-self/schedstat`): events per second per core and CPU per
//! event, with the ratio to the index alone, which on a loaded machine do not count the time
//! other processes held the core; the wall-clock time per event is printed beside them.
//!
//! `cargo bench -p switchyard-gateway --bench ingest [-- EVENTS WORKERS]` (default 200000 64)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::VecDeque;
use std::hint::black_box;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use prost::Message;
use switchyard_core::{
    BlockHash, BlockSize, KvEvent, StorageTier, StoredBlock, WorkerId, block_hashes,
};
use switchyard_gateway::cluster::pool::ModelRoutes;
use switchyard_gateway::cluster::pool::ingest::{Cursor, ingest};
use switchyard_gateway::cluster::pool::subscriber;
use switchyard_proto::convert::kv_event_to_wire;
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_proto::v1::worker_server::{Worker, WorkerServer};
use switchyard_proto::v1::{self, kv_events_response::Payload};
use switchyard_router::{IndexConfig, PrefixIndex};
use tonic::{Request, Response, Status};

const BLOCKS_PER_EVENT: usize = 16;
/// Events per message when batched: what the gateway's subscriber asks workers for.
const BATCH: usize = 64;
/// Blocks a worker holds before its oldest stores are removed.
const WORKER_CAPACITY: usize = 8192;
/// Leading blocks every request of a worker shares (a system prompt).
const SHARED_BLOCKS: usize = 4;

/// One worker's event, in order.
struct Recorded {
    worker: usize,
    seq: u64,
    event: KvEvent,
}

/// `events` events over `workers` workers, interleaved: each request stores 1–4 events of 16
/// blocks chained from a shared prefix; removals keep each worker under its capacity.
fn record(events: usize, workers: usize) -> Vec<Recorded> {
    let bs = BlockSize::new(support::BLOCK_SIZE).unwrap();
    let mut rng = support::Rng(43);
    let shared: Vec<u32> = support::prompt_tokens(SHARED_BLOCKS * bs.as_usize(), 1);
    let mut seqs = vec![0u64; workers];
    let mut held: Vec<VecDeque<Vec<BlockHash>>> = vec![VecDeque::new(); workers];
    let mut counts = vec![0usize; workers];
    let mut out = Vec::with_capacity(events + events / 4);
    while out.len() < events {
        let worker = (rng.next() % workers as u64) as usize;
        let parts = 1 + (rng.next() % 4) as usize;
        let mut tokens = shared.clone();
        tokens.extend(support::prompt_tokens(
            parts * BLOCKS_PER_EVENT * bs.as_usize(),
            rng.next(),
        ));
        let hashes = block_hashes(&tokens, bs);
        for part in 0..parts {
            let first = SHARED_BLOCKS + part * BLOCKS_PER_EVENT;
            let blocks: Vec<StoredBlock> = (first..first + BLOCKS_PER_EVENT)
                .map(|b| StoredBlock {
                    hash: hashes[b],
                    tokens: tokens[b * bs.as_usize()..(b + 1) * bs.as_usize()].to_vec(),
                })
                .collect();
            let stored: Vec<BlockHash> = blocks.iter().map(|b| b.hash).collect();
            let event = KvEvent::Stored {
                parent: Some(hashes[first - 1]),
                blocks,
                tier: StorageTier::Device,
            };
            out.push(Recorded {
                worker,
                seq: seqs[worker],
                event,
            });
            seqs[worker] += 1;
            counts[worker] += stored.len();
            held[worker].push_back(stored);
            while counts[worker] > WORKER_CAPACITY {
                let oldest = held[worker].pop_front().unwrap();
                counts[worker] -= oldest.len();
                out.push(Recorded {
                    worker,
                    seq: seqs[worker],
                    event: KvEvent::Removed {
                        blocks: oldest,
                        tier: StorageTier::Device,
                    },
                });
                seqs[worker] += 1;
            }
        }
    }
    out
}

/// The shared prefix every worker holds before the stream: a snapshot message per worker.
fn starts(workers: usize) -> Vec<v1::KvEventsResponse> {
    let bs = BlockSize::new(support::BLOCK_SIZE).unwrap();
    let shared = support::prompt_tokens(SHARED_BLOCKS * bs.as_usize(), 1);
    let hashes = block_hashes(&shared, bs);
    (0..workers)
        .map(|w| v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: format!("sim-{w}"),
            incarnation: 1,
            payload: Some(Payload::Snapshot(v1::Snapshot {
                next_seq: 0,
                blocks: hashes
                    .iter()
                    .enumerate()
                    .map(|(i, h)| v1::SnapshotBlock {
                        hash: h.get(),
                        parent: i.checked_sub(1).map(|p| hashes[p].get()),
                        tier: 0,
                    })
                    .collect(),
            })),
        })
        .collect()
}

/// A fresh index that has taken every worker's starting snapshot, with the workers' cursors.
fn started_index(ids: &[WorkerId]) -> (PrefixIndex, Vec<Cursor>) {
    let mut index = PrefixIndex::new(IndexConfig::new(
        BlockSize::new(support::BLOCK_SIZE).unwrap(),
    ));
    let mut cursors = vec![Cursor::default(); ids.len()];
    for (w, start) in starts(ids.len()).into_iter().enumerate() {
        ingest(&mut index, &ids[w], &mut cursors[w], start);
    }
    (index, cursors)
}

/// A fresh pool whose subscriber step has taken every worker's starting snapshot.
fn started_pool(workers: usize) -> (support::Pool, Arc<ModelRoutes>, Vec<WorkerId>, Vec<Cursor>) {
    let (pool, routes, ids) = support::empty_pool(workers);
    let mut cursors = vec![Cursor::default(); workers];
    for (w, start) in starts(workers).into_iter().enumerate() {
        assert!(subscriber::apply(
            &pool,
            pool.followers.context(),
            &routes,
            &ids[w],
            &mut cursors[w],
            start
        ));
    }
    (pool, routes, ids, cursors)
}

/// What a stage took: this thread's CPU time and the wall clock's.
#[derive(Debug, Clone, Copy)]
struct Took {
    cpu: Duration,
    wall: Duration,
}

struct Clock {
    cpu: Duration,
    wall: Instant,
}

impl Clock {
    fn start() -> Self {
        Self {
            cpu: support::thread_cpu(),
            wall: Instant::now(),
        }
    }

    fn took(&self) -> Took {
        Took {
            cpu: support::thread_cpu().saturating_sub(self.cpu),
            wall: self.wall.elapsed(),
        }
    }
}

fn report(stage: &str, events: usize, blocks: u64, took: Took, index_alone: Option<Took>) {
    let cpu = took.cpu.as_secs_f64();
    let per_s = events as f64 / cpu;
    let us = cpu * 1e6 / events as f64;
    let wall_us = took.wall.as_secs_f64() * 1e6 / events as f64;
    let ratio = index_alone.map_or_else(
        || "1.00×".to_owned(),
        |alone| format!("{:.2}×", cpu / alone.cpu.as_secs_f64()),
    );
    println!(
        "| {stage} | {per_s:>12.0} | {us:>8.2} | {wall_us:>8.2} | {:>12.0} | {ratio} |",
        blocks as f64 / cpu
    );
}

/// The recorded events as the messages workers send: one event each (`batch` ≤ 1), or each
/// worker's events in order, at most `batch` per message, the workers' batches taken in turn
/// (each worker has a stream of its own, which batches what it has ready).
fn messages(recorded: &[Recorded], batch: usize) -> Vec<v1::KvEventsResponse> {
    // Stamped as live events are, so the lag's clock read is in the figure.
    let stamp = switchyard_core::time::unix_micros();
    let message = |worker: usize, payload| v1::KvEventsResponse {
        logged_at_unix_us: stamp,
        worker_id: format!("sim-{worker}"),
        incarnation: 1,
        payload: Some(payload),
    };
    if batch <= 1 {
        return recorded
            .iter()
            .map(|r| message(r.worker, Payload::Event(kv_event_to_wire(r.seq, &r.event))))
            .collect();
    }
    let workers = recorded.iter().map(|r| r.worker + 1).max().unwrap_or(0);
    let mut per_worker: Vec<Vec<&Recorded>> = vec![Vec::new(); workers];
    for r in recorded {
        per_worker[r.worker].push(r);
    }
    let mut queues: Vec<_> = per_worker
        .iter()
        .map(|events| events.chunks(batch))
        .collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for (worker, queue) in queues.iter_mut().enumerate() {
            if let Some(chunk) = queue.next() {
                let events = chunk
                    .iter()
                    .map(|r| kv_event_to_wire(r.seq, &r.event))
                    .collect();
                out.push(message(worker, Payload::Batch(v1::KvEventBatch { events })));
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

/// The worker a message came from (`sim-N`).
fn worker_of(message: &v1::KvEventsResponse) -> usize {
    message.worker_id["sim-".len()..].parse().unwrap()
}

/// Decodes each message from its bytes and applies it through the gateway's subscriber step,
/// into a fresh pool; returns the time taken.
fn through_subscriber(workers: usize, wire: &[Vec<u8>], events: usize) -> Took {
    let (pool, routes, ids, mut cursors) = started_pool(workers);
    let t = Clock::start();
    for bytes in wire {
        let message = v1::KvEventsResponse::decode(bytes.as_slice()).unwrap();
        let w = worker_of(&message);
        assert!(subscriber::apply(
            &pool,
            pool.followers.context(),
            &routes,
            &ids[w],
            &mut cursors[w],
            message
        ));
    }
    let took = t.took();
    assert_eq!(
        pool.observers.metrics.kv_events_applied.get(),
        events as u64
    );
    took
}

/// Streams `messages` from a tonic server to a tonic client over loopback TCP, each through
/// the subscriber step, on the calling (current-thread) runtime; returns the time taken.
async fn through_grpc(workers: usize, messages: Vec<v1::KvEventsResponse>, events: usize) -> Took {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServer::new(Recorder(Arc::new(
                std::sync::Mutex::new(Some(messages)),
            ))))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut client = WorkerClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let (pool, routes, ids, mut cursors) = started_pool(workers);
    let t = Clock::start();
    let mut stream = client
        .kv_events(v1::KvEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    while let Some(message) = stream.next().await {
        let message = message.unwrap();
        let w = worker_of(&message);
        assert!(subscriber::apply(
            &pool,
            pool.followers.context(),
            &routes,
            &ids[w],
            &mut cursors[w],
            message
        ));
    }
    let took = t.took();
    assert_eq!(
        pool.observers.metrics.kv_events_applied.get(),
        events as u64
    );
    server.abort();
    took
}

/// A worker that streams a recording (once) and answers nothing else.
struct Recorder(Arc<std::sync::Mutex<Option<Vec<v1::KvEventsResponse>>>>);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn only_events<T>() -> Result<T, Status> {
    Err(Status::unimplemented(
        "this bench's worker only streams KV events",
    ))
}

#[tonic::async_trait]
impl Worker for Recorder {
    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::WorkerInfo>, Status> {
        only_events()
    }

    type GenerateStream = BoxStream<v1::GenerateResponse>;

    async fn generate(
        &self,
        _: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        only_events()
    }

    async fn prefill(
        &self,
        _: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        only_events()
    }

    type PullKvStream = BoxStream<v1::KvChunk>;

    async fn pull_kv(
        &self,
        _: Request<v1::PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        only_events()
    }

    type KvEventsStream = BoxStream<v1::KvEventsResponse>;

    async fn kv_events(
        &self,
        _: Request<v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        let messages = self.0.lock().unwrap().take().unwrap_or_default();
        Ok(Response::new(Box::pin(futures::stream::iter(
            messages.into_iter().map(Ok),
        ))))
    }

    type LoadStatsStream = BoxStream<v1::LoadReport>;

    async fn load_stats(
        &self,
        _: Request<v1::LoadStatsRequest>,
    ) -> Result<Response<Self::LoadStatsStream>, Status> {
        only_events()
    }

    async fn control(
        &self,
        _: Request<v1::ControlRequest>,
    ) -> Result<Response<v1::ControlResponse>, Status> {
        only_events()
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let events = args.first().copied().unwrap_or(200_000);
    let workers = args.get(1).copied().unwrap_or(64).max(1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();

    let recorded = record(events, workers);
    let blocks: u64 = recorded.iter().map(|r| r.event.block_count() as u64).sum();
    let n = recorded.len();
    let single = messages(&recorded, 1);
    let batched = messages(&recorded, BATCH);
    let wire = |messages: &[v1::KvEventsResponse]| -> Vec<Vec<u8>> {
        messages.iter().map(Message::encode_to_vec).collect()
    };
    let (single_wire, batched_wire) = (wire(&single), wire(&batched));
    println!(
        "{n} events ({blocks} blocks) over {workers} workers; {} bytes on the wire one per \
         message, {} in {} batches of at most {BATCH}",
        single_wire.iter().map(Vec::len).sum::<usize>(),
        batched_wire.iter().map(Vec::len).sum::<usize>(),
        batched.len(),
    );
    println!(
        "| stage | events/s per core | CPU µs/event | wall µs/event | blocks/s per core | \
         × index alone (CPU) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");

    // 1. The index alone.
    let (_, _, ids) = support::empty_pool(workers);
    let (mut index, _) = started_index(&ids);
    let t = Clock::start();
    for r in &recorded {
        black_box(index.apply(&ids[r.worker], 1, r.seq, &r.event).unwrap());
    }
    let alone = t.took();
    report("index alone", n, blocks, alone, None);

    // 2. Decoded from the wire and applied by the subscriber's pure step.
    let (mut index, mut cursors) = started_index(&ids);
    let t = Clock::start();
    for bytes in &single_wire {
        let message = v1::KvEventsResponse::decode(bytes.as_slice()).unwrap();
        let w = worker_of(&message);
        black_box(ingest(&mut index, &ids[w], &mut cursors[w], message));
    }
    report(
        "decode + ingest, one per message",
        n,
        blocks,
        t.took(),
        Some(alone),
    );

    // 3. The gateway's subscriber step, side effects and all.
    let took = through_subscriber(workers, &single_wire, n);
    report(
        "decode + subscriber, one per message",
        n,
        blocks,
        took,
        Some(alone),
    );
    let took = through_subscriber(workers, &batched_wire, n);
    let label = format!("decode + subscriber, batches of {BATCH}");
    report(&label, n, blocks, took, Some(alone));

    // 4. Over gRPC.
    let took = rt.block_on(through_grpc(workers, single, n));
    report(
        "gRPC + subscriber, one per message",
        n,
        blocks,
        took,
        Some(alone),
    );
    let took = rt.block_on(through_grpc(workers, batched, n));
    let label = format!("gRPC + subscriber, batches of {BATCH}");
    report(&label, n, blocks, took, Some(alone));
}
