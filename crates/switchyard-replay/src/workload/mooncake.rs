//! Mooncake traces, replayed open loop.
//!
//! One JSON object per line: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`,
//! block size 512, hash ids global to the trace (so namespace 0). Request *i* is sent at
//! `timestamp / speed`, whatever happened to the others.

use std::io::BufRead;
use std::path::Path;

use serde::Deserialize;

use super::{Micros, Outbox, RequestSpec, Workload};
use crate::error::ReplayError;
use crate::synth::PromptSpec;

/// Tokens per hash id in the Mooncake traces.
pub const MOONCAKE_BLOCK_SIZE: u32 = 512;

/// One trace record.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MooncakeRecord {
    /// Milliseconds since the trace start.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u32>,
}

/// Reads a Mooncake JSONL trace; `limit` keeps only the first records.
pub fn load(path: &Path, limit: Option<usize>) -> Result<Vec<MooncakeRecord>, ReplayError> {
    let file = std::fs::File::open(path).map_err(|e| ReplayError::io(path, e))?;
    let mut records = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|n| records.len() >= n) {
            break;
        }
        let line = line.map_err(|e| ReplayError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let record: MooncakeRecord =
            serde_json::from_str(&line).map_err(|source| ReplayError::TraceParse {
                path: path.to_owned(),
                line: i + 1,
                source,
            })?;
        records.push(record);
    }
    Ok(records)
}

/// Open-loop replay of Mooncake records at `speed` times the recorded rate.
#[derive(Debug)]
pub struct MooncakeWorkload {
    records: Vec<MooncakeRecord>,
    speed: f64,
}

impl MooncakeWorkload {
    pub fn new(records: Vec<MooncakeRecord>, speed: f64) -> Result<Self, ReplayError> {
        if !(speed.is_finite() && speed > 0.0) {
            return Err(ReplayError::InvalidConfig(format!(
                "speed must be a positive number, got {speed}"
            )));
        }
        Ok(Self { records, speed })
    }
}

impl Workload for MooncakeWorkload {
    fn start(&mut self, out: &mut Outbox) {
        for (i, r) in self.records.iter().enumerate() {
            let at = (r.timestamp as f64 * 1000.0 / self.speed).round() as Micros;
            out.send_at(
                at,
                RequestSpec {
                    id: i as u64,
                    prompt: PromptSpec {
                        namespace: 0,
                        block_size: MOONCAKE_BLOCK_SIZE,
                        hash_ids: r.hash_ids.clone(),
                        input_tokens: r.input_length,
                        tail_seed: i as u64,
                    },
                    max_tokens: r.output_length.clamp(1, u64::from(u32::MAX)) as u32,
                    session: None,
                },
            );
        }
    }

    fn on_finished(&mut self, _id: u64, _ok: bool, _now: Micros, _out: &mut Outbox) {}

    fn expected_requests(&self) -> Option<u64> {
        Some(self.records.len() as u64)
    }

    fn sessions_completed(&self) -> u64 {
        0
    }
}
