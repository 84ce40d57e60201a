//! Recorded workloads turned into one fixed stream of queries and KV events.
//!
//! The Mooncake conversation trace and the Weka agent sessions are replayed once, here, against
//! a simulated cluster: each request goes to the worker with the least work for it — the blocks
//! it would have to prefill plus the blocks assigned to that worker by the last 16 requests (a
//! stand-in for its queue; pure longest-prefix routing would send every request sharing a system
//! prompt to one worker) — which stores the blocks it lacked and evicts least-recently-used
//! blocks past its capacity, children before parents, as an engine frees a finished sequence
//! tail first. The resulting stream (query, then that request's events) is what every contender
//! replays, so all of them see the same events in the same order, and each answer is checked
//! against the one this simulation computed.

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::workload::{Block, Event, Op, Query, Scores, chain, mix};

/// One request of a replay: its query, the answer it must get, then the events it caused.
#[derive(Debug, Clone)]
pub struct Step {
    pub query: Query,
    pub expected: Scores,
    pub events: Vec<Event>,
}

/// A replayable trace.
#[derive(Debug, Clone)]
pub struct Replay {
    pub name: String,
    pub workers: usize,
    pub capacity: usize,
    pub steps: Vec<Step>,
    /// Blocks of all prompts, and of them already held by the chosen worker.
    pub prompt_blocks: u64,
    pub hit_blocks: u64,
    /// (block, worker) pairs held at the end.
    pub pairs: usize,
}

impl Replay {
    pub fn block_ops(&self) -> u64 {
        self.steps
            .iter()
            .flat_map(|s| &s.events)
            .map(|e| e.block_ops() as u64)
            .sum()
    }
}

/// The shared data directory: `SWITCHYARD_DATA`, else `shared/data` beside the repository.
pub fn data_dir() -> PathBuf {
    std::env::var_os("SWITCHYARD_DATA").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
        PathBuf::from,
    )
}

/// The bench's recorded workloads by short name, replayed (see [`replay`]): `mooncake`, the
/// Mooncake conversation trace over 16 workers of 4,096 blocks; `agent`, the agent sessions
/// (`dev_120`) over 8 workers of 32,768 blocks, both read from [`data_dir`]. `None` for another
/// name; an error when the trace cannot be read.
pub fn recorded(name: &str) -> Option<Result<Replay, String>> {
    let data = data_dir();
    let (label, requests, workers, capacity) = match name {
        "mooncake" => (
            "mooncake conversation trace",
            mooncake(&data.join("traces/mooncake/conversation_trace.jsonl")),
            16,
            4096,
        ),
        "agent" => (
            "agent sessions (weka dev_120)",
            weka(&data.join("agentx/weka_kv_cache_tester/dev_120.jsonl.gz")),
            8,
            32768,
        ),
        _ => return None,
    };
    Some(requests.map(|r| replay(label, &r, workers, capacity)))
}

/// Reads the Mooncake trace: one request per line, `hash_ids` chained ids of 512-token blocks.
pub fn mooncake(path: &Path) -> Result<Vec<Vec<u64>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
            ids(&v["hash_ids"]).ok_or_else(|| format!("{}:{}: no hash_ids", path.display(), n + 1))
        })
        .collect()
}

/// Reads Weka-format agent sessions (gzip, one session per line). Ids are local to a session,
/// so each is tagged with its session's index; sub-agent requests are placed at their absolute
/// time; all sessions start together and the requests are replayed in time order.
pub fn weka(path: &Path) -> Result<Vec<Vec<u64>>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut timed: Vec<(f64, usize, Vec<u64>)> = Vec::new();
    for (session, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: {e}", path.display(), session + 1))?;
        let Some(requests) = v["requests"].as_array() else {
            return Err(format!("{}:{}: no requests", path.display(), session + 1));
        };
        collect(requests, 0.0, session as u64, &mut timed);
    }
    // Stable order for equal times: the order of appearance.
    let mut order: Vec<usize> = (0..timed.len()).collect();
    order.sort_by(|&a, &b| timed[a].0.total_cmp(&timed[b].0).then(a.cmp(&b)));
    Ok(order
        .into_iter()
        .map(|i| std::mem::take(&mut timed[i].2))
        .collect())
}

fn collect(
    requests: &[serde_json::Value],
    base: f64,
    session: u64,
    out: &mut Vec<(f64, usize, Vec<u64>)>,
) {
    for r in requests {
        let t = base + r["t"].as_f64().unwrap_or(0.0);
        if let Some(inner) = r["requests"].as_array() {
            collect(inner, t, session, out);
        } else if let Some(list) = ids(&r["hash_ids"]) {
            let tagged = list.into_iter().map(|id| (session << 40) | id).collect();
            out.push((t, out.len(), tagged));
        }
    }
}

fn ids(v: &serde_json::Value) -> Option<Vec<u64>> {
    v.as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
}

/// A worker's cache in the simulation.
#[derive(Debug, Default)]
struct Lru {
    /// Sequence hash -> eviction key.
    stamp: HashMap<u64, (u64, u32)>,
    /// (tick, u32::MAX - position, hash): the smallest goes first, deepest first within a tick.
    order: BTreeSet<(u64, u32, u64)>,
}

impl Lru {
    fn leading(&self, blocks: &[Block]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.stamp.contains_key(&b.seq))
            .count()
    }
}

/// Replays `requests` (chained ids per request) over `workers` workers of `capacity` blocks.
pub fn replay(name: &str, requests: &[Vec<u64>], workers: usize, capacity: usize) -> Replay {
    let mut lru: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let mut steps = Vec::with_capacity(requests.len());
    let (mut prompt_blocks, mut hit_blocks) = (0u64, 0u64);
    let mut recent: std::collections::VecDeque<(usize, usize)> = Default::default();
    let mut queued = vec![0usize; workers];
    for (tick, ids) in requests.iter().enumerate() {
        let tick = tick as u64;
        let locals: Vec<u64> = ids
            .iter()
            .take(capacity)
            .map(|&id| mix(id ^ 0x51_5157))
            .collect();
        if locals.is_empty() {
            continue;
        }
        let blocks = chain(None, &locals);
        let leading: Vec<usize> = lru.iter().map(|c| c.leading(&blocks)).collect();
        let mut expected: Scores = leading
            .iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0)
            .map(|(w, &n)| (w as u32, n as u32))
            .collect();
        expected.sort_unstable();
        let best = (0..workers)
            .min_by_key(|&w| (blocks.len() - leading[w] + queued[w], w))
            .unwrap_or(0);
        let m = leading[best];
        queued[best] += blocks.len() - m;
        recent.push_back((best, blocks.len() - m));
        if recent.len() > 16
            && let Some((w, n)) = recent.pop_front()
        {
            queued[w] -= n;
        }
        prompt_blocks += blocks.len() as u64;
        hit_blocks += m as u64;
        let cache = &mut lru[best];
        for (pos, b) in blocks.iter().enumerate() {
            let key = (tick, u32::MAX - pos as u32);
            if let Some(old) = cache.stamp.insert(b.seq, key) {
                cache.order.remove(&(old.0, old.1, b.seq));
            }
            cache.order.insert((key.0, key.1, b.seq));
        }
        let mut events = Vec::new();
        if m < blocks.len() {
            events.push(Event {
                worker: best as u32,
                op: Op::Store {
                    parent: m.checked_sub(1).map(|p| blocks[p].seq),
                    blocks: blocks[m..].to_vec(),
                },
            });
        }
        let mut evicted = Vec::new();
        while cache.stamp.len() > capacity {
            let Some((_, _, seq)) = cache.order.pop_first() else {
                break;
            };
            cache.stamp.remove(&seq);
            evicted.push(seq);
        }
        if !evicted.is_empty() {
            events.push(Event {
                worker: best as u32,
                op: Op::Remove { seqs: evicted },
            });
        }
        steps.push(Step {
            query: Query { blocks },
            expected,
            events,
        });
    }
    Replay {
        pairs: lru.iter().map(|c| c.stamp.len()).sum(),
        name: name.to_owned(),
        workers,
        capacity,
        steps,
        prompt_blocks,
        hit_blocks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Op, Reference};

    /// Conversations that grow turn by turn, some sharing a system prompt, over small caches.
    fn requests() -> Vec<Vec<u64>> {
        let mut out = Vec::new();
        for turn in 1..12u64 {
            for conv in 0..5u64 {
                let mut ids = vec![1, 2];
                ids.extend((0..turn * 3).map(|i| 100 * (conv + 1) + i));
                out.push(ids);
            }
        }
        out
    }

    #[test]
    fn the_stream_reproduces_the_simulated_answers() {
        let r = replay("t", &requests(), 3, 40);
        let mut model = Reference::default();
        for step in &r.steps {
            assert_eq!(model.overlap(&step.query), step.expected);
            for ev in &step.events {
                if let Op::Store {
                    parent: Some(p), ..
                } = &ev.op
                {
                    assert!(model.holds(ev.worker, *p), "stored under a parent not held");
                }
                if let Op::Remove { seqs } = &ev.op {
                    assert!(seqs.iter().all(|s| model.holds(ev.worker, *s)));
                }
                model.apply(ev);
            }
        }
        assert_eq!(model.pairs, r.pairs);
        assert!(
            r.steps
                .iter()
                .any(|s| s.events.iter().any(|e| matches!(e.op, Op::Remove { .. })))
        );
        assert!(r.hit_blocks > 0);
    }
}
