//! The Prometheus text exposition format, parsed: the workspace's one reader of it (the
//! worker's engine adapter reads vLLM's and SGLang's `/metrics`, the planner reads gateways').
//! Lenient: lines that do not parse are skipped, since a newer exporter may add series this
//! reader does not know.

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses the Prometheus text format; lines that do not parse are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = line[open..].rfind('}')? + open;
            (
                &line[..open],
                parse_labels(&line[open + 1..close]),
                &line[close + 1..],
            )
        }
        None => {
            let (name, rest) = line.split_once(char::is_whitespace)?;
            (name, Vec::new(), rest)
        }
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.trim().to_owned(),
        labels,
        value,
    })
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_owned();
        let after = rest[eq + 1..].trim_start();
        let Some(body) = after.strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut chars = body.char_indices();
        let mut end = body.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.push((key, value));
        rest = &body[end.min(body.len())..];
    }
    labels
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_labels_escapes_values_and_garbage() {
        let samples = parse(
            "# HELP x\n# TYPE x counter\nx_total{a=\"1\",b=\"q\\\"uote\\n\"} 7\nplain 2.5 1700000000\nh_bucket{le=\"+Inf\"} 3\ngarbage line\nbad{a=\"1\"} notanumber\n",
        );
        assert_eq!(samples.len(), 3, "{samples:?}");
        assert_eq!(samples[0].name, "x_total");
        assert_eq!(samples[0].label("a"), Some("1"));
        assert_eq!(samples[0].label("b"), Some("q\"uote\n"));
        assert_eq!(samples[0].value, 7.0);
        assert_eq!(samples[1].name, "plain");
        assert_eq!(samples[1].value, 2.5);
        assert_eq!(samples[2].label("le"), Some("+Inf"));
        assert_eq!(samples[2].value, 3.0);
    }
}
