//! The response streams of the Worker service: a generation's tokens, a KV pull's chunks, and
//! the KV event stream. Each owns what must live as long as its stream (the in-flight guard,
//! the span, the request's metrics record, the hold on pulled blocks).

use std::sync::Arc;

use futures::StreamExt;
use prost::Message;
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

/// The messages a subscription starts with: its snapshot, or the events it replays (together in
/// batches of at most `max_batch`, or one per message when that is 0 or 1).
pub(super) fn start_messages(
    start: SubscriptionStart,
    max_batch: usize,
) -> Vec<v1::kv_events_response::Payload> {
    match start {
        SubscriptionStart::Replay(events) if max_batch > 1 => events
            .chunks(max_batch)
            .map(|chunk| {
                v1::kv_events_response::Payload::Batch(v1::KvEventBatch {
                    events: chunk
                        .iter()
                        .map(|e| kv_event_to_wire(e.seq, &e.event))
                        .collect(),
                })
            })
            .collect(),
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
    /// Most events per message (`KvEventsRequest.max_batch_events`; 0 or 1: one each).
    pub(super) max_batch: usize,
    /// The live receiver fell behind while a batch was gathered: resume from the log next.
    pub(super) lagged: bool,
    /// When the oldest event of the last payload entered the log (Unix microseconds); 0 when
    /// that payload was not live events (a replay, a snapshot, a digest).
    pub(super) logged_at_us: u64,
}

/// A batch stops growing once its events take this many bytes (far below a gRPC message's
/// default 4 MiB limit, whatever the events' size).
const MAX_BATCH_BYTES: usize = 1 << 20;

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
            self.logged_at_us = 0;
            if let Some(payload) = self.pending.pop_front() {
                self.note_sent(&payload);
                return Some(payload);
            }
            if self.lagged {
                self.resubscribe();
                continue;
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
                    let payload = self.gather(event);
                    self.note_sent(&payload);
                    return Some(payload);
                }
                Err(broadcast::error::RecvError::Lagged(skipped)) => {
                    tracing::debug!(skipped, "kv event consumer lagged; resuming from the log");
                    self.resubscribe();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    /// `first` and, with batching, the events already received after it (never waiting for
    /// more), as one message.
    fn gather(&mut self, first: Arc<SequencedEvent>) -> v1::kv_events_response::Payload {
        self.at = (first.seq + 1, first.digest);
        self.logged_at_us = first.logged_at_us;
        if self.max_batch <= 1 {
            return v1::kv_events_response::Payload::Event(kv_event_to_wire(
                first.seq,
                &first.event,
            ));
        }
        let mut events = vec![kv_event_to_wire(first.seq, &first.event)];
        let mut bytes = events[0].encoded_len();
        while events.len() < self.max_batch && bytes < MAX_BATCH_BYTES {
            match self.live.try_recv() {
                Ok(event) => {
                    let wire = kv_event_to_wire(event.seq, &event.event);
                    bytes += wire.encoded_len();
                    events.push(wire);
                    self.at = (event.seq + 1, event.digest);
                }
                Err(broadcast::error::TryRecvError::Lagged(skipped)) => {
                    tracing::debug!(skipped, "kv event consumer lagged; resuming from the log");
                    self.lagged = true;
                    break;
                }
                Err(_) => break,
            }
        }
        if events.len() == 1 {
            return v1::kv_events_response::Payload::Event(events.remove(0));
        }
        v1::kv_events_response::Payload::Batch(v1::KvEventBatch { events })
    }

    /// Starts again from the log at the consumer's position (a replay of what it missed, or a
    /// snapshot when the log no longer holds it).
    fn resubscribe(&mut self) {
        self.lagged = false;
        let Subscription { start, live, at } =
            self.log.subscribe(self.next_seq, self.log.incarnation());
        self.live = live;
        self.at = at;
        self.pending = start_messages(start, self.max_batch).into();
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
            v1::kv_events_response::Payload::Batch(b) => match b.events.last() {
                Some(e) => e.seq + 1,
                None => return,
            },
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_log::EventLog;
    use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier, StoredBlock, WorkerId};

    fn stored(hash: u64) -> KvEvent {
        KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                hash: BlockHash(hash),
                tokens: vec![1],
            }],
            tier: StorageTier::Device,
        }
    }

    /// A stream of `log` from `from_seq`, `max_batch` events per message at most.
    fn stream(log: &Arc<EventLog>, from_seq: Option<u64>, max_batch: usize) -> EventStreamState {
        let subscription = log.subscribe(from_seq, log.incarnation());
        let next_seq = match &subscription.start {
            SubscriptionStart::Replay(_) => from_seq,
            SubscriptionStart::Snapshot { next_seq, .. } => Some(*next_seq),
        };
        EventStreamState {
            log: Arc::clone(log),
            pending: start_messages(subscription.start, max_batch).into(),
            live: subscription.live,
            next_seq,
            at: subscription.at,
            digest_every: None,
            identity: DigestIdentity {
                model: "m".into(),
                block_size: BlockSize::new(4).unwrap(),
            },
            max_batch,
            lagged: false,
            logged_at_us: 0,
        }
    }

    /// The sequence numbers of each message's events (`[]` for a snapshot or a digest).
    async fn next_seqs(stream: &mut EventStreamState) -> Vec<u64> {
        match stream.next_payload().await.expect("a message") {
            v1::kv_events_response::Payload::Event(e) => vec![e.seq],
            v1::kv_events_response::Payload::Batch(b) => {
                assert!(b.events.len() > 1, "a batch of one goes out as an event");
                b.events.iter().map(|e| e.seq).collect()
            }
            _ => Vec::new(),
        }
    }

    #[tokio::test]
    async fn ready_events_go_out_together_up_to_the_batch_size() {
        let log = Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 64));
        let mut batched = stream(&log, None, 4);
        let mut single = stream(&log, None, 0);
        assert_eq!(next_seqs(&mut batched).await, Vec::<u64>::new(), "snapshot");
        assert_eq!(next_seqs(&mut single).await, Vec::<u64>::new(), "snapshot");
        log.publish((0..10).map(stored));
        assert_eq!(next_seqs(&mut batched).await, vec![0, 1, 2, 3]);
        assert_eq!(next_seqs(&mut batched).await, vec![4, 5, 6, 7]);
        // Nothing is held back to fill a batch.
        assert_eq!(next_seqs(&mut batched).await, vec![8, 9]);
        log.publish([stored(99)]);
        assert_eq!(next_seqs(&mut batched).await, vec![10]);
        for seq in 0..11 {
            assert_eq!(next_seqs(&mut single).await, vec![seq], "one per message");
        }
        // A resume inside the buffer replays in batches too.
        let mut resumed = stream(&log, Some(3), 4);
        assert_eq!(next_seqs(&mut resumed).await, vec![3, 4, 5, 6]);
        assert_eq!(next_seqs(&mut resumed).await, vec![7, 8, 9, 10]);
    }

    #[tokio::test]
    async fn live_messages_carry_when_their_oldest_event_entered_the_log() {
        let log = Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 64));
        let mut batched = stream(&log, None, 4);
        assert_eq!(next_seqs(&mut batched).await, Vec::<u64>::new(), "snapshot");
        assert_eq!(batched.logged_at_us, 0, "a snapshot is not live");
        let before = switchyard_core::time::unix_micros();
        log.publish((0..2).map(stored));
        let between = switchyard_core::time::unix_micros();
        std::thread::sleep(std::time::Duration::from_millis(2));
        log.publish((2..4).map(stored));
        let after = switchyard_core::time::unix_micros();
        assert_eq!(next_seqs(&mut batched).await, vec![0, 1, 2, 3]);
        // The batch's stamp is its oldest event's: logged by the first publish.
        assert!(
            (before..=between).contains(&batched.logged_at_us),
            "{before} ≤ {} ≤ {between}",
            batched.logged_at_us
        );
        assert!(log.publish([stored(9)]).is_some());
        assert_eq!(next_seqs(&mut batched).await, vec![4]);
        assert!(batched.logged_at_us >= after);
        // A resume replays from the buffer: not live, no stamp.
        let mut resumed = stream(&log, Some(1), 4);
        assert_eq!(next_seqs(&mut resumed).await, vec![1, 2, 3, 4]);
        assert_eq!(resumed.logged_at_us, 0);
    }

    #[tokio::test]
    async fn a_consumer_that_falls_behind_resumes_from_the_log_with_nothing_skipped() {
        // The live channel holds 8 events: 12 published before the consumer reads lag it.
        let log = Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 8));
        let mut batched = stream(&log, None, 64);
        assert_eq!(next_seqs(&mut batched).await, Vec::<u64>::new(), "snapshot");
        log.publish((0..3).map(stored));
        let first = next_seqs(&mut batched).await;
        assert_eq!(first, vec![0, 1, 2]);
        log.publish((3..15).map(stored));
        // Whatever the channel lost comes back from the log (a replay or a snapshot), and no
        // sequence number is skipped or repeated among the events sent.
        let mut seen = first;
        while seen.last() != Some(&14) {
            let seqs = next_seqs(&mut batched).await;
            if seqs.is_empty() {
                // A snapshot: the consumer's position moved to its next_seq.
                seen.clear();
                seen.push(batched.next_seq.unwrap() - 1);
                continue;
            }
            assert_eq!(seqs[0], seen.last().unwrap() + 1, "{seen:?} then {seqs:?}");
            seen.extend(seqs);
        }
    }
}
