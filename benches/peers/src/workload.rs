//! The event streams and queries every contender is fed, and the reference model that checks
//! their answers.
//!
//! A block carries two hashes: its *local* hash (its own tokens; what Dynamo's indexers walk a
//! query by) and its *sequence* hash, chained from the parent's sequence hash and the local hash
//! with Dynamo's own chaining function (`dynamo_tokens::compute_next_sequence_hash`), so Dynamo's
//! positional indexer can recompute it while it searches. Switchyard's index is given the same
//! sequence hashes as its chained `BlockHash`es. Every stream is prefix-closed the way an engine
//! publishes it: a worker stores a chain under a parent it holds and evicts children before
//! their parents.

use std::collections::{HashMap, HashSet};

use switchyard_core::rng::SplitMix64;

/// The workspace's seeded generator (`switchyard_core::rng::SplitMix64`): deterministic data
/// without a dependency.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// The SplitMix64 finaliser, also used to turn trace ids into local hashes.
pub use switchyard_core::rng::mix64 as mix;

/// One block: its local hash and its chained sequence hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    pub local: u64,
    pub seq: u64,
}

/// Chains local hashes into blocks, continuing from `parent`'s sequence hash.
pub fn chain(parent: Option<u64>, locals: &[u64]) -> Vec<Block> {
    let mut prev = parent;
    locals
        .iter()
        .map(|&local| {
            let seq = match prev {
                None => local,
                Some(p) => dynamo_tokens::compute_next_sequence_hash(p, local),
            };
            prev = Some(seq);
            Block { local, seq }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub enum Op {
    /// A chain of blocks stored under `parent` (a sequence hash the worker holds), or at the root.
    Store {
        parent: Option<u64>,
        blocks: Vec<Block>,
    },
    /// Blocks dropped, by sequence hash, children before parents.
    Remove { seqs: Vec<u64> },
}

#[derive(Debug, Clone)]
pub struct Event {
    pub worker: u32,
    pub op: Op,
}

impl Event {
    pub fn block_ops(&self) -> usize {
        match &self.op {
            Op::Store { blocks, .. } => blocks.len(),
            Op::Remove { seqs } => seqs.len(),
        }
    }
}

/// A query prompt in both forms.
#[derive(Debug, Clone)]
pub struct Query {
    pub blocks: Vec<Block>,
}

impl Query {
    pub fn locals(&self) -> Vec<u64> {
        self.blocks.iter().map(|b| b.local).collect()
    }
    pub fn seqs(&self) -> Vec<u64> {
        self.blocks.iter().map(|b| b.seq).collect()
    }
}

/// Per-worker leading blocks held, sorted by worker, zeros left out.
pub type Scores = Vec<(u32, u32)>;

/// The obvious model: each worker's set of sequence hashes; overlap walks the prompt.
#[derive(Debug, Default)]
pub struct Reference {
    held: HashMap<u32, HashSet<u64>>,
    pub pairs: usize,
}

impl Reference {
    pub fn apply(&mut self, ev: &Event) {
        let set = self.held.entry(ev.worker).or_default();
        match &ev.op {
            Op::Store { blocks, .. } => {
                for b in blocks {
                    if set.insert(b.seq) {
                        self.pairs += 1;
                    }
                }
            }
            Op::Remove { seqs } => {
                for s in seqs {
                    if set.remove(s) {
                        self.pairs -= 1;
                    }
                }
            }
        }
    }

    pub fn holds(&self, worker: u32, seq: u64) -> bool {
        self.held.get(&worker).is_some_and(|s| s.contains(&seq))
    }

    pub fn overlap(&self, q: &Query) -> Scores {
        let mut out: Scores = self
            .held
            .iter()
            .map(|(&w, set)| {
                let n = q.blocks.iter().take_while(|b| set.contains(&b.seq)).count();
                (w, n as u32)
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        out.sort_unstable();
        out
    }
}

/// Blocks per stored chain in the synthetic streams (and in the apply batch).
pub const CHAIN_BLOCKS: usize = 16;

/// A synthetic index: `pairs` (block, worker) pairs over `workers` workers.
///
/// - The query prompt is one chain of `prompt_len` blocks; the first `holders` workers hold
///   prefixes of it of lengths `prompt_len · (i+1) / holders` (so one holds all of it).
/// - Every worker then fills its share of `pairs` with 16-block chains: 30 % drawn from a pool
///   of chains shared between workers (common system prompts), 70 % its own.
#[derive(Debug, Clone, Copy)]
pub struct Synthetic {
    pub workers: usize,
    pub pairs: usize,
    pub prompt_len: usize,
    pub holders: usize,
    pub seed: u64,
}

impl Synthetic {
    /// The bench's synthetic index: `pairs` over `workers`, the first 32 holding prefixes of an
    /// 8,192-block prompt, seed 7.
    pub fn of(workers: usize, pairs: usize) -> Self {
        Synthetic {
            workers,
            pairs,
            prompt_len: 8192,
            holders: 32,
            seed: 7,
        }
    }

    pub fn prompt(&self) -> Query {
        let mut rng = Rng::new(self.seed ^ 0x9e0f);
        let locals: Vec<u64> = (0..self.prompt_len).map(|_| rng.next_u64()).collect();
        Query {
            blocks: chain(None, &locals),
        }
    }

    /// The answer to a query of the prompt's first `len` blocks: the holders of the prompt hold
    /// prefixes of known lengths, and nobody else holds any of it.
    pub fn expected(&self, len: usize) -> Scores {
        let holders = self.holders.min(self.workers);
        (0..holders)
            .map(|i| {
                let held = self.prompt_len * (i + 1) / holders;
                (i as u32, held.min(len) as u32)
            })
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// The population, one worker at a time, as an iterator of events (10M pairs do not need to
    /// sit in memory as events).
    pub fn population(&self) -> impl Iterator<Item = Event> + '_ {
        let prompt = self.prompt();
        let holders = self.holders.min(self.workers);
        let prompt_pairs: usize = (0..holders)
            .map(|i| self.prompt_len * (i + 1) / holders)
            .sum();
        let chains_per_worker =
            self.pairs.saturating_sub(prompt_pairs) / self.workers / CHAIN_BLOCKS;
        let shared_chains = (self.pairs / 20 / CHAIN_BLOCKS).max(1) as u64;
        let seed = self.seed;
        (0..self.workers).flat_map(move |w| {
            let mut rng = Rng::new(seed.wrapping_mul(31).wrapping_add(w as u64));
            let mut events = Vec::new();
            if w < holders {
                let len = self.prompt_len * (w + 1) / holders;
                events.push(Event {
                    worker: w as u32,
                    op: Op::Store {
                        parent: None,
                        blocks: prompt.blocks[..len].to_vec(),
                    },
                });
            }
            let mut taken = HashSet::new();
            let mut made = 0;
            while made < chains_per_worker {
                let locals: Vec<u64> = if rng.below(10) < 3 {
                    let id = rng.below(shared_chains);
                    if !taken.insert(id) {
                        continue;
                    }
                    let mut r = Rng::new(seed ^ mix(id + 1));
                    (0..CHAIN_BLOCKS).map(|_| r.next_u64()).collect()
                } else {
                    (0..CHAIN_BLOCKS).map(|_| rng.next_u64()).collect()
                };
                events.push(Event {
                    worker: w as u32,
                    op: Op::Store {
                        parent: None,
                        blocks: chain(None, &locals),
                    },
                });
                made += 1;
            }
            events.into_iter()
        })
    }

    /// Steady-state churn: `events` pairs of a 16-block `Store` (its first 4 blocks from a pool
    /// of 256 shared prefixes) and the matching `Remove`, children first, so a batch leaves the
    /// index as it found it.
    pub fn churn(&self, events: usize) -> Vec<Event> {
        let mut rng = Rng::new(self.seed ^ 0xc4c4);
        let prefixes: Vec<Vec<u64>> = (0..256)
            .map(|_| (0..4).map(|_| rng.next_u64()).collect())
            .collect();
        let mut out = Vec::with_capacity(2 * events);
        for _ in 0..events {
            let worker = rng.below(self.workers as u64) as u32;
            let mut locals = prefixes[rng.below(256) as usize].clone();
            locals.extend((4..CHAIN_BLOCKS).map(|_| rng.next_u64()));
            let blocks = chain(None, &locals);
            let seqs = blocks.iter().rev().map(|b| b.seq).collect();
            out.push(Event {
                worker,
                op: Op::Store {
                    parent: None,
                    blocks,
                },
            });
            out.push(Event {
                worker,
                op: Op::Remove { seqs },
            });
        }
        out
    }
}

/// Every holder of the 128-block prompt holds all of it: the worst case for a walk.
pub fn all_hold(workers: usize, prompt: &Query) -> Vec<Event> {
    (0..workers as u32)
        .map(|worker| Event {
            worker,
            op: Op::Store {
                parent: None,
                blocks: prompt.blocks.clone(),
            },
        })
        .collect()
}
