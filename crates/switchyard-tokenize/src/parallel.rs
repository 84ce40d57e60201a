//! One long text tokenized on several cores: cut at clean splits (see `session::seam`: the
//! tokens of the two sides of such a cut are exactly the tokens of the whole), the pieces
//! encoded at once on tokio's blocking pool, the results joined with their offsets shifted.
//!
//! Used above a size threshold by the session tokenizer, for a fresh prompt and for the new
//! tail of a turn. Without a tokio runtime, with one core, for a tokenizer that allows no
//! seam, or for a text that probably exceeds the caller's token limit (where the chunked
//! serial path stops early), the text is tokenized in one pass as before.
//!
//! ## Only on idle cores
//! Cutting a text pays only when its pieces really run at once: on a core another tokenization
//! is using, a piece waits for it and the hand-off is pure cost (measured: 0.4–0.97× of one
//! pass on a 2-core host with the other core busy). So the pieces are counted against a
//! [`CoreBudget`], the process's cores (`available_parallelism`, which follows a cgroup CPU
//! limit): a long tokenization counts its own thread while it runs, and takes one helper per
//! core nobody counted is using. A gateway under load has every core counted by its own
//! long prompts and tokenizes each in one pass; one long prompt on an otherwise idle gateway
//! gets every core. What the budget cannot see is other processes on the host, and
//! tokenizations too short to cut (under 64 KiB of text, about a millisecond).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

use switchyard_core::TokenId;

use crate::error::TokenizeError;
use crate::session::seam::SeamPolicy;
use crate::tokenizer::{Bounded, Tokenizer, offset_u32};

/// Pieces are at least this long: below it the hand-off to another thread (a wake-up, a
/// copy of the text) costs a noticeable part of the piece's own work (~8k tokens, ~1 ms).
pub(crate) const MIN_PIECE_BYTES: usize = 32 << 10;

/// Texts with more than this many bytes per allowed token are taken serially, chunk by chunk,
/// so an over-long prompt is refused after tokenizing little of it. Real text averages 3–5.
const LIKELY_FITS_BYTES_PER_TOKEN: usize = 8;

/// The cores long tokenizations may use, and how many of them are in use now.
#[derive(Debug)]
pub struct CoreBudget {
    capacity: usize,
    busy: AtomicUsize,
    /// Long texts cut into pieces, and those taken in one pass since every core was busy.
    split: AtomicU64,
    whole_busy: AtomicU64,
}

/// Threads counted against a [`CoreBudget`]; released when dropped.
#[derive(Debug)]
#[must_use = "the threads count as busy only while this is held"]
pub struct Occupied<'a> {
    budget: &'a CoreBudget,
    threads: usize,
}

impl CoreBudget {
    pub const fn new(capacity: usize) -> Self {
        Self {
            capacity,
            busy: AtomicUsize::new(0),
            split: AtomicU64::new(0),
            whole_busy: AtomicU64::new(0),
        }
    }

    /// The process's budget: one core per `available_parallelism`, shared by every tokenizer.
    pub fn process() -> &'static CoreBudget {
        static BUDGET: OnceLock<CoreBudget> = OnceLock::new();
        BUDGET.get_or_init(|| {
            CoreBudget::new(std::thread::available_parallelism().map_or(1, Into::into))
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Threads counted now.
    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::Relaxed)
    }

    /// Long texts cut into pieces so far.
    pub fn split_texts(&self) -> u64 {
        self.split.load(Ordering::Relaxed)
    }

    /// Long texts taken in one pass because no core was free.
    pub fn whole_for_busy_cores(&self) -> u64 {
        self.whole_busy.load(Ordering::Relaxed)
    }

    /// Counts the calling thread, whatever the budget: it is running anyway.
    pub fn occupy(&self) -> Occupied<'_> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Occupied {
            budget: self,
            threads: 1,
        }
    }

    /// Counts up to `wanted` more threads, as many as there are free cores (possibly none).
    pub fn reserve(&self, wanted: usize) -> Occupied<'_> {
        let mut busy = self.busy.load(Ordering::Relaxed);
        loop {
            let threads = wanted.min(self.capacity.saturating_sub(busy));
            if threads == 0 {
                return Occupied {
                    budget: self,
                    threads: 0,
                };
            }
            match self.busy.compare_exchange_weak(
                busy,
                busy + threads,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Occupied {
                        budget: self,
                        threads,
                    };
                }
                Err(now) => busy = now,
            }
        }
    }
}

impl Occupied<'_> {
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Splits one thread off into a guard of its own (`None` when none is left).
    fn take_one(&mut self) -> Option<Self> {
        self.threads = self.threads.checked_sub(1)?;
        Some(Occupied {
            budget: self.budget,
            threads: 1,
        })
    }
}

impl Drop for Occupied<'_> {
    fn drop(&mut self) {
        if self.threads > 0 {
            self.budget.busy.fetch_sub(self.threads, Ordering::Relaxed);
        }
    }
}

/// How a text is split: into at most `workers` pieces of at least `min_piece_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParallelPlan {
    pub(crate) workers: usize,
    pub(crate) min_piece_bytes: usize,
}

impl Default for ParallelPlan {
    /// One piece per core of the process's [`CoreBudget`], [`MIN_PIECE_BYTES`] each at least.
    fn default() -> Self {
        Self {
            workers: CoreBudget::process().capacity(),
            min_piece_bytes: MIN_PIECE_BYTES,
        }
    }
}

impl ParallelPlan {
    /// How many pieces [`pieces`](Self::pieces) aims at (it may find fewer clean splits).
    fn count(&self, tok: &Tokenizer, text: &str) -> usize {
        if tok.seam_policy() == SeamPolicy::Disabled {
            return 1;
        }
        self.workers
            .min(text.len() / self.min_piece_bytes.max(1))
            .max(1)
    }

    /// The byte ranges `text` is cut into, covering it end to end; one range when it is not
    /// worth cutting or no clean split is near the targets.
    pub(crate) fn pieces(&self, tok: &Tokenizer, text: &str) -> Vec<(usize, usize)> {
        let count = self.count(tok, text);
        if count < 2 {
            return vec![(0, text.len())];
        }
        let target = text.len() / count;
        let mut ranges = Vec::with_capacity(count);
        let mut from = 0;
        while from < text.len() {
            let to = if ranges.len() + 1 == count {
                text.len()
            } else {
                tok.next_cut(text.as_bytes(), from + target)
            };
            ranges.push((from, to));
            from = to;
        }
        ranges
    }
}

/// [`Tokenizer::encode_with_starts_within`], with the pieces of a long text encoded in
/// parallel on the blocking pool of the current tokio runtime, one per free core of `budget`
/// (the calling thread counts as one). Always the same ids and starts as one pass.
pub(crate) fn encode_with_starts_within(
    tok: &Arc<Tokenizer>,
    text: &str,
    max: usize,
    plan: &ParallelPlan,
    budget: &'static CoreBudget,
) -> Bounded {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return tok.encode_with_starts_within(text, max);
    };
    if text.len() / LIKELY_FITS_BYTES_PER_TOKEN > max {
        return tok.encode_with_starts_within(text, max);
    }
    let wanted = plan.count(tok, text);
    if wanted < 2 {
        return tok.encode_with_starts_within(text, max);
    }
    let at_least = tok.min_tokens(text.len());
    if at_least > max {
        return Bounded {
            result: Err(TokenizeError::TooManyTokens { at_least, max }),
            tokenized_bytes: 0,
        };
    }
    let caller = budget.occupy();
    let helpers = budget.reserve(wanted - 1);
    if helpers.threads() == 0 {
        budget.whole_busy.fetch_add(1, Ordering::Relaxed);
        return tok.encode_with_starts_within(text, max);
    }
    let ranges = ParallelPlan {
        workers: 1 + helpers.threads(),
        ..*plan
    }
    .pieces(tok, text);
    budget.split.fetch_add(1, Ordering::Relaxed);
    let result = encode_pieces(tok, &runtime, text, ranges, max, helpers);
    drop(caller);
    Bounded {
        result,
        tokenized_bytes: text.len(),
    }
}

type Piece = Result<(Vec<TokenId>, Vec<u32>), TokenizeError>;

/// The pieces of one text, taken in turn by whichever thread is free: the caller and the
/// helpers it spawned.
struct Pieces {
    tok: Arc<Tokenizer>,
    text: Arc<str>,
    ranges: Vec<(usize, usize)>,
    next: AtomicUsize,
}

impl Pieces {
    /// Encodes pieces until none is left, sending each result with its index.
    fn work(&self, tx: &mpsc::Sender<(usize, Piece)>) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(from, to)) = self.ranges.get(k) else {
                return;
            };
            let piece = self
                .text
                .get(from..to)
                .ok_or(TokenizeError::TextTooLong { bytes: to })
                .and_then(|piece| self.tok.encode_with_starts(piece));
            // The receiver is gone only if the caller stopped waiting; nothing to do then.
            let _ = tx.send((k, piece));
        }
    }
}

fn encode_pieces(
    tok: &Arc<Tokenizer>,
    runtime: &tokio::runtime::Handle,
    text: &str,
    ranges: Vec<(usize, usize)>,
    max: usize,
    mut helpers: Occupied<'static>,
) -> Result<(Vec<TokenId>, Vec<u32>), TokenizeError> {
    let count = ranges.len();
    // The blocking pool wants owned data: one copy of the text, shared by the pieces.
    let pieces = Arc::new(Pieces {
        tok: Arc::clone(tok),
        text: Arc::from(text),
        ranges,
        next: AtomicUsize::new(0),
    });
    let (tx, rx) = mpsc::channel::<(usize, Piece)>();
    while let Some(core) = helpers.take_one() {
        let (tx, pieces) = (tx.clone(), Arc::clone(&pieces));
        // Not awaited: results come back on the channel. A helper that starts late (the pool
        // busy) finds nothing left, so the caller, which works too, never waits on a piece
        // nobody has started; a full pool cannot deadlock it. The helper's core stays counted
        // until it is done.
        drop(runtime.spawn_blocking(move || {
            pieces.work(&tx);
            drop(core);
        }));
    }
    pieces.work(&tx);
    drop(tx);
    let mut results: Vec<Option<Piece>> = (0..count).map(|_| None).collect();
    for (k, piece) in rx.iter().take(count) {
        results[k] = Some(piece);
    }
    let mut ids = Vec::new();
    let mut starts = Vec::new();
    for (result, &(from, _)) in results.into_iter().zip(&pieces.ranges) {
        let (piece_ids, piece_starts) = result.ok_or(TokenizeError::PieceLost)??;
        let shift = offset_u32(from)?;
        ids.extend_from_slice(&piece_ids);
        for start in piece_starts {
            starts.push(
                start
                    .checked_add(shift)
                    .ok_or(TokenizeError::TextTooLong { bytes: text.len() })?,
            );
        }
    }
    if ids.len() > max {
        return Err(TokenizeError::TooManyTokens {
            at_least: ids.len(),
            max,
        });
    }
    Ok((ids, starts))
}

#[cfg(test)]
mod tests;
