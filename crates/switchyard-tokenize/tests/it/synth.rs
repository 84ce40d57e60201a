//! Deterministic synthetic text for session tests: words per (seed, id) that mix ASCII,
//! code punctuation, digits, whitespace runs and multi-byte UTF-8.

/// SplitMix64: a fixed, portable pseudo-random sequence.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

pub fn seed_of(parts: &[&[u8]]) -> u64 {
    // FNV-1a over the parts: stable across runs and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const SYLLABLES: [&str; 16] = [
    "ka", "ro", "ten", "s", "ing", "ex", "port", "al", "fn", "mut", "str", "ue", "qu", "ion", "de",
    "ll",
];
const CODE: [&str; 20] = [
    "(", ")", "{", "}", "::", "->", "=>", "==", "&&", "//", ";", ",", "[0]", "\"", "'s", "'t",
    "</", "/>", "#[", "!=",
];
const WIDE: [&str; 12] = [
    "数据",
    "中文",
    "café",
    "naïve",
    "🦀",
    "🚀",
    "ñ",
    "—",
    "é",
    "日本語",
    "👨‍👩‍👧",
    "Ω",
];
const SPACES: [&str; 6] = [" ", "  ", "\n", "\n    ", "\t", "\n\n"];

/// `words` pseudo-random words for `rng`, each preceded by a separator.
pub fn words(rng: &mut Rng, words: usize) -> String {
    let mut out = String::new();
    for _ in 0..words {
        let kind = rng.below(20);
        out.push_str(if kind < 14 {
            " "
        } else {
            SPACES[rng.below(SPACES.len())]
        });
        match rng.below(10) {
            0..=4 => {
                for _ in 0..=rng.below(3) {
                    out.push_str(SYLLABLES[rng.below(SYLLABLES.len())]);
                }
                if rng.below(3) == 0 {
                    out.push_str(CODE[rng.below(CODE.len())]);
                }
            }
            5 | 6 => out.push_str(CODE[rng.below(CODE.len())]),
            7 => out.push_str(&(rng.next() % 100_000).to_string()),
            _ => out.push_str(WIDE[rng.below(WIDE.len())]),
        }
    }
    out
}
