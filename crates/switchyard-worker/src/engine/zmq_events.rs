//! Following an engine's ZMQ KV event publisher: one SUB socket per data-parallel rank,
//! sequence tracking, gap repair through the replay (ROUTER) socket, restart detection.
//!
//! Every live message is three frames: topic, an 8-byte big-endian sequence number, a
//! MessagePack batch. Sequence numbers grow by one per batch from 0 at engine start. A jump
//! forward is a gap: a DEALER asks the replay socket for everything from the first missing number
//! and applies what comes back up to the live message; a jump back is a restart. When a gap
//! cannot be repaired, or after a restart, the rank's blocks are removed from the worker's view
//! and rebuilt from the events that follow, so the router never keeps blocks the engine may no
//! longer hold.
//!
//! Replay replies come in two framings, told apart per reply: `[empty, seq, payload]` (vLLM up to
//! 0.25) and `[empty, topic, seq, payload]` (vLLM 0.26 and later, SGLang), each stream ending with
//! the marker `seq = 0xff×8` (its topic frame empty in the newer framing). A worker that joins an
//! engine already running asks for everything from 0; the engine's buffer may have dropped the
//! oldest batches, and then the contiguous tail it still has is applied and the log says which
//! batches were lost (blocks stored in them stay unknown until the engine evicts or announces
//! them again).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::kv_decode::{EngineBatch, decode_batch};
use super::kv_relay::KvRelay;
use super::stats::AdapterCounters;
use crate::event_log::EventLog;

/// How long one replay may take before the gap is treated as unrepairable.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(3);
/// The replay socket's end-of-replay sequence number (−1 as signed).
const END_MARKER: u64 = u64::MAX;

/// Where one rank publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEndpoints {
    pub rank: u32,
    pub events: String,
    pub replay: Option<String>,
}

/// Why an endpoint cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint {endpoint:?} must be tcp://host:port ({why})")]
pub struct EndpointError {
    pub endpoint: String,
    pub why: &'static str,
}

/// The endpoint of `rank`: engines offset the TCP port by the data-parallel rank.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    let err = |why| EndpointError {
        endpoint: endpoint.to_owned(),
        why,
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| err("only tcp:// is supported"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| err("no port"))?;
    if host.is_empty() || host == "*" {
        return Err(err("connect to the engine's host, not a wildcard"));
    }
    let port: u16 = port.parse().map_err(|_| err("the port is not a number"))?;
    let port = u16::try_from(u32::from(port) + rank).map_err(|_| err("rank port past 65535"))?;
    Ok(format!("tcp://{host}:{port}"))
}

/// What the rank followers share: the relay, the worker's log, the counters.
#[derive(Debug)]
pub struct RelayShared {
    pub relay: Mutex<KvRelay>,
    pub log: Arc<EventLog>,
    pub counters: Arc<AdapterCounters>,
}

impl RelayShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, KvRelay> {
        self.relay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decodes and applies one batch; a malformed one is counted and skipped.
    pub fn apply(&self, rank: u32, seq: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => self.apply_batch(rank, &batch),
            Err(err) => {
                let c = self.counters.rank(rank);
                c.add(&c.malformed, 1);
                tracing::warn!(rank, seq, error = %err, "malformed kv event batch skipped");
            }
        }
    }

    /// Applies one decoded batch (from the ZMQ stream, or converted from TensorRT-LLM's
    /// polled events).
    pub fn apply_batch(&self, rank: u32, batch: &EngineBatch) {
        let c = self.counters.rank(rank);
        c.add(&c.batches, 1);
        self.lock().apply(rank, batch, &self.log, &self.counters);
    }

    /// Forgets what `rank` held (lost events, an engine restart) and publishes the removals.
    pub fn reset(&self, rank: u32) {
        self.lock().reset_and_publish(rank, &self.log);
    }
}

/// What a sequence number means given the last one applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStep {
    /// The first message seen from this publisher.
    First,
    InOrder,
    /// Batches `missing_from..seq` were lost.
    Gap {
        missing_from: u64,
    },
    /// The publisher started again (sequence went back).
    Restart,
}

pub fn classify(last: Option<u64>, seq: u64) -> SeqStep {
    match last {
        None => SeqStep::First,
        Some(last) if seq == last.wrapping_add(1) => SeqStep::InOrder,
        Some(last) if seq > last => SeqStep::Gap {
            missing_from: last + 1,
        },
        Some(_) => SeqStep::Restart,
    }
}

/// Follows one rank until `cancel`.
pub async fn follow_rank(
    endpoints: RankEndpoints,
    topic: String,
    shared: Arc<RelayShared>,
    cancel: CancellationToken,
) {
    let rank = endpoints.rank;
    let mut sub = zeromq::SubSocket::new();
    // The engine may not be up yet: keep trying; the socket reconnects by itself afterwards.
    loop {
        let connected = tokio::select! {
            _ = cancel.cancelled() => return,
            r = sub.connect(&endpoints.events) => r,
        };
        match connected {
            Ok(()) => break,
            Err(err) => {
                tracing::debug!(rank, endpoint = %endpoints.events, error = %err, "kv event publisher not reachable yet");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
    }
    if let Err(err) = sub.subscribe(&topic).await {
        tracing::error!(rank, error = %err, "cannot subscribe to kv events");
        return;
    }
    tracing::info!(rank, endpoint = %endpoints.events, "following engine kv events");
    let mut last: Option<u64> = None;
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            m = sub.recv() => m,
        };
        let message = match message {
            Ok(m) => m,
            Err(err) => {
                tracing::warn!(rank, error = %err, "kv event socket error");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            }
        };
        let Some((seq, payload)) = split_live(message) else {
            let c = shared.counters.rank(rank);
            c.add(&c.malformed, 1);
            tracing::warn!(
                rank,
                "kv event message without 3 frames and an 8-byte sequence"
            );
            continue;
        };
        let c = shared.counters.rank(rank);
        match classify(last, seq) {
            SeqStep::InOrder => {}
            SeqStep::First => {
                // Joining a running engine: fetch what it published before we listened.
                if seq > 0 && endpoints.replay.is_some() {
                    catch_up(&endpoints, &shared, 0, seq, false).await;
                }
            }
            SeqStep::Gap { missing_from } => {
                c.add(&c.gaps, 1);
                tracing::warn!(rank, missing_from, seq, "kv event gap; replaying");
                catch_up(&endpoints, &shared, missing_from, seq, true).await;
            }
            SeqStep::Restart => {
                c.add(&c.restarts, 1);
                tracing::warn!(rank, last = ?last, seq, "engine restarted; clearing its blocks");
                shared.reset(rank);
                if seq > 0 && endpoints.replay.is_some() {
                    catch_up(&endpoints, &shared, 0, seq, false).await;
                }
            }
        }
        shared.apply(rank, seq, &payload);
        last = Some(seq);
    }
}

/// Applies batches `from..until` from the replay socket; when that is impossible and
/// `reset_on_failure`, clears the rank instead.
async fn catch_up(
    endpoints: &RankEndpoints,
    shared: &RelayShared,
    from: u64,
    until: u64,
    reset_on_failure: bool,
) {
    let rank = endpoints.rank;
    let c = shared.counters.rank(rank);
    let replayed = match &endpoints.replay {
        Some(replay) => {
            match tokio::time::timeout(REPLAY_TIMEOUT, fetch(replay, from, until)).await {
                Ok(Ok(batches)) => Some(batches),
                Ok(Err(err)) => {
                    tracing::warn!(rank, error = %err, "kv event replay failed");
                    None
                }
                Err(_) => {
                    tracing::warn!(rank, "kv event replay timed out");
                    None
                }
            }
        }
        None => None,
    };
    // The contiguous run that ends just before `until`, if the replay has one.
    let tail = replayed
        .as_deref()
        .and_then(|batches| contiguous_tail(batches, until));
    let complete = tail.is_some_and(|first| first == from);
    match (replayed, tail) {
        (Some(batches), Some(_)) if complete => {
            c.add(&c.replays, 1);
            c.add(&c.replayed_batches, batches.len() as u64);
            for (seq, payload) in batches {
                shared.apply(rank, seq, &payload);
            }
        }
        (Some(batches), Some(first)) if !reset_on_failure => {
            // Joining a running engine whose buffer no longer reaches back to `from`: what it
            // still has helps; what came before is lost, and the log says so.
            c.add(&c.replays, 1);
            let kept: Vec<(u64, Vec<u8>)> = batches
                .into_iter()
                .filter(|(seq, _)| *seq >= first)
                .collect();
            c.add(&c.replayed_batches, kept.len() as u64);
            tracing::info!(
                rank,
                replayed_from = first,
                until,
                lost = first - from,
                "joined a running engine: replayed the batches it still buffers; blocks stored \
                 in the {} before them stay unknown until evicted or stored again",
                first - from
            );
            for (seq, payload) in kept {
                shared.apply(rank, seq, &payload);
            }
        }
        _ if reset_on_failure => {
            c.add(&c.resyncs, 1);
            tracing::warn!(
                rank,
                from,
                until,
                "kv event gap not replayable; clearing the rank's blocks and rebuilding"
            );
            shared.reset(rank);
        }
        _ => {
            tracing::info!(
                rank,
                from,
                until,
                "earlier kv events not replayable; starting from the live stream"
            );
        }
    }
}

/// Asks the replay ROUTER for batches from `from` and collects those before `until`.
async fn fetch(
    endpoint: &str,
    from: u64,
    until: u64,
) -> Result<Vec<(u64, Vec<u8>)>, zeromq::ZmqError> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await?;
    // A DEALER adds no delimiter; the ROUTER expects [identity, empty, start].
    let mut request = ZmqMessage::from(Vec::<u8>::new());
    request.push_back(from.to_be_bytes().to_vec().into());
    dealer.send(request).await?;
    let mut batches = Vec::new();
    loop {
        let reply = dealer.recv().await?;
        let Some((seq, payload)) = split_replay(&reply.into_vec()) else {
            tracing::debug!("kv event replay reply of an unknown framing skipped");
            continue;
        };
        if seq == END_MARKER || seq >= until {
            return Ok(batches);
        }
        batches.push((seq, payload));
    }
}

/// The first sequence number of the contiguous run of `batches` that ends at `until - 1`.
fn contiguous_tail(batches: &[(u64, Vec<u8>)], until: u64) -> Option<u64> {
    let mut want = until;
    for (seq, _) in batches.iter().rev() {
        if want == 0 || *seq != want - 1 {
            break;
        }
        want -= 1;
    }
    (want < until).then_some(want)
}

/// The sequence number and payload of a live `[topic, seq, payload]` message.
fn split_live(message: ZmqMessage) -> Option<(u64, Vec<u8>)> {
    split_live_frames(&message.into_vec())
}

/// [`split_live`] over the message's frames; `None` when they are not `[topic, seq, payload]`
/// with an 8-byte sequence number. Public for the fuzz targets (`crates/switchyard-fuzz`).
pub fn split_live_frames<B: AsRef<[u8]>>(frames: &[B]) -> Option<(u64, Vec<u8>)> {
    let [_topic, seq, payload] = frames else {
        return None;
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.as_ref().to_vec()))
}

/// The sequence number and payload of a replay reply as a DEALER receives it, in either
/// framing: `[empty, seq, payload]` or `[empty, topic, seq, payload]`; `None` for any other.
/// Public for the fuzz targets (`crates/switchyard-fuzz`).
pub fn split_replay<B: AsRef<[u8]>>(frames: &[B]) -> Option<(u64, Vec<u8>)> {
    if !(3..=4).contains(&frames.len()) || !frames[0].as_ref().is_empty() {
        return None;
    }
    let n = frames.len();
    let seq: [u8; 8] = frames[n - 2].as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), frames[n - 1].as_ref().to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_endpoints_offset_the_port() {
        assert_eq!(
            rank_endpoint("tcp://10.0.0.1:5557", 2).unwrap(),
            "tcp://10.0.0.1:5559"
        );
        assert!(rank_endpoint("tcp://*:5557", 0).is_err());
        assert!(rank_endpoint("ipc:///tmp/x", 0).is_err());
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
    }

    fn frames<'a>(parts: &[&'a [u8]]) -> Vec<&'a [u8]> {
        parts.to_vec()
    }

    #[test]
    fn replay_replies_in_both_framings_and_their_end_markers() {
        let seq = 7u64.to_be_bytes();
        let end = u64::MAX.to_be_bytes();
        // vLLM ≤ 0.25.
        assert_eq!(
            split_replay(&frames(&[b"", &seq, b"payload"])),
            Some((7, b"payload".to_vec()))
        );
        assert_eq!(
            split_replay(&frames(&[b"", &end, b""])),
            Some((END_MARKER, vec![]))
        );
        // vLLM ≥ 0.26 and SGLang: a topic frame; the end marker's topic is empty.
        assert_eq!(
            split_replay(&frames(&[b"", b"kv-events", &seq, b"payload"])),
            Some((7, b"payload".to_vec()))
        );
        assert_eq!(
            split_replay(&frames(&[b"", b"", &end, b""])),
            Some((END_MARKER, vec![]))
        );
        // Not a reply: no delimiter, a short sequence, too many frames.
        assert_eq!(split_replay(&frames(&[b"x", &seq, b"p"])), None);
        assert_eq!(split_replay(&frames(&[b"", b"123", b"p"])), None);
        assert_eq!(split_replay(&frames(&[b"", b"", b"", &seq, b"p"])), None);
    }

    #[test]
    fn the_contiguous_tail_before_the_live_message() {
        let batch = |seq| (seq, Vec::new());
        assert_eq!(contiguous_tail(&[batch(3), batch(4), batch(5)], 6), Some(3));
        assert_eq!(contiguous_tail(&[batch(0), batch(2), batch(3)], 4), Some(2));
        assert_eq!(contiguous_tail(&[batch(1), batch(2)], 4), None);
        assert_eq!(contiguous_tail(&[], 4), None);
    }

    #[test]
    fn sequence_steps() {
        assert_eq!(classify(None, 5), SeqStep::First);
        assert_eq!(classify(Some(4), 5), SeqStep::InOrder);
        assert_eq!(classify(Some(4), 9), SeqStep::Gap { missing_from: 5 });
        assert_eq!(classify(Some(4), 0), SeqStep::Restart);
        assert_eq!(classify(Some(4), 4), SeqStep::Restart);
    }
}
