//! Whole characters as the merge loop's starting symbols, where that provably changes nothing.
//!
//! A CJK piece of 20 characters is 60 bytes; starting the merge from the 20 character tokens
//! instead of the 60 bytes saves two thirds of the pair lookups and merges. It is exact for a
//! character `c` with token `T` under three conditions, checked at load:
//!
//! 1. The merge list is *monotone*: every token is produced by exactly one merge, listed
//!    before any merge that uses the token (true of trained merge lists: Qwen2/3's, GPT-2's).
//!    Merging then happens in rank order: a merge of rank `r` only creates pairs ranked above
//!    `r`, so Hugging Face's "lowest rank first, leftmost on a tie" is a sweep over ranks.
//! 2. `c`'s bytes alone merge into `T`; let `R` be the rank of the merge producing `T`.
//! 3. No merge of rank `≤ R` joins a fragment of `c` that can sit at its edge (the left and
//!    right spines of `T`'s merge tree) with a symbol outside it. A symbol on the left of `c`
//!    ends with the byte before `c`, so this is checked per occurrence: a set of bytes per
//!    character says which neighbours could do it (often a space before a CJK lead byte).
//!
//! Then, in that text, `c`'s bytes become `T` by rank `R` without any merge across its edges,
//! and pairs with `T` itself rank above `R` (monotone), so the sweep outside `c` sees the same
//! symbols either way.

use std::collections::HashMap;

use switchyard_core::TokenId;

use super::bpe::Merges;

const NONE: u32 = u32::MAX;

/// A set of byte values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
struct ByteSet([u64; 4]);

impl ByteSet {
    #[inline]
    fn contains(&self, b: u8) -> bool {
        self.0[usize::from(b >> 6)] & (1 << (b & 63)) != 0
    }

    fn insert(&mut self, b: u8) {
        self.0[usize::from(b >> 6)] |= 1 << (b & 63);
    }
}

/// A character's token, and the bytes that, right before or after it, could join one of its
/// edge fragments before the token forms (indices into [`CharTokens::sets`]).
#[derive(Debug, Clone, Copy)]
struct CharEntry {
    token: TokenId,
    before: u16,
    after: u16,
}

/// The characters of two to four bytes that may start the merge as their own token.
#[derive(Debug, Default)]
pub(crate) struct CharTokens {
    /// By code point below U+10000: 1 + index into `entries`, 0 when the character starts
    /// as bytes.
    bmp: Vec<u32>,
    astral: HashMap<u32, u32>,
    entries: Vec<CharEntry>,
    /// Distinct byte sets (few: they depend mostly on the lead byte).
    sets: Vec<ByteSet>,
}

impl CharTokens {
    /// The token `c` starts as, given the bytes right before and after it in its piece.
    #[inline]
    pub(crate) fn get(&self, c: char, before: Option<u8>, after: Option<u8>) -> Option<TokenId> {
        let cp = u32::from(c);
        let slot = match self.bmp.get(cp as usize) {
            Some(&slot) => slot,
            None => self.astral.get(&cp).copied().unwrap_or(0),
        };
        let entry = self.entries.get(slot.checked_sub(1)? as usize)?;
        let blocks = |set: u16, byte: Option<u8>| {
            byte.is_some_and(|b| {
                self.sets
                    .get(usize::from(set))
                    .is_none_or(|s| s.contains(b))
            })
        };
        (!blocks(entry.before, before) && !blocks(entry.after, after)).then_some(entry.token)
    }

    /// How many characters may start as one token.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The table for `merges` (which must not use one yet), from its `pairs` (left, right,
    /// merged) in rank order; empty when the merge list is not monotone.
    pub(crate) fn build(merges: &Merges, pairs: &[(TokenId, TokenId, TokenId)]) -> Self {
        let Some(tree) = MergeTree::new(merges.byte_ids(), pairs) else {
            return Self::default();
        };
        let mut table = Self {
            bmp: vec![0; 0x10000],
            ..Self::default()
        };
        let mut interned: HashMap<ByteSet, u16> = HashMap::new();
        let mut ids = Vec::new();
        let mut scratch = Vec::new();
        for &(_, _, token) in pairs {
            let Some(c) = tree.single_char(token) else {
                continue;
            };
            let mut utf8 = [0; 4];
            ids.clear();
            merges.encode(
                c.encode_utf8(&mut utf8).as_bytes(),
                &mut ids,
                None,
                &mut scratch,
            );
            if ids != [token] {
                continue;
            }
            let (before, after) = tree.edge_blockers(token);
            let mut intern = |set: ByteSet| {
                let next = u16::try_from(table.sets.len()).ok()?;
                let index = *interned.entry(set).or_insert(next);
                if index == next {
                    table.sets.push(set);
                }
                Some(index)
            };
            let (Some(before), Some(after)) = (intern(before), intern(after)) else {
                continue;
            };
            table.entries.push(CharEntry {
                token,
                before,
                after,
            });
            let slot = table.entries.len() as u32;
            let cp = u32::from(c);
            match table.bmp.get_mut(cp as usize) {
                Some(s) => *s = slot,
                None => {
                    table.astral.insert(cp, slot);
                }
            }
        }
        table
    }
}

/// The merge list as a tree: how each token is produced, its first and last byte, and the
/// merges it takes part in.
struct MergeTree {
    /// Rank of the merge producing each token (`NONE` for bytes).
    produced_at: Vec<u32>,
    children: Vec<(TokenId, TokenId)>,
    /// `(first byte, last byte)` of each token (bytes and merged tokens).
    ends: Vec<Option<(u8, u8)>>,
    /// For each token, `(rank, last byte of the left side)` of the merges where it is the
    /// right side.
    joined_from_left: Vec<Vec<(u32, u8)>>,
    /// For each token, `(rank, first byte of the right side)` of the merges where it is the
    /// left side.
    joined_from_right: Vec<Vec<(u32, u8)>>,
    /// The bytes of each token of at most four bytes (length 0 for longer ones).
    short: Vec<([u8; 4], u8)>,
}

impl MergeTree {
    /// `None` unless the merge list is monotone (see the module header) and every merge
    /// joins bytes or merged tokens.
    fn new(byte_ids: &[TokenId; 256], pairs: &[(TokenId, TokenId, TokenId)]) -> Option<Self> {
        let size = pairs
            .iter()
            .flat_map(|&(l, r, m)| [l, r, m])
            .chain(byte_ids.iter().copied())
            .max()? as usize
            + 1;
        let mut tree = Self {
            produced_at: vec![NONE; size],
            children: vec![(0, 0); size],
            ends: vec![None; size],
            joined_from_left: vec![Vec::new(); size],
            joined_from_right: vec![Vec::new(); size],
            short: vec![([0; 4], 0); size],
        };
        for (b, &id) in byte_ids.iter().enumerate() {
            if tree.ends[id as usize].is_some() {
                return None; // two bytes share a token
            }
            tree.ends[id as usize] = Some((b as u8, b as u8));
            tree.short[id as usize] = ([b as u8, 0, 0, 0], 1);
        }
        let mut used = vec![false; size];
        for (rank, &(left, right, merged)) in pairs.iter().enumerate() {
            let rank = rank as u32;
            let (l, r, m) = (left as usize, right as usize, merged as usize);
            // Each side already exists (monotone); the result is new and not used yet.
            let ((first, _), (_, last)) = (tree.ends[l]?, tree.ends[r]?);
            if tree.ends[m].is_some() || used[m] {
                return None;
            }
            used[l] = true;
            used[r] = true;
            tree.produced_at[m] = rank;
            tree.children[m] = (left, right);
            tree.ends[m] = Some((first, last));
            let (left_last, right_first) = (tree.ends[l]?.1, tree.ends[r]?.0);
            tree.joined_from_left[r].push((rank, left_last));
            tree.joined_from_right[l].push((rank, right_first));
            let ((lb, ln), (rb, rn)) = (tree.short[l], tree.short[r]);
            if ln + rn <= 4 {
                let mut bytes = lb;
                bytes[ln as usize..(ln + rn) as usize].copy_from_slice(&rb[..rn as usize]);
                tree.short[m] = (bytes, ln + rn);
            }
        }
        Some(tree)
    }

    /// The character a merged token spells, when it spells exactly one of two to four bytes.
    fn single_char(&self, token: TokenId) -> Option<char> {
        let (bytes, len) = self.short.get(token as usize)?;
        let text = std::str::from_utf8(bytes.get(..*len as usize)?).ok()?;
        let mut chars = text.chars();
        let c = chars.next()?;
        (chars.next().is_none() && c.len_utf8() >= 2).then_some(c)
    }

    /// Condition 3, as byte sets: the last bytes of whatever a fragment on the left spine of
    /// `token`'s tree is merged with, on its left, at a rank up to the one producing `token`;
    /// and the first bytes of what the right spine is merged with on its right.
    fn edge_blockers(&self, token: TokenId) -> (ByteSet, ByteSet) {
        let rank = self.produced_at[token as usize];
        let (mut left, mut right) = self.children[token as usize];
        let mut before = ByteSet::default();
        let mut after = ByteSet::default();
        loop {
            for &(r, byte) in &self.joined_from_left[left as usize] {
                if r <= rank {
                    before.insert(byte);
                }
            }
            if self.produced_at[left as usize] == NONE {
                break;
            }
            left = self.children[left as usize].0;
        }
        loop {
            for &(r, byte) in &self.joined_from_right[right as usize] {
                if r <= rank {
                    after.insert(byte);
                }
            }
            if self.produced_at[right as usize] == NONE {
                break;
            }
            right = self.children[right as usize].1;
        }
        (before, after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::bpe::tests::bytes;

    /// "é" is C3 A9; 300 = C3 A9.
    #[test]
    fn a_character_whose_edges_merge_late_starts_whole() {
        let pairs = [(0xC3, 0xA9, 300), (b'x'.into(), 0xC3, 301)];
        let merges = Merges::new(bytes(), pairs).unwrap();
        let chars = merges.char_tokens();
        assert_eq!(chars.get('é', Some(b'x'), None), Some(300));
        assert_eq!(chars.get('é', None, Some(b'x')), Some(300));
        assert_eq!(chars.len(), 1);
    }

    #[test]
    fn an_edge_merging_first_keeps_the_bytes_after_that_neighbour() {
        // "x" + C3 merges before C3 + A9: "xé" is x C3 A9 → (xC3) A9, never x é; after any
        // other byte, or before anything, é starts whole.
        let pairs = [(b'x'.into(), 0xC3, 301), (0xC3, 0xA9, 300)];
        let merges = Merges::new(bytes(), pairs).unwrap();
        let chars = merges.char_tokens();
        assert_eq!(chars.get('é', Some(b'x'), None), None);
        assert_eq!(chars.get('é', Some(b'y'), Some(b'x')), Some(300));
        let encode = |text: &str| {
            let mut ids = Vec::new();
            merges.encode(text.as_bytes(), &mut ids, None, &mut Vec::new());
            ids
        };
        assert_eq!(encode("xé"), [301, 0xA9]);
        assert_eq!(encode("yéx"), [u32::from(b'y'), 300, u32::from(b'x')]);
    }

    #[test]
    fn a_right_edge_merging_first_keeps_the_bytes_before_that_neighbour() {
        // A9 + "x" merges first: "éx" stays bytes, C3 (A9x).
        let pairs = [(0xA9, b'x'.into(), 301), (0xC3, 0xA9, 300)];
        let merges = Merges::new(bytes(), pairs).unwrap();
        let chars = merges.char_tokens();
        assert_eq!(chars.get('é', None, Some(b'x')), None);
        assert_eq!(chars.get('é', Some(b'x'), Some(b'y')), Some(300));
        let mut ids = Vec::new();
        merges.encode("éx".as_bytes(), &mut ids, None, &mut Vec::new());
        assert_eq!(ids, [0xC3, 301]);
    }

    #[test]
    fn a_merge_list_that_is_not_monotone_gets_no_table() {
        // 300 is used (rank 0) before it is produced (rank 1).
        let pairs = [(300, b'x'.into(), 301), (0xC3, 0xA9, 300)];
        let merges = Merges::new(bytes(), pairs).unwrap();
        assert_eq!(merges.char_tokens().len(), 0);
    }
}
