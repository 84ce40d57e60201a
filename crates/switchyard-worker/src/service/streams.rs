//! The response streams of the Worker service: a generation's tokens, a KV pull's chunks, and
//! the KV event stream. Each owns what must live as long as its stream (the in-flight guard,
//! the span, the request's metrics record, the hold on pulled blocks).

use std::sync::Arc;

use futures::StreamExt;
use switchyard_proto::convert::{kv_event_to_wire, snapshot_block_to_wire};
use switchyard_proto::{ErrorCode, v1};
use switchyard_telemetry::record_error;
use tokio::sync::broadcast;
use tonic::Status;

use super::{BoxStream, finish_code, finish_name, finish_to_wire};
use crate::engine::{KvPiece, KvPull};
use crate::event_log::{SequencedEvent, Subscription, SubscriptionStart};
use crate::kv_source::ChunkStream;
use crate::metrics::{RequestKind, RequestRecord};
use crate::state::InFlightGuard;

/// The gRPC stream of a started generation. It holds the in-flight guard and the span until it
/// ends, and counts the request: at its end, its error, or its drop (`cancelled`).
pub(super) fn stream_generate(
    engine_stream: ChunkStream,
    in_flight: InFlightGuard,
    span: tracing::Span,
    record: RequestRecord,
) -> BoxStream<v1::GenerateResponse> {
    let mut record = Some(record);
    let mut first_token = true;
    let stream = engine_stream.map(move |item| {
        // The guard lives as long as the stream: the request is in flight until then. So
        // does the span, which ends with the generation.
        if let Ok(chunk) = &item {
            if first_token && !chunk.tokens.is_empty() {
                first_token = false;
                in_flight.prefill_done();
            }
            if let Some(r) = record.as_mut() {
                r.tokens_sent(chunk.tokens.len());
            }
            if let Some(finish) = chunk.finish {
                span.record(
                    "cached_prompt_tokens",
                    i64::from(chunk.cached_prompt_tokens),
                );
                span.record("completion_tokens", i64::from(chunk.completion_tokens));
                span.record("finish_reason", finish_name(finish));
                if let Some(r) = record.take() {
                    r.metrics().tokens(
                        RequestKind::Generate,
                        chunk.prompt_tokens,
                        chunk.cached_prompt_tokens,
                        chunk.completion_tokens,
                    );
                    r.finish(finish_code(finish));
                }
            }
        }
        if let Err(err) = &item {
            record_error(&span, err.to_string());
            if let Some(r) = record.take() {
                r.finish(Status::from(err.clone()).code());
            }
        }
        item.map(|chunk| v1::GenerateResponse {
            token_ids: chunk.tokens,
            finish_reason: finish_to_wire(chunk.finish),
            cached_prompt_tokens: chunk.cached_prompt_tokens,
            prompt_tokens: chunk.prompt_tokens,
            completion_tokens: chunk.completion_tokens,
            logprobs: chunk.logprobs.iter().map(v1::TokenLogprob::from).collect(),
        })
        .map_err(Status::from)
    });
    Box::pin(stream)
}

pub(super) fn start_messages(start: SubscriptionStart) -> Vec<v1::kv_events_response::Payload> {
    match start {
        SubscriptionStart::Replay(events) => events
            .iter()
            .map(|e| v1::kv_events_response::Payload::Event(kv_event_to_wire(e.seq, &e.event)))
            .collect(),
        SubscriptionStart::Snapshot {
            next_seq, blocks, ..
        } => {
            vec![v1::kv_events_response::Payload::Snapshot(v1::Snapshot {
                next_seq,
                blocks: blocks.iter().map(snapshot_block_to_wire).collect(),
            })]
        }
    }
}

/// Drives one KV pull: each piece the engine hands over (all blocks at once, or one prefill
/// chunk's blocks while a pipelined prefill runs) goes out in chunks of at most `per_chunk`
/// blocks as soon as it arrives; only that piece's blocks are converted. The request is
/// counted when its last chunk goes out (the puller drops the stream then) or it fails.
pub(super) struct PullState {
    pub(super) record: Option<RequestRecord>,
    pub(super) pull: KvPull,
    pub(super) per_chunk: usize,
    pub(super) bytes_per_token: u64,
    pub(super) next_block: usize,
    pub(super) pending: std::collections::VecDeque<v1::KvChunk>,
    pub(super) done: bool,
    /// This worker's KV layout, announced on the first chunk (then `None`); `None` from the
    /// start for engines without one.
    pub(super) layout: Option<v1::KvLayout>,
    pub(super) sent: PullSent,
    /// `serve_pull`: ends when the stream is dropped.
    pub(super) span: tracing::Span,
}

/// What a pull has sent so far, for its span.
#[derive(Debug, Default)]
pub(super) struct PullSent {
    chunks: u64,
    blocks: u64,
    bytes: u64,
}

impl PullState {
    pub(super) async fn next_chunk(&mut self) -> Option<Result<v1::KvChunk, Status>> {
        loop {
            if let Some(mut chunk) = self.pending.pop_front() {
                if let Some(layout) = self.layout.take() {
                    chunk.layout = Some(layout);
                }
                if chunk.last {
                    self.finish(tonic::Code::Ok);
                }
                return Some(Ok(chunk));
            }
            if self.done {
                return None;
            }
            let status = match self.pull.next_piece().await {
                None => ErrorCode::Unavailable
                    .status("the prefill ended before its last kv chunk (engine stopped)"),
                Some(Err(err)) => err.into(),
                Some(Ok(piece)) => {
                    self.split(piece);
                    continue;
                }
            };
            self.done = true;
            self.finish(status.code());
            return Some(Err(status));
        }
    }

    fn finish(&mut self, code: tonic::Code) {
        if let Some(record) = self.record.take() {
            record.finish(code);
        }
    }

    /// Counts what went out on the span (as it goes, so a pull the decode side abandons still
    /// shows how far it got) and marks the span failed on an error.
    pub(super) fn note(&mut self, item: &Result<v1::KvChunk, Status>) {
        match item {
            Ok(chunk) => {
                self.sent.chunks += 1;
                self.sent.blocks += chunk.blocks.len() as u64;
                self.sent.bytes += chunk.bytes;
                self.span.record("chunks", self.sent.chunks as i64);
                self.span.record("blocks", self.sent.blocks as i64);
                self.span.record("bytes", self.sent.bytes as i64);
            }
            Err(status) => record_error(&self.span, status.message()),
        }
    }

    fn split(&mut self, piece: KvPiece) {
        if let Some(record) = &self.record {
            let tokens: u64 = piece.blocks.iter().map(|b| b.tokens.len() as u64).sum();
            let metrics = record.metrics();
            metrics.blocks_served(piece.blocks.len() as u64, tokens * self.bytes_per_token);
            if piece.last {
                metrics.tokens(RequestKind::Prefill, 0, piece.cached_prompt_tokens, 0);
            }
        }
        for blocks in piece.blocks.chunks(self.per_chunk) {
            let tokens: u64 = blocks.iter().map(|b| b.tokens.len() as u64).sum();
            self.pending.push_back(v1::KvChunk {
                first_block: self.next_block as u32,
                bytes: tokens * self.bytes_per_token,
                blocks: blocks
                    .iter()
                    .map(|b| v1::KvBlock {
                        hash: b.hash.get(),
                        token_ids: b.tokens.clone(),
                    })
                    .collect(),
                ..Default::default()
            });
            self.next_block += blocks.len();
        }
        if !piece.last {
            return;
        }
        self.done = true;
        if self.pending.is_empty() {
            self.pending.push_back(v1::KvChunk {
                first_block: self.next_block as u32,
                ..Default::default()
            });
        }
        if let Some(last) = self.pending.back_mut() {
            last.last = true;
            last.first_token_id = piece.first_token;
            last.cached_prompt_tokens = piece.cached_prompt_tokens;
        }
    }
}

/// What a KV digest says the worker is, besides its blocks (see `KvDigest` in the proto).
#[derive(Debug, Clone)]
pub(super) struct DigestIdentity {
    pub(super) model: String,
    pub(super) block_size: switchyard_core::BlockSize,
}

/// Drives one KV event stream: the start (replay or snapshot), then live events; when the
/// consumer lags behind the live channel it resumes from the log itself, so it never skips.
/// With a digest interval, a `KvDigest` of what the events sent so far leave in place goes out
/// between events at that interval.
pub(super) struct EventStreamState {
    pub(super) log: Arc<crate::event_log::EventLog>,
    pub(super) pending: std::collections::VecDeque<v1::kv_events_response::Payload>,
    pub(super) live: broadcast::Receiver<Arc<SequencedEvent>>,
    /// Sequence number the consumer expects next, once known.
    pub(super) next_seq: Option<u64>,
    /// The digest of the view once everything sent (and pending) is applied, with its
    /// sequence number.
    pub(super) at: (u64, switchyard_core::BlockSetDigest),
    pub(super) digest_every: Option<tokio::time::Interval>,
    pub(super) identity: DigestIdentity,
}

/// Shortest digest interval a consumer may ask for.
const MIN_DIGEST_INTERVAL_MS: u32 = 100;

/// The digest timer for an asked interval (0: none); its first tick is one interval away.
pub(super) fn digest_timer(interval_ms: u32) -> Option<tokio::time::Interval> {
    if interval_ms == 0 {
        return None;
    }
    let period =
        std::time::Duration::from_millis(u64::from(interval_ms.max(MIN_DIGEST_INTERVAL_MS)));
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    Some(timer)
}

impl EventStreamState {
    pub(super) async fn next_payload(&mut self) -> Option<v1::kv_events_response::Payload> {
        loop {
            if let Some(payload) = self.pending.pop_front() {
                self.note_sent(&payload);
                return Some(payload);
            }
            let Self {
                live, digest_every, ..
            } = self;
            let tick = async {
                match digest_every.as_mut() {
                    Some(timer) => {
                        timer.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let received = tokio::select! {
                biased;
                received = live.recv() => received,
                () = tick => return Some(self.digest_payload()),
            };
            match received {
                Ok(event) => {
                    // Events already covered by the replay or snapshot are skipped.
                    if self.next_seq.is_some_and(|next| event.seq < next) {
                        continue;
                    }
                    let payload = v1::kv_events_response::Payload::Event(kv_event_to_wire(
                        event.seq,
                        &event.event,
                    ));
                    self.at = (event.seq + 1, event.digest);
                    self.note_sent(&payload);
                    return Some(payload);
                }
                Err(broadcast::error::RecvError::Lagged(skipped)) => {
                    tracing::debug!(skipped, "kv event consumer lagged; resuming from the log");
                    let Subscription { start, live, at } =
                        self.log.subscribe(self.next_seq, self.log.incarnation());
                    self.live = live;
                    self.at = at;
                    self.pending = start_messages(start).into();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    /// The digest of what the events sent so far leave in place (only sent when nothing is
    /// pending, so it is exactly the consumer's position).
    fn digest_payload(&self) -> v1::kv_events_response::Payload {
        let (next_seq, digest) = self.at;
        v1::kv_events_response::Payload::Digest(v1::KvDigest {
            next_seq,
            blocks: digest.blocks,
            sum: digest.sum,
            model: self.identity.model.clone(),
            block_size: self.identity.block_size.get(),
            hash_scheme: switchyard_core::HASH_SCHEME.to_owned(),
            hash_probe: switchyard_core::hash_probe(self.identity.block_size),
        })
    }

    fn note_sent(&mut self, payload: &v1::kv_events_response::Payload) {
        self.next_seq = Some(match payload {
            v1::kv_events_response::Payload::Event(e) => e.seq + 1,
            v1::kv_events_response::Payload::Snapshot(s) => s.next_seq,
            v1::kv_events_response::Payload::Digest(d) => d.next_seq,
        });
    }
}
