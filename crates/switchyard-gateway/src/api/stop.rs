//! Stop strings, applied to the detokenized text as it streams.
//!
//! Text that might be the start of a stop string is held back until the next piece decides it,
//! so a stream never shows the client part of a stop string, and what it does show is exactly
//! what a non-streamed answer would contain.

/// Streams text through a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    longest: usize,
    /// Keep the matched stop string at the end of the text (vLLM's
    /// `include_stop_str_in_output`).
    include_stop: bool,
}

/// What to do with a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Emit this text (possibly empty) and continue.
    Continue(String),
    /// Emit this text, then stop: a stop string matched.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            held: String::new(),
            longest,
            include_stop: false,
        }
    }

    /// The same matcher, keeping a matched stop string in the text when `include`.
    pub fn including_the_stop(mut self, include: bool) -> Self {
        self.include_stop = include;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(text.to_owned());
        }
        self.held.push_str(text);
        // The earliest match of any stop string ends the text.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s.len())))
            .min();
        if let Some((at, len)) = hit {
            let end = if self.include_stop { at + len } else { at };
            let out = self.held[..end].to_owned();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        // Keep back the longest suffix that could still start a stop string.
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// The generation ended by itself: release what was held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn partial_suffix_len(&self) -> usize {
        let max = self.longest.saturating_sub(1).min(self.held.len());
        for len in (1..=max).rev() {
            let start = self.held.len() - len;
            if !self.held.is_char_boundary(start) {
                continue;
            }
            let suffix = &self.held[start..];
            if self.stops.iter().any(|s| s.starts_with(suffix)) {
                return len;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_caught_and_never_shown() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["END"], &["EN", "x"]), ("ENx".into(), false));
        assert_eq!(run(&["END"], &["abc", "EN"]), ("abcEN".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["b", "ab"], &["xxab"]), ("xx".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&["日本"], &["日", "x"]), ("日x".into(), false));
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn the_stop_string_is_kept_when_asked() {
        let mut m = StopMatcher::new(vec!["END".into()]).including_the_stop(true);
        assert_eq!(m.push("abc EN"), StopOutcome::Continue("abc ".into()));
        assert_eq!(m.push("D tail"), StopOutcome::Stopped("END".into()));
    }
}
