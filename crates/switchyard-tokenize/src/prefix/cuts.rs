//! Where a rendered prompt is cut into cacheable segments, and the chained hash that names
//! each prefix.
//!
//! A cut is always a clean split of the text (`session::seam`): the tokens of the text are
//! the tokens of the part before the cut followed by those of the part after. So a prompt cut
//! at `c1 < c2 < … < ck` tokenizes as `tok(x[..c1]) ++ tok(x[c1..c2]) ++ … ++ tok(x[ck..])`,
//! and each segment's tokens depend on its bytes alone.
//!
//! Cuts fall where chat templates start and end messages (added tokens such as
//! `<|im_start|>`, `<|im_end|>`, `<|start_header_id|>`), merged so that no segment is shorter
//! than [`MIN_SEGMENT_BYTES`], and, for tokenizers whose word boundaries are understood, also
//! every [`CHUNK_BYTES`] inside a long message, at the first word boundary past the mark. The
//! choice of a cut reads only the text before it and a few bytes after it, so two prompts that
//! share a long opening are cut alike inside it: that is what makes their segments match.

use aho_corasick::AhoCorasick;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::session::seam::{SeamPolicy, SeamRules};

/// Segments are at least this long (unless the tokenizer's longest added token is longer):
/// bookkeeping per segment would outweigh the few tokens of a shorter one.
pub(crate) const MIN_SEGMENT_BYTES: usize = 256;
/// A message longer than this is cut inside as well (word-boundary tokenizers), so prompts
/// that share only the start of a long message still share most of it.
pub(crate) const CHUNK_BYTES: usize = 16 << 10;
/// How far past a chunk mark a word boundary is looked for before giving up on that mark.
const CHUNK_SCAN_BYTES: usize = 1 << 10;
/// The hash of the empty prefix.
pub(crate) const ROOT: u64 = 0x5357_5944_5052_4546;

/// The end of one segment of a text and the hash of the whole prefix up to there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cut {
    pub end: usize,
    pub hash: u64,
}

/// Cuts texts for one tokenizer.
#[derive(Debug)]
pub(crate) struct Cutter {
    rules: SeamRules,
    /// Finds added-token occurrences; `None` when the tokenizer has none.
    added: Option<AhoCorasick>,
    min_segment: usize,
}

impl Cutter {
    /// `None` when the tokenizer allows no clean split (nothing can be cached).
    pub(crate) fn new(rules: &SeamRules) -> Option<Self> {
        if rules.policy() == SeamPolicy::Disabled {
            return None;
        }
        let tokens = rules.added_tokens();
        let added = if tokens.is_empty() {
            None
        } else {
            // Built from the tokenizer's own added tokens; failing means a pathological
            // vocabulary, and then only word-boundary chunks are cut.
            AhoCorasick::new(tokens).ok()
        };
        Some(Self {
            rules: rules.clone(),
            added,
            min_segment: MIN_SEGMENT_BYTES.max(2 * rules.margin()),
        })
    }

    /// The cuts of `text`, in order, each with the chained hash of the prefix it ends.
    pub(crate) fn cuts(&self, text: &[u8]) -> Vec<Cut> {
        let words = matches!(self.rules.policy(), SeamPolicy::Words { .. });
        let mut added = self
            .added
            .as_ref()
            .map(|ac| ac.find_iter(text).map(|m| m.start()));
        let mut next_added = || added.as_mut().and_then(Iterator::next);
        let mut cuts = Vec::new();
        let (mut last, mut hash) = (0, ROOT);
        let mut pending = next_added();
        // The next chunk mark: a word boundary is looked for from here.
        let mut mark = CHUNK_BYTES;
        loop {
            while pending.is_some_and(|a| a < last + self.min_segment) {
                pending = next_added();
            }
            let chunk_cut = if words && mark < text.len() && pending.is_none_or(|a| a > mark) {
                let end = (mark + CHUNK_SCAN_BYTES)
                    .min(pending.unwrap_or(text.len()))
                    .min(text.len());
                let found = (mark..end).find(|&r| self.rules.clean_split(text, r));
                mark = found.unwrap_or(end) + CHUNK_BYTES;
                found
            } else {
                None
            };
            let cut = match (chunk_cut, pending) {
                (Some(r), _) => Some(r),
                (None, Some(a)) if words && a > mark => continue,
                (None, Some(a)) => {
                    pending = next_added();
                    self.rules.clean_split(text, a).then_some(a)
                }
                (None, None) if words && mark < text.len() => continue,
                (None, None) => break,
            };
            if let Some(end) = cut {
                hash = xxh3_64_with_seed(&text[last..end], hash);
                cuts.push(Cut { end, hash });
                last = end;
                mark = last + CHUNK_BYTES;
            }
        }
        cuts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;

    fn cutter() -> Cutter {
        let tok = Tokenizer::builtin_cl100k();
        Cutter::new(tok.seam_rules()).expect("cl100k allows word seams")
    }

    fn chat(system: &str, user: &str) -> String {
        format!(
            "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )
    }

    #[test]
    fn a_shared_system_prompt_ends_a_segment_both_prompts_share() {
        let system = "You are a careful assistant. ".repeat(40);
        let a = chat(&system, &"Tell me about trains. ".repeat(20));
        let b = chat(&system, &"Explain compilers please. ".repeat(20));
        let (ca, cb) = (cutter().cuts(a.as_bytes()), cutter().cuts(b.as_bytes()));
        assert_eq!(ca[0], cb[0], "the system message is one segment in both");
        let system_end = a.find("<|im_end|>").unwrap();
        assert_eq!(ca[0].end, system_end);
        assert_ne!(ca[1].hash, cb[1].hash, "the user messages differ");
    }

    #[test]
    fn segments_are_never_shorter_than_the_minimum() {
        let text = "<|im_start|>a<|im_end|>".repeat(200);
        let cuts = cutter().cuts(text.as_bytes());
        assert!(!cuts.is_empty());
        let mut last = 0;
        for cut in &cuts {
            assert!(cut.end - last >= MIN_SEGMENT_BYTES, "{cut:?} after {last}");
            last = cut.end;
        }
    }

    #[test]
    fn long_messages_are_chunked_at_clean_splits() {
        let text = "word ".repeat(20_000);
        let tok = Tokenizer::builtin_cl100k();
        let cuts = cutter().cuts(text.as_bytes());
        assert!(cuts.len() >= 5, "{} cuts in 100 kB", cuts.len());
        for cut in &cuts {
            assert!(tok.seam_rules().clean_split(text.as_bytes(), cut.end));
        }
        // A text with no word boundary at all is not cut (and the scan ends).
        assert!(cutter().cuts("x".repeat(100_000).as_bytes()).is_empty());
    }
}
