//! Predicted against realized: the router predicted that the chosen worker holds the prompt's
//! first N blocks; the engine reports how many prompt tokens it really reused. The difference,
//! per worker and model, is the router's accuracy. A decision whose realized hit falls far
//! short (or far above) is flagged with its likely cause.

use std::time::Duration;

use serde::Serialize;
use switchyard_core::BlockHash;

use super::decisions::DecisionEntry;
use super::metrics::{MispredictionLabels, RouteLabels};
use crate::cluster::pool::{ModelRoutes, WorkerHandle, WorkerPool};

/// Why a realized hit was far from the prediction (the most likely reason the gateway can tell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The worker publishes no KV events (never configured, or cut).
    KvEventsSilent,
    /// The index lists blocks the engine no longer holds and nothing is arriving to correct it
    /// (a lost removal, a cache reset without an event, a diverged index).
    IndexStale,
    /// The index learned of the blocks' removal after the decision: evicted while in flight.
    EvictedInFlight,
    /// Events are arriving, but the removal had not reached the index when it decided.
    EventLag,
    /// The engine reused blocks the index did not list for it: stored events lost or late.
    IndexMissingBlocks,
}

impl Cause {
    pub const ALL: [Cause; 5] = [
        Self::KvEventsSilent,
        Self::IndexStale,
        Self::EvictedInFlight,
        Self::EventLag,
        Self::IndexMissingBlocks,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::KvEventsSilent => "kv_events_silent",
            Self::IndexStale => "index_stale",
            Self::EvictedInFlight => "evicted_in_flight",
            Self::EventLag => "event_lag",
            Self::IndexMissingBlocks => "index_missing_blocks",
        }
    }
}

/// A misprediction, as a decision's outcome shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Flag {
    pub cause: Cause,
    pub why: String,
}

/// What the engine reported for one routed attempt.
#[derive(Debug)]
pub struct Realized<'a> {
    pub entry: &'a DecisionEntry,
    pub worker: &'a WorkerHandle,
    pub routes: &'a ModelRoutes,
    /// The prompt's full-block hashes (the attempt's context).
    pub prompt_blocks: &'a [BlockHash],
    pub cached_prompt_tokens: u64,
    /// Whether the worker computed the prompt itself (aggregated decode, or a prefill): only
    /// then is the realized hit comparable with the prediction.
    pub comparable: bool,
}

/// Records the realized hit on the decision, updates the accuracy metrics, tells the worker's
/// KV audit that events are owed, and flags a misprediction.
pub fn realize(pool: &WorkerPool, r: Realized<'_>) {
    let entry = r.entry;
    let realized = r.cached_prompt_tokens;
    if !r.comparable {
        entry.update(|o| o.realized_cached_tokens = Some(realized));
        return;
    }
    let block_size = u64::from(entry.block_size.max(1));
    let predicted = entry.predicted_cached_tokens;
    let error = predicted as i64 - realized as i64;
    let labels = RouteLabels {
        model: entry.model.clone(),
        worker: entry.decision.worker.to_string(),
    };
    let m = &pool.metrics.audit;
    m.prediction_error
        .get_or_create(&labels)
        .observe(error as f64);
    m.predicted_tokens.get_or_create(&labels).inc_by(predicted);
    m.realized_tokens.get_or_create(&labels).inc_by(realized);
    let evaluated = m.evaluated.get_or_create(&labels).inc() + 1;
    let accurate_counter = m.accurate.get_or_create(&labels);
    let accurate = if error.unsigned_abs() < block_size {
        accurate_counter.inc() + 1
    } else {
        accurate_counter.get()
    };
    m.accuracy_ratio
        .get_or_create(&labels)
        .set(accurate as f64 / evaluated as f64);
    // New full blocks were computed: the engine should announce them.
    if (r.prompt_blocks.len() as u64) > realized / block_size {
        r.worker.kv.expect_event();
    }
    let flag = flag(pool, &r, predicted, realized, block_size);
    if let Some(flag) = &flag {
        m.mispredictions
            .get_or_create(&MispredictionLabels {
                model: labels.model.clone(),
                worker: labels.worker.clone(),
                cause: flag.cause.as_str(),
            })
            .inc();
        tracing::warn!(
            request = %entry.tags.request_id,
            worker = %labels.worker,
            predicted,
            realized,
            cause = flag.cause.as_str(),
            why = %flag.why,
            "realized prefix hit far from the router's prediction"
        );
    }
    entry.update(|o| {
        o.realized_cached_tokens = Some(realized);
        o.prediction_error_tokens = Some(error);
        o.flag = flag;
    });
}

fn flag(
    pool: &WorkerPool,
    r: &Realized<'_>,
    predicted: u64,
    realized: u64,
    block_size: u64,
) -> Option<Flag> {
    let over = predicted >= realized + block_size && realized * 2 < predicted;
    let under = realized >= predicted + 2 * block_size && realized > predicted * 2;
    if !over && !under {
        return None;
    }
    let kv = &r.worker.kv;
    if let Some(silent) = kv.silent() {
        return Some(Flag {
            cause: Cause::KvEventsSilent,
            why: format!("the worker {silent}"),
        });
    }
    if under {
        return Some(if kv.events_applied() == 0 {
            Flag {
                cause: Cause::KvEventsSilent,
                why: format!(
                    "the engine reused {realized} prompt tokens the index never heard of: no KV event has arrived from the worker since it joined"
                ),
            }
        } else {
            Flag {
                cause: Cause::IndexMissingBlocks,
                why: format!(
                    "the engine reused {realized} prompt tokens, the index listed {predicted}: stored events were lost or are late"
                ),
            }
        });
    }
    let id = &r.entry.decision.worker;
    let (now_blocks, awaiting) = {
        let core = r.routes.lock();
        let index = &core.serving.index;
        let now = index
            .worker_key(id)
            .map_or(0, |key| index.overlap(r.prompt_blocks).get(key).device);
        (u64::from(now), index.awaiting_snapshot(id))
    };
    let predicted_blocks = predicted / block_size;
    if now_blocks < predicted_blocks {
        return Some(Flag {
            cause: Cause::EvictedInFlight,
            why: format!(
                "{} of the {predicted_blocks} predicted blocks were removed (the index learned it after the decision): evicted while the request was in flight",
                predicted_blocks - now_blocks
            ),
        });
    }
    let silence = pool.audit.kv_silence_after();
    let age = kv.last_event_age();
    if kv.diverged() || awaiting {
        return Some(Flag {
            cause: Cause::IndexStale,
            why: "the index diverged from the worker's own view and is being resynchronised".into(),
        });
    }
    match age {
        Some(age) if age < silence => Some(Flag {
            cause: Cause::EventLag,
            why: format!(
                "events arrive (last {} ms ago) but the removal of {} predicted block(s) had not reached the index",
                age.as_millis(),
                predicted_blocks - realized / block_size
            ),
        }),
        _ => Some(Flag {
            cause: Cause::IndexStale,
            why: format!(
                "the index still lists {now_blocks} block(s) the engine did not have, and no KV event arrived for {}: a removal was lost or the cache was reset without an event",
                describe_age(age)
            ),
        }),
    }
}

fn describe_age(age: Option<Duration>) -> String {
    match age {
        Some(age) => format!("{:.1}s", age.as_secs_f64()),
        None => "as long as the worker has been known".to_owned(),
    }
}
