//! A sweep's renderings, each from the report itself: the terminal table (every cell, every
//! policy's hit rate and TTFT p99, the verdict and who beats kv by how much), a Markdown grid
//! for `docs/BENCHMARKS.md`, CSV (one row per run) and JSON.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::verdict::{Beaten, Judgement, Metric, Standing, Verdict};
use super::{SweepCell, SweepReport, Tally};
use crate::error::ReplayError;
use crate::metrics::Summary;

/// `12.3 %`.
fn percent(share: f64) -> String {
    format!("{:.1} %", share * 100.0)
}

/// A TTFT p99 in seconds, `-` for a run that completed nothing.
fn seconds(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".to_owned(), |ms| format!("{:.1} s", ms / 1e3))
}

/// How far `b` is ahead of kv: hit rate in points, TTFT p99 as a share of kv's.
fn lead_of(b: &Beaten) -> String {
    match (b.metric, b.kv, b.other) {
        (Metric::HitRate, Some(kv), Some(other)) => format!("+{:.1} pts", (other - kv) * 100.0),
        (Metric::TtftP99, Some(_), Some(_)) => format!("-{:.1} %", b.margin * 100.0),
        (_, None, _) => "kv completed nothing".to_owned(),
        (_, _, None) => "-".to_owned(),
    }
}

fn short(metric: Metric) -> &'static str {
    match metric {
        Metric::HitRate => "hit",
        Metric::TtftP99 => "p99",
    }
}

/// `hit: sglang-ca +7.3 pts, approx-kv +3.3 pts; p99: sglang-ca -11.2 %` (every beater) or,
/// with `top_only`, the largest per metric and how many more there are.
fn behind(judgement: &Judgement, top_only: bool) -> String {
    let mut parts = Vec::new();
    for metric in Metric::ALL {
        let beaters: Vec<&Beaten> = judgement
            .behind
            .iter()
            .filter(|b| b.metric == metric)
            .collect();
        let Some(top) = beaters.first() else {
            continue;
        };
        let named = if top_only {
            let more = match beaters.len() - 1 {
                0 => String::new(),
                n => format!(" (+{n} more)"),
            };
            format!("{} {}{more}", top.policy, lead_of(top))
        } else {
            beaters
                .iter()
                .map(|b| format!("{} {}", b.policy, lead_of(b)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        parts.push(format!("{}: {named}", short(metric)));
    }
    parts.join("; ")
}

/// `ahead on hit rate and TTFT p99`, for a cell kv leads.
fn ahead(judgement: &Judgement) -> String {
    let on: Vec<&str> = [
        (judgement.hit_rate, Metric::HitRate),
        (judgement.ttft_p99, Metric::TtftP99),
    ]
    .iter()
    .filter(|(s, _)| *s == Standing::Ahead)
    .map(|(_, m)| m.as_str())
    .collect();
    format!("ahead on {}", on.join(" and "))
}

fn detail(cell: &SweepCell, top_only: bool) -> String {
    match cell.judgement.verdict {
        Verdict::Trails => behind(&cell.judgement, top_only),
        Verdict::Leads => ahead(&cell.judgement),
        Verdict::Ties => String::new(),
    }
}

fn figures(run: &Summary) -> String {
    format!(
        "{} / {}",
        percent(run.cache_hit_rate),
        seconds(Metric::TtftP99.of(run))
    )
}

fn tally_line(tally: &Tally) -> String {
    format!(
        "leads {}, ties {}, trails {} of {} cells",
        tally.leads,
        tally.ties,
        tally.trails,
        tally.cells()
    )
}

impl SweepReport {
    fn others(&self) -> Vec<&str> {
        self.policies
            .iter()
            .map(String::as_str)
            .filter(|p| *p != self.reference)
            .collect()
    }

    /// The summary line: `kv leads 3, ties 1, trails 8 of 12 cells`.
    pub fn summary_line(&self) -> String {
        format!("{} {}", self.reference, tally_line(&self.tally))
    }

    /// The terminal table: a row per cell with each policy's hit rate / TTFT p99, the verdict
    /// and, where kv trails, every policy that beats it and by how much; then the tally, per
    /// trace and in all.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let replicas = if self.replicas > 1 {
            format!(
                "; each policy's run of {} replicas with the median TTFT p99",
                self.replicas
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "sweep: {} against {}; hit rate / TTFT p99; within {:.0} % is a tie{replicas}",
            self.reference,
            self.others().join(", "),
            self.tie * 100.0
        );
        for t in &self.traces {
            let _ = writeln!(
                s,
                "  {}: {} ({} {}, rate = {} factor)",
                t.name,
                t.path,
                t.size,
                if t.level_kind == "speed" {
                    "requests"
                } else {
                    "sessions"
                },
                t.level_kind
            );
        }
        let name_width = self
            .traces
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut header = format!(
            "{:<name_width$} {:>7} {:>5} {:>6}",
            "trace", "workers", "rate", "level"
        );
        for p in &self.policies {
            let _ = write!(header, " {p:>18}");
        }
        let _ = write!(header, "  {:<7} behind / ahead", "verdict");
        let _ = writeln!(s, "{header}");
        let _ = writeln!(s, "{}", "-".repeat(header.len()));
        for cell in &self.cells {
            let mut row = format!(
                "{:<name_width$} {:>7} {:>5} {:>6}",
                cell.trace, cell.workers, cell.rate, cell.level
            );
            for run in &cell.runs {
                let _ = write!(row, " {:>18}", figures(run));
            }
            let verdict = match cell.judgement.verdict {
                Verdict::Trails => "TRAILS",
                v => v.as_str(),
            };
            let _ = writeln!(row, "  {verdict:<7} {}", detail(cell, false));
            s.push_str(row.trim_end());
            s.push('\n');
        }
        if self.traces.len() > 1 {
            for t in &self.traces {
                let tally = Tally::of(self.cells.iter().filter(|c| c.trace == t.name));
                let _ = writeln!(s, "{}: {} {}", t.name, self.reference, tally_line(&tally));
            }
        }
        let _ = writeln!(s, "{}", self.summary_line());
        s
    }

    /// A Markdown grid for the docs: a row per trace and worker count, a column per rate,
    /// each cell kv's hit rate / TTFT p99, the verdict and the largest beater per metric.
    pub fn markdown(&self) -> String {
        let mut s = String::from("| trace | workers |");
        for rate in &self.rates {
            let _ = write!(s, " {rate}× |");
        }
        s.push_str("\n|---|---:|");
        s.push_str(&"---|".repeat(self.rates.len()));
        s.push('\n');
        for t in &self.traces {
            for &workers in &self.workers {
                let _ = write!(s, "| {} | {workers} |", t.name);
                for cell in self
                    .cells
                    .iter()
                    .filter(|c| c.trace == t.name && c.workers == workers)
                {
                    let kv = cell.run(&self.reference).map(figures).unwrap_or_default();
                    let verdict = match cell.judgement.verdict {
                        Verdict::Trails => "**trails**",
                        v => v.as_str(),
                    };
                    let detail = match cell.judgement.verdict {
                        Verdict::Trails => format!(": {}", behind(&cell.judgement, true)),
                        _ => String::new(),
                    };
                    let _ = write!(s, " {kv} {verdict}{detail} |");
                }
                s.push('\n');
            }
        }
        let _ = writeln!(s, "\n{}.", self.summary_line());
        s
    }

    pub fn to_json(&self) -> Result<String, ReplayError> {
        serde_json::to_string_pretty(self).map_err(|e| ReplayError::Report(e.to_string()))
    }

    /// One row per run, with its cell's verdict and the metrics on which the run beats kv.
    pub fn to_csv(&self) -> String {
        let mut s = String::from(
            "trace,workers,rate,level,policy,requests_completed,requests_failed,cache_hit_rate,\
             ttft_p50_ms,ttft_p99_ms,verdict,beats_kv_on\n",
        );
        for cell in &self.cells {
            for run in &cell.runs {
                let beats: Vec<&str> = cell
                    .judgement
                    .behind
                    .iter()
                    .filter(|b| b.policy == run.label)
                    .map(|b| short(b.metric))
                    .collect();
                let _ = writeln!(
                    s,
                    "{},{},{},{},{},{},{},{:.5},{:.3},{:.3},{},{}",
                    cell.trace,
                    cell.workers,
                    cell.rate,
                    cell.level,
                    run.label,
                    run.requests_completed,
                    run.requests_failed,
                    run.cache_hit_rate,
                    run.ttft_ms.p50,
                    run.ttft_ms.p99,
                    cell.judgement.verdict.as_str(),
                    beats.join("|"),
                );
            }
        }
        s
    }

    /// Writes `<stem>.json`, `<stem>.csv` and `<stem>.md` (the grid) into `dir`.
    pub fn write_files(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>, ReplayError> {
        std::fs::create_dir_all(dir).map_err(|e| ReplayError::io(dir, e))?;
        let files = [
            (dir.join(format!("{stem}.json")), self.to_json()?),
            (dir.join(format!("{stem}.csv")), self.to_csv()),
            (dir.join(format!("{stem}.md")), self.markdown()),
        ];
        let mut written = Vec::with_capacity(files.len());
        for (path, text) in files {
            std::fs::write(&path, text).map_err(|e| ReplayError::io(&path, e))?;
            written.push(path);
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::metrics::Percentiles;
    use crate::sweep::{TraceInfo, verdict};

    fn run(label: &str, hit: f64, p99_ms: f64) -> Summary {
        let mut s = Summary::from_records(label, 1.0, 4, 0, &[]);
        s.cache_hit_rate = hit;
        s.requests_completed = 100;
        s.ttft_ms = Percentiles {
            p99: p99_ms,
            ..Percentiles::default()
        };
        s
    }

    fn cell(rate: f64, runs: Vec<Summary>) -> SweepCell {
        let others: Vec<&Summary> = runs[1..].iter().collect();
        SweepCell {
            trace: "mooncake".into(),
            workers: 4,
            rate,
            level: rate,
            judgement: verdict::judge(&runs[0], &others, 0.02),
            runs,
            replicas: Vec::new(),
        }
    }

    /// Issue 45's table: kv leads with headroom and trails sglang-ca under overload.
    fn report() -> SweepReport {
        let cells = vec![
            cell(
                1.0,
                vec![
                    run("kv", 0.161, 11_300.0),
                    run("approx-kv", 0.130, 11_600.0),
                    run("sglang-ca", 0.158, 15_900.0),
                ],
            ),
            cell(
                1.5,
                vec![
                    run("kv", 0.119, 189_700.0),
                    run("approx-kv", 0.152, 174_000.0),
                    run("sglang-ca", 0.192, 168_500.0),
                ],
            ),
        ];
        SweepReport {
            reference: "kv".into(),
            tie: 0.02,
            replicas: 1,
            policies: vec!["kv".into(), "approx-kv".into(), "sglang-ca".into()],
            workers: vec![4],
            rates: vec![1.0, 1.5],
            traces: vec![TraceInfo {
                name: "mooncake".into(),
                path: "conversation_trace.jsonl".into(),
                level_kind: "speed".into(),
                size: 2000,
                concurrency: None,
                time_scale: None,
                max_gap_s: None,
            }],
            settings: serde_json::Value::Null,
            tally: Tally::of(&cells),
            cells,
        }
    }

    #[test]
    fn the_table_names_who_beats_kv_by_how_much_and_counts_the_cells() {
        let table = report().table();
        let rows: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("mooncake "))
            .collect();
        assert_eq!(rows.len(), 2, "{table}");
        assert!(rows[0].contains("leads   ahead on TTFT p99"), "{table}");
        assert!(rows[0].contains("16.1 % / 11.3 s"), "{table}");
        assert!(
            rows[1].contains(
                "TRAILS  hit: sglang-ca +7.3 pts, approx-kv +3.3 pts; p99: sglang-ca -11.2 %, approx-kv -8.3 %"
            ),
            "{table}"
        );
        assert!(
            table.ends_with("kv leads 1, ties 0, trails 1 of 2 cells\n"),
            "{table}"
        );
    }

    #[test]
    fn the_markdown_grid_has_a_column_per_rate_and_the_top_beater_per_metric() {
        let md = report().markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines[0], "| trace | workers | 1× | 1.5× |");
        assert_eq!(
            lines[2],
            "| mooncake | 4 | 16.1 % / 11.3 s leads | 11.9 % / 189.7 s **trails**: \
             hit: sglang-ca +7.3 pts (+1 more); p99: sglang-ca -11.2 % (+1 more) |"
        );
        assert!(
            md.ends_with("kv leads 1, ties 0, trails 1 of 2 cells.\n"),
            "{md}"
        );
    }

    #[test]
    fn csv_and_json_carry_each_run_and_the_verdicts() {
        let report = report();
        let csv = report.to_csv();
        assert_eq!(csv.lines().count(), 1 + 6);
        assert!(
            csv.contains(
                "mooncake,4,1.5,1.5,sglang-ca,100,0,0.19200,0.000,168500.000,trails,hit|p99\n"
            ),
            "{csv}"
        );
        assert!(
            csv.contains("mooncake,4,1,1,kv,100,0,0.16100,0.000,11300.000,leads,\n"),
            "{csv}"
        );
        let json: serde_json::Value = serde_json::from_str(&report.to_json().unwrap()).unwrap();
        assert_eq!(json["tally"]["trails"], 1);
        let trailing = &json["cells"][1];
        assert_eq!(trailing["verdict"], "trails");
        assert_eq!(trailing["hit_rate"], "behind");
        assert_eq!(trailing["behind"][0]["policy"], "sglang-ca");
        assert_eq!(trailing["behind"][0]["metric"], "hit_rate");
        assert_eq!(trailing["runs"].as_array().unwrap().len(), 3);
        assert_eq!(json["cells"][0]["ttft_p99"], "ahead");
    }
}
