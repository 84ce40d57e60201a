//! The metrics read at scrape time from what the worker keeps anyway: the engine's load and
//! telemetry, the role and drain state, the KV event log.
//!
//! The load gauges are `engine_*` because the gateway already exports its own view of each
//! worker's load as `switchyard_worker_running_requests{worker}` and the like: same names with
//! the same `worker` label would mix the two in every query.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use switchyard_core::Role;

use crate::engine::Engine;
use crate::engine::stats::AdapterStats;
use crate::state::WorkerState;

/// Reads `engine` and `state` at each scrape.
#[derive(Debug)]
pub struct ScrapeCollector {
    engine: Arc<dyn Engine>,
    state: WorkerState,
}

impl ScrapeCollector {
    pub fn new(engine: Arc<dyn Engine>, state: WorkerState) -> Self {
        Self { engine, state }
    }
}

// Help texts end with a period, as the registry writes those of registered metrics.

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let metric = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
    let help = format!("{help}.");
    metric.encode(enc.encode_descriptor(name, &help, None, metric.metric_type())?)
}

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let metric = ConstCounter::new(v);
    let help = format!("{help}.");
    metric.encode(enc.encode_descriptor(name, &help, None, metric.metric_type())?)
}

/// A labelled family: one series per `(label name, label value, value)` row.
fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: Vec<([(&'static str, String); 1], M)>,
) -> std::fmt::Result {
    let Some((_, first)) = rows.first() else {
        return Ok(());
    };
    let help = format!("{help}.");
    let mut family = enc.encode_descriptor(name, &help, None, first.metric_type())?;
    for (labels, metric) in &rows {
        metric.encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// One relay counter: (metric, help, its field).
type RelayCounter = (&'static str, &'static str, fn(&AdapterStats) -> u64);

/// The relay counters, exported per rank.
const RELAY: [RelayCounter; 18] = [
    (
        "engine_kv_batches",
        "Engine KV event batches applied (live or replayed), per data-parallel rank",
        |s| s.batches,
    ),
    (
        "engine_kv_events_relayed",
        "Engine KV events relayed into the worker's event log, per rank",
        |s| s.events,
    ),
    (
        "engine_kv_gaps",
        "Sequence gaps in the engine's KV event stream, per rank",
        |s| s.gaps,
    ),
    (
        "engine_kv_replays",
        "Gaps repaired from the engine's replay socket, per rank",
        |s| s.replays,
    ),
    (
        "engine_kv_replayed_batches",
        "Batches received through replay, per rank",
        |s| s.replayed_batches,
    ),
    (
        "engine_kv_replay_failures",
        "Gaps replay could not repair (the rank's blocks were cleared and rebuilt), per rank",
        |s| s.resyncs,
    ),
    (
        "engine_restarts",
        "Engine restarts seen in the KV event stream (sequence going back), per rank",
        |s| s.restarts,
    ),
    (
        "engine_kv_malformed_frames",
        "KV event messages skipped as malformed, per rank",
        |s| s.malformed,
    ),
    (
        "engine_kv_partial_blocks",
        "Partial blocks (pages beyond the tokens) skipped, per rank",
        |s| s.partial_blocks,
    ),
    (
        "engine_kv_unrelatable",
        "BlockStored events skipped because their parent was unknown, per rank",
        |s| s.unrelatable,
    ),
    (
        "engine_kv_skipped_events",
        "Engine KV events the worker could not use (unknown type, malformed field), skipped alone, per rank",
        |s| s.skipped_events,
    ),
    (
        "engine_kv_block_size_mismatches",
        "BlockStored events with a larger block size than the worker's, skipped, per rank",
        |s| s.block_size_mismatches,
    ),
    (
        "engine_kv_duplicate_stores",
        "Stores of blocks the engine already held (re-announcements), ignored, per rank",
        |s| s.duplicate_stores,
    ),
    (
        "engine_kv_unknown_removals",
        "Removals of blocks the worker did not know held, ignored, per rank",
        |s| s.unknown_removals,
    ),
    (
        "engine_kv_other_groups",
        "Stores of non-full-attention KV-cache groups (sliding window, Mamba), skipped, per rank",
        |s| s.other_groups,
    ),
    (
        "engine_kv_unknown_media",
        "Engine KV events naming a medium the worker does not know, per rank",
        |s| s.unknown_media,
    ),
    (
        "engine_kv_buffer_wraps",
        "TensorRT-LLM: gaps where the engine's KV event buffer wrapped before a poll read it, per rank",
        |s| s.buffer_wraps,
    ),
    (
        "engine_kv_poll_failures",
        "TensorRT-LLM: failed polls of the engine's /kv_cache_events (counted on rank 0)",
        |s| s.poll_failures,
    ),
];

impl Collector for ScrapeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let e = &mut enc;
        gauge(
            e,
            "requests_in_flight",
            "Requests being served (generations, prefills, KV pulls)",
            self.state.in_flight(),
        )?;
        gauge(
            e,
            "draining",
            "1 while the worker takes no new requests",
            u64::from(self.state.is_draining()),
        )?;
        let role = self.state.role();
        family(
            e,
            "role",
            "The worker's current role (1) among prefill, decode and both",
            [Role::Prefill, Role::Decode, Role::Both]
                .into_iter()
                .map(|r| {
                    let v = i64::from(r == role);
                    ([("role", r.as_str().to_owned())], ConstGauge::new(v))
                })
                .collect(),
        )?;

        let load = crate::state::worker_load(&*self.engine, &self.state);
        gauge(
            e,
            "engine_queued_prefill_tokens",
            "Prompt tokens admitted but not yet prefilled",
            load.queued_prefill_tokens,
        )?;
        gauge(
            e,
            "engine_waiting_requests",
            "Requests waiting in the engine for admission",
            load.waiting_requests,
        )?;
        gauge(
            e,
            "engine_running_requests",
            "Sequences in the engine's running batch",
            load.running_requests,
        )?;
        gauge(
            e,
            "engine_decode_sequences",
            "Sequences decoding",
            load.active_decode_sequences,
        )?;
        gauge(
            e,
            "kv_active_blocks",
            "Device KV blocks referenced by running sequences",
            load.active_blocks,
        )?;
        gauge(
            e,
            "kv_used_blocks",
            "Device KV blocks in use, cached or referenced",
            load.used_blocks,
        )?;
        gauge(
            e,
            "kv_capacity_blocks",
            "Device KV capacity in blocks",
            load.capacity_blocks,
        )?;
        counter(
            e,
            "engine_preemptions",
            "Sequences the engine preempted",
            load.preemptions_total,
        )?;

        let log = self.engine.events();
        counter(
            e,
            "kv_events_published",
            "KV events published by this engine incarnation",
            log.next_seq(),
        )?;
        gauge(
            e,
            "kv_event_subscribers",
            "Consumers (gateways) following the KV event stream",
            log.subscribers() as u64,
        )?;
        let (snapshots, replays) = log.subscriptions();
        family(
            e,
            "kv_event_subscriptions",
            "KV event subscriptions served, by how they started: a snapshot, or a replay from the buffer",
            vec![
                (
                    [("start", "snapshot".to_owned())],
                    ConstCounter::new(snapshots),
                ),
                ([("start", "replay".to_owned())], ConstCounter::new(replays)),
            ],
        )?;
        gauge(
            e,
            "kv_event_log_blocks",
            "Blocks (per tier) the published events leave in place",
            log.block_count() as u64,
        )?;

        let t = self.engine.telemetry();
        if let Some(held) = t.held_kv_handles {
            gauge(
                e,
                "kv_handles_held",
                "Prefilled KV held under a handle for a decode worker to pull",
                held,
            )?;
        }
        if let Some(retained) = t.retained_kv_blocks {
            gauge(
                e,
                "kv_retained_blocks",
                "Idle KV blocks retention hints keep pinned (within the retention budget)",
                retained,
            )?;
        }
        if let Some(expired) = t.expired_kv_handles {
            counter(
                e,
                "kv_handles_expired",
                "KV handles that expired unpulled (their blocks released)",
                expired,
            )?;
        }
        for (name, help, field) in RELAY {
            family(
                e,
                name,
                help,
                t.relay_ranks
                    .iter()
                    .enumerate()
                    .map(|(rank, s)| ([("rank", rank.to_string())], ConstCounter::new(field(s))))
                    .collect(),
            )?;
        }
        if let Some((ok, failed, up)) = t.engine_scrapes {
            gauge(
                e,
                "engine_metrics_up",
                "1 when the last scrape of the engine's own /metrics (its load) succeeded",
                u64::from(up),
            )?;
            family(
                e,
                "engine_metrics_scrapes",
                "Scrapes of the engine's own /metrics, by outcome",
                vec![
                    ([("outcome", "ok".to_owned())], ConstCounter::new(ok)),
                    ([("outcome", "error".to_owned())], ConstCounter::new(failed)),
                ],
            )?;
        }
        Ok(())
    }
}
