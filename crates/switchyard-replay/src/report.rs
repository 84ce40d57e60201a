//! Reports: a table for the terminal, JSON and CSV files.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::ReplayError;
use crate::metrics::{Percentiles, Summary};

/// Everything one replay command measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// What was replayed (`mooncake`, `agentx`).
    pub workload: String,
    /// Trace file, as given.
    pub trace: String,
    /// `offline` or `live`.
    pub mode: String,
    /// What `level` means: `speed` or `concurrency`.
    pub level_kind: String,
    pub seed: u64,
    /// The replay's settings, for reproduction.
    pub settings: serde_json::Value,
    pub runs: Vec<Summary>,
}

impl Report {
    /// The comparison table, one row per run.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} ({} mode, {}): {}",
            self.workload, self.mode, self.level_kind, self.trace
        );
        let header = [
            "policy",
            "level",
            "done",
            "fail",
            "sess",
            "ttft p50",
            "ttft p90",
            "ttft p99",
            "tpot p50",
            "tpot p90",
            "tok/s/user",
            "out tok/s/wkr",
            "hit rate",
            "host hit",
            "peer hit",
            "recomputed",
            "moved GB",
            "floor p99",
        ];
        let widths = [12, 7, 7, 5, 5, 10, 10, 10, 9, 9, 10, 13, 8, 8, 8, 12, 9, 10];
        let mut line = String::new();
        for (h, w) in header.iter().zip(widths) {
            let _ = write!(line, "{h:>w$} ");
        }
        let _ = writeln!(s, "{}", line.trim_end());
        let _ = writeln!(s, "{}", "-".repeat(line.trim_end().len()));
        for r in &self.runs {
            let cells = [
                r.label.clone(),
                format!("{}", r.level),
                r.requests_completed.to_string(),
                r.requests_failed.to_string(),
                r.sessions_completed.to_string(),
                format!("{:.0}ms", r.ttft_ms.p50),
                format!("{:.0}ms", r.ttft_ms.p90),
                format!("{:.0}ms", r.ttft_ms.p99),
                format!("{:.1}ms", r.tpot_ms.p50),
                format!("{:.1}ms", r.tpot_ms.p90),
                format!("{:.1}", r.interactivity_tok_s),
                format!("{:.1}", r.output_tok_s_per_worker),
                format!("{:.1}%", r.cache_hit_rate * 100.0),
                format!("{:.1}%", r.host_hit_rate * 100.0),
                format!("{:.1}%", r.peer_hit_rate * 100.0),
                r.recomputed_tokens.to_string(),
                format!("{:.1}", r.transferred_bytes as f64 / 1e9),
                r.ttft_floor_ms
                    .map_or_else(|| "-".to_owned(), |f| format!("{:.0}ms", f.p99)),
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

    pub fn to_csv(&self) -> String {
        let mut s = String::from(
            "workload,mode,policy,level_kind,level,workers,requests_completed,requests_failed,\
             sessions_completed,duration_s,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,ttft_mean_ms,\
             tpot_p50_ms,tpot_p90_ms,tpot_p99_ms,interactivity_tok_s,output_tokens,\
             output_tok_s_per_worker,prompt_tokens,cached_tokens,cache_hit_rate,host_hit_rate,\
             recomputed_tokens,transferred_bytes,peer_hit_rate,ttft_floor_p50_ms,ttft_floor_p99_ms\n",
        );
        for r in &self.runs {
            // Empty where the run measured no floor (live runs).
            let floor = |pick: fn(&Percentiles) -> f64| {
                r.ttft_floor_ms
                    .as_ref()
                    .map_or_else(String::new, |f| format!("{:.3}", pick(f)))
            };
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{:.3},{},{},{:.5},{:.5},{},{},{:.5},{},{}",
                self.workload,
                self.mode,
                r.label,
                self.level_kind,
                r.level,
                r.workers,
                r.requests_completed,
                r.requests_failed,
                r.sessions_completed,
                r.duration_s,
                r.ttft_ms.p50,
                r.ttft_ms.p90,
                r.ttft_ms.p99,
                r.ttft_ms.mean,
                r.tpot_ms.p50,
                r.tpot_ms.p90,
                r.tpot_ms.p99,
                r.interactivity_tok_s,
                r.output_tokens,
                r.output_tok_s_per_worker,
                r.prompt_tokens,
                r.cached_tokens,
                r.cache_hit_rate,
                r.host_hit_rate,
                r.recomputed_tokens,
                r.transferred_bytes,
                r.peer_hit_rate,
                floor(|f| f.p50),
                floor(|f| f.p99),
            );
        }
        s
    }

    /// Writes `<stem>.json`, `<stem>.csv`, and the Pareto plot as `<stem>.svg` and `<stem>.png`,
    /// into `dir`.
    pub fn write_files(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>, ReplayError> {
        std::fs::create_dir_all(dir).map_err(|e| ReplayError::io(dir, e))?;
        let json = dir.join(format!("{stem}.json"));
        let csv = dir.join(format!("{stem}.csv"));
        let svg = dir.join(format!("{stem}.svg"));
        std::fs::write(&json, self.to_json()?).map_err(|e| ReplayError::io(&json, e))?;
        std::fs::write(&csv, self.to_csv()).map_err(|e| ReplayError::io(&csv, e))?;
        let title = format!(
            "{} ({}): interactivity vs throughput",
            self.workload, self.mode
        );
        crate::plot::pareto_svg(&svg, &title, &self.level_kind, &self.runs)?;
        let png = dir.join(format!("{stem}.png"));
        crate::plot::svg_to_png(&svg, &png)?;
        Ok(vec![json, csv, svg, png])
    }
}
