//! Pieces that encode to one token, looked up before any merging. Most pieces of prose and
//! code are one token, so this lookup is the hot path: pieces of up to 15 bytes (nearly all)
//! are keyed by their bytes packed into a `u128`, so a probe compares two integers in the
//! table's own memory instead of following a pointer to a heap key and calling `memcmp`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use switchyard_core::TokenId;

use super::bpe::Part;

/// The longest piece kept in the packed table: its 16th byte holds the length.
const PACKED: usize = 15;

#[derive(Debug, Default)]
pub(crate) struct WholePieces {
    packed: HashMap<u128, TokenId, BuildHasherDefault<PackedHasher>>,
    long: HashMap<Vec<u8>, TokenId, BuildHasherDefault<BytesHasher>>,
}

impl WholePieces {
    pub(crate) fn insert(&mut self, piece: Vec<u8>, id: TokenId) {
        match pack(&piece) {
            Some(key) => self.packed.insert(key, id),
            None => self.long.insert(piece, id),
        };
    }

    #[inline]
    pub(crate) fn get(&self, piece: &[u8]) -> Option<TokenId> {
        match pack(piece) {
            Some(key) => self.packed.get(&key).copied(),
            None => self.long.get(piece).copied(),
        }
    }
}

/// The merged pieces of one encode call, by their bytes: long texts (code above all) repeat
/// the identifiers and words that are not one token, and a lookup is cheaper than merging
/// again. Pieces over 15 bytes (CJK runs) are rarely repeated and are not kept.
#[derive(Default)]
pub(crate) struct MergeMemo {
    /// Packed piece to its range in `merged`.
    index: HashMap<u128, (u32, u32), BuildHasherDefault<PackedHasher>>,
    /// `(id, offset in the piece where it starts)` of every kept piece, one after another.
    merged: Vec<(TokenId, u32)>,
    /// The piece being merged: ids, starts, both together, and the merge loop's work space.
    ids: Vec<TokenId>,
    starts: Vec<u32>,
    current: Vec<(TokenId, u32)>,
    scratch: Vec<Part>,
}

/// Pieces kept per call, at most; past it, pieces are merged every time.
const MEMO_PIECES: usize = 1 << 16;

impl MergeMemo {
    /// The tokens of `piece` with the offset in it where each starts, from the memo or from
    /// `merge` (which appends ids and starts, as [`super::bpe::Merges::encode`] does).
    pub(crate) fn get_or_merge(
        &mut self,
        piece: &[u8],
        merge: impl FnOnce(&[u8], &mut Vec<TokenId>, &mut Vec<u32>, &mut Vec<Part>),
    ) -> &[(TokenId, u32)] {
        let key = pack(piece);
        if let Some(&(from, to)) = key.and_then(|k| self.index.get(&k)) {
            return &self.merged[from as usize..to as usize];
        }
        self.ids.clear();
        self.starts.clear();
        merge(piece, &mut self.ids, &mut self.starts, &mut self.scratch);
        self.current.clear();
        self.current
            .extend(self.ids.iter().copied().zip(self.starts.iter().copied()));
        if let Some(key) = key
            && self.index.len() < MEMO_PIECES
        {
            let from = self.merged.len() as u32;
            self.merged.extend_from_slice(&self.current);
            self.index.insert(key, (from, self.merged.len() as u32));
        }
        &self.current
    }
}

/// The bytes in the low 15 bytes (little-endian), the length in the top one.
#[inline]
fn pack(piece: &[u8]) -> Option<u128> {
    if piece.len() > PACKED {
        return None;
    }
    let mut bytes = [0u8; 16];
    bytes[..piece.len()].copy_from_slice(piece);
    bytes[PACKED] = piece.len() as u8;
    Some(u128::from_le_bytes(bytes))
}

/// A multiply-and-fold hash of the packed key: the table is fixed at load from the vocabulary,
/// so there is no adversary to defend against, and SipHash would cost more than the probe.
#[derive(Default)]
struct PackedHasher(u64);

impl Hasher for PackedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u128(&mut self, n: u128) {
        let folded = u128::from((n as u64) ^ 0x2d35_8dcc_aa6c_78a5)
            * u128::from(((n >> 64) as u64) ^ 0x8bb8_4b93_962e_acc9);
        self.0 = (folded as u64) ^ ((folded >> 64) as u64);
    }
}

/// FxHash-style hashing of longer byte strings, eight bytes at a time.
#[derive(Default)]
pub(super) struct BytesHasher(u64);

impl Hasher for BytesHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0xf135_7aea_2e62_a9c5;
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.0 = (self.0 ^ u64::from_le_bytes(word))
                .wrapping_mul(K)
                .rotate_left(26);
        }
        let mut tail = [0u8; 8];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        self.0 = (self.0 ^ u64::from_le_bytes(tail) ^ ((rest.len() as u64) << 59))
            .wrapping_mul(K)
            .rotate_left(26);
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0 ^ n as u64).wrapping_mul(0xf135_7aea_2e62_a9c5);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_pieces_are_found_and_distinguished() {
        let mut whole = WholePieces::default();
        let long = b"a piece longer than fifteen bytes".to_vec();
        whole.insert(b"the".to_vec(), 1);
        whole.insert(b"the\0".to_vec(), 2);
        whole.insert(b"exactly 15 byte".to_vec(), 3);
        whole.insert(long.clone(), 4);
        assert_eq!(whole.get(b"the"), Some(1));
        assert_eq!(
            whole.get(b"the\0"),
            Some(2),
            "a trailing zero byte is part of the key"
        );
        assert_eq!(whole.get(b"exactly 15 byte"), Some(3));
        assert_eq!(whole.get(&long), Some(4));
        assert_eq!(whole.get(b"th"), None);
        assert_eq!(whole.get(b""), None);
        assert_eq!(whole.get(&long[..16]), None);
    }

    #[test]
    fn the_memo_merges_a_piece_once_and_answers_repeats() {
        let mut memo = MergeMemo::default();
        let mut merges = 0;
        let mut merge_ab = |piece: &[u8], ids: &mut Vec<TokenId>, starts: &mut Vec<u32>| {
            merges += 1;
            ids.extend([7, 8]);
            starts.extend([0, piece.len() as u32 - 1]);
        };
        for _ in 0..3 {
            let got = memo
                .get_or_merge(b"abc", |p, i, s, _| merge_ab(p, i, s))
                .to_vec();
            assert_eq!(got, [(7, 0), (8, 2)]);
        }
        let long = [b'x'; 20];
        for _ in 0..2 {
            let got = memo
                .get_or_merge(&long, |p, i, s, _| merge_ab(p, i, s))
                .to_vec();
            assert_eq!(got, [(7, 0), (8, 19)]);
        }
        assert_eq!(merges, 3, "abc once, the 20-byte piece each time");
    }
}
