//! Predicted against realized: the router predicted that the chosen worker holds the prompt's
//! first N blocks; the engine reports how many prompt tokens it really reused. The difference,
//! per worker and model, is the router's accuracy. A decision whose realized hit falls far
//! short (or far above) is flagged with its likely cause.

use std::time::Duration;

use switchyard_core::BlockHash;

use super::AuditMetrics;
use super::decisions::DecisionEntry;
pub use super::flag::{Cause, Flag};
use super::kv::KvAudit;
use super::metrics::{MispredictionLabels, RouteLabels};

/// What the engine reported for one routed attempt.
pub struct Realized<'a> {
    pub entry: &'a DecisionEntry,
    /// The decision's worker's KV audit.
    pub kv: &'a KvAudit,
    /// What the model's index lists for the decision's worker now: how many of the prompt's
    /// leading blocks, and whether it awaits the worker's snapshot. Asked only when the
    /// realized hit fell short of the prediction.
    pub index_now: &'a dyn Fn() -> (u32, bool),
    /// The prompt's full-block hashes (the attempt's context).
    pub prompt_blocks: &'a [BlockHash],
    pub cached_prompt_tokens: u64,
    /// Whether the worker computed the prompt itself (aggregated decode, or a prefill): only
    /// then is the realized hit comparable with the prediction.
    pub comparable: bool,
}

impl std::fmt::Debug for Realized<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Realized")
            .field("entry", &self.entry.tags.request_id)
            .field("prompt_blocks", &self.prompt_blocks.len())
            .field("cached_prompt_tokens", &self.cached_prompt_tokens)
            .field("comparable", &self.comparable)
            .finish_non_exhaustive()
    }
}

/// Records the realized hit on the decision, updates the accuracy metrics, tells the worker's
/// KV audit that events are owed, and flags a misprediction (`silence_after`: how long a
/// worker may owe events before it counts as silent).
pub fn realize(m: &AuditMetrics, silence_after: Duration, r: Realized<'_>) {
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
        let sent_ago =
            Duration::from_millis(super::tags::unix_ms().saturating_sub(entry.at_unix_ms));
        r.kv.expect_event(sent_ago);
    }
    let flag = flag(silence_after, &r, predicted, realized, block_size);
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
    silence_after: Duration,
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
    let kv = r.kv;
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
    let (now_blocks, awaiting) = (r.index_now)();
    let now_blocks = u64::from(now_blocks);
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
    let silence = silence_after;
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
