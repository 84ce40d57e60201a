//! Target attainment of a run's requests and the Markdown table `planner bench` prints.

use super::{Attainment, Outcome, ShiftSettings};
use crate::sizing::Targets;

/// A finished request's figures.
#[derive(Debug, Clone, Copy)]
pub(super) struct Finished {
    pub phase: usize,
    pub ttft: f64,
    /// Mean time between tokens after the first; `None` for one-token outputs.
    pub itl: Option<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub cached_tokens: u32,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

pub(super) fn attainment(finished: &[Finished], targets: &Targets) -> Attainment {
    if finished.is_empty() {
        return Attainment::default();
    }
    let n = finished.len() as f64;
    let ttft_ok = |f: &Finished| f.ttft <= targets.ttft_seconds;
    let itl_ok = |f: &Finished| f.itl.is_none_or(|i| i <= targets.itl_seconds);
    let multi = finished.iter().filter(|f| f.itl.is_some()).count().max(1) as f64;
    let mut ttfts: Vec<f64> = finished.iter().map(|f| f.ttft).collect();
    let mut itls: Vec<f64> = finished.iter().filter_map(|f| f.itl).collect();
    ttfts.sort_by(f64::total_cmp);
    itls.sort_by(f64::total_cmp);
    Attainment {
        requests: finished.len(),
        ttft: finished.iter().filter(|f| ttft_ok(f)).count() as f64 / n,
        itl: finished
            .iter()
            .filter(|f| f.itl.is_some() && itl_ok(f))
            .count() as f64
            / multi,
        both: finished.iter().filter(|f| ttft_ok(f) && itl_ok(f)).count() as f64 / n,
        ttft_p50: percentile(&ttfts, 0.5),
        ttft_p99: percentile(&ttfts, 0.99),
        itl_p50: percentile(&itls, 0.5),
        itl_p99: percentile(&itls, 0.99),
    }
}

/// A Markdown table of the outcomes, one row per configuration.
pub fn markdown(settings: &ShiftSettings, outcomes: &[Outcome]) -> String {
    let pct = |x: f64| format!("{:.1} %", x * 100.0);
    let mut out = String::from(
        "| configuration | requests | TTFT attained | ITL attained | both | both, per phase | both, mean of phases | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | moves | failed |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        let phases: Vec<String> = o
            .phases
            .iter()
            .zip(&settings.phases)
            .map(|(a, p)| format!("{}: {}", p.name, pct(a.both)))
            .collect();
        let mean = o.phases.iter().map(|a| a.both).sum::<f64>() / o.phases.len().max(1) as f64;
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} / {:.2} | {:.1} / {:.1} | {} | {} |\n",
            o.label,
            o.overall.requests,
            pct(o.overall.ttft),
            pct(o.overall.itl),
            pct(o.overall.both),
            phases.join(", "),
            pct(mean),
            o.overall.ttft_p50,
            o.overall.ttft_p99,
            o.overall.itl_p50 * 1e3,
            o.overall.itl_p99 * 1e3,
            o.moves,
            o.failed,
        ));
    }
    out
}
