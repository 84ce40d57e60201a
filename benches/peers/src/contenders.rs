//! The indexes under test behind one small interface.
//!
//! Each contender converts events and queries into its own input types *before* the clock
//! starts, so only the index's own work is timed, and converts its answer back afterwards.
//!
//! - [`Switchyard`]: `switchyard_router::PrefixIndex`, fed chained sequence hashes.
//! - [`DynamoRadix`]: Dynamo's single-threaded `RadixTree`, fed local hashes with parent links.
//! - [`DynamoPositional`]: Dynamo's positional "flash" indexer (`nested_map`), strided jump
//!   search (jump 32, Dynamo's documented default) or its binary-search mode.
//! - [`DynamoConcurrent`]: Dynamo's `ConcurrentRadixTreeCompressed`. Its only way to apply
//!   events is its `SyncIndexer::worker` loop, so it runs on one dedicated thread fed through
//!   the same flume channel Dynamo's `ThreadPoolIndexer` uses; the timing of a batch starts
//!   before the first send and ends when the worker acknowledges a flush behind it, minus the
//!   median round trip of an empty flush measured at start. Queries run on the caller's
//!   thread, as in Dynamo.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::nested_map::{LevelIndex, SearchMode};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree};
use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier, StoredBlock, WorkerId};
use switchyard_router::{IndexConfig, PrefixIndex};

use crate::workload::{Event, Op, Query, Scores};

/// Tokens per block given to Switchyard's index (hashes are not re-verified, so the tokens'
/// values do not matter; their count must match the index's block size).
pub const BLOCK_TOKENS: u32 = 16;

/// Every contender, Switchyard first, for an index of `workers` workers, keeping those whose
/// name contains one of `only` (all when `only` is empty). `big` leaves out the binary-search
/// positional indexer: it builds the same structure as the strided one (only its query
/// differs), and at 10M pairs a second copy would cost gigabytes on a shared machine.
///
/// Dynamo's approximate indexer is not here: it consumes no KV events (it predicts a worker's
/// cache from the router's own decisions, through async leases and an LRU or TTL model), so no
/// event stream can be given to it and to the others alike. It runs inside the concurrent radix
/// tree's worker loop, feeding that tree events it makes up; its queries are that tree's.
pub fn lineup(workers: usize, big: bool, only: &[String]) -> Vec<Box<dyn Contender>> {
    let mut contenders: Vec<Box<dyn Contender>> = vec![
        Box::new(Switchyard::new(workers)),
        Box::new(DynamoRadix::new()),
        Box::new(DynamoPositional::new(SearchMode::Strided)),
    ];
    if !big {
        contenders.push(Box::new(DynamoPositional::new(SearchMode::Binary)));
    }
    contenders.push(Box::new(DynamoConcurrent::new()));
    contenders.retain(|c| only.is_empty() || only.iter().any(|o| c.name().contains(o.as_str())));
    contenders
}

pub trait Contender {
    fn name(&self) -> &'static str;
    /// Applies `events` in order; returns the time spent in the index.
    fn apply(&mut self, events: &[Event]) -> Duration;
    /// One overlap query; returns the time spent in the index and the answer.
    fn overlap(&mut self, q: &Query) -> (Duration, Scores);
    /// Events the index refused (every stream here is valid, so this stays 0).
    fn errors(&self) -> u64;
}

pub struct Switchyard {
    index: PrefixIndex,
    ids: Vec<WorkerId>,
    seqs: Vec<u64>,
    errors: u64,
}

impl Switchyard {
    pub fn new(workers: usize) -> Self {
        let bs = BlockSize::new(BLOCK_TOKENS).unwrap_or_else(|e| panic!("block size: {e}"));
        let mut cfg = IndexConfig::new(bs);
        cfg.verify_hashes = false;
        cfg.max_entries = usize::MAX;
        Self {
            index: PrefixIndex::new(cfg),
            ids: (0..workers)
                .map(|i| {
                    WorkerId::new(format!("worker-{i:04}"))
                        .unwrap_or_else(|e| panic!("worker id: {e}"))
                })
                .collect(),
            seqs: vec![0; workers],
            errors: 0,
        }
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }
}

fn to_switchyard(ev: &Event) -> KvEvent {
    match &ev.op {
        Op::Store { parent, blocks } => KvEvent::Stored {
            parent: parent.map(BlockHash),
            blocks: blocks
                .iter()
                .map(|b| StoredBlock {
                    hash: BlockHash(b.seq),
                    tokens: vec![0; BLOCK_TOKENS as usize],
                })
                .collect(),
            tier: StorageTier::Device,
        },
        Op::Remove { seqs } => KvEvent::Removed {
            blocks: seqs.iter().map(|&s| BlockHash(s)).collect(),
            tier: StorageTier::Device,
        },
    }
}

impl Contender for Switchyard {
    fn name(&self) -> &'static str {
        "switchyard"
    }

    fn apply(&mut self, events: &[Event]) -> Duration {
        let prepared: Vec<(usize, u64, KvEvent)> = events
            .iter()
            .map(|e| {
                let w = e.worker as usize;
                let seq = self.seqs[w];
                self.seqs[w] += 1;
                (w, seq, to_switchyard(e))
            })
            .collect();
        let start = Instant::now();
        for (w, seq, ev) in &prepared {
            match self.index.apply(&self.ids[*w], 1, *seq, ev) {
                Ok(switchyard_router::ApplyOutcome::Applied) => {}
                _ => self.errors += 1,
            }
        }
        start.elapsed()
    }

    fn overlap(&mut self, q: &Query) -> (Duration, Scores) {
        let prompt: Vec<BlockHash> = q.blocks.iter().map(|b| BlockHash(b.seq)).collect();
        let start = Instant::now();
        let scores = self.index.overlap(&prompt);
        let took = start.elapsed();
        let mut out: Scores = scores
            .iter()
            .filter_map(|(key, o)| {
                let id = self.index.worker_id(key)?;
                let w = self.ids.iter().position(|x| x == id)?;
                Some((w as u32, o.any_tier))
            })
            .collect();
        out.sort_unstable();
        (took, out)
    }

    fn errors(&self) -> u64 {
        self.errors
    }
}

fn to_router_event(ev: &Event, id: u64) -> RouterEvent {
    let data = match &ev.op {
        Op::Store { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.seq),
                    tokens_hash: LocalBlockHash(b.local),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        Op::Remove { seqs } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: seqs.iter().map(|&s| ExternalSequenceBlockHash(s)).collect(),
        }),
    };
    RouterEvent::new(
        u64::from(ev.worker),
        KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
}

fn from_dynamo(scores: &OverlapScores) -> Scores {
    let mut out: Scores = scores
        .scores
        .iter()
        .filter(|&(_, &n)| n > 0)
        .map(|(w, &n)| (w.worker_id as u32, n))
        .collect();
    out.sort_unstable();
    out
}

fn locals(q: &Query) -> Vec<LocalBlockHash> {
    q.blocks.iter().map(|b| LocalBlockHash(b.local)).collect()
}

pub struct DynamoRadix {
    tree: RadixTree,
    next_id: u64,
    errors: u64,
}

impl DynamoRadix {
    pub fn new() -> Self {
        Self {
            tree: RadixTree::new(),
            next_id: 0,
            errors: 0,
        }
    }
}

impl Default for DynamoRadix {
    fn default() -> Self {
        Self::new()
    }
}

impl Contender for DynamoRadix {
    fn name(&self) -> &'static str {
        "dynamo radix_tree"
    }

    fn apply(&mut self, events: &[Event]) -> Duration {
        let prepared: Vec<RouterEvent> = events
            .iter()
            .map(|e| {
                self.next_id += 1;
                to_router_event(e, self.next_id)
            })
            .collect();
        let start = Instant::now();
        for ev in prepared {
            if self.tree.apply_event(ev).is_err() {
                self.errors += 1;
            }
        }
        start.elapsed()
    }

    fn overlap(&mut self, q: &Query) -> (Duration, Scores) {
        let seq = locals(q);
        let start = Instant::now();
        let scores = self.tree.find_matches(seq, false);
        let took = start.elapsed();
        (took, from_dynamo(&scores))
    }

    fn errors(&self) -> u64 {
        self.errors
    }
}

pub struct DynamoPositional {
    index: PositionalIndexer,
    worker_blocks: rustc_hash::FxHashMap<WorkerWithDpRank, LevelIndex>,
    mode: SearchMode,
    next_id: u64,
    errors: u64,
}

impl DynamoPositional {
    /// Jump size 32, the value Dynamo's indexer documentation uses.
    pub fn new(mode: SearchMode) -> Self {
        Self {
            index: PositionalIndexer::new_with_mode(32, mode),
            worker_blocks: Default::default(),
            mode,
            next_id: 0,
            errors: 0,
        }
    }
}

impl Contender for DynamoPositional {
    fn name(&self) -> &'static str {
        match self.mode {
            SearchMode::Strided => "dynamo positional (jump 32)",
            SearchMode::Binary => "dynamo positional (binary)",
        }
    }

    fn apply(&mut self, events: &[Event]) -> Duration {
        let prepared: Vec<RouterEvent> = events
            .iter()
            .map(|e| {
                self.next_id += 1;
                to_router_event(e, self.next_id)
            })
            .collect();
        let start = Instant::now();
        for ev in prepared {
            if self
                .index
                .apply_event(&mut self.worker_blocks, ev, None)
                .is_err()
            {
                self.errors += 1;
            }
        }
        start.elapsed()
    }

    fn overlap(&mut self, q: &Query) -> (Duration, Scores) {
        let seq = locals(q);
        let start = Instant::now();
        let scores = SyncIndexer::find_matches(&self.index, &seq, false);
        let took = start.elapsed();
        (took, from_dynamo(&scores))
    }

    fn errors(&self) -> u64 {
        self.errors
    }
}

pub struct DynamoConcurrent {
    tree: Arc<ConcurrentRadixTreeCompressed>,
    tx: flume::Sender<WorkerTask>,
    thread: Option<JoinHandle<()>>,
    handoff: Duration,
    next_id: u64,
}

impl DynamoConcurrent {
    pub fn new() -> Self {
        let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
        let (tx, rx) = flume::unbounded();
        let backend = Arc::clone(&tree);
        let thread = std::thread::spawn(move || {
            if let Err(e) = backend.worker(rx, None) {
                eprintln!("dynamo concurrent radix tree worker failed: {e}");
            }
        });
        let mut me = Self {
            tree,
            tx,
            thread: Some(thread),
            handoff: Duration::ZERO,
            next_id: 0,
        };
        let mut trips: Vec<Duration> = (0..201)
            .map(|_| {
                let start = Instant::now();
                me.flush();
                start.elapsed()
            })
            .collect();
        trips.sort_unstable();
        me.handoff = trips[trips.len() / 2];
        me
    }

    /// Median round trip of an empty flush, subtracted from every apply timing.
    pub fn handoff(&self) -> Duration {
        self.handoff
    }

    fn flush(&self) {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        if self.tx.send(WorkerTask::Flush(done_tx)).is_ok() {
            let _ = done_rx.blocking_recv();
        }
    }
}

impl Default for DynamoConcurrent {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for DynamoConcurrent {
    fn drop(&mut self) {
        let _ = self.tx.send(WorkerTask::Terminate);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Contender for DynamoConcurrent {
    fn name(&self) -> &'static str {
        "dynamo concurrent_radix_tree"
    }

    fn apply(&mut self, events: &[Event]) -> Duration {
        let prepared: Vec<WorkerTask> = events
            .iter()
            .map(|e| {
                self.next_id += 1;
                WorkerTask::Event(to_router_event(e, self.next_id))
            })
            .collect();
        let start = Instant::now();
        for task in prepared {
            let _ = self.tx.send(task);
        }
        self.flush();
        start.elapsed().saturating_sub(self.handoff)
    }

    fn overlap(&mut self, q: &Query) -> (Duration, Scores) {
        let seq = locals(q);
        let start = Instant::now();
        let scores = SyncIndexer::find_matches(&*self.tree, &seq, false);
        let took = start.elapsed();
        (took, from_dynamo(&scores))
    }

    /// The worker loop only logs refused events; answers are checked instead.
    fn errors(&self) -> u64 {
        0
    }
}
