//! Pieces that encode to one token, looked up before any merging. Most pieces of prose and
//! code are one token, so this lookup is the hot path: pieces of up to 15 bytes (nearly all)
//! are keyed by their bytes packed into a `u128`, so a probe compares two integers in the
//! table's own memory instead of following a pointer to a heap key and calling `memcmp`.
//!
//! The full table (150k entries for Qwen3, 8 MiB) is far larger than a core's L2 cache, and
//! its probes were most of the encoder's time on a processor with 512 KiB of it. Token ids
//! follow merge order, so low ids are the frequent pieces: the lowest-id short pieces (up to
//! 7 bytes, [`HOT_ENTRIES`] of them, two thirds of the tokens of prose and code) are also kept
//! in a small open-addressing table of 16-byte slots (128 KiB) that stays in cache; the full
//! table answers the rest.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use switchyard_core::TokenId;

use super::bpe::Part;
use super::open::OpenTable;

/// The longest piece kept in the packed table: its 16th byte holds the length.
const PACKED: usize = 15;

/// The longest piece the hot table keeps: its key is one `u64`, the length in the top byte.
const HOT_BYTES: usize = 7;

/// How many short pieces the hot table keeps, lowest ids first; its slots are twice as many.
const HOT_ENTRIES: usize = 4096;

#[derive(Debug)]
pub(crate) struct WholePieces {
    /// Hot key ([`hot_key`]) and id; key 0 is a free slot.
    hot: OpenTable<(u64, TokenId)>,
    packed: HashMap<u128, TokenId, BuildHasherDefault<PackedHasher>>,
    long: HashMap<Vec<u8>, TokenId, BuildHasherDefault<BytesHasher>>,
}

impl FromIterator<(Vec<u8>, TokenId)> for WholePieces {
    fn from_iter<I: IntoIterator<Item = (Vec<u8>, TokenId)>>(pieces: I) -> Self {
        let mut packed = HashMap::default();
        let mut long = HashMap::default();
        for (piece, id) in pieces {
            match pack(&piece) {
                Some(key) => packed.insert(key, id),
                None => long.insert(piece, id),
            };
        }
        let mut short: Vec<(u64, TokenId)> = packed
            .iter()
            .filter_map(|(&key, &id)| Some((hot_key(key)?, id)))
            .collect();
        short.sort_unstable_by_key(|&(_, id)| id);
        short.truncate(HOT_ENTRIES);
        let mut hot = OpenTable::with_room_for(short.len(), (0, 0));
        for (key, id) in short {
            hot.insert(key, (key, id), |_| false);
        }
        Self { hot, packed, long }
    }
}

impl WholePieces {
    #[inline]
    pub(crate) fn get(&self, piece: &[u8]) -> Option<TokenId> {
        let Some(key) = pack(piece) else {
            return self.long.get(piece).copied();
        };
        if let Some(short) = hot_key(key)
            && let Some((_, id)) = self.hot.find(short, |(k, _)| k == short)
        {
            return Some(id);
        }
        self.packed.get(&key).copied()
    }
}

/// The hot table's key of a packed piece of 1 to [`HOT_BYTES`] bytes: its bytes and, in the top
/// byte, its length (never zero, the empty slot's key).
#[inline]
fn hot_key(packed: u128) -> Option<u64> {
    (1..=HOT_BYTES as u128)
        .contains(&(packed >> 120))
        .then_some(packed as u64 | (packed >> 64) as u64)
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

/// The bytes in the low 15 bytes (little-endian), the length in the top one. Read as two
/// (possibly overlapping) words rather than copied into a zeroed buffer: a buffer written byte
/// by byte and read back as one `u128` stalls the load until the stores retire.
#[inline]
fn pack(piece: &[u8]) -> Option<u128> {
    let len = piece.len();
    if len > PACKED {
        return None;
    }
    let (lo, hi) = if len >= 8 {
        let first = u64::from_le_bytes(piece[..8].try_into().ok()?);
        // The last eight bytes, shifted so that bytes 8.. land at the bottom.
        let last = u64::from_le_bytes(piece[len - 8..].try_into().ok()?);
        let rest = if len == 8 {
            0
        } else {
            last >> (8 * (16 - len))
        };
        (first, rest)
    } else if len >= 4 {
        let first = u32::from_le_bytes(piece[..4].try_into().ok()?);
        let last = u32::from_le_bytes(piece[len - 4..].try_into().ok()?);
        // Overlapping bytes are the same bytes at the same places, so OR keeps them.
        (u64::from(first) | (u64::from(last) << (8 * (len - 4))), 0)
    } else if len > 0 {
        let word = u64::from(piece[0])
            | (u64::from(piece[len / 2]) << (8 * (len / 2)))
            | (u64::from(piece[len - 1]) << (8 * (len - 1)));
        (word, 0)
    } else {
        (0, 0)
    };
    Some(u128::from(lo) | (u128::from(hi | ((len as u64) << 56)) << 64))
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
        let long = b"a piece longer than fifteen bytes".to_vec();
        let whole: WholePieces = [
            (b"the".to_vec(), 1),
            (b"the\0".to_vec(), 2),
            (b"exactly 15 byte".to_vec(), 3),
            (long.clone(), 4),
        ]
        .into_iter()
        .collect();
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

    /// The packing the word reads must reproduce: the bytes copied into a zeroed buffer.
    fn pack_by_copy(piece: &[u8]) -> Option<u128> {
        (piece.len() <= PACKED).then(|| {
            let mut bytes = [0u8; 16];
            bytes[..piece.len()].copy_from_slice(piece);
            bytes[PACKED] = piece.len() as u8;
            u128::from_le_bytes(bytes)
        })
    }

    proptest::proptest! {
        #[test]
        fn packing_reads_every_byte_once_in_place(piece in proptest::collection::vec(proptest::num::u8::ANY, 0..20)) {
            proptest::prop_assert_eq!(pack(&piece), pack_by_copy(&piece));
        }
    }

    #[test]
    fn every_piece_is_found_whether_or_not_the_hot_table_keeps_it() {
        // Three times as many short pieces as the hot table keeps, plus 8 to 15-byte ones: the
        // low ids land in the hot table, the rest only in the full one.
        let mut pieces = Vec::new();
        let mut state = 0x9e37_79b9_u64;
        let mut seen = std::collections::HashSet::new();
        while pieces.len() < 3 * HOT_ENTRIES + 500 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let len = 1 + (state >> 60) as usize; // 1..=16
            let piece: Vec<u8> = (0..len).map(|k| (state >> (k % 7 * 8)) as u8).collect();
            if seen.insert(piece.clone()) {
                pieces.push((piece, pieces.len() as TokenId));
            }
        }
        let whole: WholePieces = pieces.iter().cloned().collect();
        assert_eq!(whole.hot.used().count(), HOT_ENTRIES);
        for (piece, id) in &pieces {
            assert_eq!(whole.get(piece), Some(*id), "{piece:?}");
            let mut other = piece.clone();
            other.push(0xff);
            if !seen.contains(&other) {
                assert_eq!(whole.get(&other), None, "{other:?}");
            }
        }
        for (key, id) in whole.hot.used() {
            assert!(
                (id as usize) < 4 * HOT_ENTRIES,
                "hot keeps low ids: {key:x} {id}"
            );
        }
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
