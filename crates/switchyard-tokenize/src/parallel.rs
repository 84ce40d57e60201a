//! One long text tokenized on several cores: cut at clean splits (see `session::seam`: the
//! tokens of the two sides of such a cut are exactly the tokens of the whole), the pieces
//! encoded at once on tokio's blocking pool, the results joined with their offsets shifted.
//!
//! Used above a size threshold by the session tokenizer, for a fresh prompt and for the new
//! tail of a turn. Without a tokio runtime, with one core, for a tokenizer that allows no
//! seam, or for a text that probably exceeds the caller's token limit (where the chunked
//! serial path stops early), the text is tokenized in one pass as before.

use std::sync::atomic::{AtomicUsize, Ordering};
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

/// How a text is split: into at most `workers` pieces of at least `min_piece_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParallelPlan {
    pub(crate) workers: usize,
    pub(crate) min_piece_bytes: usize,
}

impl Default for ParallelPlan {
    /// One piece per available core, [`MIN_PIECE_BYTES`] each at least.
    fn default() -> Self {
        static CORES: OnceLock<usize> = OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, Into::into));
        Self {
            workers: cores,
            min_piece_bytes: MIN_PIECE_BYTES,
        }
    }
}

impl ParallelPlan {
    /// The byte ranges `text` is cut into, covering it end to end; one range when it is not
    /// worth cutting or no clean split is near the targets.
    pub(crate) fn pieces(&self, tok: &Tokenizer, text: &str) -> Vec<(usize, usize)> {
        let count = self.workers.min(text.len() / self.min_piece_bytes.max(1));
        if count < 2 || tok.seam_policy() == SeamPolicy::Disabled {
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
/// parallel on the blocking pool of the current tokio runtime. Always the same ids and starts
/// as one pass.
pub(crate) fn encode_with_starts_within(
    tok: &Arc<Tokenizer>,
    text: &str,
    max: usize,
    plan: &ParallelPlan,
) -> Bounded {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return tok.encode_with_starts_within(text, max);
    };
    if text.len() / LIKELY_FITS_BYTES_PER_TOKEN > max {
        return tok.encode_with_starts_within(text, max);
    }
    let ranges = plan.pieces(tok, text);
    if ranges.len() < 2 {
        return tok.encode_with_starts_within(text, max);
    }
    let at_least = tok.min_tokens(text.len());
    if at_least > max {
        return Bounded {
            result: Err(TokenizeError::TooManyTokens { at_least, max }),
            tokenized_bytes: 0,
        };
    }
    Bounded {
        result: encode_pieces(tok, &runtime, text, ranges, max),
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
    for _ in 1..count {
        let (tx, pieces) = (tx.clone(), Arc::clone(&pieces));
        // Not awaited: results come back on the channel. A helper that starts late (the pool
        // busy) finds nothing left, so the caller, which works too, never waits on a piece
        // nobody has started; a full pool cannot deadlock it.
        drop(runtime.spawn_blocking(move || pieces.work(&tx)));
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
