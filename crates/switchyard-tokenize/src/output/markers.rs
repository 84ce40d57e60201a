//! The hold-back rule: text may be emitted up to where a marker could still begin.

/// How many leading bytes of `buf` can be emitted without cutting a marker in `markers` that the
/// next piece of text could complete: all of it, less the longest suffix that is a proper
/// prefix of some marker.
pub(crate) fn safe_len(buf: &str, markers: &[&str]) -> usize {
    let mut keep = 0;
    for marker in markers {
        let longest = marker.len().saturating_sub(1).min(buf.len());
        for k in (keep + 1..=longest).rev() {
            let at = buf.len() - k;
            if buf.is_char_boundary(at) && marker.starts_with(&buf[at..]) {
                keep = k;
                break;
            }
        }
    }
    buf.len() - keep
}

/// The first of `markers` found in `buf`: (byte offset, the marker).
pub(crate) fn find_first<'m>(buf: &str, markers: &[&'m str]) -> Option<(usize, &'m str)> {
    markers
        .iter()
        .filter_map(|m| buf.find(m).map(|at| (at, *m)))
        .min_by_key(|(at, _)| *at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_only_a_possible_marker_start() {
        assert_eq!(safe_len("hello <to", &["<tool_call>"]), 6);
        assert_eq!(safe_len("hello <", &["<tool_call>"]), 6);
        assert_eq!(safe_len("hello", &["<tool_call>"]), 5);
        assert_eq!(safe_len("a <x", &["<tool_call>"]), 4);
        // The longest candidate over several markers wins.
        assert_eq!(safe_len("ab</thi", &["</think>", "<t"]), 2);
        // Multi-byte markers are cut only at character boundaries.
        assert_eq!(safe_len("x<｜tool", &["<｜tool▁calls▁begin｜>"]), 1);
    }

    #[test]
    fn finds_the_earliest_marker() {
        assert_eq!(find_first("a[B]c[A]", &["[A]", "[B]"]), Some((1, "[B]")));
        assert_eq!(find_first("abc", &["[A]"]), None);
    }
}
