//! Byte-pair merging with Hugging Face's semantics: the pair with the lowest merge rank is
//! merged first, the leftmost one on a tie, and only pairs listed in `merges` ever merge.
//!
//! Merging starts from one symbol per byte, or per character for the characters of
//! [`CharTokens`] (a CJK run then starts from a third as many symbols). Pieces up to 256
//! symbols (nearly all of them) use tiktoken's scheme: a flat array of parts whose pair ranks
//! are updated around each merge. Longer ones (a long line of dashes or spaces) use a heap
//! over a linked list, as `tokenizers` does, so the work stays O(n log n) in the piece length.
//!
//! The pair table is probed for every adjacent pair, and at 150k pairs it is far larger than a
//! core's L2 cache, so each probe is a miss: it is one array of `u64` slots (left, right and
//! rank, 21 bits each; linear probing, at most half full), so a probe reads one cache line and
//! no control bytes, and the merged token is read from a by-rank array only when a pair wins.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use switchyard_core::TokenId;

use super::chars::CharTokens;
use super::open::OpenTable;

/// Pieces of up to this many symbols take the quadratic-but-cache-friendly path.
const SHORT_PIECE: usize = 256;

/// One symbol of a piece being merged: where it starts, its id, and the rank of merging it
/// with the next symbol (`u32::MAX` when that pair does not merge).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    start: u32,
    id: TokenId,
    rank: u32,
}

/// Bits of each field of a pair slot: ids and ranks up to 2^21 - 2 (two million; the largest
/// byte-level vocabularies hold a quarter of that).
const FIELD_BITS: u32 = 21;
const FIELD_MAX: u64 = (1 << FIELD_BITS) - 1;
/// An empty slot: every field all ones, which no pair can be (ids and ranks stay below).
const EMPTY: u64 = u64::MAX;

/// The merge table of one vocabulary.
#[derive(Debug)]
pub(crate) struct Merges {
    /// The id of each single byte.
    byte_ids: [TokenId; 256],
    /// The pairs that merge: `left | right << 21 | rank << 42` in an open-addressing table.
    pairs: PairTable,
    /// The token each rank merges into (under tiktoken's ranks, every pair of one rank makes
    /// the same token).
    merged_by_rank: Vec<TokenId>,
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
    /// `None` when a pair is listed twice, one rank makes two different tokens, or an id or
    /// rank does not fit the table's 21 bits (the vocabulary then keeps the Hugging Face
    /// pipeline). Merging starts from bytes only: [`CharTokens`] needs each token made by one
    /// merge.
    pub(crate) fn from_ranked(
        byte_ids: [TokenId; 256],
        pairs: impl IntoIterator<Item = (TokenId, TokenId, u32, TokenId)>,
    ) -> Option<Self> {
        let pairs: Vec<_> = pairs.into_iter().collect();
        let mut table = PairTable::with_room_for(pairs.len());
        let mut merged_by_rank: Vec<TokenId> = Vec::new();
        for &(left, right, rank, merged) in &pairs {
            let fits = |n: u32| u64::from(n) < FIELD_MAX;
            if !(fits(left) && fits(right) && fits(rank) && table.insert(left, right, rank)) {
                return None;
            }
            let at = rank as usize;
            if merged_by_rank.len() <= at {
                merged_by_rank.resize(at + 1, TokenId::MAX);
            }
            match merged_by_rank[at] {
                TokenId::MAX => merged_by_rank[at] = merged,
                // One rank making two different tokens cannot be told apart by rank alone.
                other if other != merged => return None,
                _ => {}
            }
        }
        Some(Self {
            byte_ids,
            pairs: table,
            merged_by_rank,
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

    /// The rank at which `left` and `right` merge.
    #[inline]
    fn rank(&self, left: TokenId, right: TokenId) -> Option<u32> {
        self.pairs.rank(left, right)
    }

    #[inline]
    fn merged(&self, rank: u32) -> TokenId {
        self.merged_by_rank[rank as usize]
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
            if let Some(rank) = self.rank(parts[k].id, parts[k + 1].id) {
                parts[k].rank = rank;
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
            parts[at].id = self.merged(best);
            parts.remove(at + 1);
            parts[at].rank = u32::MAX;
            if at + 1 < parts.len()
                && let Some(rank) = self.rank(parts[at].id, parts[at + 1].id)
            {
                parts[at].rank = rank;
            }
            if at > 0 {
                parts[at - 1].rank = self
                    .rank(parts[at - 1].id, parts[at].id)
                    .unwrap_or(u32::MAX);
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
        // (rank, left position); `Reverse` makes the heap pop the lowest rank, then the
        // leftmost position.
        let mut heap = BinaryHeap::with_capacity(n);
        for k in 0..n - 1 {
            if let Some(rank) = self.rank(ids[k], ids[k + 1]) {
                heap.push(Reverse((rank, k)));
            }
        }
        while let Some(Reverse((rank, left))) = heap.pop() {
            let right = next[left];
            if !alive[left] || right == NONE {
                continue;
            }
            // Stale if the pair there now does not merge at this rank (a pair that does makes
            // the same token: one rank, one token).
            if self.rank(ids[left], ids[right]) != Some(rank) {
                continue;
            }
            let merged = self.merged(rank);
            ids[left] = merged;
            alive[right] = false;
            let after = next[right];
            next[left] = after;
            if after != NONE {
                prev[after] = left;
                if let Some(r) = self.rank(merged, ids[after]) {
                    heap.push(Reverse((r, left)));
                }
            }
            let before = prev[left];
            if before != NONE
                && let Some(r) = self.rank(ids[before], merged)
            {
                heap.push(Reverse((r, before)));
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

/// The pairs that merge, with their ranks: `u64` slots of `left | right << 21 | rank << 42` in
/// an [`OpenTable`] hashed on `(left, right)`.
#[derive(Debug)]
struct PairTable(OpenTable<u64>);

/// The `(left, right)` bits of a slot.
const PAIR_MASK: u64 = (1 << (2 * FIELD_BITS)) - 1;

#[inline]
fn pair(left: TokenId, right: TokenId) -> u64 {
    u64::from(left) | (u64::from(right) << FIELD_BITS)
}

impl PairTable {
    fn with_room_for(pairs: usize) -> Self {
        Self(OpenTable::with_room_for(pairs, EMPTY))
    }

    /// Adds a pair (all fields below [`FIELD_MAX`]); `false` when it is already there.
    fn insert(&mut self, left: TokenId, right: TokenId, rank: u32) -> bool {
        let pair = pair(left, right);
        let slot = pair | (u64::from(rank) << (2 * FIELD_BITS));
        self.0.insert(pair, slot, |s| s & PAIR_MASK == pair)
    }

    #[inline]
    fn rank(&self, left: TokenId, right: TokenId) -> Option<u32> {
        if u64::from(left.max(right)) >= FIELD_MAX {
            return None;
        }
        let pair = pair(left, right);
        let slot = self.0.find(pair, |s| s & PAIR_MASK == pair)?;
        Some((slot >> (2 * FIELD_BITS)) as u32)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Byte `b` is token `b`.
    pub(in crate::fast) fn bytes() -> [TokenId; 256] {
        std::array::from_fn(|b| b as TokenId)
    }

    #[test]
    fn tables_it_cannot_hold_exactly_are_refused() {
        // The first id and rank that do not fit; the one below does.
        let big = FIELD_MAX as TokenId;
        assert!(
            Merges::from_ranked(bytes(), [(1, 2, 0, 300), (big - 1, 2, big - 1, 301)]).is_some()
        );
        assert!(
            Merges::from_ranked(bytes(), [(1, big, 0, 300)]).is_none(),
            "an id past 21 bits"
        );
        assert!(
            Merges::from_ranked(bytes(), [(1, 2, big, 300)]).is_none(),
            "a rank past 21 bits"
        );
        assert!(
            Merges::from_ranked(bytes(), [(1, 2, 0, 300), (1, 2, 1, 301)]).is_none(),
            "a pair listed twice"
        );
        assert!(
            Merges::from_ranked(bytes(), [(1, 2, 0, 300), (3, 4, 0, 301)]).is_none(),
            "one rank, two tokens"
        );
        assert!(
            Merges::from_ranked(bytes(), [(1, 2, 0, 300), (3, 4, 0, 300)]).is_some(),
            "one rank, one token: tiktoken's splits"
        );
    }

    #[test]
    fn every_pair_is_found_at_its_rank_and_no_other_pair_is() {
        let pairs: Vec<_> = (0..5_000u32)
            .map(|k| (k % 701, (k * 7919) % 2_003, k, 10_000 + k))
            .collect();
        let merges = Merges::from_ranked(bytes(), pairs.iter().copied()).unwrap();
        for &(left, right, rank, merged) in &pairs {
            assert_eq!(merges.rank(left, right), Some(rank));
            assert_eq!(merges.merged(rank), merged);
            assert_eq!(merges.rank(right + 2_003, left), None);
        }
        assert_eq!(merges.rank(TokenId::MAX, 0), None);
    }
}
