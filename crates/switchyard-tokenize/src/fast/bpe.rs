//! Byte-pair merging with Hugging Face's semantics: the pair with the lowest merge rank is
//! merged first, the leftmost one on a tie, and only pairs listed in `merges` ever merge.
//!
//! Merging starts from one symbol per byte, or per character for the characters of
//! [`CharTokens`] (a CJK run then starts from a third as many symbols). Pieces up to 256
//! symbols (nearly all of them) use tiktoken's scheme: a flat array of parts whose pair ranks
//! are updated around each merge. Longer ones (a long line of dashes or spaces) use a heap
//! over a linked list, as `tokenizers` does, so the work stays O(n log n) in the piece length.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use switchyard_core::TokenId;

use super::chars::CharTokens;

/// Pieces of up to this many symbols take the quadratic-but-cache-friendly path.
const SHORT_PIECE: usize = 256;

/// One symbol of a piece being merged: where it starts, its id, and the rank and result of
/// merging it with the next symbol (`u32::MAX` when that pair does not merge).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    start: u32,
    id: TokenId,
    rank: u32,
    merged: TokenId,
}

/// The merge table of one vocabulary.
#[derive(Debug)]
pub(crate) struct Merges {
    /// The id of each single byte.
    byte_ids: [TokenId; 256],
    /// `(left << 32) | right` to `(rank, merged id)`.
    pairs: HashMap<u64, (u32, TokenId), BuildHasherDefault<PairHasher>>,
    /// Characters whose bytes provably merge into one token before anything else touches
    /// them, so the merge starts from that token (see [`CharTokens`]).
    chars: CharTokens,
}

impl Merges {
    /// The table for `pairs` (left, right, merged) in rank order; `None` when a pair is
    /// listed twice (which rank wins would then be a detail of `tokenizers`' map building).
    pub(crate) fn new(
        byte_ids: [TokenId; 256],
        pairs: impl IntoIterator<Item = (TokenId, TokenId, TokenId)>,
    ) -> Option<Self> {
        let pairs: Vec<_> = pairs.into_iter().collect();
        let ranked = pairs
            .iter()
            .enumerate()
            .map(|(rank, &(left, right, merged))| {
                (left, right, u32::try_from(rank).unwrap_or(u32::MAX), merged)
            });
        let mut merges = Self::from_ranked(byte_ids, ranked)?;
        merges.chars = CharTokens::build(&merges, &pairs);
        Some(merges)
    }

    /// The table for `pairs` (left, right, rank, merged), where several pairs may share a
    /// rank (tiktoken: every split of a token into two tokens merges at the token's rank);
    /// `None` when a pair is listed twice or a rank is `u32::MAX`. Merging starts from bytes
    /// only: [`CharTokens`] needs each token made by one merge.
    pub(crate) fn from_ranked(
        byte_ids: [TokenId; 256],
        pairs: impl IntoIterator<Item = (TokenId, TokenId, u32, TokenId)>,
    ) -> Option<Self> {
        let pairs = pairs.into_iter();
        let mut map: HashMap<u64, (u32, TokenId), BuildHasherDefault<PairHasher>> =
            HashMap::with_capacity_and_hasher(pairs.size_hint().0, BuildHasherDefault::default());
        for (left, right, rank, merged) in pairs {
            if rank == u32::MAX || map.insert(key(left, right), (rank, merged)).is_some() {
                return None;
            }
        }
        Some(Self {
            byte_ids,
            pairs: map,
            chars: CharTokens::default(),
        })
    }

    pub(crate) fn byte_ids(&self) -> &[TokenId; 256] {
        &self.byte_ids
    }

    /// The characters that start the merge as one token.
    #[cfg(test)]
    pub(crate) fn char_tokens(&self) -> &CharTokens {
        &self.chars
    }

    #[inline]
    fn get(&self, left: TokenId, right: TokenId) -> Option<(u32, TokenId)> {
        self.pairs.get(&key(left, right)).copied()
    }

    /// Appends the ids of `piece` to `out`, and when `starts` is given, the offset in the
    /// piece of each token's first byte (plus `base`). `scratch` is reused across pieces.
    pub(crate) fn encode(
        &self,
        piece: &[u8],
        out: &mut Vec<TokenId>,
        starts: Option<(&mut Vec<u32>, u32)>,
        scratch: &mut Vec<Part>,
    ) {
        self.initial_parts(piece, scratch);
        if scratch.len() <= SHORT_PIECE {
            self.merge_short(out, starts, scratch);
        } else {
            self.merge_long(out, starts, scratch);
        }
    }

    /// The symbols merging starts from: one per byte, or one per character for the
    /// characters of [`CharTokens`].
    fn initial_parts(&self, piece: &[u8], parts: &mut Vec<Part>) {
        parts.clear();
        let mut k = 0;
        while k < piece.len() {
            let b = piece[k];
            let width = match b {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            let whole = match piece.get(k..k + width) {
                Some(bytes) if width > 1 => std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.chars().next())
                    .and_then(|c| {
                        let before = k.checked_sub(1).map(|j| piece[j]);
                        self.chars.get(c, before, piece.get(k + width).copied())
                    }),
                _ => None,
            };
            let (id, step) = match whole {
                Some(id) => (id, width),
                None => (self.byte_ids[b as usize], 1),
            };
            parts.push(Part {
                start: k as u32,
                id,
                rank: u32::MAX,
                merged: 0,
            });
            k += step;
        }
    }

    fn merge_short(
        &self,
        out: &mut Vec<TokenId>,
        starts: Option<(&mut Vec<u32>, u32)>,
        parts: &mut Vec<Part>,
    ) {
        for k in 0..parts.len().saturating_sub(1) {
            if let Some((rank, merged)) = self.get(parts[k].id, parts[k + 1].id) {
                parts[k].rank = rank;
                parts[k].merged = merged;
            }
        }
        loop {
            let mut best = u32::MAX;
            let mut at = 0;
            for (k, part) in parts[..parts.len().saturating_sub(1)].iter().enumerate() {
                if part.rank < best {
                    best = part.rank;
                    at = k;
                }
            }
            if best == u32::MAX {
                break;
            }
            parts[at].id = parts[at].merged;
            parts.remove(at + 1);
            parts[at].rank = u32::MAX;
            if at + 1 < parts.len()
                && let Some((rank, merged)) = self.get(parts[at].id, parts[at + 1].id)
            {
                parts[at].rank = rank;
                parts[at].merged = merged;
            }
            if at > 0 {
                parts[at - 1].rank = u32::MAX;
                if let Some((rank, merged)) = self.get(parts[at - 1].id, parts[at].id) {
                    parts[at - 1].rank = rank;
                    parts[at - 1].merged = merged;
                }
            }
        }
        out.extend(parts.iter().map(|p| p.id));
        if let Some((starts, base)) = starts {
            starts.extend(parts.iter().map(|p| base + p.start));
        }
    }

    fn merge_long(
        &self,
        out: &mut Vec<TokenId>,
        starts: Option<(&mut Vec<u32>, u32)>,
        parts: &[Part],
    ) {
        const NONE: usize = usize::MAX;
        let n = parts.len();
        let mut ids: Vec<TokenId> = parts.iter().map(|p| p.id).collect();
        let mut next: Vec<usize> = (1..=n).map(|k| if k == n { NONE } else { k }).collect();
        let mut prev: Vec<usize> = (0..n).map(|k| k.checked_sub(1).unwrap_or(NONE)).collect();
        let mut alive = vec![true; n];
        // (rank, left position, merged id); `Reverse` makes the heap pop the lowest rank, then
        // the leftmost position.
        let mut heap = BinaryHeap::with_capacity(n);
        for k in 0..n - 1 {
            if let Some((rank, merged)) = self.get(ids[k], ids[k + 1]) {
                heap.push(Reverse((rank, k, merged)));
            }
        }
        while let Some(Reverse((rank, left, merged))) = heap.pop() {
            let right = next[left];
            if !alive[left] || right == NONE {
                continue;
            }
            // Stale if either side changed since this entry was pushed.
            if self.get(ids[left], ids[right]) != Some((rank, merged)) {
                continue;
            }
            ids[left] = merged;
            alive[right] = false;
            let after = next[right];
            next[left] = after;
            if after != NONE {
                prev[after] = left;
                if let Some((r, m)) = self.get(merged, ids[after]) {
                    heap.push(Reverse((r, left, m)));
                }
            }
            let before = prev[left];
            if before != NONE
                && let Some((r, m)) = self.get(ids[before], merged)
            {
                heap.push(Reverse((r, before, m)));
            }
        }
        let mut k = 0;
        let mut starts = starts;
        while k != NONE {
            out.push(ids[k]);
            if let Some((starts, base)) = starts.as_mut() {
                starts.push(*base + parts[k].start);
            }
            k = next[k];
        }
    }
}

#[inline]
fn key(left: TokenId, right: TokenId) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// A multiplicative hash for the `u64` pair keys: they are not attacker-chosen in a way that
/// matters (the table is fixed at load), and SipHash would dominate the merge loop.
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.0 ^= self.0 >> 32;
    }
}
