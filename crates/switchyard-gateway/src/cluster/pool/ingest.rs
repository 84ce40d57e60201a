//! One KV-event stream message applied to the prefix index: a pure function of the index, where
//! the stream stands (the [`Cursor`]) and the message, with no metrics, logs, recorder or locks.
//! The live subscriber (`subscriber.rs`) wraps it with those; the fuzz target and the ingestion
//! bench call it directly, so what they exercise is what the gateway runs.

use switchyard_core::{KvEvent, SnapshotBlock, WorkerId};
use switchyard_proto::convert::{kv_event_from_wire, snapshot_block_from_wire};
use switchyard_proto::v1::{self, kv_events_response::Payload};
use switchyard_router::{ApplyOutcome, PrefixIndex};

/// Where a worker's event stream stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    pub incarnation: u64,
    /// Next sequence number wanted; `None` asks for a snapshot.
    pub next_seq: Option<u64>,
}

/// What one message did.
#[derive(Debug, Clone, PartialEq)]
pub enum Ingested {
    /// A snapshot replaced everything known of the worker.
    Snapshot {
        incarnation: u64,
        next_seq: u64,
        blocks: Vec<SnapshotBlock>,
    },
    /// An event, or a batch of them, went through in order: `applied` changed the index,
    /// events it already had were skipped (duplicates after a resume), and `stop`, when
    /// set, is why the rest of the message was not applied (the cursor then asks for a
    /// snapshot).
    Events {
        incarnation: u64,
        applied: Vec<(u64, KvEvent)>,
        stop: Option<Resync>,
    },
    /// The worker's digest of its own view, for the caller to compare with the index (`audit::kv`)
    /// at `at`, the point of the stream the cursor stands at (`None` while a resync is under
    /// way: nothing to compare); nothing changed.
    Digest {
        at: Option<u64>,
        digest: v1::KvDigest,
    },
    /// A message without a payload: nothing changed.
    Nothing,
    /// A snapshot the stream cannot go on from: the cursor now asks for another.
    Resync(Resync),
}

/// Why a stream must start again from a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub enum Resync {
    /// A snapshot block did not convert: the worker's entries were dropped from the index.
    InvalidSnapshot(String),
    /// The index refused the snapshot.
    SnapshotRefused(String),
    /// An event did not convert from the wire.
    Undecodable(String),
    /// An event was not the next one.
    Gap { expected: Option<u64>, got: u64 },
    /// The index refused the event (a forged hash, a malformed store).
    Invalid(String),
}

impl Resync {
    /// Whether the message itself was bad (counted as an invalid event), not only out of place.
    pub fn invalid_event(&self) -> bool {
        matches!(self, Self::Undecodable(_) | Self::Invalid(_))
    }
}

/// Applies `message` from `worker`'s stream to `index` and moves `cursor` past it.
pub fn ingest(
    index: &mut PrefixIndex,
    worker: &WorkerId,
    cursor: &mut Cursor,
    message: v1::KvEventsResponse,
) -> Ingested {
    let incarnation = message.incarnation;
    let ingested = match message.payload {
        Some(Payload::Snapshot(snapshot)) => {
            let blocks: Result<Vec<_>, _> = snapshot
                .blocks
                .iter()
                .map(snapshot_block_from_wire)
                .collect();
            match blocks {
                Err(err) => {
                    index.remove_worker(worker);
                    Ingested::Resync(Resync::InvalidSnapshot(err.to_string()))
                }
                Ok(blocks) => {
                    match index.apply_snapshot(worker, incarnation, snapshot.next_seq, &blocks) {
                        Ok(()) => {
                            *cursor = Cursor {
                                incarnation,
                                next_seq: Some(snapshot.next_seq),
                            };
                            Ingested::Snapshot {
                                incarnation,
                                next_seq: snapshot.next_seq,
                                blocks,
                            }
                        }
                        Err(err) => Ingested::Resync(Resync::SnapshotRefused(err.to_string())),
                    }
                }
            }
        }
        Some(Payload::Event(event)) => events(index, worker, cursor, incarnation, vec![event]),
        Some(Payload::Batch(batch)) => events(index, worker, cursor, incarnation, batch.events),
        Some(Payload::Digest(digest)) => Ingested::Digest {
            at: if incarnation == cursor.incarnation {
                cursor.next_seq
            } else {
                None
            },
            digest,
        },
        None => Ingested::Nothing,
    };
    if ingested.resync().is_some() {
        cursor.next_seq = None;
    }
    ingested
}

/// Applies `wire` events in order, up to the first the stream cannot go on from.
fn events(
    index: &mut PrefixIndex,
    worker: &WorkerId,
    cursor: &mut Cursor,
    incarnation: u64,
    wire: Vec<v1::KvEvent>,
) -> Ingested {
    let mut applied = Vec::with_capacity(wire.len());
    let mut stop = None;
    for event in wire {
        let (seq, event) = match kv_event_from_wire(event) {
            Ok(decoded) => decoded,
            Err(err) => {
                stop = Some(Resync::Undecodable(err.to_string()));
                break;
            }
        };
        match index.apply(worker, incarnation, seq, &event) {
            Ok(ApplyOutcome::Applied) => {
                *cursor = Cursor {
                    incarnation,
                    // None past the last sequence number: a snapshot next time.
                    next_seq: seq.checked_add(1),
                };
                applied.push((seq, event));
            }
            Ok(ApplyOutcome::Stale { .. }) => {}
            Ok(ApplyOutcome::ResyncNeeded { expected, got }) => {
                stop = Some(Resync::Gap { expected, got });
                break;
            }
            Err(err) => {
                stop = Some(Resync::Invalid(err.to_string()));
                break;
            }
        }
    }
    Ingested::Events {
        incarnation,
        applied,
        stop,
    }
}

impl Ingested {
    /// Why the stream must start again from a snapshot, if it must.
    pub fn resync(&self) -> Option<&Resync> {
        match self {
            Self::Resync(why)
            | Self::Events {
                stop: Some(why), ..
            } => Some(why),
            _ => None,
        }
    }
}
