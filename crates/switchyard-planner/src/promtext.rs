//! Reading the figures the planner needs out of a gateway's Prometheus text exposition (parsed
//! by the workspace's one reader, `switchyard_core::promtext`).
//!
//! Only what the planner reads is kept: counters and gauges by name (summed over their label
//! sets) and histograms as cumulative `le` buckets. Lines that do not parse are skipped: a
//! gateway of a newer version may export series this one does not know.

use std::collections::BTreeMap;

/// Samples of one scrape: metric name (with suffix) → summed value; histogram name → buckets.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    pub values: BTreeMap<String, f64>,
    /// Cumulative bucket counts by upper bound (`+Inf` as `f64::INFINITY`), per histogram.
    pub buckets: BTreeMap<String, Vec<(f64, f64)>>,
}

impl Scrape {
    pub fn parse(text: &str) -> Self {
        let mut scrape = Self::default();
        for sample in switchyard_core::promtext::parse(text) {
            if let Some(hist) = sample.name.strip_suffix("_bucket") {
                let Some(le) = sample.label("le").and_then(parse_bound) else {
                    continue;
                };
                let buckets = scrape.buckets.entry(hist.to_owned()).or_default();
                match buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some((_, count)) => *count += sample.value,
                    None => buckets.push((le, sample.value)),
                }
            } else {
                *scrape.values.entry(sample.name).or_default() += sample.value;
            }
        }
        for buckets in scrape.buckets.values_mut() {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        scrape
    }

    pub fn value(&self, name: &str) -> f64 {
        self.values.get(name).copied().unwrap_or(0.0)
    }

    /// Adds another gateway's scrape (same metric set) to this one.
    pub fn add(&mut self, other: &Scrape) {
        for (name, v) in &other.values {
            *self.values.entry(name.clone()).or_default() += v;
        }
        for (name, theirs) in &other.buckets {
            let ours = self.buckets.entry(name.clone()).or_default();
            for (le, count) in theirs {
                match ours.iter_mut().find(|(b, _)| b == le) {
                    Some((_, c)) => *c += count,
                    None => ours.push((*le, *count)),
                }
            }
            ours.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }

    /// `self − earlier` for every counter and bucket (what happened between two scrapes).
    /// A counter that went down (a gateway restarted) counts from zero.
    pub fn since(&self, earlier: &Scrape) -> Scrape {
        let delta = |now: f64, then: f64| if now >= then { now - then } else { now };
        let values = self
            .values
            .iter()
            .map(|(k, v)| (k.clone(), delta(*v, earlier.value(k))))
            .collect();
        let buckets = self
            .buckets
            .iter()
            .map(|(name, now)| {
                let then = earlier.buckets.get(name);
                let diff = now
                    .iter()
                    .map(|(le, c)| {
                        let before = then
                            .and_then(|t| t.iter().find(|(b, _)| b == le))
                            .map_or(0.0, |(_, c)| *c);
                        (*le, delta(*c, before))
                    })
                    .collect();
                (name.clone(), diff)
            })
            .collect();
        Scrape { values, buckets }
    }

    /// The `q` quantile of a histogram, interpolated linearly inside its bucket; `None`
    /// without observations.
    pub fn quantile(&self, histogram: &str, q: f64) -> Option<f64> {
        let buckets = self.buckets.get(histogram)?;
        let total = buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower = (0.0, 0.0);
        for &(le, count) in buckets {
            if count >= rank {
                if le.is_infinite() {
                    // Past the last finite bound: the bound is all that is known.
                    return Some(lower.0);
                }
                let span = count - lower.1;
                let frac = if span > 0.0 {
                    (rank - lower.1) / span
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * frac);
            }
            lower = (le, count);
        }
        Some(lower.0)
    }
}

fn parse_bound(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const TEXT: &str = r#"# HELP switchyard_requests HTTP requests
# TYPE switchyard_requests counter
switchyard_requests_total{endpoint="chat",status="ok"} 7
switchyard_requests_total{endpoint="completions",status="ok"} 3
switchyard_requests_queued 2
switchyard_time_to_first_token_seconds_sum 1.5
switchyard_time_to_first_token_seconds_count 10
switchyard_time_to_first_token_seconds_bucket{le="0.1"} 2
switchyard_time_to_first_token_seconds_bucket{le="0.2"} 8
switchyard_time_to_first_token_seconds_bucket{le="+Inf"} 10
garbage line
# EOF
"#;

    #[test]
    fn counters_are_summed_over_labels_and_histograms_kept() {
        let s = Scrape::parse(TEXT);
        assert_eq!(s.value("switchyard_requests_total"), 10.0);
        assert_eq!(s.value("switchyard_requests_queued"), 2.0);
        assert_eq!(
            s.value("switchyard_time_to_first_token_seconds_count"),
            10.0
        );
        let q = s
            .quantile("switchyard_time_to_first_token_seconds", 0.5)
            .unwrap();
        assert!((q - 0.15).abs() < 1e-9, "{q}");
        // The top 20 % lie past the last finite bound.
        assert_eq!(
            s.quantile("switchyard_time_to_first_token_seconds", 0.99),
            Some(0.2)
        );
        assert_eq!(s.quantile("missing", 0.5), None);
    }

    #[test]
    fn deltas_between_scrapes_and_sums_across_gateways() {
        let before = Scrape::parse(TEXT);
        let after = Scrape::parse(
            &TEXT
                .replace("} 7", "} 17")
                .replace("le=\"0.1\"} 2", "le=\"0.1\"} 12")
                .replace("le=\"0.2\"} 8", "le=\"0.2\"} 18")
                .replace("le=\"+Inf\"} 10", "le=\"+Inf\"} 20"),
        );
        let d = after.since(&before);
        assert_eq!(d.value("switchyard_requests_total"), 10.0);
        assert!(
            d.quantile("switchyard_time_to_first_token_seconds", 0.5)
                .unwrap()
                <= 0.1
        );
        let mut both = before.clone();
        both.add(&after);
        assert_eq!(both.value("switchyard_requests_total"), 30.0);
        // A restarted gateway's counters count from zero rather than going negative.
        let restarted = before.since(&after);
        assert_eq!(restarted.value("switchyard_requests_total"), 10.0);
    }
}
