//! Where a new turn's text may be re-tokenized from, so that the old turn's tokens up to there
//! plus a tokenization of the rest equal a full tokenization of the new text.
//!
//! A tokenizer turns text into ids in layers, each working on pieces the one above made:
//! 1. added tokens (`<|im_end|>`, `<tool_call>`) are found left-most-longest and cut out;
//! 2. each remaining segment is normalised (NFC or nothing, for the tokenizers handled
//!    here) and split by the pre-tokenizer regex into "words";
//! 3. BPE runs on each word alone.
//!
//! So a byte position `r` is a *clean split* of a text `x` — `tok(x) == tok(x[..r]) ++
//! tok(x[r..])` — when every layer splits there. [`SeamRules::clean_split`] accepts `r` only
//! if (a) no occurrence of any added token straddles `r` (then the added-token matches of
//! `x[..r]` and `x[r..]` are exactly those of `x`) and (b) either an added token starts at
//! `r` (a segment boundary), or the regex provably ends a word at `r` whatever follows and
//! starts the next at `r` whatever precedes, judged from the byte before and the byte at `r`
//! (see [`word_boundary`]). Every check reads only bytes in `[r - L + 1, r + L)` with `L` the
//! longest added token (at least 4), so when that window lies inside the common prefix of the
//! old and the new text, `r` is a clean split of both, and the old tokens before `r` are
//! exactly the new text's first tokens.

use switchyard_core::TokenId;

/// How far a seam can be refined for one tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeamPolicy {
    /// The pipeline is not understood well enough: always tokenize in full.
    Disabled,
    /// Only the start of an added token is a restart point (unknown pre-tokenizer regex).
    AddedTokens,
    /// Added-token starts and word boundaries of the GPT-4 family regex, which puts digits
    /// in runs of up to three (`\p{N}{1,3}`, cl100k, Llama 3) or one at a time (Qwen); o200k's
    /// also keeps a contraction (`'s`) with the word before it. GPT-2's regex is judged as a
    /// GPT-4 one with digit runs: each boundary [`word_boundary`] accepts then is one of
    /// GPT-2's too (see there).
    Words {
        digit_runs: bool,
        contractions_attach: bool,
    },
}

/// Word-boundary candidates examined before only added-token starts are considered: a seam
/// inside ordinary text finds a boundary within a few tokens.
const WORD_SCAN_TOKENS: usize = 64;
/// The window of the checks holds at least one whole character after `r`.
const MIN_MARGIN: usize = 4;

/// What [`SeamRules::find_restart`] found: re-tokenize the new text from `byte`, keeping the
/// old tokens before index `token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Restart {
    pub byte: usize,
    pub token: usize,
}

/// The facts about one tokenizer that decide where a seam may be cut.
#[derive(Debug, Clone)]
pub(crate) struct SeamRules {
    policy: SeamPolicy,
    /// Added tokens matched on the raw text, as bytes.
    added: Vec<Vec<u8>>,
    /// Whether some added token starts with this byte (a cheap pre-filter).
    first_bytes: [bool; 256],
    /// Bit set over ids: is this id an added token.
    added_id_bits: Vec<u64>,
    max_added_len: usize,
}

impl SeamRules {
    pub(crate) fn new(
        policy: SeamPolicy,
        added: impl IntoIterator<Item = (String, TokenId)>,
    ) -> Self {
        let mut rules = Self {
            policy,
            added: Vec::new(),
            first_bytes: [false; 256],
            added_id_bits: Vec::new(),
            max_added_len: 0,
        };
        for (content, id) in added {
            let Some(&first) = content.as_bytes().first() else {
                continue;
            };
            rules.first_bytes[usize::from(first)] = true;
            rules.max_added_len = rules.max_added_len.max(content.len());
            let (word, bit) = (id as usize / 64, id % 64);
            if rules.added_id_bits.len() <= word {
                rules.added_id_bits.resize(word + 1, 0);
            }
            rules.added_id_bits[word] |= 1 << bit;
            rules.added.push(content.into_bytes());
        }
        rules
    }

    pub(crate) fn policy(&self) -> SeamPolicy {
        self.policy
    }

    /// The added tokens matched on the raw text, as bytes.
    pub(crate) fn added_tokens(&self) -> &[Vec<u8>] {
        &self.added
    }

    /// The window half-width of [`clean_split`](Self::clean_split): it reads only
    /// `text[r + 1 - L .. r + L]` with this `L`.
    pub(crate) fn margin(&self) -> usize {
        self.max_added_len.max(MIN_MARGIN)
    }

    fn is_added_id(&self, id: TokenId) -> bool {
        self.added_id_bits
            .get(id as usize / 64)
            .is_some_and(|word| word & (1 << (id % 64)) != 0)
    }

    /// Where to restart tokenizing `new` given the old text, its token ids and each token's
    /// start byte. `Restart { byte: 0, token: 0 }` means "tokenize everything".
    pub(crate) fn find_restart(
        &self,
        old: &[u8],
        starts: &[u32],
        ids: &[TokenId],
        new: &[u8],
    ) -> Restart {
        const FULL: Restart = Restart { byte: 0, token: 0 };
        if self.policy == SeamPolicy::Disabled || starts.len() != ids.len() {
            return FULL;
        }
        let common = common_prefix(old, new);
        let Some(limit) = common.checked_sub(self.max_added_len.max(MIN_MARGIN)) else {
            return FULL;
        };
        // The token holding the last common byte is always re-tokenized, and so is at least
        // the whole token before it.
        let seam_token = starts
            .partition_point(|&s| (s as usize) < common)
            .saturating_sub(1);
        let below_limit = starts.partition_point(|&s| (s as usize) <= limit);
        let top = below_limit.min(seam_token);
        let words = matches!(self.policy, SeamPolicy::Words { .. });
        for (scanned, i) in (1..top).rev().enumerate() {
            let r = starts[i] as usize;
            if starts[i - 1] as usize >= r {
                // A token sharing a character with the one before: no boundary here.
                continue;
            }
            let word_candidate = words && scanned < WORD_SCAN_TOKENS;
            if !word_candidate && !self.is_added_id(ids[i]) {
                continue;
            }
            if self.clean_split(new, r) {
                return Restart { byte: r, token: i };
            }
        }
        FULL
    }

    /// Whether `r` is a clean split of `text` (see the module docs). Reads only
    /// `text[r + 1 - L .. r + L]`, `L = max(longest added token, 4)`.
    pub(crate) fn clean_split(&self, text: &[u8], r: usize) -> bool {
        if r == 0 || r >= text.len() || self.policy == SeamPolicy::Disabled {
            return false;
        }
        if self.added_straddles(text, r) {
            return false;
        }
        if self.added_starts_at(text, r) {
            return true;
        }
        match self.policy {
            SeamPolicy::Words {
                digit_runs,
                contractions_attach,
            } => {
                word_boundary(text[r - 1], text[r], digit_runs)
                    && !(contractions_attach
                        && text[r] == b'\''
                        && text[r - 1].is_ascii_alphabetic())
            }
            SeamPolicy::AddedTokens | SeamPolicy::Disabled => false,
        }
    }

    /// Some occurrence of an added token starts before `r` and ends after it.
    fn added_straddles(&self, text: &[u8], r: usize) -> bool {
        let from = r.saturating_sub(self.max_added_len.saturating_sub(1));
        (from..r).any(|start| {
            self.first_bytes[usize::from(text[start])]
                && self
                    .added
                    .iter()
                    .any(|token| start + token.len() > r && text[start..].starts_with(token))
        })
    }

    fn added_starts_at(&self, text: &[u8], r: usize) -> bool {
        self.first_bytes[usize::from(text[r])]
            && self.added.iter().any(|token| text[r..].starts_with(token))
    }
}

/// Character classes of the GPT-4 family pre-tokenizer regex
/// (`'s|'t|… | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}{1,3} | ␣?[^\s\p{L}\p{N}]+[\r\n]* | \s…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn ascii_class(byte: u8) -> Class {
    match byte {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        // Unicode White_Space within ASCII, which is what `\s` means in these regexes.
        b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => Class::Space,
        _ => Class::Other,
    }
}

/// Whether the regex ends a word between `before` and `at` whatever comes after `at`, and
/// in a way that cutting the text there leaves every word before unchanged.
///
/// Only ASCII is judged, which also keeps NFC from composing across the cut (an ASCII
/// character never combines with what precedes it). The argument, per class of `before`:
/// - whitespace: never. The whitespace alternatives (`\s+(?!\S)`, `\s*[\r\n]+`, `\s++$`)
///   look at the whole run and the character after it, so the text after `r` decides.
/// - letter: the word holding it is a contraction (`'ll`, all letters) or
///   `[^\r\n\p{L}\p{N}]?\p{L}+`; both end at a non-letter `at`, and end the same way at
///   the end of the cut text. A letter `at` would continue the word.
/// - digit: one digit per word (Qwen) ends anywhere; `\p{N}{1,3}` runs (cl100k, Llama 3)
///   group from the start of the digit run, so only a non-digit `at` ends one for sure.
/// - other (punctuation): its word is `␣?[^\s\p{L}\p{N}]+[\r\n]*`, ended by a digit or a
///   space other than `\r`/`\n`. A letter `at` could make it the prefix of `'s` or of
///   `[^…]?\p{L}+`, more punctuation or a newline would extend it.
///
/// o200k's words (case-aware letter runs) end the same way, except that a contraction after
/// a letter belongs to its word: the caller refuses a letter then `'` for it.
///
/// Every regex decision before the word holding `before` looked at most one character past
/// its own word, or through a whitespace run that ends before `before`: all inside the cut.
///
/// GPT-2's regex (`'s|… | ␣?\p{L}+ | ␣?\p{N}+ | ␣?[^\s\p{L}\p{N}]+ | \s+(?!\S) | \s+`), taken
/// with `digit_runs`, ends a word at every boundary accepted here: its letter and digit words
/// end at the first other character, unbounded digit runs end only at a non-digit, and its
/// punctuation run ends at any whitespace or digit (an apostrophe before a digit or a space
/// starts no contraction); whitespace and letter-after-punctuation are refused as above.
fn word_boundary(before: u8, at: u8, digit_runs: bool) -> bool {
    if !before.is_ascii() || !at.is_ascii() {
        return false;
    }
    match (ascii_class(before), ascii_class(at)) {
        (Class::Space, _) | (Class::Letter, Class::Letter) => false,
        (Class::Letter, _) => true,
        (Class::Digit, Class::Digit) => !digit_runs,
        (Class::Digit, _) => true,
        (Class::Other, Class::Digit) => true,
        (Class::Other, Class::Space) => at != b'\n' && at != b'\r',
        (Class::Other, _) => false,
    }
}

/// Length of the common prefix of `a` and `b`, backed off to a UTF-8 character boundary.
pub(crate) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const CHUNK: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    // Both texts are UTF-8 and agree before `i`: step back over continuation bytes.
    while i > 0 && i < b.len() && (b[i] & 0xC0) == 0x80 {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_stops_at_a_character_boundary() {
        assert_eq!(common_prefix(b"hello", b"help"), 3);
        assert_eq!(common_prefix("aé".as_bytes(), "aè".as_bytes()), 1);
        assert_eq!(common_prefix(b"abc", b"abc"), 3);
        let long = vec![b'x'; 1000];
        let mut other = long.clone();
        other[700] = b'y';
        assert_eq!(common_prefix(&long, &other), 700);
    }

    #[test]
    fn word_boundaries_follow_the_regex() {
        assert!(word_boundary(b'a', b' ', false));
        assert!(!word_boundary(b'a', b'b', false));
        assert!(word_boundary(b't', b'\'', false));
        assert!(!word_boundary(b'\'', b's', false));
        assert!(word_boundary(b'1', b'2', false));
        assert!(!word_boundary(b'1', b'2', true));
        assert!(!word_boundary(b' ', b'x', false));
        assert!(!word_boundary(b'.', b'\n', false));
        assert!(word_boundary(b'.', b' ', false));
        assert!(!word_boundary(b'(', b'x', false));
    }

    #[test]
    fn added_tokens_are_never_cut() {
        let rules = SeamRules::new(
            SeamPolicy::Words {
                digit_runs: false,
                contractions_attach: false,
            },
            [("<|im_end|>".to_owned(), 7), ("<tool_call>".to_owned(), 9)],
        );
        let text = b"ab<tool_call>cd<|im_end|>ef";
        assert!(rules.clean_split(text, 2), "start of an added token");
        assert!(
            !rules.clean_split(text, 6),
            "inside <tool_call>, between l and _"
        );
        assert!(rules.clean_split(text, 15), "start of <|im_end|>");
        assert!(rules.is_added_id(7) && rules.is_added_id(9) && !rules.is_added_id(8));
    }
}
