//! Where `kv` stands in one sweep cell: each other policy's cache hit rate and TTFT p99 against
//! kv's, with a tie band so that noise of a request or two is not called a loss.
//!
//! A figure is *behind* another when the other is better by more than `tie` of the larger of
//! the two (`(high - low) / high > tie`: the better hit rate, the worse TTFT): the same band
//! whichever of the two is kv's, and never a division by zero. kv is behind on a metric when any other policy beats it
//! that way; ahead when it beats every other policy that way; tied otherwise. The cell
//! *trails* when kv is behind on either metric, *leads* when it is behind on neither and
//! ahead on at least one, and *ties* when it is level with the best other on both.

use serde::Serialize;

use crate::metrics::Summary;

/// A figure the sweep compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Prompt tokens served from cache / prompt tokens: higher is better.
    HitRate,
    /// 99th-percentile time to first token, in ms: lower is better. A run that completed no
    /// request has none and is worse than any run that did.
    TtftP99,
}

impl Metric {
    pub const ALL: [Metric; 2] = [Metric::HitRate, Metric::TtftP99];

    pub fn as_str(self) -> &'static str {
        match self {
            Metric::HitRate => "hit rate",
            Metric::TtftP99 => "TTFT p99",
        }
    }

    /// The run's figure, `None` for a TTFT p99 of a run that completed nothing.
    pub fn of(self, run: &Summary) -> Option<f64> {
        match self {
            Metric::HitRate => Some(run.cache_hit_rate),
            Metric::TtftP99 => (run.requests_completed > 0).then_some(run.ttft_ms.p99),
        }
    }

    /// How far `ours` is behind `theirs`, as a share of the larger of the two (0 when ours is
    /// as good or better; 1 when ours is missing and theirs is not).
    pub fn shortfall(self, ours: Option<f64>, theirs: Option<f64>) -> f64 {
        match (ours, theirs) {
            (Some(ours), Some(theirs)) => {
                // Theirs beats ours when `high > low`: a higher hit rate, a lower TTFT. The
                // gap is a share of the larger figure, which is the better hit rate and the
                // worse TTFT alike.
                let (high, low) = match self {
                    Metric::HitRate => (theirs, ours),
                    Metric::TtftP99 => (ours, theirs),
                };
                if high > low { (high - low) / high } else { 0.0 }
            }
            (None, Some(_)) => 1.0,
            (_, None) => 0.0,
        }
    }
}

/// kv's place on one metric among the cell's policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Standing {
    Ahead,
    Tie,
    Behind,
}

/// A cell's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Leads,
    Ties,
    Trails,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Leads => "leads",
            Verdict::Ties => "ties",
            Verdict::Trails => "trails",
        }
    }
}

/// One policy that beats kv on one metric beyond the tie band.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Beaten {
    pub policy: String,
    pub metric: Metric,
    /// kv's figure (hit rate in [0, 1], TTFT p99 in ms; `None`: kv completed nothing).
    pub kv: Option<f64>,
    /// The other policy's figure, in the same unit.
    pub other: Option<f64>,
    /// How far kv is behind, as a share of the larger figure (more than the tie band).
    pub margin: f64,
}

/// kv's standing in one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judgement {
    pub verdict: Verdict,
    pub hit_rate: Standing,
    pub ttft_p99: Standing,
    /// Every (policy, metric) that beats kv, by metric then by margin, largest first.
    pub behind: Vec<Beaten>,
}

/// Judges `reference`'s run (kv's) against `others` with a tie band of `tie`.
pub fn judge(reference: &Summary, others: &[&Summary], tie: f64) -> Judgement {
    let mut behind = Vec::new();
    let mut standings = [Standing::Tie; 2];
    for (metric, standing) in Metric::ALL.into_iter().zip(&mut standings) {
        let ours = metric.of(reference);
        let mut beats_all = !others.is_empty();
        let mut beaten: Vec<Beaten> = Vec::new();
        for other in others {
            let theirs = metric.of(other);
            let margin = metric.shortfall(ours, theirs);
            if margin > tie {
                beaten.push(Beaten {
                    policy: other.label.clone(),
                    metric,
                    kv: ours,
                    other: theirs,
                    margin,
                });
            }
            if metric.shortfall(theirs, ours) <= tie {
                beats_all = false;
            }
        }
        beaten.sort_by(|a, b| b.margin.total_cmp(&a.margin));
        *standing = if !beaten.is_empty() {
            Standing::Behind
        } else if beats_all {
            Standing::Ahead
        } else {
            Standing::Tie
        };
        behind.extend(beaten);
    }
    let [hit_rate, ttft_p99] = standings;
    let verdict = if standings.contains(&Standing::Behind) {
        Verdict::Trails
    } else if standings.contains(&Standing::Ahead) {
        Verdict::Leads
    } else {
        Verdict::Ties
    };
    Judgement {
        verdict,
        hit_rate,
        ttft_p99,
        behind,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::metrics::Percentiles;

    fn run(label: &str, hit: f64, p99_ms: f64) -> Summary {
        let mut s = Summary::from_records(label, 1.0, 4, 0, &[]);
        s.cache_hit_rate = hit;
        s.ttft_ms = Percentiles {
            p99: p99_ms,
            ..Percentiles::default()
        };
        s.requests_completed = 10;
        s
    }

    fn verdict(kv: &Summary, others: &[Summary]) -> Judgement {
        let refs: Vec<&Summary> = others.iter().collect();
        judge(kv, &refs, 0.02)
    }

    #[test]
    fn within_two_percent_of_the_better_figure_is_a_tie() {
        let kv = run("kv", 0.500, 1000.0);
        // 0.509 is 1.8 % above 0.5; 981 ms is 1.9 % below 1000 ms.
        let j = verdict(&kv, &[run("approx-kv", 0.509, 981.0)]);
        assert_eq!(j.verdict, Verdict::Ties);
        assert_eq!((j.hit_rate, j.ttft_p99), (Standing::Tie, Standing::Tie));
        assert!(j.behind.is_empty());
    }

    #[test]
    fn a_better_hit_rate_anywhere_makes_kv_trail_and_names_every_policy_that_beats_it() {
        let kv = run("kv", 0.119, 189_700.0);
        let j = verdict(
            &kv,
            &[
                run("approx-kv", 0.152, 174_000.0),
                run("dynamo-kv", 0.113, 191_800.0),
                run("sglang-ca", 0.192, 168_500.0),
            ],
        );
        assert_eq!(j.verdict, Verdict::Trails);
        assert_eq!(
            (j.hit_rate, j.ttft_p99),
            (Standing::Behind, Standing::Behind)
        );
        let named: Vec<(&str, Metric)> = j
            .behind
            .iter()
            .map(|b| (b.policy.as_str(), b.metric))
            .collect();
        assert_eq!(
            named,
            [
                ("sglang-ca", Metric::HitRate),
                ("approx-kv", Metric::HitRate),
                ("sglang-ca", Metric::TtftP99),
                ("approx-kv", Metric::TtftP99),
            ]
        );
        let top = &j.behind[0];
        assert!((top.margin - (0.192 - 0.119) / 0.192).abs() < 1e-12);
        assert_eq!((top.kv, top.other), (Some(0.119), Some(0.192)));
        let tail = &j.behind[2];
        assert!((tail.margin - (189_700.0 - 168_500.0) / 189_700.0).abs() < 1e-12);
    }

    #[test]
    fn kv_leads_when_it_beats_every_other_on_one_metric_and_ties_the_other() {
        let kv = run("kv", 0.526, 10_000.0);
        let j = verdict(
            &kv,
            &[
                run("approx-kv", 0.439, 10_100.0),
                run("sglang-ca", 0.40, 9_900.0),
            ],
        );
        assert_eq!(j.verdict, Verdict::Leads);
        assert_eq!((j.hit_rate, j.ttft_p99), (Standing::Ahead, Standing::Tie));
    }

    #[test]
    fn beating_some_but_tying_one_is_not_ahead() {
        let kv = run("kv", 0.50, 10_000.0);
        let j = verdict(
            &kv,
            &[
                run("approx-kv", 0.30, 20_000.0),
                run("sglang-ca", 0.495, 9_990.0),
            ],
        );
        assert_eq!(j.verdict, Verdict::Ties);
    }

    #[test]
    fn lower_ttft_is_better_and_higher_hit_is_better() {
        let kv = run("kv", 0.30, 5_000.0);
        let worse_tail = verdict(&kv, &[run("other", 0.30, 8_000.0)]);
        assert_eq!(worse_tail.ttft_p99, Standing::Ahead);
        let better_tail = verdict(&kv, &[run("other", 0.30, 3_000.0)]);
        assert_eq!(better_tail.ttft_p99, Standing::Behind);
        assert_eq!(better_tail.verdict, Verdict::Trails);
        let lower_hit = verdict(&kv, &[run("other", 0.20, 5_000.0)]);
        assert_eq!(lower_hit.hit_rate, Standing::Ahead);
    }

    #[test]
    fn zeros_and_runs_that_completed_nothing_are_judged_without_dividing_by_zero() {
        let kv = run("kv", 0.0, 0.0);
        let j = verdict(&kv, &[run("other", 0.0, 0.0)]);
        assert_eq!(j.verdict, Verdict::Ties);
        let j = verdict(&kv, &[run("other", 0.01, 0.0)]);
        assert_eq!(j.hit_rate, Standing::Behind);
        assert_eq!(j.behind[0].margin, 1.0);

        let mut nothing = run("kv", 0.2, 0.0);
        nothing.requests_completed = 0;
        let j = verdict(&nothing, &[run("other", 0.2, 90_000.0)]);
        assert_eq!(j.ttft_p99, Standing::Behind, "{j:?}");
        assert_eq!(j.behind[0].kv, None);
        let j = verdict(&run("kv", 0.2, 90_000.0), &[nothing]);
        assert_eq!(j.ttft_p99, Standing::Ahead, "{j:?}");
    }
}
