//! `proto_conversions`: bytes decoded by prost as `switchyard.v1` messages, then converted to
//! core types by `switchyard_proto::convert`, as the worker and the gateway do with what they
//! receive; KV-event streams are applied to the router's `PrefixIndex` as the gateway's
//! subscriber applies them.
//!
//! Input: one byte choosing the message, then its protobuf encoding:
//!
//! | byte mod 6 | message | what is done with it |
//! |---|---|---|
//! | 0 | `KvEventsResponse`s, each length-delimited | the gateway subscriber's `pool::ingest` on each, in order, into two prefix indexes (hashes verified, as the gateway does; and not, as replay does) |
//! | 1 | `WorkerInfo` | `WorkerInfo::try_from`; what is accepted survives a round trip |
//! | 2 | `GenerateRequest` | its sampling through `Sampling::try_from` (the worker's check); round trip |
//! | 3 | `LoadReport` | `LoadStats::from` and `role_from_wire`; round trip through `load_to_wire` |
//! | 4 | `ControlRequest` | `role_from_wire` of a `SetRole` |
//! | 5 | `KvEvent` | `kv_event_from_wire`, `KvEvent::validate`; round trip |
//!
//! A message prost cannot decode is simply refused (prost's own decoding is not ours to test
//! further); anything converted must convert back to the same wire meaning.

use prost::Message;
use switchyard_core::{BlockSize, LoadStats, Sampling, WorkerId, WorkerInfo};
use switchyard_gateway::cluster::pool::ingest::{Cursor, Ingested, ingest};
use switchyard_proto::convert::{
    kv_event_from_wire, kv_event_to_wire, load_to_wire, role_from_wire, worker_info_to_wire,
};
use switchyard_proto::v1;
use switchyard_router::{IndexConfig, PrefixIndex};

const BLOCK_SIZE: u32 = 4;
/// Small, so the index's eviction is reached by short inputs.
const MAX_ENTRIES: usize = 64;
/// Events of one input applied at most (each is at least a few bytes anyway).
const MAX_MESSAGES: usize = 256;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    match kind % 6 {
        0 => kv_event_stream(bytes),
        1 => worker_info(bytes),
        2 => sampling(bytes),
        3 => load_report(bytes),
        4 => control(bytes),
        _ => kv_event(bytes),
    }
}

fn block_size() -> BlockSize {
    BlockSize::new(BLOCK_SIZE).unwrap_or_else(|_| unreachable!("4 is a valid block size"))
}

fn kv_event_stream(mut bytes: &[u8]) {
    let worker = WorkerId::new("fuzz-worker").unwrap_or_else(|_| unreachable!("a valid id"));
    let verified = IndexConfig {
        max_entries: MAX_ENTRIES,
        ..IndexConfig::new(block_size())
    };
    let trusted = IndexConfig {
        verify_hashes: false,
        ..verified
    };
    let mut indexes = [
        (PrefixIndex::new(verified), Cursor::default()),
        (PrefixIndex::new(trusted), Cursor::default()),
    ];
    for _ in 0..MAX_MESSAGES {
        if bytes.is_empty() {
            break;
        }
        let Ok(message) = v1::KvEventsResponse::decode_length_delimited(&mut bytes) else {
            break;
        };
        for (index, cursor) in &mut indexes {
            apply(index, &worker, cursor, message.clone());
        }
    }
}

/// The gateway subscriber's own step ([`switchyard_gateway::cluster::pool::ingest`]) on one message,
/// then the index's bound and the cursor's rule: a message the stream cannot go on from leaves
/// the cursor asking for a snapshot, an applied event moves it past the event.
fn apply(
    index: &mut PrefixIndex,
    worker: &WorkerId,
    cursor: &mut Cursor,
    message: v1::KvEventsResponse,
) {
    let ingested = ingest(index, worker, cursor, message);
    match &ingested {
        _ if ingested.resync().is_some() => {
            assert_eq!(cursor.next_seq, None, "{ingested:?}");
        }
        Ingested::Events { applied, .. } => {
            if let Some((seq, _)) = applied.last() {
                assert_eq!(cursor.next_seq, seq.checked_add(1));
            }
        }
        Ingested::Snapshot { next_seq, .. } => assert_eq!(cursor.next_seq, Some(*next_seq)),
        // The gateway compares the worker's digest with the index's own view of the worker.
        Ingested::Digest { .. } => {
            let _ = index.worker_digest(worker);
        }
        Ingested::Resync(_) | Ingested::Nothing => {}
    }
    let stats = index.stats();
    assert!(
        stats.entries <= MAX_ENTRIES,
        "the index holds {} entries, more than its bound of {MAX_ENTRIES}",
        stats.entries
    );
}

fn worker_info(bytes: &[u8]) {
    let Ok(wire) = v1::WorkerInfo::decode(bytes) else {
        return;
    };
    let draining = wire.draining;
    let Ok(info) = WorkerInfo::try_from(wire) else {
        return;
    };
    let again = WorkerInfo::try_from(worker_info_to_wire(&info, draining));
    assert_eq!(
        again.ok().as_ref(),
        Some(&info),
        "an accepted WorkerInfo does not survive a round trip"
    );
}

fn sampling(bytes: &[u8]) {
    let Ok(request) = v1::GenerateRequest::decode(bytes) else {
        return;
    };
    let Ok(sampling) = Sampling::try_from(request.sampling.unwrap_or_default()) else {
        return;
    };
    let again = Sampling::try_from(v1::SamplingParams::from(&sampling));
    assert_eq!(
        again.ok().as_ref(),
        Some(&sampling),
        "accepted sampling does not survive a round trip"
    );
}

fn load_report(bytes: &[u8]) {
    let Ok(report) = v1::LoadReport::decode(bytes) else {
        return;
    };
    let stats = LoadStats::from(&report);
    let (Ok(role), Ok(worker)) = (
        role_from_wire(report.role),
        WorkerId::new(&report.worker_id),
    ) else {
        return;
    };
    let wire = load_to_wire(
        &worker,
        &stats,
        role,
        report.draining,
        report.timestamp_unix_ms,
    );
    assert_eq!(wire, report, "a load report does not survive a round trip");
}

fn control(bytes: &[u8]) {
    let Ok(request) = v1::ControlRequest::decode(bytes) else {
        return;
    };
    if let Some(v1::control_request::Command::SetRole(set)) = request.command
        && let Ok(role) = role_from_wire(set.role)
    {
        assert_eq!(i32::from(v1::Role::from(role)), set.role);
    }
}

fn kv_event(bytes: &[u8]) {
    let Ok(wire) = v1::KvEvent::decode(bytes) else {
        return;
    };
    let Ok((seq, event)) = kv_event_from_wire(wire) else {
        return;
    };
    let _ = event.validate(block_size());
    let again = kv_event_from_wire(kv_event_to_wire(seq, &event));
    assert_eq!(
        again.ok(),
        Some((seq, event)),
        "an accepted KvEvent does not survive a round trip"
    );
}
