//! o200k's split pattern (GPT-4o, GPT-4.1, the o-series), as tiktoken spells it, run as a
//! hand-written scanner like the GPT-4 one of [`super::pretokenize`]:
//!
//! ```text
//! [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//! |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! Where cl100k's pattern takes any run of letters, this one is case-aware: a word is
//! upper-case letters then lower-case ones (`HTTPServer` is one word, `helloWorld` two),
//! with modifier and other letters (CJK) and combining marks counting as either case, and a
//! contraction stays with the word before it. Marks also belong to the optional prefix and to
//! punctuation runs, so the first two alternatives are tried in the regex's own backtracking
//! order (prefix taken, then not) — see [`next_end`].

use std::sync::OnceLock;

use super::pretokenize::{CodePointTable, contraction_end, unicode_ranges, whitespace_end};

/// tiktoken's o200k split regex, exactly.
pub(crate) const O200K_REGEX: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+"
);

/// Which of the pattern's character sets a character is in, as bits.
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`
const UPPER: u8 = 1;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`
const LOWER: u8 = 2;
/// `[^\r\n\p{L}\p{N}]`
const PREFIX: u8 = 4;
/// `[^\s\p{L}\p{N}]`
const PUNCT: u8 = 8;
/// `\p{N}`
const NUMBER: u8 = 16;

/// Sets by general category: Lu and Lt are upper only, Ll lower only, Lm and Lo both, and
/// marks are letters of either case yet not `\p{L}`, so also prefix and punctuation.
const CASED_UPPER: u8 = UPPER;
const CASED_LOWER: u8 = LOWER;
const UNCASED: u8 = UPPER | LOWER;
const MARK: u8 = UPPER | LOWER | PREFIX | PUNCT;
const OTHER: u8 = PREFIX | PUNCT;
/// Whitespace other than `\r` and `\n` (those are in no set).
const SPACE: u8 = PREFIX;

const ASCII: [u8; 128] = {
    let mut table = [OTHER; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        table[b] = if c.is_ascii_uppercase() {
            CASED_UPPER
        } else if c.is_ascii_lowercase() {
            CASED_LOWER
        } else if c.is_ascii_digit() {
            NUMBER
        } else if c == b'\r' || c == b'\n' {
            0
        } else if matches!(c, b' ' | b'\t' | 0x0B | 0x0C) {
            SPACE
        } else {
            OTHER
        };
        b += 1;
    }
    table
};

fn tables() -> &'static CodePointTable<u8> {
    static TABLES: OnceLock<CodePointTable<u8>> = OnceLock::new();
    // Later entries win; the categories are disjoint and no space is a letter, number or
    // mark, so only `\r` and `\n` (in no set) override `\s`.
    TABLES.get_or_init(|| {
        CodePointTable::new(
            OTHER,
            &[
                (CASED_UPPER, r"[\p{Lu}\p{Lt}]"),
                (CASED_LOWER, r"\p{Ll}"),
                (UNCASED, r"[\p{Lm}\p{Lo}]"),
                (MARK, r"\p{M}"),
                (NUMBER, r"\p{N}"),
                (SPACE, r"\s"),
                (0, r"[\r\n]"),
            ],
        )
    })
}

/// Whether the Unicode tables this pattern needs loaded as expected.
pub(crate) fn tables_ready() -> bool {
    [r"[\p{Lu}\p{Lt}]", r"\p{Ll}", r"[\p{Lm}\p{Lo}]", r"\p{M}"]
        .iter()
        .all(|r| !unicode_ranges(r).is_empty())
}

/// The sets of the character at byte `i` (a char boundary before the end) and where it ends.
#[inline]
fn at(text: &str, i: usize) -> (u8, usize) {
    let b = text.as_bytes()[i];
    if b < 0x80 {
        return (ASCII[b as usize], i + 1);
    }
    let c = text[i..].chars().next().unwrap_or('\u{FFFD}');
    (tables().get(c), i + c.len_utf8())
}

/// The end of the run of characters in `set` starting at byte `i`.
#[inline]
fn run(text: &str, mut i: usize, set: u8) -> usize {
    while i < text.len() {
        let (sets, end) = at(text, i);
        if sets & set == 0 {
            break;
        }
        i = end;
    }
    i
}

/// `UPPER* LOWER+` from `j`, as the backtracking engine finds it: the upper run as long as it
/// can be while a lower character still follows, so either the run stops at a cased lower
/// letter, or it gives back up to its last character that is in both sets.
fn upper_then_lower(text: &str, j: usize) -> Option<usize> {
    let mut k = j;
    let mut last_both = None;
    while k < text.len() {
        let (sets, end) = at(text, k);
        if sets & UPPER == 0 {
            break;
        }
        if sets & LOWER != 0 {
            last_both = Some(end);
        }
        k = end;
    }
    if k < text.len() && at(text, k).0 & LOWER != 0 {
        return Some(run(text, k, LOWER));
    }
    last_both
}

/// `UPPER+ LOWER*` from `j`.
fn upper_and_lower(text: &str, j: usize) -> Option<usize> {
    if j >= text.len() || at(text, j).0 & UPPER == 0 {
        return None;
    }
    Some(run(text, run(text, j, UPPER), LOWER))
}

/// Where the piece starting at byte `i` (< `text.len()`) ends.
pub(crate) fn next_end(text: &str, i: usize) -> usize {
    let (sets, after) = at(text, i);
    let with_contraction = |end: usize| {
        if text.as_bytes().get(end) == Some(&b'\'') {
            contraction_end(text, end + 1).unwrap_or(end)
        } else {
            end
        }
    };
    // 1 and 2: each with the prefix character first, then without it.
    for word in [upper_then_lower, upper_and_lower] {
        if sets & PREFIX != 0
            && let Some(end) = word(text, after)
        {
            return with_contraction(end);
        }
        if let Some(end) = word(text, i) {
            return with_contraction(end);
        }
    }
    // 3. \p{N}{1,3}
    if sets & NUMBER != 0 {
        let mut end = after;
        for _ in 1..3 {
            if end >= text.len() {
                break;
            }
            let (next, next_end) = at(text, end);
            if next & NUMBER == 0 {
                break;
            }
            end = next_end;
        }
        return end;
    }
    // 4. ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
    let punct_from = if sets & PUNCT != 0 {
        Some(after)
    } else if text.as_bytes()[i] == b' ' && after < text.len() && at(text, after).0 & PUNCT != 0 {
        Some(at(text, after).1)
    } else {
        None
    };
    if let Some(from) = punct_from {
        let end = run(text, from, PUNCT);
        let tail = text.as_bytes()[end..]
            .iter()
            .take_while(|&&b| matches!(b, b'\r' | b'\n' | b'/'))
            .count();
        return end + tail;
    }
    // 5-7: whitespace, as in the GPT-4 pattern.
    whitespace_end(text, i, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let end = next_end(text, i);
            pieces.push(&text[i..end]);
            i = end;
        }
        pieces
    }

    #[test]
    fn splits_like_the_regex_on_hand_picked_cases() {
        assert!(tables_ready());
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(
            split("helloWorld HTTPServer"),
            ["hello", "World", " HTTPServer"]
        );
        assert_eq!(split("HELLO, WORLD"), ["HELLO", ",", " WORLD"]);
        assert_eq!(split("I'M don't 's"), ["I'M", " don't", " '", "s"]);
        assert_eq!(split("12345"), ["123", "45"]);
        assert_eq!(split("a/b//\n/c"), ["a", "/b", "//\n/", "c"]);
        assert_eq!(split("你好，世界"), ["你好", "，世界"]);
        assert_eq!(split("e\u{301}\u{301}!"), ["e\u{301}\u{301}", "!"]);
        assert_eq!(split("!!\u{301}"), ["!!\u{301}"]);
        assert_eq!(split("x.\n\nfoo  "), ["x", ".\n\n", "foo", "  "]);
        assert_eq!(split("a  1"), ["a", " ", " ", "1"]);
    }
}
