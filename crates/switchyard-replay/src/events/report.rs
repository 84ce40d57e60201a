//! What `switchyard replay events` reports: per policy, how often it agreed with the live
//! decisions (decode worker, serving mode, prefill worker), what its choices had cached and
//! how evenly it spread the requests; as a table, JSON and CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;
use switchyard_core::WorkerId;
use switchyard_router::recording::{RouteRecord, ServedAs};

use super::lane::Outcome;
use crate::error::ReplayError;
use crate::metrics::Percentiles;

/// What the index made of the recorded events (all but `applied` should be rare: gaps appear
/// before a worker's first recorded snapshot or where the recording dropped records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IndexCounts {
    pub snapshots: u64,
    pub applied: u64,
    pub stale: u64,
    pub gaps: u64,
    pub invalid: u64,
}

/// One policy's figures over the recording.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// The policy, or `live (<policy>)` for the decisions the gateway actually made.
    pub policy: String,
    pub decisions: u64,
    /// Requests the policy could not route (no candidate it accepts).
    pub failures: u64,
    /// Fraction of decisions that chose the live decision's decode (generating) worker.
    pub agreement: f64,
    /// Fraction of decisions served the way the live one was (aggregated, disaggregated,
    /// refused, rerouted).
    pub stage_agreement: f64,
    /// Decisions served disaggregated (through a prefill worker).
    pub disaggregated: u64,
    /// Live decisions served disaggregated: the ones the prefill choice is compared on.
    pub prefill_decisions: u64,
    /// Fraction of `prefill_decisions` the policy also served disaggregated with the live
    /// decision's prefill worker; `None` when the live gateway disaggregated none.
    pub prefill_agreement: Option<f64>,
    /// Leading prompt blocks the chosen (decode) worker held in its device tier.
    pub cached_blocks: Percentiles,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Most requests routed to one worker over the mean per worker (1 = perfectly even).
    pub load_spread: f64,
    pub routed_per_worker: BTreeMap<WorkerId, u64>,
}

/// Everything `switchyard replay events` measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventsReport {
    pub recording: String,
    pub seed: u64,
    /// The live policy when the recording started.
    pub live_policy: String,
    /// The live disaggregation mode when the recording started (`off` for version 1 files).
    pub disaggregation: String,
    /// Whether the recording ended with a trailer saying no record was dropped.
    pub complete: bool,
    pub dropped: u64,
    pub records: u64,
    /// The session or tenant the decisions were narrowed to (`--session`, `--tenant`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    pub index: IndexCounts,
    pub policies: Vec<PolicyReport>,
}

#[derive(Debug, Default)]
pub(super) struct Tally {
    decisions: u64,
    pub(super) failures: u64,
    agreed: u64,
    same_stage: u64,
    disaggregated: u64,
    live_prefills: u64,
    same_prefill: u64,
    cached_blocks: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    routed: BTreeMap<WorkerId, u64>,
}

impl Tally {
    pub(super) fn add(&mut self, record: &RouteRecord, outcome: &Outcome) {
        let (chosen, cached_blocks) = &outcome.decode;
        self.decisions += 1;
        self.agreed += u64::from(*chosen == record.chosen);
        self.same_stage += u64::from(outcome.stage == record.served);
        self.disaggregated += u64::from(outcome.stage == ServedAs::Disaggregated);
        if let Some((live_prefill, _)) = Outcome::live(record).prefill {
            self.live_prefills += 1;
            self.same_prefill += u64::from(
                outcome
                    .prefill
                    .as_ref()
                    .is_some_and(|(worker, _)| *worker == live_prefill),
            );
        }
        self.cached_blocks.push(f64::from(*cached_blocks));
        self.prompt_tokens += record.prompt_tokens;
        let cached = u64::from(*cached_blocks) * u64::from(record.block_size);
        self.cached_tokens += cached.min(record.prompt_tokens);
        for c in &record.candidates {
            self.routed.entry(c.clone()).or_default();
        }
        *self.routed.entry(chosen.clone()).or_default() += 1;
    }

    pub(super) fn report(mut self, policy: String) -> PolicyReport {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let max = self.routed.values().copied().max().unwrap_or(0);
        let total: u64 = self.routed.values().sum();
        let mean = ratio(total, self.routed.len() as u64);
        PolicyReport {
            policy,
            decisions: self.decisions,
            failures: self.failures,
            agreement: ratio(self.agreed, self.decisions),
            stage_agreement: ratio(self.same_stage, self.decisions),
            disaggregated: self.disaggregated,
            prefill_decisions: self.live_prefills,
            prefill_agreement: (self.live_prefills > 0)
                .then(|| ratio(self.same_prefill, self.live_prefills)),
            cached_blocks: Percentiles::of(&mut self.cached_blocks),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            hit_rate: ratio(self.cached_tokens, self.prompt_tokens),
            load_spread: if mean > 0.0 { max as f64 / mean } else { 0.0 },
            routed_per_worker: self.routed,
        }
    }
}

fn percent(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

impl EventsReport {
    /// The comparison table, one row per policy (the live decisions first). `agree` compares
    /// the decode worker, `stage` the serving mode, `prefill` the prefill worker of the live
    /// disaggregated decisions.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kv-event replay: {} ({} records{}; disaggregation {}; index: {} snapshots, {} events, {} gaps)",
            self.recording,
            self.records,
            if self.complete {
                String::new()
            } else {
                format!(", INCOMPLETE: {} dropped", self.dropped)
            },
            self.disaggregation,
            self.index.snapshots,
            self.index.applied,
            self.index.gaps,
        );
        if let Some(filter) = &self.filter {
            let _ = writeln!(
                s,
                "decisions of {filter} only (every request replayed, these counted)"
            );
        }
        let header = [
            "policy",
            "decisions",
            "fail",
            "agree",
            "stage",
            "disagg",
            "prefill",
            "cached p50",
            "cached p99",
            "cached mean",
            "hit rate",
            "spread",
        ];
        let widths = [16, 9, 5, 7, 7, 6, 7, 10, 10, 11, 8, 6];
        let mut line = String::new();
        for (h, w) in header.iter().zip(widths) {
            let _ = write!(line, "{h:>w$} ");
        }
        let _ = writeln!(s, "{}", line.trim_end());
        let _ = writeln!(s, "{}", "-".repeat(line.trim_end().len()));
        for p in &self.policies {
            let cells = [
                p.policy.clone(),
                p.decisions.to_string(),
                p.failures.to_string(),
                percent(p.agreement),
                percent(p.stage_agreement),
                p.disaggregated.to_string(),
                p.prefill_agreement.map_or_else(|| "-".into(), percent),
                format!("{:.0}", p.cached_blocks.p50),
                format!("{:.0}", p.cached_blocks.p99),
                format!("{:.1}", p.cached_blocks.mean),
                percent(p.hit_rate),
                format!("{:.2}", p.load_spread),
            ];
            let mut row = String::new();
            for (c, w) in cells.iter().zip(widths) {
                let _ = write!(row, "{c:>w$} ");
            }
            let _ = writeln!(s, "{}", row.trim_end());
        }
        s
    }

    pub fn to_json(&self) -> Result<String, ReplayError> {
        serde_json::to_string_pretty(self).map_err(|e| ReplayError::Report(e.to_string()))
    }

    /// One row per policy; `prefill_agreement` is empty when the live gateway disaggregated
    /// nothing.
    pub fn to_csv(&self) -> String {
        let mut s = String::from(
            "policy,decisions,failures,agreement,cached_blocks_p50,cached_blocks_p90,\
             cached_blocks_p99,cached_blocks_mean,prompt_tokens,cached_tokens,hit_rate,load_spread,\
             stage_agreement,disaggregated,prefill_decisions,prefill_agreement\n",
        );
        for p in &self.policies {
            let c = &p.cached_blocks;
            let _ = writeln!(
                s,
                "{},{},{},{:.5},{},{},{},{:.3},{},{},{:.5},{:.3},{:.5},{},{},{}",
                p.policy,
                p.decisions,
                p.failures,
                p.agreement,
                c.p50,
                c.p90,
                c.p99,
                c.mean,
                p.prompt_tokens,
                p.cached_tokens,
                p.hit_rate,
                p.load_spread,
                p.stage_agreement,
                p.disaggregated,
                p.prefill_decisions,
                p.prefill_agreement
                    .map_or_else(String::new, |a| format!("{a:.5}")),
            );
        }
        s
    }

    /// Writes `<stem>.json` and `<stem>.csv` into `dir`.
    pub fn write_files(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>, ReplayError> {
        std::fs::create_dir_all(dir).map_err(|e| ReplayError::io(dir, e))?;
        let json = dir.join(format!("{stem}.json"));
        let csv = dir.join(format!("{stem}.csv"));
        std::fs::write(&json, self.to_json()?).map_err(|e| ReplayError::io(&json, e))?;
        std::fs::write(&csv, self.to_csv()).map_err(|e| ReplayError::io(&csv, e))?;
        Ok(vec![json, csv])
    }
}
