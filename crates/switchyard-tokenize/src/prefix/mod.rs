//! The cross-request prefix cache: system prompts, tool definitions and the shared opening
//! of sub-agents recur across sessions and tenants, so a rendered prompt's opening is
//! tokenized once and its tokens reused by every later prompt that starts with it.
//!
//! - `cuts`: where a prompt is cut into segments (message boundaries, and word boundaries
//!   inside long messages), each cut a clean split, and the chained hash naming each prefix.
//! - `store`: the segments held, sharded, bounded in bytes with CLOCK eviction.
//!
//! A look-up cuts the prompt, then walks its prefixes from the start: the segment stored
//! under the prefix's hash counts only if its bytes and its parent's hash are the request's
//! own, so the reused tokens are those of byte-identical segments, never of a hash alone.
//! Because every cut is a clean split, the tokens of a prompt are the concatenation of its
//! segments' tokens and its tail's: a hit equals a fresh tokenization.

mod cuts;
mod store;

use std::sync::atomic::{AtomicU64, Ordering};

use switchyard_core::TokenId;

use crate::error::TokenizeError;
use crate::tokenizer::{Tokenizer, offset_u32};
pub(crate) use cuts::CHUNK_BYTES;
use cuts::{Cut, Cutter, ROOT};
use store::{Segment, SegmentStore};

/// Counters of a [`PrefixCache`], for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Segments held now, and their bytes (text, ids, offsets and bookkeeping).
    pub segments: usize,
    pub bytes: usize,
    /// Look-ups that reused at least one segment, and those that reused none.
    pub hits: u64,
    pub misses: u64,
    /// Tokens taken from the cache instead of tokenized.
    pub reused_tokens: u64,
    /// Segments dropped to honour the byte bound.
    pub evictions: u64,
}

impl std::iter::Sum for PrefixStats {
    /// Figures of several caches (one per tokenizer) added up.
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| Self {
            segments: a.segments + b.segments,
            bytes: a.bytes + b.bytes,
            hits: a.hits + b.hits,
            misses: a.misses + b.misses,
            reused_tokens: a.reused_tokens + b.reused_tokens,
            evictions: a.evictions + b.evictions,
        })
    }
}

/// What a look-up found: the tokens of `text[..bytes]`, made of `segments` whole segments.
#[derive(Debug, Default)]
pub(crate) struct PrefixHit {
    pub bytes: usize,
    pub segments: usize,
    pub ids: Vec<TokenId>,
    pub starts: Vec<u32>,
}

/// Prompt openings tokenized once and shared by every request; see the module docs.
/// Shared by reference across threads; look-ups and insertions take a shard's lock only
/// around a map access.
#[derive(Debug)]
pub struct PrefixCache {
    cutter: Option<Cutter>,
    store: SegmentStore,
    hits: AtomicU64,
    misses: AtomicU64,
    reused_tokens: AtomicU64,
}

impl PrefixCache {
    /// A cache of at most `max_bytes` for `tokenizer`; off (every look-up empty, nothing
    /// stored) when `max_bytes` is 0 or the tokenizer allows no clean split.
    pub fn new(tokenizer: &Tokenizer, max_bytes: usize) -> Self {
        Self {
            cutter: (max_bytes > 0)
                .then(|| Cutter::new(tokenizer.seam_rules()))
                .flatten(),
            store: SegmentStore::new(max_bytes),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            reused_tokens: AtomicU64::new(0),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.cutter.is_some()
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            segments: self.store.segments(),
            bytes: self.store.bytes(),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            reused_tokens: self.reused_tokens.load(Ordering::Relaxed),
            evictions: self.store.evictions(),
        }
    }

    /// The cuts of `text` (none when the cache is off).
    pub(crate) fn cuts(&self, text: &str) -> Vec<Cut> {
        self.cutter
            .as_ref()
            .map_or_else(Vec::new, |c| c.cuts(text.as_bytes()))
    }

    /// The longest cached opening of `text` made of whole segments at `cuts` (not counted:
    /// see [`count`](Self::count)).
    pub(crate) fn lookup(&self, text: &str, cuts: &[Cut]) -> PrefixHit {
        if !self.is_enabled() {
            return PrefixHit::default();
        }
        let mut hit = PrefixHit::default();
        let (mut from, mut parent) = (0, ROOT);
        for cut in cuts {
            let Some(segment) = self.store.get(cut.hash) else {
                break;
            };
            let Some(bytes) = text.as_bytes().get(from..cut.end) else {
                break;
            };
            if segment.parent != parent || *segment.text != *bytes {
                break;
            }
            // Every start is below the cut, so none overflows once the cut fits.
            let (Ok(shift), Ok(_)) = (offset_u32(from), offset_u32(cut.end)) else {
                break;
            };
            hit.ids.extend_from_slice(&segment.ids);
            hit.starts.extend(segment.starts.iter().map(|&s| s + shift));
            hit.segments += 1;
            hit.bytes = cut.end;
            (from, parent) = (cut.end, cut.hash);
        }
        hit
    }

    /// Counts a look-up whose result was used: a hit when it reused a segment.
    pub(crate) fn count(&self, hit: &PrefixHit) {
        if !self.is_enabled() {
            return;
        }
        if hit.segments > 0 {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.reused_tokens
                .fetch_add(hit.ids.len() as u64, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Stores the segments of `text` after the first `known` ones, given the tokens and
    /// token starts of the whole text. Stops at the first cut no token starts at (which a
    /// clean split rules out) or that cannot be stored.
    pub(crate) fn insert(
        &self,
        text: &str,
        cuts: &[Cut],
        known: usize,
        ids: &[TokenId],
        starts: &[u32],
    ) -> Result<(), TokenizeError> {
        if !self.is_enabled() || ids.len() != starts.len() {
            return Ok(());
        }
        let (mut from, mut parent) = known
            .checked_sub(1)
            .and_then(|i| cuts.get(i))
            .map_or((0, ROOT), |c| (c.end, c.hash));
        let mut first = starts.partition_point(|&s| (s as usize) < from);
        for cut in cuts.iter().skip(known) {
            let end = starts.partition_point(|&s| (s as usize) < cut.end);
            if starts.get(end).is_none_or(|&s| s as usize != cut.end) {
                break;
            }
            let (Some(bytes), Some(seg_ids), Some(seg_starts)) = (
                text.as_bytes().get(from..cut.end),
                ids.get(first..end),
                starts.get(first..end),
            ) else {
                break;
            };
            let shift = offset_u32(from)?;
            let segment = Segment {
                parent,
                text: bytes.into(),
                ids: seg_ids.into(),
                starts: seg_starts
                    .iter()
                    .map(|&s| s.saturating_sub(shift))
                    .collect(),
            };
            if !self.store.insert(cut.hash, segment) && !self.store.contains(cut.hash) {
                // Too large to keep: the segments after it could never be reached.
                break;
            }
            (from, parent, first) = (cut.end, cut.hash, end);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
