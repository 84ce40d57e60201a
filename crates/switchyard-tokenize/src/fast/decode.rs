//! Decoding for a `tokenizer.json` whose decoder is `ByteLevel`, from a table built once.
//!
//! `tokenizers` decodes ids by cloning each token's string (its added tokens, then its
//! model's vocabulary), dropping special tokens when asked, and handing the strings to the
//! `ByteLevel` decoder, which maps each token's characters back to bytes (a token with a
//! character outside the byte alphabet keeps its UTF-8 bytes as they are) and reads the whole
//! as UTF-8, lossily. That is two allocations per token and a hash look-up per character; a
//! streamed answer decodes a small window at every token. [`ByteLevelDecoder`] does the same
//! from the bytes of every id, worked out once when the tokenizer loads, so decoding is a
//! concatenation. It is built only when the decoder is exactly `ByteLevel` (whose options do
//! not change decoding), and checked against the library by the tests.

use std::collections::HashMap;

use switchyard_core::TokenId;
use tokenizers::decoders::DecoderWrapper;

use super::load::byte_chars;

/// What decoding one id appends.
#[derive(Debug)]
struct Piece {
    bytes: Box<[u8]>,
    /// Dropped when special tokens are skipped (its text is a special added token's).
    special: bool,
}

/// The bytes of every id of a tokenizer whose decoder is `ByteLevel`.
#[derive(Debug)]
pub(crate) struct ByteLevelDecoder {
    /// By id; `None` for an id the tokenizer does not know (decoding skips it, as the library
    /// does).
    pieces: Vec<Option<Piece>>,
}

impl ByteLevelDecoder {
    /// The table for `tokenizer`, or `None` when its decoder is anything but `ByteLevel`.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let char_bytes: HashMap<char, u8> = byte_chars()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let ids = tokenizer
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |id| id as usize + 1);
        let added = tokenizer.get_added_vocabulary();
        let pieces = (0..ids)
            .map(|id| {
                let token = tokenizer.id_to_token(id as TokenId)?;
                let bytes: Option<Vec<u8>> =
                    token.chars().map(|c| char_bytes.get(&c).copied()).collect();
                Some(Piece {
                    special: added.is_special_token(&token),
                    bytes: bytes.unwrap_or_else(|| token.as_bytes().to_vec()).into(),
                })
            })
            .collect();
        Some(Self { pieces })
    }

    /// Appends the bytes `ids` decode to, as `tokenizers` decodes them (read as UTF-8, lossily):
    /// each id's bytes in turn, so the bytes of a sequence are the concatenation of its parts'
    /// (what lets a stream be decoded a token at a time).
    pub(crate) fn extend_bytes(
        &self,
        bytes: &mut Vec<u8>,
        ids: &[TokenId],
        skip_special_tokens: bool,
    ) {
        for &id in ids {
            if let Some(Some(piece)) = self.pieces.get(id as usize)
                && !(skip_special_tokens && piece.special)
            {
                bytes.extend_from_slice(&piece.bytes);
            }
        }
    }
}
