//! Aggregated against disaggregated serving under load, on the same workers and the same
//! open-loop requests (`switchyard replay disagg`).
//!
//! Each [`Setup`] is one way to use the same N simulated workers: every worker `both` with
//! KV-aware routing (aggregated), or a fixed prefill/decode split under `enforce` (every prompt
//! through the prefill pool) or `auto` (only prompts whose uncached part on the decode worker
//! reaches the threshold). A [`Row`] reports TTFT and inter-token gaps, target attainment and
//! throughput, for all requests and separately for short and long prompts: what
//! disaggregation is meant to protect is the short requests' decode, and what it costs shows in
//! the long prompts' TTFT (a smaller pool prefills them, and their KV moves).

use serde::Serialize;

use crate::cluster::{ClusterConfig, ClusterRun, DisaggConfig, DisaggMode, DisaggStats};
use crate::error::ReplayError;
use crate::metrics::Percentiles;
use crate::workload::Workload;
use crate::{Cluster, progress_bar};

/// One way to use the cluster's workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub label: String,
    pub disagg: Option<DisaggConfig>,
}

/// Aggregated, then for each prefill-pool size `enforce` and `auto` (threshold
/// `min_uncached_tokens`).
pub fn setups(workers: usize, prefill_pools: &[usize], min_uncached_tokens: u64) -> Vec<Setup> {
    let mut out = vec![Setup {
        label: format!("aggregated ({workers} both)"),
        disagg: None,
    }];
    for &p in prefill_pools.iter().filter(|&&p| p >= 1 && p < workers) {
        for mode in [DisaggMode::Enforce, DisaggMode::Auto] {
            let mut disagg = DisaggConfig::split(p, workers - p, mode);
            disagg.min_uncached_tokens = min_uncached_tokens;
            out.push(Setup {
                label: format!("{p}P:{}D {}", workers - p, mode.as_str()),
                disagg: Some(disagg),
            });
        }
    }
    out
}

/// Latency targets. A request attains TTFT when its first token comes within its class's
/// target, ITL when its mean time per output token after the first is within `itl_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Targets {
    pub ttft_s: f64,
    /// TTFT target of long prompts (a 32k prefill alone takes 2.6 s on the default model).
    pub long_ttft_s: f64,
    pub itl_s: f64,
    /// Prompts of at least this many tokens are "long".
    pub long_prompt_tokens: u64,
    /// A gap between two tokens at least this long counts as a stall.
    pub stall_s: f64,
}

impl Default for Targets {
    fn default() -> Self {
        Self {
            ttft_s: 1.0,
            long_ttft_s: 5.0,
            itl_s: 0.030,
            long_prompt_tokens: 8192,
            stall_s: 0.1,
        }
    }
}

/// Figures of one class of requests (all, short or long prompts).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassFigures {
    pub requests: u64,
    pub ttft_ms: Percentiles,
    /// Gaps between consecutive tokens, over every token of the class.
    pub itl_ms: Percentiles,
    pub itl_p999_ms: f64,
    /// Gaps of at least [`Targets::stall_s`].
    pub stalls: u64,
    /// Fractions of the class's requests (failed ones count as missed).
    pub ttft_attained: f64,
    pub itl_attained: f64,
    pub both_attained: f64,
}

/// One setup's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub label: String,
    pub workers: usize,
    pub requests: u64,
    pub failed: u64,
    pub all: ClassFigures,
    pub short: ClassFigures,
    pub long: ClassFigures,
    /// Output tokens per second of the whole cluster, first arrival to last token.
    pub output_tok_s: f64,
    pub duration_s: f64,
    pub disagg: DisaggStats,
    /// The most prompt tokens one sequence computed on a worker that decodes (`both` or
    /// `decode`): what a long prefill can stall there.
    pub decode_longest_prefill: u64,
    /// Preemptions on the workers that decode (KV pressure: their sequences recompute).
    pub decode_preempted: u64,
}

/// Serves `workload` with `setup` on `base`'s workers.
pub fn run_setup(
    workload: &mut dyn Workload,
    base: &ClusterConfig,
    setup: &Setup,
    targets: &Targets,
) -> Result<(Row, ClusterRun), ReplayError> {
    let config = ClusterConfig {
        disagg: setup.disagg.clone(),
        token_gaps: true,
        retention: None,
        session_scheduling: false,
        ..base.clone()
    };
    let bar = progress_bar(workload.expected_requests(), setup.label.clone());
    let run = Cluster::new(config)?.run(workload, &bar)?;
    bar.finish_and_clear();
    Ok((row(setup, base.workers, &run, targets), run))
}

fn row(setup: &Setup, workers: usize, run: &ClusterRun, targets: &Targets) -> Row {
    let long = |prompt: u64| prompt >= targets.long_prompt_tokens;
    let class = |pick: &dyn Fn(u64) -> bool| {
        let records: Vec<_> = run
            .records
            .iter()
            .filter(|r| pick(r.prompt_tokens))
            .collect();
        let n = records.len() as u64;
        let ttft_ok = |r: &crate::RequestRecord| {
            let limit = if long(r.prompt_tokens) {
                targets.long_ttft_s
            } else {
                targets.ttft_s
            };
            r.ok && r
                .first_token
                .is_some_and(|f| (f - r.arrival) as f64 / 1e6 <= limit)
        };
        let itl_ok =
            |r: &crate::RequestRecord| r.ok && r.tpot_s().is_none_or(|s| s <= targets.itl_s);
        let frac = |k: usize| if n == 0 { 0.0 } else { k as f64 / n as f64 };
        let mut ttft: Vec<f64> = records
            .iter()
            .filter(|r| r.ok)
            .filter_map(|r| Some((r.first_token? - r.arrival) as f64 / 1e3))
            .collect();
        let mut gaps: Vec<f64> = run
            .token_gaps
            .iter()
            .filter(|g| pick(u64::from(g.prompt_tokens)))
            .map(|g| f64::from(g.gap_us) / 1e3)
            .collect();
        let stalls = gaps.iter().filter(|&&g| g >= targets.stall_s * 1e3).count() as u64;
        let itl_ms = Percentiles::of(&mut gaps);
        // `of` sorted the gaps: nearest rank.
        let itl_p999_ms = match gaps.len() {
            0 => 0.0,
            len => gaps[((len as f64 * 0.999).ceil() as usize).clamp(1, len) - 1],
        };
        ClassFigures {
            requests: n,
            ttft_ms: Percentiles::of(&mut ttft),
            itl_ms,
            itl_p999_ms,
            stalls,
            ttft_attained: frac(records.iter().filter(|r| ttft_ok(r)).count()),
            itl_attained: frac(records.iter().filter(|r| itl_ok(r)).count()),
            both_attained: frac(records.iter().filter(|r| ttft_ok(r) && itl_ok(r)).count()),
        }
    };
    let ok: Vec<_> = run.records.iter().filter(|r| r.ok).collect();
    let start = run.records.iter().map(|r| r.arrival).min().unwrap_or(0);
    let end = ok.iter().filter_map(|r| r.finished).max().unwrap_or(start);
    let duration_s = end.saturating_sub(start) as f64 / 1e6;
    let output: u64 = ok.iter().map(|r| r.output_tokens).sum();
    Row {
        label: setup.label.clone(),
        workers,
        requests: run.records.len() as u64,
        failed: (run.records.len() - ok.len()) as u64,
        all: class(&|_| true),
        short: class(&|p| !long(p)),
        long: class(&long),
        output_tok_s: if duration_s > 0.0 {
            output as f64 / duration_s
        } else {
            0.0
        },
        duration_s,
        disagg: run.disagg.clone(),
        decode_longest_prefill: run
            .workers
            .iter()
            .filter(|w| w.role != "prefill")
            .map(|w| w.longest_prefill)
            .max()
            .unwrap_or(0),
        decode_preempted: run
            .workers
            .iter()
            .filter(|w| w.role != "prefill")
            .map(|w| w.preempted)
            .sum(),
    }
}

/// The rows as two Markdown tables: latencies and attainment per class, then throughput and
/// the prefill pool's transfers.
pub fn markdown(rows: &[Row]) -> String {
    let pct = |x: f64| format!("{:.1} %", x * 100.0);
    let ms = |x: f64| {
        if x >= 10_000.0 {
            format!("{:.1} s", x / 1e3)
        } else {
            format!("{x:.0}")
        }
    };
    let mut out = String::from(
        "| setup | short TTFT p50 / p99 (ms) | short ITL p50 / p99 / p99.9 (ms) | short stalls | long TTFT p50 / p99 (ms) | long ITL p99 (ms) | short: TTFT / ITL / both attained | long: both attained | all: both attained |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} / {} | {:.1} / {:.1} / {:.0} | {} | {} / {} | {:.1} | {} / {} / {} | {} | {} |\n",
            r.label,
            ms(r.short.ttft_ms.p50),
            ms(r.short.ttft_ms.p99),
            r.short.itl_ms.p50,
            r.short.itl_ms.p99,
            r.short.itl_p999_ms,
            r.short.stalls,
            ms(r.long.ttft_ms.p50),
            ms(r.long.ttft_ms.p99),
            r.long.itl_ms.p99,
            pct(r.short.ttft_attained),
            pct(r.short.itl_attained),
            pct(r.short.both_attained),
            pct(r.long.both_attained),
            pct(r.all.both_attained),
        ));
    }
    out.push_str(
        "\n| setup | requests (short + long) | failed | output tok/s | disaggregated | kept aggregated | KV moved (GiB) | descriptors | link time (s) | longest prefill on a decoding worker | preemptions on decoding workers |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} ({} + {}) | {} | {:.0} | {} | {} | {:.1} | {} | {:.1} | {} | {} |\n",
            r.label,
            r.requests,
            r.short.requests,
            r.long.requests,
            r.failed,
            r.output_tok_s,
            r.disagg.disaggregated,
            r.disagg.kept_aggregated,
            r.disagg.bytes as f64 / f64::from(1u32 << 30),
            r.disagg.descriptors,
            r.disagg.transfer_s,
            r.decode_longest_prefill,
            r.decode_preempted,
        ));
    }
    out
}
