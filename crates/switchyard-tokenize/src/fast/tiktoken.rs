//! The built-in OpenAI vocabularies (`cl100k_base`, `o200k_base`) on the fast path, built from
//! tiktoken's rank table.
//!
//! tiktoken merges differently from a Hugging Face merge list: two adjacent parts merge when
//! their concatenated bytes are a token, at that token's rank (its id), lowest rank first and
//! leftmost on a tie, and a piece that is itself a token is taken whole before any merging.
//! The merge loop of [`Merges`] does the same once its pair table answers "is the
//! concatenation a token" for every pair of tokens that can sit side by side: each split of
//! each token into two tokens is such a pair, at the token's rank. A token split into parts
//! that are not both tokens can never be formed from them, since every part is a token.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use aho_corasick::{AhoCorasickBuilder, MatchKind};
use switchyard_core::TokenId;

use super::FastBpe;
use super::bpe::Merges;
use super::load::NotRecognised;
use super::pretokenize::{self, Pattern};
use super::whole::{BytesHasher, WholePieces};

impl FastBpe {
    /// The fast encoder for a tiktoken vocabulary: `tokens` are the ordinary tokens' bytes
    /// by id (their rank), `specials` the special tokens matched on the raw text.
    pub(crate) fn from_ranks(
        pattern: Pattern,
        tokens: &[(Vec<u8>, TokenId)],
        specials: &[(&str, TokenId)],
    ) -> Result<Self, NotRecognised> {
        need_tables(pattern)?;
        let by_bytes: HashMap<&[u8], TokenId, BuildHasherDefault<BytesHasher>> = tokens
            .iter()
            .map(|(bytes, id)| (bytes.as_slice(), *id))
            .collect();
        if by_bytes.len() != tokens.len() {
            return Err(NotRecognised("two tokens with the same bytes"));
        }
        let mut byte_ids = [0; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = *by_bytes
                .get([b as u8].as_slice())
                .ok_or(NotRecognised("a byte missing from the vocab"))?;
        }
        let mut pairs = Vec::new();
        for (bytes, id) in tokens {
            for k in 1..bytes.len() {
                if let Some(&left) = by_bytes.get(&bytes[..k])
                    && let Some(&right) = by_bytes.get(&bytes[k..])
                {
                    pairs.push((left, right, *id, *id));
                }
            }
        }
        let whole_pieces: WholePieces = tokens.iter().cloned().collect();
        let merges = Merges::from_ranked(byte_ids, pairs)
            .ok_or(NotRecognised("a pair of tokens listed twice"))?;
        let contents: Vec<&str> = specials.iter().map(|&(text, _)| text).collect();
        let added = if contents.is_empty() {
            None
        } else {
            let automaton = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&contents)
                .map_err(|_| NotRecognised("added tokens automaton"))?;
            Some((automaton, specials.iter().map(|&(_, id)| id).collect()))
        };
        Ok(Self {
            pattern,
            nfc: false,
            merges,
            whole_pieces,
            added,
        })
    }
}

fn need_tables(pattern: Pattern) -> Result<(), NotRecognised> {
    let ready =
        pretokenize::tables_ready() && (pattern != Pattern::O200k || super::o200k::tables_ready());
    if ready {
        Ok(())
    } else {
        Err(NotRecognised("unicode tables unavailable"))
    }
}
