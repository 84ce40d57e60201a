//! The KV recording format: what a gateway writes when asked to record the inputs of its router,
//! and what `switchyard replay events` reads back (`docs/kv-recording.md`).
//!
//! A recording is JSON Lines, one [`Record`] per line, tagged by `type`: a `header`, then the
//! router's inputs in the exact order the gateway applied them, then a `trailer`. Readers
//! ignore fields they do not know, so later versions may add some.

use serde::{Deserialize, Serialize};
use switchyard_core::{BlockHash, KvEvent, LoadStats, SnapshotBlock, WorkerId, WorkerInfo};

use crate::load::Tick;
use crate::policy::PolicyConfig;
use crate::serve::ServeSettings;

/// The format name in the header line.
pub const FORMAT: &str = "switchyard-kv-recording";
/// The format version in the header line. Version 2 added the serving settings to the header,
/// the serving mode and prefill step to `route` records (with `prefill_failed` records) and
/// `tenant` to `route` records; version 1 files read as recordings of a gateway with
/// disaggregation off and without tenants.
pub const VERSION: u32 = 2;
/// The oldest version readers accept.
pub const MIN_VERSION: u32 = 1;

/// The first line of a recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    #[serde(default)]
    pub gateway_version: String,
    #[serde(default)]
    pub started_at_unix_ms: u64,
    /// The gateway's router clock (microseconds) when the recording started.
    #[serde(default)]
    pub start_tick: Tick,
    /// The live routing policy when the recording started.
    #[serde(default)]
    pub policy: String,
    #[serde(default)]
    pub policy_settings: PolicyConfig,
    /// The live serving settings (disaggregation mode and its thresholds) when the recording
    /// started; absent in version 1 files, which read as disaggregation off.
    #[serde(default)]
    pub serve: ServeSettings,
    /// The workers known when the recording started (later ones arrive as `worker_joined`).
    #[serde(default)]
    pub workers: Vec<WorkerInfo>,
    #[serde(default)]
    pub max_records: Option<u64>,
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

/// The last line of a recording that ended normally.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trailer {
    /// Records written between header and trailer.
    pub records: u64,
    /// Records the gateway could not write (the writer fell behind); 0 in a complete file.
    pub dropped: u64,
    pub complete: bool,
    /// `stopped`, `shutdown`, or the limit that ended the recording.
    #[serde(default)]
    pub ended_by: String,
}

/// One line of a recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    Header(Header),
    /// A worker joined (or came back as a new incarnation).
    WorkerJoined {
        #[serde(default)]
        tick: Tick,
        worker: WorkerInfo,
    },
    /// A worker left: its blocks, load and policy state are dropped.
    WorkerLeft {
        #[serde(default)]
        tick: Tick,
        model: String,
        worker: WorkerId,
    },
    /// A snapshot replaced everything known of the worker's cache.
    Snapshot {
        #[serde(default)]
        tick: Tick,
        model: String,
        worker: WorkerId,
        incarnation: u64,
        next_seq: u64,
        blocks: Vec<SnapshotBlock>,
    },
    /// A KV event applied in sequence.
    KvEvent {
        #[serde(default)]
        tick: Tick,
        model: String,
        worker: WorkerId,
        incarnation: u64,
        seq: u64,
        event: KvEvent,
    },
    /// The worker's blocks were dropped from the index (an invalid snapshot).
    IndexDropped {
        #[serde(default)]
        tick: Tick,
        model: String,
        worker: WorkerId,
    },
    /// A load report.
    Load {
        tick: Tick,
        model: String,
        worker: WorkerId,
        stats: LoadStats,
    },
    /// A routing request and the live policy's decision. `key` names the request in the
    /// `prefill_done` and `finished` records that follow.
    Route(Box<RouteRecord>),
    /// The routed request's first token arrived.
    PrefillDone {
        #[serde(default)]
        tick: Tick,
        model: String,
        key: u64,
        #[serde(default)]
        worker: Option<WorkerId>,
    },
    /// The routed request ended (finished, failed or cancelled).
    Finished {
        #[serde(default)]
        tick: Tick,
        model: String,
        key: u64,
        #[serde(default)]
        worker: Option<WorkerId>,
    },
    /// A booked prefill failed (or was given up): its booking `key` ends, and the decode
    /// request `decode_key` computes its prompt itself again.
    PrefillFailed {
        #[serde(default)]
        tick: Tick,
        model: String,
        key: u64,
        decode_key: u64,
    },
    Trailer(Trailer),
}

/// How the live gateway served a routed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServedAs {
    /// On the decode worker alone (also every route of a version 1 file).
    #[default]
    Aggregated,
    /// Prefilled on [`PrefillRecord::chosen`], decoded on the route's `chosen`.
    Disaggregated,
    /// `enforce` and no prefill worker: answered 503.
    Refused,
    /// The decode worker serves only with a prefill worker and got none: the next attempt's
    /// route, among workers that serve aggregated, follows.
    Rerouted,
}

impl ServedAs {
    pub fn as_str(self) -> &'static str {
        match self {
            ServedAs::Aggregated => "aggregated",
            ServedAs::Disaggregated => "disaggregated",
            ServedAs::Refused => "refused",
            ServedAs::Rerouted => "rerouted",
        }
    }
}

/// The prefill step of a route, when the gateway consulted the prefill pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRecord {
    /// The prefill booking's key (its `prefill_done`, `finished` or `prefill_failed` records
    /// name it), when a prefill worker was booked.
    #[serde(default)]
    pub key: Option<u64>,
    /// The prefill pool's candidates for the decode worker.
    pub candidates: Vec<WorkerId>,
    /// The prefill worker chosen: booked, or (saturated pool) left for aggregated serving.
    #[serde(default)]
    pub chosen: Option<WorkerId>,
    /// Leading prompt blocks the prefill worker held in its device tier.
    #[serde(default)]
    pub cached_blocks: u32,
}

/// A routing request as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRecord {
    pub tick: Tick,
    pub model: String,
    pub key: u64,
    #[serde(default)]
    pub attempt: u32,
    pub block_size: u32,
    pub prompt_tokens: u64,
    pub max_tokens: u32,
    pub session: Option<String>,
    /// The request's fairness tenant (`user:…`, `key:…`, `ip:…`, `anonymous`); since version 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub block_hashes: Vec<BlockHash>,
    pub candidates: Vec<WorkerId>,
    #[serde(default)]
    pub policy: String,
    pub chosen: WorkerId,
    /// Leading prompt blocks the chosen worker held in its device tier.
    pub cached_blocks: u32,
    /// Whether the attempt could use the prefill pool (not a migration, no log probabilities,
    /// disaggregation on). A route record that could is written once the serving mode is
    /// decided, with it.
    #[serde(default)]
    pub prefill_pool: bool,
    /// How the attempt was served.
    #[serde(default)]
    pub served: ServedAs,
    /// The prefill step, when the prefill pool was consulted.
    #[serde(default)]
    pub prefill: Option<PrefillRecord>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_with_a_type_tag_and_tolerate_unknown_fields() {
        let trailer = Record::Trailer(Trailer {
            records: 3,
            dropped: 0,
            complete: true,
            ended_by: "stopped".into(),
        });
        let line = serde_json::to_string(&trailer).unwrap();
        assert!(line.starts_with(r#"{"type":"trailer""#), "{line}");
        assert_eq!(serde_json::from_str::<Record>(&line).unwrap(), trailer);
        let newer = r#"{"type":"finished","model":"m","key":7,"future_field":1}"#;
        assert!(matches!(
            serde_json::from_str::<Record>(newer).unwrap(),
            Record::Finished { key: 7, .. }
        ));
    }
}
