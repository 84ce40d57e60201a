//! The completion tokens an engine reports in a response the proxy streams through the picker:
//! the `usage` object of a JSON answer, or of the usage chunk that ends a stream. The picker
//! charges them to the tenant's token quota; a response that reports none is charged the bound
//! it was allowed (`max_tokens`), so a client cannot slip past a token limit by asking for no
//! usage.

/// The key whose value is read; its last occurrence in the response wins (a stream's final
/// usage chunk follows any per-chunk usage).
const KEY: &[u8] = b"\"completion_tokens\"";
/// The most bytes kept from one chunk for the next: a key or number split between chunks is
/// read whole, and a body that never completes one cannot grow the carry.
const MAX_CARRY: usize = 256;

/// Scans response body chunks for the engine's count of completion tokens.
#[derive(Debug, Default)]
pub struct UsageScan {
    /// The end of the previous chunk, scanned again with the next one.
    carry: Vec<u8>,
    reported: Option<u64>,
}

impl UsageScan {
    /// Reads one chunk of the response body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut window = std::mem::take(&mut self.carry);
        window.extend_from_slice(chunk);
        let mut at = 0;
        while let Some(found) = find(&window[at..], KEY) {
            let key = at + found;
            let value = key + KEY.len();
            match number_after_colon(&window[value..]) {
                Some(Parsed::Value(n)) => self.reported = Some(n),
                Some(Parsed::Incomplete) => {
                    if window.len() - key <= MAX_CARRY {
                        self.carry = window[key..].to_vec();
                    }
                    return;
                }
                None => {}
            }
            at = value;
        }
        // A key may begin in this chunk's last bytes and end in the next one.
        let tail = window.len().saturating_sub(KEY.len() - 1).max(at);
        self.carry = window[tail..].to_vec();
    }

    /// The completion tokens the response reported, if it reported any.
    pub fn completion_tokens(&self) -> Option<u64> {
        self.reported
    }
}

enum Parsed {
    Value(u64),
    /// The chunk ended inside the number (or before it): the next chunk completes it.
    Incomplete,
}

/// `: 123` after a key, with optional whitespace; None when something else follows.
fn number_after_colon(bytes: &[u8]) -> Option<Parsed> {
    let mut i = 0;
    let skip_space = |i: &mut usize| {
        while bytes.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    skip_space(&mut i);
    match bytes.get(i) {
        None => return Some(Parsed::Incomplete),
        Some(b':') => i += 1,
        Some(_) => return None,
    }
    skip_space(&mut i);
    let digits = bytes[i.min(bytes.len())..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if i + digits == bytes.len() {
        return Some(Parsed::Incomplete);
    }
    if digits == 0 {
        return None;
    }
    std::str::from_utf8(&bytes[i..i + digits])
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Parsed::Value)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Option<u64> {
        let mut scan = UsageScan::default();
        for chunk in chunks {
            scan.feed(chunk);
        }
        scan.completion_tokens()
    }

    #[test]
    fn reads_usage_from_json_and_streams_split_anywhere() {
        let json = br#"{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":9,"completion_tokens": 412,"total_tokens":421}}"#;
        assert_eq!(scan(&[json]), Some(412));
        // Every split point of the body, in two chunks, reads the same.
        for cut in 0..json.len() {
            assert_eq!(
                scan(&[&json[..cut], &json[cut..]]),
                Some(412),
                "cut at {cut}"
            );
        }
        // Byte by byte.
        let bytes: Vec<&[u8]> = json.chunks(1).collect();
        assert_eq!(scan(&bytes), Some(412));
        // A stream's last usage chunk wins over earlier per-chunk usage.
        let stream = b"data: {\"usage\":{\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"completion_tokens\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(scan(&[stream]), Some(7));
    }

    #[test]
    fn a_response_without_usage_reports_none_and_garbage_is_bounded() {
        assert_eq!(
            scan(&[b"data: {\"choices\":[]}\n\n", b"data: [DONE]"]),
            None
        );
        assert_eq!(scan(&[br#"{"completion_tokens":"many"}"#]), None);
        let mut scan = UsageScan::default();
        scan.feed(br#"{"completion_tokens": "#);
        for _ in 0..10_000 {
            scan.feed(b"9");
        }
        assert!(scan.carry.len() <= MAX_CARRY, "{}", scan.carry.len());
        assert_eq!(scan.completion_tokens(), None);
    }
}
