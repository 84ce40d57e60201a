//! The side-by-side table: one row per workload and figure, one column per contender, and
//! Switchyard's advantage over the best Dynamo indexer on that row.

use std::fmt::Write as _;

use serde::Serialize;

use crate::measure::Machine;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Block operations per second; higher is better.
    Throughput,
    /// Query latency p50 and p99 in µs; lower is better.
    Latency,
    /// Heap bytes per (block, worker) pair; lower is better.
    Bytes,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub contender: String,
    /// Throughput (ops/s), p50 (µs) or bytes per pair.
    pub value: f64,
    /// p99 (µs) for latency rows.
    pub p99: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub workload: String,
    pub figure: String,
    pub kind: Kind,
    pub cells: Vec<Cell>,
    /// Load averages when the row was measured.
    pub loadavg: String,
}

/// How many times better Switchyard is than the best Dynamo contender on a figure (> 1: ahead).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Advantage {
    pub value: f64,
    pub p99: Option<f64>,
}

impl Row {
    pub fn advantage(&self) -> Option<Advantage> {
        let ours = self.cells.iter().find(|c| c.contender == "switchyard")?;
        let theirs: Vec<&Cell> = self
            .cells
            .iter()
            .filter(|c| c.contender != "switchyard")
            .collect();
        let better = |ours: f64, values: &mut dyn Iterator<Item = f64>| -> Option<f64> {
            match self.kind {
                Kind::Throughput => values.reduce(f64::max).map(|best| ours / best),
                Kind::Latency | Kind::Bytes => values.reduce(f64::min).map(|best| best / ours),
            }
        };
        let value = better(ours.value, &mut theirs.iter().map(|c| c.value))?;
        let p99 = ours
            .p99
            .and_then(|o| better(o, &mut theirs.iter().filter_map(|c| c.p99)));
        Some(Advantage { value, p99 })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub command: String,
    pub date: String,
    pub machine: Machine,
    pub dynamo_kv_router: String,
    pub contenders: Vec<String>,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

fn fmt_value(kind: Kind, c: &Cell) -> String {
    match kind {
        Kind::Throughput => format!("{:.2} M/s", c.value / 1e6),
        Kind::Latency => format!("{} / {}", fmt_us(c.value), c.p99.map_or("-".into(), fmt_us)),
        Kind::Bytes => format!("{:.1}", c.value),
    }
}

fn fmt_us(us: f64) -> String {
    if us >= 100.0 {
        format!("{us:.0}")
    } else if us >= 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "Command: `{}`  ", self.command);
        let _ = writeln!(
            out,
            "Date: {}; machine: {}, {} logical CPUs; dynamo-kv-router {}.  ",
            self.date, self.machine.cpu, self.machine.cpus, self.dynamo_kv_router
        );
        let _ = writeln!(
            out,
            "Throughput in block operations per second; latency p50 / p99 in µs; memory in heap bytes per (block, worker) pair. \
             \"× best Dynamo\" is Switchyard's advantage over the best Dynamo indexer on that row (> 1 = Switchyard ahead; for latency p50 and p99 separately)."
        );
        let _ = writeln!(out);
        let mut header = "| workload | figure |".to_owned();
        let mut rule = "|---|---|".to_owned();
        for c in &self.contenders {
            let _ = write!(header, " {c} |");
            rule.push_str("---|");
        }
        header.push_str(" × best Dynamo | load avg |");
        rule.push_str("---|---|");
        let _ = writeln!(out, "{header}");
        let _ = writeln!(out, "{rule}");
        for row in &self.rows {
            let mut line = format!("| {} | {} |", row.workload, row.figure);
            for name in &self.contenders {
                let cell = row.cells.iter().find(|c| &c.contender == name);
                let text = cell.map_or("-".to_owned(), |c| fmt_value(row.kind, c));
                if name == "switchyard" {
                    let _ = write!(line, " **{text}** |");
                } else {
                    let _ = write!(line, " {text} |");
                }
            }
            let adv = row.advantage().map_or("-".to_owned(), |a| match a.p99 {
                Some(p99) => format!("{:.2}× / {:.2}×", a.value, p99),
                None => format!("{:.2}×", a.value),
            });
            let _ = writeln!(line, " {adv} | {} |", row.loadavg);
            out.push_str(&line);
        }
        if !self.notes.is_empty() {
            let _ = writeln!(out);
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        out
    }
}
