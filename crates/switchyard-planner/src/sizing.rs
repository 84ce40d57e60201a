//! How many prefill and decode workers a load needs to meet the latency targets.
//!
//! **Prefill** (TTFT). A request's uncached prompt is `input × (1 − hit rate)` tokens (cached
//! tokens need no prefill); alone on a worker it takes `t = profile.prefill_seconds(uncached)`.
//! The pool must prefill `rate × uncached` tokens per second. Treating each prefill worker as a
//! queue whose time in system is `t / (1 − ρ)`, the TTFT target holds while the utilisation
//! `ρ ≤ 1 − t / ttft_target`, so `prefill = ⌈demand / (throughput × ρ_max)⌉`. When even an idle
//! worker misses the target (`t ≥ target`), the pool is sized for `ρ = 0.5` and the reason
//! says the target cannot be met at that prompt length.
//!
//! **Decode** (ITL). By Little's law `rate × output × itl` sequences decode at once (at least
//! as many as the workers report now). One worker keeps the inter-token latency within target
//! up to `c* = profile.max_concurrency(context, itl_target)` sequences of the mean context
//! (`input + output / 2`), so `decode = ⌈concurrency / c*⌉`.
//!
//! [`allocate`] then applies the per-pool minimums and the worker budget.

use serde::Serialize;

use crate::connector::PoolSizes;
use crate::predict::Load;
use crate::profile::PerformanceProfile;

/// The latency targets, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Targets {
    pub ttft_seconds: f64,
    pub itl_seconds: f64,
}

/// Utilisation a prefill pool is sized for when the TTFT target is out of reach anyway.
const UNREACHABLE_TTFT_UTILISATION: f64 = 0.5;

/// What a load needs, before limits, with the figures behind it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Requirement {
    pub prefill: u32,
    pub decode: u32,
    /// Uncached prompt tokens per second the prefill pool must compute.
    pub prefill_tokens_per_second: f64,
    /// Seconds an idle worker takes to prefill the mean uncached prompt.
    pub prefill_seconds: f64,
    /// Whether prompts are prefilled on the decode workers (uncached part below the
    /// gateway's disaggregation threshold).
    pub aggregated: bool,
    /// Sequences decoding at once.
    pub decode_concurrency: f64,
    /// Sequences each decode worker holds at the chosen size.
    pub sequences_per_decode_worker: f64,
    pub why: String,
}

/// What the workers carry now, beside the predicted traffic.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Backlog {
    /// Sequences decoding on the decode workers: a floor for the decode concurrency, because
    /// Little's law on a predicted rate can lag a burst.
    pub active_decode_sequences: f64,
    /// Prompt tokens queued on the prefill workers: cleared within `interval_seconds` on top
    /// of the new traffic, so a pool that fell behind grows instead of staying behind.
    pub queued_prefill_tokens: f64,
    pub interval_seconds: f64,
}

/// Most decode workers the search considers; beyond that the target is called unreachable.
const MAX_DECODE_SEARCH: u32 = 4096;

/// Sizes both pools for `load` and the `backlog` the workers carry. Prompts whose uncached part is below `disagg_min_uncached_tokens` are prefilled by the
/// decode workers (as the gateway's `auto` disaggregation does), which slows their decoding.
pub fn required(
    load: &Load,
    backlog: &Backlog,
    profile: &PerformanceProfile,
    targets: &Targets,
    disagg_min_uncached_tokens: f64,
) -> Requirement {
    let uncached = load.input_tokens * (1.0 - load.cache_hit_rate.clamp(0.0, 1.0));
    let backlog_rate = if backlog.interval_seconds > 0.0 {
        backlog.queued_prefill_tokens.max(0.0) / backlog.interval_seconds
    } else {
        0.0
    };
    let aggregated = uncached < disagg_min_uncached_tokens;
    let new_work = if aggregated {
        0.0
    } else {
        load.request_rate * uncached
    };
    let demand = new_work + backlog_rate;
    let prefill_seconds = if uncached >= 1.0 {
        profile.prefill_seconds(uncached)
    } else {
        0.0
    };
    let mut why = Vec::new();
    if aggregated && uncached >= 1.0 {
        why.push(format!(
            "{uncached:.0} uncached prompt tokens stay on the decode workers (below {disagg_min_uncached_tokens:.0})"
        ));
    }
    let prefill = if demand <= 0.0 {
        why.push("no prefill pool work predicted".to_owned());
        0
    } else {
        // A backlog of prompts the prediction calls short was still sent to the pool: size
        // it at the disaggregation threshold's length.
        let length = if aggregated {
            disagg_min_uncached_tokens.max(1.0)
        } else {
            uncached
        };
        let seconds = profile.prefill_seconds(length);
        let throughput = profile.prefill_throughput(length);
        let max_utilisation = if seconds < targets.ttft_seconds {
            1.0 - seconds / targets.ttft_seconds
        } else {
            why.push(format!(
                "TTFT target {:.0} ms unreachable: an idle worker needs {:.0} ms for {length:.0} uncached tokens",
                targets.ttft_seconds * 1e3,
                seconds * 1e3
            ));
            UNREACHABLE_TTFT_UTILISATION
        };
        let n = (demand / (throughput * max_utilisation)).ceil().max(1.0);
        why.push(format!(
            "prefill {demand:.0} tok/s ({backlog_rate:.0} of them backlog) at {:.0} tok/s per worker, utilisation <= {:.2} for TTFT {:.0} ms",
            throughput,
            max_utilisation,
            targets.ttft_seconds * 1e3
        ));
        saturating_u32(n)
    };
    // Share of a decode pool's time that goes to prefilling aggregated prompts: their
    // marginal cost (the step overhead is shared with the decode batch).
    let prefill_share = if aggregated && uncached >= 1.0 {
        load.request_rate * (prefill_seconds - profile.prefill_seconds(0.0)).max(0.0)
    } else {
        0.0
    };
    let context = load.input_tokens + load.output_tokens / 2.0;
    let concurrency = (load.request_rate * load.output_tokens * targets.itl_seconds)
        .max(backlog.active_decode_sequences.max(0.0));
    let itl_at = |n: u32| {
        let n = f64::from(n);
        let busy = 1.0 - prefill_share / n;
        if busy <= 0.0 {
            f64::INFINITY
        } else {
            profile.itl_seconds((concurrency / n).max(1.0), context) / busy
        }
    };
    let (decode, per_worker) = if concurrency <= 0.0 {
        (0, 0.0)
    } else {
        match (1..=MAX_DECODE_SEARCH).find(|&n| itl_at(n) <= targets.itl_seconds) {
            Some(n) => {
                why.push(format!(
                    "decode {concurrency:.1} sequences of {context:.0} tokens: {:.1} per worker keeps ITL {:.1} ms within {:.1} ms",
                    concurrency / f64::from(n),
                    itl_at(n) * 1e3,
                    targets.itl_seconds * 1e3
                ));
                (n, concurrency / f64::from(n))
            }
            None => {
                why.push(format!(
                    "ITL target {:.1} ms unreachable for sequences of {context:.0} tokens",
                    targets.itl_seconds * 1e3
                ));
                // Spread the sequences one per worker: as close as workers can get.
                let n = saturating_u32(concurrency.ceil().max(1.0));
                (n, 1.0)
            }
        }
    };
    Requirement {
        prefill,
        decode,
        prefill_tokens_per_second: demand,
        prefill_seconds,
        aggregated,
        decode_concurrency: concurrency,
        sequences_per_decode_worker: per_worker,
        why: why.join("; "),
    }
}

fn saturating_u32(x: f64) -> u32 {
    if x >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        x as u32
    }
}

/// Pool bounds the operator sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub min_prefill: u32,
    pub min_decode: u32,
    pub max_total: u32,
}

/// The pool sizes to aim for: `required` within `limits`, never both pools empty. With
/// `fill_to` (a connector that moves a fixed set of workers between the pools), every one of
/// those workers is placed, the spare ones in proportion to what each pool needs.
pub fn allocate(required: (u32, u32), limits: &Limits, fill_to: Option<u32>) -> PoolSizes {
    let budget = fill_to.map_or(limits.max_total, |n| n.min(limits.max_total));
    let mut prefill = required.0.max(limits.min_prefill);
    let mut decode = required.1.max(limits.min_decode);
    if prefill + decode == 0 {
        // Nothing asked for: a decode worker serves aggregated until load shows up.
        decode = 1;
    }
    let wanted = (prefill, decode);
    let total = u64::from(prefill) + u64::from(decode);
    let budget_total = u64::from(budget.max(1));
    if total > budget_total || fill_to.is_some() {
        // Share the budget in proportion to the need, then respect the minimums.
        let share = (budget_total as f64 * f64::from(wanted.0) / total as f64).round() as u32;
        let budget = budget.max(1);
        let min_decode = limits.min_decode.min(budget);
        let min_prefill = limits.min_prefill.min(budget - min_decode);
        prefill = share.clamp(min_prefill, budget - min_decode);
        decode = budget - prefill;
        if prefill + decode == 0 {
            decode = 1;
        }
    }
    PoolSizes { prefill, decode }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use proptest::prelude::*;
    use switchyard_engine_sim::TimingModel;

    fn profile() -> PerformanceProfile {
        PerformanceProfile::from_timing(&TimingModel::default(), 1.0, 8192)
    }

    /// Sizing with every prompt disaggregated unless said otherwise.
    fn required(load: &Load, observed: f64, p: &PerformanceProfile, t: &Targets) -> Requirement {
        super::required(load, &sequences(observed), p, t, 0.0)
    }

    fn sequences(active: f64) -> Backlog {
        Backlog {
            active_decode_sequences: active,
            ..Backlog::default()
        }
    }

    const TARGETS: Targets = Targets {
        ttft_seconds: 0.5,
        itl_seconds: 0.02,
    };

    fn load(rate: f64, input: f64, output: f64, hit: f64) -> Load {
        Load {
            request_rate: rate,
            input_tokens: input,
            output_tokens: output,
            cache_hit_rate: hit,
        }
    }

    #[test]
    fn prefill_heavy_load_needs_prefill_workers_and_decode_heavy_needs_decode() {
        let p = profile();
        let prefill_heavy = required(&load(20.0, 6000.0, 20.0, 0.0), 0.0, &p, &TARGETS);
        let decode_heavy = required(&load(20.0, 100.0, 1500.0, 0.0), 0.0, &p, &TARGETS);
        assert!(
            prefill_heavy.prefill > prefill_heavy.decode,
            "{prefill_heavy:?}"
        );
        assert!(
            decode_heavy.decode > decode_heavy.prefill,
            "{decode_heavy:?}"
        );
    }

    #[test]
    fn pools_grow_with_the_rate() {
        let p = profile();
        let small = required(&load(5.0, 4000.0, 500.0, 0.0), 0.0, &p, &TARGETS);
        let large = required(&load(50.0, 4000.0, 500.0, 0.0), 0.0, &p, &TARGETS);
        assert!(large.prefill > small.prefill && large.decode > small.decode);
    }

    #[test]
    fn cached_prompt_tokens_need_no_prefill() {
        let p = profile();
        let cold = required(&load(20.0, 8000.0, 10.0, 0.0), 0.0, &p, &TARGETS);
        let warm = required(&load(20.0, 8000.0, 10.0, 0.9), 0.0, &p, &TARGETS);
        assert!(warm.prefill < cold.prefill, "cold {cold:?} warm {warm:?}");
        assert!(
            (warm.prefill_tokens_per_second * 10.0 - cold.prefill_tokens_per_second).abs() < 1.0
        );
    }

    #[test]
    fn observed_sequences_are_a_floor_and_unreachable_targets_are_reported() {
        let p = profile();
        let idle = required(&load(0.0, 0.0, 0.0, 0.0), 0.0, &p, &TARGETS);
        assert_eq!((idle.prefill, idle.decode), (0, 0));
        let busy = required(&load(0.0, 0.0, 0.0, 0.0), 500.0, &p, &TARGETS);
        assert!(busy.decode >= 1);
        let tight = Targets {
            ttft_seconds: 0.01,
            itl_seconds: 0.001,
        };
        let r = required(&load(1.0, 8000.0, 100.0, 0.0), 0.0, &p, &tight);
        assert!(r.why.contains("TTFT target 10 ms unreachable"), "{}", r.why);
        assert!(r.why.contains("(0 of them backlog)"), "{}", r.why);
        assert!(r.why.contains("ITL target 1.0 ms unreachable"), "{}", r.why);
        assert!(r.prefill >= 1 && r.decode >= 1);
    }

    #[test]
    fn a_prefill_backlog_is_cleared_within_the_interval() {
        let p = profile();
        let l = load(4.0, 6000.0, 20.0, 0.0);
        let steady = required(&l, 0.0, &p, &TARGETS);
        let behind = Backlog {
            queued_prefill_tokens: 600_000.0,
            interval_seconds: 10.0,
            ..Backlog::default()
        };
        let catching_up = super::required(&l, &behind, &p, &TARGETS, 0.0);
        assert!(
            (catching_up.prefill_tokens_per_second - steady.prefill_tokens_per_second - 60_000.0)
                .abs()
                < 1e-6
        );
        assert!(catching_up.prefill > steady.prefill);
    }

    #[test]
    fn short_prompts_prefilled_by_decode_workers_need_more_of_them() {
        let p = profile();
        let l = load(30.0, 200.0, 400.0, 0.0);
        let split = super::required(&l, &sequences(0.0), &p, &TARGETS, 0.0);
        let aggregated = super::required(&l, &sequences(0.0), &p, &TARGETS, 512.0);
        assert!(aggregated.aggregated && !split.aggregated);
        assert_eq!(aggregated.prefill, 0);
        assert!(split.prefill >= 1);
        assert!(
            aggregated.decode > split.decode,
            "{aggregated:?} vs {split:?}"
        );
    }

    #[test]
    fn the_chosen_decode_size_is_the_smallest_within_the_itl_target() {
        let p = profile();
        let l = load(30.0, 200.0, 400.0, 0.0);
        let r = super::required(&l, &sequences(0.0), &p, &TARGETS, 512.0);
        // The model written out: the decode workers also spend `share` of their time on the
        // short prompts' prefill.
        let share = 30.0 * (p.prefill_seconds(200.0) - p.prefill_seconds(0.0));
        let itl = |n: f64| p.itl_seconds(r.decode_concurrency / n, 400.0) / (1.0 - share / n);
        let n = f64::from(r.decode);
        assert!(r.decode > 1, "{r:?}");
        assert!(itl(n) <= TARGETS.itl_seconds, "{r:?}");
        assert!(
            itl(n - 1.0) > TARGETS.itl_seconds || itl(n - 1.0) < 0.0,
            "{r:?}"
        );
    }

    #[test]
    fn allocate_fills_a_fixed_set_in_proportion() {
        let limits = Limits {
            min_prefill: 1,
            min_decode: 1,
            max_total: 8,
        };
        assert_eq!(
            allocate((3, 1), &limits, Some(4)),
            PoolSizes {
                prefill: 3,
                decode: 1
            }
        );
        assert_eq!(
            allocate((0, 9), &limits, Some(4)),
            PoolSizes {
                prefill: 1,
                decode: 3
            }
        );
        assert_eq!(
            allocate((2, 2), &limits, None),
            PoolSizes {
                prefill: 2,
                decode: 2
            }
        );
        assert_eq!(allocate((20, 20), &limits, None).total(), 8);
    }

    proptest! {
        /// Whatever is required: within the budget, minimums kept when they fit, never both empty.
        #[test]
        fn allocations_respect_the_limits(p in 0u32..100, d in 0u32..100, min_p in 0u32..4, min_d in 0u32..4, extra in 0u32..10, fill in proptest::option::of(1u32..20)) {
            let limits = Limits { min_prefill: min_p, min_decode: min_d, max_total: (min_p + min_d + extra).max(1) };
            let got = allocate((p, d), &limits, fill);
            let budget = fill.map_or(limits.max_total, |n| n.min(limits.max_total)).max(1);
            prop_assert!(got.total() >= 1);
            prop_assert!(got.total() <= budget);
            if let Some(n) = fill {
                prop_assert_eq!(got.total(), n.min(limits.max_total));
            }
            if min_p + min_d <= budget {
                prop_assert!(got.prefill >= min_p && got.decode >= min_d);
            }
        }
    }
}
