//! Server-sent events, decoded: the workspace's one reader of `text/event-stream` (the engine
//! adapter reads vLLM's and SGLang's streams, the live replayer and the tests read the
//! gateway's). Events end at a blank line (`\n\n`, `\r\n\r\n` or `\r\r`); an event's `data:`
//! lines are joined with `\n`, one space after the colon dropped, as the HTML standard says.

/// An incremental decoder: feed it the stream's bytes as they come.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `bytes`; returns the data of every event they complete (events without data,
    /// such as comments or bare `event:` lines, give nothing).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, separator)) = event_end(&self.buffer) {
            let event: Vec<u8> = self.buffer.drain(..end + separator).take(end).collect();
            if let Some(data) = data_of(&String::from_utf8_lossy(&event)) {
                out.push(data);
            }
        }
        out
    }

    /// The end of the stream: the data of a last event that had no blank line after it.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.buffer);
        data_of(&String::from_utf8_lossy(&rest))
    }
}

/// Every event's data in a whole stream's `text`.
pub fn events(text: &str) -> Vec<String> {
    let mut decoder = SseDecoder::new();
    let mut out = decoder.push(text.as_bytes());
    out.extend(decoder.finish());
    out
}

/// The first blank line in `buf`: where the event before it ends and how long the separator is.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    (0..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if rest.starts_with(b"\n\n") || rest.starts_with(b"\r\r") {
            Some((i, 2))
        } else {
            None
        }
    })
}

/// The data of one event's lines, `None` when it has none.
fn data_of(event: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.split(['\n', '\r']) {
        let value = match line.strip_prefix("data") {
            Some("") => "",
            Some(rest) => match rest.strip_prefix(':') {
                Some(value) => value.strip_prefix(' ').unwrap_or(value),
                None => continue,
            },
            None => continue,
        };
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(value);
            }
            None => data = Some(value.to_owned()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_pushes_and_every_line_ending() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: {\"a\"").is_empty());
        assert_eq!(d.push(b":1}\n\ndata: x\r\n\r\n"), ["{\"a\":1}", "x"]);
        assert_eq!(d.push(b": comment\n\nevent: ping\n\ndata:y\r\r"), ["y"]);
        assert_eq!(d.push(b"data: one\ndata: two\n\n"), ["one\ntwo"]);
        assert!(d.push(b"data: [DONE]").is_empty());
        assert_eq!(d.finish().as_deref(), Some("[DONE]"));
        assert_eq!(d.finish(), None);
    }

    #[test]
    fn a_whole_stream() {
        assert_eq!(
            events("data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"),
            ["1", "2", "[DONE]"]
        );
        assert_eq!(events("datax: no\n\n"), Vec::<String>::new());
    }
}
