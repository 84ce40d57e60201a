//! A fast, exact path for the common byte-level BPE `tokenizer.json` (Qwen2/Qwen3,
//! cl100k-style and GPT-2 patterns): added tokens split out with the same Aho-Corasick search
//! `tokenizers` uses, the split regex replaced by a hand-written scanner
//! ([`pretokenize`]), and byte-pair merging without the library's per-word allocations
//! ([`bpe`]), starting from whole characters where that is provably exact ([`chars`]).
//! Pieces that are one token are looked up first ([`whole`]); pieces that merge are kept for
//! the rest of the call, since long texts repeat them.
//!
//! [`FastBpe::from_json`] accepts a tokenizer only when every stage is one it reproduces
//! exactly; anything else keeps the Hugging Face pipeline. A text that is not already in NFC
//! (by the quick check of the normalization tables `tokenizers` itself uses) is handed back
//! to Hugging Face too, so normalization never has to be reimplemented.
//!
//! [`FastBpe::from_ranks`] ([`tiktoken`]) builds the same encoder from a tiktoken rank table
//! for the built-in vocabularies, with tiktoken's split patterns (cl100k's, and o200k's in
//! [`o200k`]).

mod bpe;
mod chars;
mod decode;
mod load;
mod o200k;
mod open;
mod pretokenize;
mod tiktoken;
mod whole;

pub(crate) use decode::ByteLevelDecoder;
pub(crate) use load::NotRecognised;
pub(crate) use o200k::O200K_REGEX;
pub(crate) use pretokenize::Pattern;

use aho_corasick::AhoCorasick;
use switchyard_core::TokenId;
use unicode_normalization_alignments::{IsNormalized, is_nfc_quick};

use crate::error::TokenizeError;
use crate::tokenizer::offset_u32;
pub(crate) use pretokenize::GPT2_REGEX;
use whole::MergeMemo;

/// Token ids and the byte offset where each starts.
type IdsAndStarts = (Vec<TokenId>, Vec<u32>);

/// Added tokens (all matched on the raw text) and their ids, by pattern index.
type AddedTokens = (AhoCorasick, Vec<TokenId>);

/// The fast encoder for one recognised `tokenizer.json`.
#[derive(Debug)]
pub(crate) struct FastBpe {
    pattern: pretokenize::Pattern,
    /// Whether the tokenizer's normalizer is NFC (otherwise it has none).
    nfc: bool,
    merges: bpe::Merges,
    /// Pieces that encode to one token, looked up before merging: with `ignore_merges`
    /// every token of the vocab (as `tokenizers` does), otherwise each token whose own bytes
    /// merge back into it.
    whole_pieces: whole::WholePieces,
    added: Option<AddedTokens>,
}

impl FastBpe {
    /// The ids of `text`, or `None` when the text needs the Hugging Face pipeline (it is not
    /// in NFC while the tokenizer normalizes).
    pub(crate) fn encode(&self, text: &str) -> Option<Vec<TokenId>> {
        if !self.normalized(text) {
            return None;
        }
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        let mut memo = MergeMemo::default();
        self.for_each_segment(text, |segment| match segment {
            Segment::Added(id, _) => ids.push(id),
            Segment::Text(from, to) => {
                self.encode_segment(&text[from..to], &mut ids, None, &mut memo);
            }
        });
        Some(ids)
    }

    /// As [`encode`](Self::encode), with the byte offset in `text` where each token starts
    /// (the start of the character for a token that begins inside one, as `tokenizers` gives).
    pub(crate) fn encode_with_starts(
        &self,
        text: &str,
    ) -> Option<Result<IdsAndStarts, TokenizeError>> {
        if !self.normalized(text) {
            return None;
        }
        if let Err(e) = offset_u32(text.len()) {
            return Some(Err(e));
        }
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        let mut starts = Vec::with_capacity(text.len() / 4 + 1);
        let mut memo = MergeMemo::default();
        self.for_each_segment(text, |segment| match segment {
            Segment::Added(id, from) => {
                ids.push(id);
                starts.push(from as u32);
            }
            Segment::Text(from, to) => {
                let first = starts.len();
                let starts_at = Some((&mut starts, from as u32));
                self.encode_segment(&text[from..to], &mut ids, starts_at, &mut memo);
                for start in &mut starts[first..] {
                    while !text.is_char_boundary(*start as usize) {
                        *start -= 1;
                    }
                }
            }
        });
        Some(Ok((ids, starts)))
    }

    fn normalized(&self, text: &str) -> bool {
        !self.nfc || text.is_ascii() || is_nfc_quick(text.chars()) == IsNormalized::Yes
    }

    fn for_each_segment(&self, text: &str, mut each: impl FnMut(Segment)) {
        let Some((automaton, ids)) = &self.added else {
            if !text.is_empty() {
                each(Segment::Text(0, text.len()));
            }
            return;
        };
        let mut from = 0;
        for found in automaton.find_iter(text) {
            if from < found.start() {
                each(Segment::Text(from, found.start()));
            }
            each(Segment::Added(
                ids[found.pattern().as_usize()],
                found.start(),
            ));
            from = found.end();
        }
        if from < text.len() {
            each(Segment::Text(from, text.len()));
        }
    }

    fn encode_segment(
        &self,
        segment: &str,
        ids: &mut Vec<TokenId>,
        mut starts: Option<(&mut Vec<u32>, u32)>,
        memo: &mut MergeMemo,
    ) {
        for (from, to) in self.pattern.pieces(segment) {
            let piece = &segment.as_bytes()[from..to];
            let base = starts.as_ref().map_or(0, |(_, base)| *base) + from as u32;
            if let Some(id) = self.whole_pieces.get(piece) {
                ids.push(id);
                if let Some((starts, _)) = starts.as_mut() {
                    starts.push(base);
                }
                continue;
            }
            let merged = memo.get_or_merge(piece, |piece, out, at, scratch| {
                self.merges.encode(piece, out, Some((at, 0)), scratch);
            });
            ids.extend(merged.iter().map(|&(id, _)| id));
            if let Some((starts, _)) = starts.as_mut() {
                starts.extend(merged.iter().map(|&(_, at)| base + at));
            }
        }
    }
}

enum Segment {
    /// An added token's id and the byte where it starts.
    Added(TokenId, usize),
    /// A byte range of ordinary text.
    Text(usize, usize),
}

#[cfg(test)]
mod decode_tests;
#[cfg(test)]
pub(crate) mod exact_tests;
#[cfg(test)]
mod tiktoken_tests;
