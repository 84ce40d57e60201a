//! The worker's KV event log: sequence numbers, a bounded replay buffer, snapshots, live fan-out.
//!
//! Every engine publishes its cache changes here. The log numbers them from 0 for this
//! incarnation, keeps the last `capacity` events so a consumer that reconnects can resume where
//! it stopped, and keeps its own view of the blocks the events describe so it can answer a
//! consumer that asks for something older with an exact snapshot. The snapshot and the live
//! subscription are taken under one lock, so a consumer sees neither a gap nor a duplicate.
//! The view's [`BlockSetDigest`] is kept up to date with it and travels with every event, so a
//! stream can tell its consumer exactly what it should hold after any event it sent.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use switchyard_core::{
    BlockHash, BlockSetDigest, EventSeq, Incarnation, KvEvent, SnapshotBlock, StorageTier, WorkerId,
};
use tokio::sync::broadcast;

/// One published event with its sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequencedEvent {
    pub seq: EventSeq,
    pub event: KvEvent,
    /// The digest of the log's view once this event is applied.
    pub digest: BlockSetDigest,
    /// When the event entered the log, in microseconds since the Unix epoch (the stream
    /// carries it so its consumer can tell how late the event reached it).
    pub logged_at_us: u64,
}

/// How a subscription starts.
#[derive(Debug)]
pub enum SubscriptionStart {
    /// The buffer still holds everything from the requested sequence number on.
    Replay(Vec<Arc<SequencedEvent>>),
    /// Every block held before event `next_seq`; live events continue at `next_seq`.
    Snapshot {
        next_seq: EventSeq,
        blocks: Vec<SnapshotBlock>,
        /// The digest of `blocks`.
        digest: BlockSetDigest,
    },
}

/// A consumer's view: where to start, then the live events after it.
#[derive(Debug)]
pub struct Subscription {
    pub start: SubscriptionStart,
    pub live: broadcast::Receiver<Arc<SequencedEvent>>,
    /// Where the start leaves the consumer: the next sequence number and the digest of the view
    /// the events before it leave in place.
    pub at: (EventSeq, BlockSetDigest),
}

#[derive(Debug)]
struct LogState {
    next_seq: EventSeq,
    buffer: VecDeque<Arc<SequencedEvent>>,
    /// (hash, tier) → parent, exactly the blocks the published events leave in place.
    blocks: BTreeMap<(BlockHash, StorageTier), Option<BlockHash>>,
    /// Digest of `blocks`, kept up to date with it.
    digest: BlockSetDigest,
}

/// The event log of one engine incarnation.
#[derive(Debug)]
pub struct EventLog {
    worker: WorkerId,
    incarnation: Incarnation,
    capacity: usize,
    state: Mutex<LogState>,
    live_tx: broadcast::Sender<Arc<SequencedEvent>>,
    /// Subscriptions that started with a snapshot, and with a replay from the buffer.
    snapshots: AtomicU64,
    replays: AtomicU64,
}

impl EventLog {
    /// A log that keeps the last `capacity` events for replay (at least one).
    pub fn new(worker: WorkerId, incarnation: Incarnation, capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let (live_tx, _) = broadcast::channel(capacity);
        Self {
            worker,
            incarnation,
            capacity,
            state: Mutex::new(LogState {
                next_seq: 0,
                buffer: VecDeque::with_capacity(capacity),
                blocks: BTreeMap::new(),
                digest: BlockSetDigest::default(),
            }),
            live_tx,
            snapshots: AtomicU64::new(0),
            replays: AtomicU64::new(0),
        }
    }

    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Sequence number the next event will get.
    pub fn next_seq(&self) -> EventSeq {
        self.lock().next_seq
    }

    /// Number of blocks (per tier) the published events leave in place.
    pub fn block_count(&self) -> usize {
        self.lock().blocks.len()
    }

    /// How many leading blocks of `chain` the view holds in some tier: the prompt the engine
    /// finds cached (its events say so), so the part past them is what it has to compute.
    pub fn leading_held(&self, chain: &[BlockHash]) -> usize {
        let state = self.lock();
        chain
            .iter()
            .take_while(|h| {
                state
                    .blocks
                    .range((**h, StorageTier::Device)..=(**h, StorageTier::Remote))
                    .next()
                    .is_some()
            })
            .count()
    }

    /// The digest of the view, and the sequence number of the next event (the view is what the
    /// events before it leave in place).
    pub fn digest(&self) -> (EventSeq, BlockSetDigest) {
        let state = self.lock();
        (state.next_seq, state.digest)
    }

    /// Subscriptions served since start: (started from a snapshot, resumed from the buffer).
    pub fn subscriptions(&self) -> (u64, u64) {
        (
            self.snapshots.load(Ordering::Relaxed),
            self.replays.load(Ordering::Relaxed),
        )
    }

    /// Consumers following the live events now.
    pub fn subscribers(&self) -> usize {
        self.live_tx.receiver_count()
    }

    /// Publishes events in order and returns the sequence number of the last one.
    pub fn publish(&self, events: impl IntoIterator<Item = KvEvent>) -> Option<EventSeq> {
        let logged_at_us = switchyard_core::time::unix_micros();
        let mut state = self.lock();
        let mut last = None;
        for event in events {
            let LogState { blocks, digest, .. } = &mut *state;
            apply_to_view(blocks, digest, &event);
            let item = Arc::new(SequencedEvent {
                seq: state.next_seq,
                event,
                digest: state.digest,
                logged_at_us,
            });
            state.next_seq += 1;
            if state.buffer.len() == self.capacity {
                state.buffer.pop_front();
            }
            state.buffer.push_back(Arc::clone(&item));
            last = Some(item.seq);
            // No receiver is not an error: nobody is listening yet.
            let _ = self.live_tx.send(item);
        }
        last
    }

    /// Subscribes from `from_seq` of `incarnation`: a replay when the buffer still holds it,
    /// otherwise (absent, too old, from the future, or another incarnation) a snapshot.
    pub fn subscribe(&self, from_seq: Option<EventSeq>, incarnation: Incarnation) -> Subscription {
        let state = self.lock();
        let live = self.live_tx.subscribe();
        let oldest = state.buffer.front().map_or(state.next_seq, |e| e.seq);
        let start = match from_seq {
            Some(from)
                if incarnation == self.incarnation && from >= oldest && from <= state.next_seq =>
            {
                let skip = (from - oldest) as usize;
                self.replays.fetch_add(1, Ordering::Relaxed);
                SubscriptionStart::Replay(state.buffer.iter().skip(skip).cloned().collect())
            }
            _ => {
                self.snapshots.fetch_add(1, Ordering::Relaxed);
                SubscriptionStart::Snapshot {
                    next_seq: state.next_seq,
                    digest: state.digest,
                    blocks: state
                        .blocks
                        .iter()
                        .map(|(&(hash, tier), &parent)| SnapshotBlock { hash, parent, tier })
                        .collect(),
                }
            }
        };
        Subscription {
            start,
            live,
            at: (state.next_seq, state.digest),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        // A panic while holding this lock can only come from a bug in this module; the state is
        // still consistent event by event, so keep serving rather than poisoning every stream.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn apply_to_view(
    blocks: &mut BTreeMap<(BlockHash, StorageTier), Option<BlockHash>>,
    digest: &mut BlockSetDigest,
    event: &KvEvent,
) {
    match event {
        KvEvent::Stored {
            parent,
            blocks: stored,
            tier,
        } => {
            let mut prev = *parent;
            for block in stored {
                if blocks.insert((block.hash, *tier), prev).is_none() {
                    digest.add(block.hash, *tier);
                }
                prev = Some(block.hash);
            }
        }
        KvEvent::Removed {
            blocks: removed,
            tier,
        } => {
            for hash in removed {
                if blocks.remove(&(*hash, *tier)).is_some() {
                    digest.remove(*hash, *tier);
                }
            }
        }
        KvEvent::Cleared => {
            blocks.clear();
            *digest = BlockSetDigest::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::StoredBlock;

    fn stored(hash: u64, parent: Option<u64>) -> KvEvent {
        KvEvent::Stored {
            parent: parent.map(BlockHash),
            blocks: vec![StoredBlock {
                hash: BlockHash(hash),
                tokens: vec![1],
            }],
            tier: StorageTier::Device,
        }
    }

    fn log(capacity: usize) -> EventLog {
        EventLog::new(WorkerId::new("w").unwrap(), 9, capacity)
    }

    #[test]
    fn leading_held_counts_the_prefix_held_in_any_tier() {
        let log = log(8);
        log.publish([stored(1, None), stored(2, Some(1))]);
        log.publish([KvEvent::Stored {
            parent: Some(BlockHash(2)),
            blocks: vec![StoredBlock {
                hash: BlockHash(3),
                tokens: vec![1],
            }],
            tier: StorageTier::Host,
        }]);
        let chain = |hs: &[u64]| hs.iter().map(|h| BlockHash(*h)).collect::<Vec<_>>();
        assert_eq!(log.leading_held(&chain(&[1, 2, 3, 4])), 3);
        // A block missing in the middle ends the prefix: the engine recomputes from there.
        assert_eq!(log.leading_held(&chain(&[1, 9, 3])), 1);
        assert_eq!(log.leading_held(&chain(&[7])), 0);
        assert_eq!(log.leading_held(&[]), 0);
        log.publish([KvEvent::Removed {
            blocks: vec![BlockHash(2)],
            tier: StorageTier::Device,
        }]);
        assert_eq!(log.leading_held(&chain(&[1, 2, 3])), 1);
    }

    #[test]
    fn sequence_numbers_start_at_zero_and_grow_by_one() {
        let log = log(8);
        assert_eq!(log.publish([stored(1, None), stored(2, Some(1))]), Some(1));
        assert_eq!(log.publish([KvEvent::Cleared]), Some(2));
        assert_eq!(log.next_seq(), 3);
    }

    #[test]
    fn resume_inside_the_buffer_replays_exactly_the_missing_events() {
        let log = log(8);
        log.publish((0..5).map(|i| stored(i + 1, None)));
        let sub = log.subscribe(Some(3), 9);
        match sub.start {
            SubscriptionStart::Replay(events) => {
                let seqs: Vec<_> = events.iter().map(|e| e.seq).collect();
                assert_eq!(seqs, vec![3, 4]);
            }
            other => panic!("expected replay, got {other:?}"),
        }
        // Resuming at the head replays nothing and continues live.
        match log.subscribe(Some(5), 9).start {
            SubscriptionStart::Replay(events) => assert!(events.is_empty()),
            other => panic!("expected empty replay, got {other:?}"),
        }
    }

    #[test]
    fn too_old_future_or_foreign_incarnation_gets_a_snapshot() {
        let log = log(2);
        log.publish([stored(1, None), stored(2, Some(1)), stored(3, Some(2))]);
        log.publish([KvEvent::Removed {
            blocks: vec![BlockHash(2)],
            tier: StorageTier::Device,
        }]);
        for (from, inc) in [(Some(0), 9), (Some(99), 9), (Some(3), 8), (None, 9)] {
            match log.subscribe(from, inc).start {
                SubscriptionStart::Snapshot {
                    next_seq,
                    blocks,
                    digest,
                } => {
                    assert_eq!(next_seq, 4);
                    assert_eq!(
                        digest,
                        BlockSetDigest::of(blocks.iter().map(|b| (b.hash, b.tier)))
                    );
                    let hashes: Vec<_> = blocks.iter().map(|b| b.hash.get()).collect();
                    assert_eq!(hashes, vec![1, 3]);
                    assert_eq!(blocks[1].parent, Some(BlockHash(2)));
                }
                other => panic!("expected snapshot for {from:?}/{inc}, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn live_events_follow_the_start_without_gap() {
        let log = log(4);
        log.publish([stored(1, None)]);
        let mut sub = log.subscribe(None, 0);
        log.publish([stored(2, Some(1))]);
        let next = sub.live.recv().await.unwrap();
        assert_eq!(next.seq, 1);
        match sub.start {
            SubscriptionStart::Snapshot { next_seq, .. } => assert_eq!(next_seq, 1),
            other => panic!("expected snapshot, got {other:?}"),
        }
    }

    #[test]
    fn cleared_empties_the_view() {
        let log = log(4);
        log.publish([stored(1, None), KvEvent::Cleared]);
        assert_eq!(log.block_count(), 0);
        assert_eq!(log.digest(), (2, BlockSetDigest::default()));
    }

    #[test]
    fn each_event_carries_the_digest_of_the_view_after_it() {
        let log = log(8);
        let mut sub = log.subscribe(None, 9);
        log.publish([stored(1, None), stored(1, None), stored(2, Some(1))]);
        log.publish([KvEvent::Removed {
            blocks: vec![BlockHash(1), BlockHash(99)],
            tier: StorageTier::Device,
        }]);
        let mut digests = Vec::new();
        while let Ok(e) = sub.live.try_recv() {
            digests.push(e.digest);
        }
        let d = |hashes: &[u64]| {
            BlockSetDigest::of(hashes.iter().map(|&h| (BlockHash(h), StorageTier::Device)))
        };
        // A duplicate store changes nothing; removing an unknown block changes nothing.
        assert_eq!(digests, vec![d(&[1]), d(&[1]), d(&[1, 2]), d(&[2])]);
        assert_eq!(log.digest(), (4, d(&[2])));
    }
}
