//! Pieces that encode to one token, looked up before any merging. Most pieces of prose and
//! code are one token, so this lookup is the hot path: pieces of up to 15 bytes (nearly all)
//! are keyed by their bytes packed into a `u128`, so a probe compares two integers in the
//! table's own memory instead of following a pointer to a heap key and calling `memcmp`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use switchyard_core::TokenId;

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
struct BytesHasher(u64);

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
}
