//! The split patterns of the GPT-4 family and GPT-2's, recognised by their exact regex text
//! and run as a hand-written scanner over characters instead of a backtracking regex engine.
//!
//! The GPT-4 family patterns read
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//! with `{D}` either nothing (Qwen2/Qwen3: one digit per piece) or `{1,3}` (cl100k, Llama 3).
//! GPT-2's, which a bare `ByteLevel { use_regex: true }` pre-tokenizer applies (what
//! `tokenizers`' own BPE trainer writes by default), reads
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//! [`Pattern::next_end`] applies the alternatives in that order at each position, the way a
//! leftmost-first regex does; the character classes come from `regex-syntax`, the tables the
//! `tokenizers` crate's regex engine uses, so both agree on every code point.
//!
//! tiktoken spells cl100k's pattern with one more alternative, `\s++$` before `\s*[\r\n]`:
//! whitespace that runs to the end of the text is one piece ([`Pattern::tiktoken_cl100k`]).
//! o200k's case-aware pattern has its own scanner, [`super::o200k`].

use std::sync::OnceLock;

/// Qwen2's pattern, also Qwen2.5's and Qwen3's.
pub(crate) const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// cl100k's pattern as Llama 3's `tokenizer.json` spells it.
pub(crate) const CL100K_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-2's pattern: the one `ByteLevel { use_regex: true }` applies.
pub(crate) const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// A recognised split pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// The GPT-4 family: how many digits one piece may hold, and whether whitespace running
    /// to the end of the text is one piece (tiktoken's `\s++$`).
    Gpt4 {
        max_digits: usize,
        trailing_space_whole: bool,
    },
    /// o200k's case-aware pattern.
    O200k,
    Gpt2,
}

impl Pattern {
    /// The pattern whose regex is exactly `regex`, if it is one this module implements as
    /// Hugging Face's pipeline runs it.
    pub(crate) fn recognise(regex: &str) -> Option<Self> {
        let max_digits = match regex {
            QWEN2_REGEX => 1,
            CL100K_REGEX => 3,
            GPT2_REGEX => return Some(Self::Gpt2),
            _ => return None,
        };
        Some(Self::Gpt4 {
            max_digits,
            trailing_space_whole: false,
        })
    }

    /// cl100k's pattern as tiktoken runs it.
    pub(crate) fn tiktoken_cl100k() -> Self {
        Self::Gpt4 {
            max_digits: 3,
            trailing_space_whole: true,
        }
    }

    /// The pieces of `text`, as byte ranges that cover it end to end.
    pub(crate) fn pieces<'a>(&self, text: &'a str) -> Pieces<'a> {
        Pieces {
            pattern: *self,
            text,
            at: 0,
        }
    }

    /// Where the piece starting at byte `i` (< `text.len()`) ends.
    fn next_end(&self, text: &str, i: usize) -> usize {
        match *self {
            Self::Gpt4 {
                max_digits,
                trailing_space_whole,
            } => gpt4_next_end(text, i, max_digits, trailing_space_whole),
            Self::O200k => super::o200k::next_end(text, i),
            Self::Gpt2 => gpt2_next_end(text, i),
        }
    }
}

/// [`Pattern::next_end`] for the GPT-4 family.
fn gpt4_next_end(text: &str, i: usize, max_digits: usize, trailing_space_whole: bool) -> usize {
    let s = Scan { text };
    let (c, class, after) = s.at(i);
    // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == '\''
        && let Some(end) = s.contraction(after)
    {
        return end;
    }
    // 2. [^\r\n\p{L}\p{N}]?\p{L}+
    if class == Class::Letter {
        return s.run(after, Class::Letter);
    }
    let prefixable = class == Class::Other || (class == Class::Space && !is_newline(c));
    if prefixable && after < text.len() && s.at(after).1 == Class::Letter {
        return s.run(after, Class::Letter);
    }
    // 3. \p{N} or \p{N}{1,3}
    if class == Class::Number {
        let mut end = after;
        for _ in 1..max_digits {
            if end >= text.len() {
                break;
            }
            let (_, next, next_end) = s.at(end);
            if next != Class::Number {
                break;
            }
            end = next_end;
        }
        return end;
    }
    // 4. ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let others_from = if class == Class::Other {
        Some(after)
    } else if c == ' ' && after < text.len() && s.at(after).1 == Class::Other {
        Some(s.at(after).2)
    } else {
        None
    };
    if let Some(from) = others_from {
        let end = s.run(from, Class::Other);
        let tail = text.as_bytes()[end..]
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n')
            .count();
        return end + tail;
    }
    // Whitespace from here on.
    whitespace_end(text, i, trailing_space_whole)
}

/// GPT-2's alternatives at byte `i`: 1. `'s|'t|'re|'ve|'m|'ll|'d` (case-sensitive),
/// 2.–4. ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` (a run of one class, optionally after
/// one U+0020), 5. `\s+(?!\S)`, 6. `\s+`.
fn gpt2_next_end(text: &str, i: usize) -> usize {
    let s = Scan { text };
    let (c, class, after) = s.at(i);
    if c == '\''
        && let Some(end) = s.exact_contraction(after)
    {
        return end;
    }
    if class != Class::Space {
        return s.run(after, class);
    }
    if c == ' ' && after < text.len() {
        let next = s.at(after).1;
        if next != Class::Space {
            return s.run(after, next);
        }
    }
    space_run_end(text, i, false, false)
}

/// Where the whitespace piece starting at byte `i` ends: `\s*[\r\n]+|\s+(?!\S)|\s+`,
/// after `\s++$` when `trailing_whole`.
pub(super) fn whitespace_end(text: &str, i: usize, trailing_whole: bool) -> usize {
    space_run_end(text, i, trailing_whole, true)
}

/// [`whitespace_end`], with the newline alternative `\s*[\r\n]+` only when `newlines`.
fn space_run_end(text: &str, i: usize, trailing_whole: bool, newlines: bool) -> usize {
    let s = Scan { text };
    let (c, _, after) = s.at(i);
    let mut end = after;
    let mut last_newline_end = is_newline(c).then_some(after);
    let mut last_start = i;
    while end < text.len() {
        let (next, next_class, next_end) = s.at(end);
        if next_class != Class::Space {
            break;
        }
        if is_newline(next) {
            last_newline_end = Some(next_end);
        }
        last_start = end;
        end = next_end;
    }
    if trailing_whole && end == text.len() {
        return end;
    }
    if let Some(newline_end) = last_newline_end.filter(|_| newlines) {
        return newline_end;
    }
    if end == text.len() || last_start == i {
        return end;
    }
    last_start
}

/// The end of a contraction (`s`, `t`, `re`, `ve`, `m`, `ll`, `d` in any case) whose
/// apostrophe ends at byte `i`.
pub(super) fn contraction_end(text: &str, i: usize) -> Option<usize> {
    Scan { text }.contraction(i)
}

/// Iterator over the pieces of one text; see [`Pattern::pieces`].
pub(crate) struct Pieces<'a> {
    pattern: Pattern,
    text: &'a str,
    at: usize,
}

impl Iterator for Pieces<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if self.at >= self.text.len() {
            return None;
        }
        let start = self.at;
        self.at = self.pattern.next_end(self.text, start);
        Some((start, self.at))
    }
}

fn is_newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Class {
    /// `\p{L}`
    Letter = 0,
    /// `\p{N}`
    Number = 1,
    /// `\s` (Unicode `White_Space`)
    Space = 2,
    /// Anything else.
    Other = 3,
}

struct Scan<'a> {
    text: &'a str,
}

impl Scan<'_> {
    /// The character at byte `i` (a char boundary before the end), its class, and where it ends.
    #[inline]
    fn at(&self, i: usize) -> (char, Class, usize) {
        let bytes = self.text.as_bytes();
        let b = bytes[i];
        if b < 0x80 {
            return (b as char, ASCII[b as usize], i + 1);
        }
        let c = self.text[i..].chars().next().unwrap_or('\u{FFFD}');
        (c, classify(c), i + c.len_utf8())
    }

    /// The end of the run of `class` characters starting at byte `i`.
    #[inline]
    fn run(&self, mut i: usize, class: Class) -> usize {
        let bytes = self.text.as_bytes();
        while i < bytes.len() {
            let b = bytes[i];
            if b < 0x80 {
                if ASCII[b as usize] != class {
                    break;
                }
                i += 1;
            } else {
                let (_, c, end) = self.at(i);
                if c != class {
                    break;
                }
                i = end;
            }
        }
        i
    }

    /// The end of a contraction whose apostrophe ends at `i`, matched exactly (GPT-2's
    /// alternatives carry no `(?i:…)`).
    fn exact_contraction(&self, i: usize) -> Option<usize> {
        let rest = &self.text.as_bytes()[i..];
        match rest {
            [b's' | b't' | b'm' | b'd', ..] => Some(i + 1),
            [b'r' | b'v', b'e', ..] | [b'l', b'l', ..] => Some(i + 2),
            _ => None,
        }
    }

    /// The end of a contraction whose apostrophe ends at `i`, matched case-insensitively with
    /// Unicode simple case folding (so `ſ`, U+017F, counts as `s`).
    fn contraction(&self, i: usize) -> Option<usize> {
        let rest = &self.text[i..];
        let mut chars = rest.chars();
        let first = chars.next()?;
        let second = chars.next();
        let fold = |c: char| match c {
            'ſ' => 's',
            c => c.to_ascii_lowercase(),
        };
        let end_one = i + first.len_utf8();
        match fold(first) {
            's' | 't' | 'm' | 'd' => Some(end_one),
            'r' | 'v' if second.map(fold) == Some('e') => Some(end_one + 1),
            'l' if second.map(fold) == Some('l') => Some(end_one + 1),
            _ => None,
        }
    }
}

const ASCII: [Class; 128] = {
    let mut table = [Class::Other; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        table[b] = if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if matches!(c, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r') {
            Class::Space
        } else {
            Class::Other
        };
        b += 1;
    }
    table
};

/// A value per code point from one-class regexes (later ones win): an array over the Basic
/// Multilingual Plane, sorted ranges above it.
pub(super) struct CodePointTable<T> {
    bmp: Vec<T>,
    astral: Vec<(u32, u32, T)>,
    default: T,
}

impl<T: Copy> CodePointTable<T> {
    pub(super) fn new(default: T, classes: &[(T, &str)]) -> Self {
        let mut bmp = vec![default; 0x10000];
        let mut astral = Vec::new();
        for &(value, regex) in classes {
            for (start, end) in unicode_ranges(regex) {
                for cp in start..=end.min(0xFFFF) {
                    bmp[cp as usize] = value;
                }
                if end > 0xFFFF {
                    astral.push((start.max(0x10000), end, value));
                }
            }
        }
        // Above the BMP the ranges of different classes never overlap (general categories are
        // disjoint and every `\s` character is in the BMP), so one sorted list answers.
        astral.sort_unstable_by_key(|&(start, _, _)| start);
        Self {
            bmp,
            astral,
            default,
        }
    }

    #[inline]
    pub(super) fn get(&self, c: char) -> T {
        let cp = u32::from(c);
        if cp <= 0xFFFF {
            return self.bmp[cp as usize];
        }
        let idx = self.astral.partition_point(|&(start, _, _)| start <= cp);
        match idx.checked_sub(1).map(|k| self.astral[k]) {
            Some((_, end, value)) if cp <= end => value,
            _ => self.default,
        }
    }
}

fn tables() -> &'static CodePointTable<Class> {
    static TABLES: OnceLock<CodePointTable<Class>> = OnceLock::new();
    TABLES.get_or_init(|| {
        CodePointTable::new(
            Class::Other,
            &[
                (Class::Letter, r"\p{L}"),
                (Class::Number, r"\p{N}"),
                (Class::Space, r"\s"),
            ],
        )
    })
}

/// The code point ranges of a one-class regex, from the same Unicode tables the regex engine
/// uses; empty if `regex-syntax` ever stops reading it as one Unicode class.
pub(super) fn unicode_ranges(regex: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    match regex_syntax::parse(regex).map(|hir| hir.into_kind()) {
        Ok(HirKind::Class(HirClass::Unicode(class))) => class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect(),
        _ => Vec::new(),
    }
}

/// Whether the Unicode tables loaded as expected (each class non-empty).
pub(crate) fn tables_ready() -> bool {
    [r"\p{L}", r"\p{N}", r"\s"]
        .iter()
        .all(|r| !unicode_ranges(r).is_empty())
}

fn classify(c: char) -> Class {
    tables().get(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pattern: &str, text: &str) -> Vec<String> {
        let p = Pattern::recognise(pattern).unwrap_or_else(|| panic!("unknown pattern"));
        p.pieces(text).map(|(a, b)| text[a..b].to_owned()).collect()
    }

    #[test]
    fn splits_like_the_regex_on_hand_picked_cases() {
        let q = QWEN2_REGEX;
        assert_eq!(split(q, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            split(q, "I'm here, it'S ok'll"),
            ["I", "'m", " here", ",", " it", "'S", " ok", "'ll"]
        );
        assert_eq!(split(q, "a   b"), ["a", "  ", " b"]);
        assert_eq!(split(q, "a  1"), ["a", " ", " ", "1"]);
        assert_eq!(split(q, "x\n   foo"), ["x", "\n", "  ", " foo"]);
        assert_eq!(split(q, "x.\n\nfoo  "), ["x", ".\n\n", "foo", "  "]);
        assert_eq!(split(q, "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(split(CL100K_REGEX, "12345"), ["123", "45"]);
        assert_eq!(split(q, " .x \t.y"), [" .", "x", " ", "\t", ".y"]);
        assert_eq!(split(q, "'ſ 'x"), ["'ſ", " '", "x"]);
        assert_eq!(split(q, "你好，世界"), ["你好", "，世界"]);
    }

    /// tiktoken's `\s++$`: a whitespace run reaching the end of the text stays whole. (In
    /// cl100k's ids this rarely shows: few tokens end in a newline then other whitespace.)
    #[test]
    fn tiktoken_cl100k_keeps_trailing_whitespace_whole() {
        let tiktoken = Pattern::tiktoken_cl100k();
        let pieces = |text: &'static str| -> Vec<&'static str> {
            tiktoken.pieces(text).map(|(a, b)| &text[a..b]).collect()
        };
        assert_eq!(pieces("x \n  "), ["x", " \n  "]);
        assert_eq!(pieces("x \n  y"), ["x", " \n", " ", " y"]);
        assert_eq!(split(CL100K_REGEX, "x \n  "), ["x", " \n", "  "]);
    }

    #[test]
    fn gpt2_splits_like_the_regex_on_hand_picked_cases() {
        let g = GPT2_REGEX;
        assert_eq!(split(g, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            split(g, "I'm here, it'S ok'll"),
            ["I", "'m", " here", ",", " it", "'", "S", " ok", "'ll"]
        );
        assert_eq!(split(g, "a   b"), ["a", "  ", " b"]);
        assert_eq!(split(g, "a \tb"), ["a", " ", "\t", "b"]);
        assert_eq!(split(g, " 12345x"), [" 12345", "x"]);
        assert_eq!(split(g, "x\n   foo"), ["x", "\n  ", " foo"]);
        assert_eq!(split(g, "x.\n\nfoo  "), ["x", ".", "\n", "\n", "foo", "  "]);
        assert_eq!(split(g, " .x \t.y"), [" .", "x", " ", "\t", ".", "y"]);
        assert_eq!(split(g, " 'sx"), [" '", "sx"]);
        assert_eq!(split(g, "你好，世界"), ["你好", "，", "世界"]);
    }

    #[test]
    fn unicode_tables_load() {
        assert!(tables_ready());
        assert_eq!(classify('é'), Class::Letter);
        assert_eq!(classify('\u{3000}'), Class::Space);
        assert_eq!(classify('\u{1F600}'), Class::Other);
        assert_eq!(classify('\u{20000}'), Class::Letter);
        assert_eq!(classify('\u{0301}'), Class::Other);
    }

    #[test]
    fn unknown_patterns_are_not_recognised() {
        assert!(Pattern::recognise(r"\s+").is_none());
        assert!(Pattern::recognise(&format!("{QWEN2_REGEX} ")).is_none());
    }
}
