//! Deciding among many candidates while explaining few.
//!
//! The choice rule (`explain::compare`: cost, then running requests, then the request's
//! rendezvous hash, then the worker id) is a total order, so the winner is the minimum over the
//! candidates, and the runner-up the next. Above [`EXPLAIN_ALL_UP_TO`] candidates the `kv`
//! policy ranks every candidate by its cost alone ([`Scorer::cost`]: no breakdown built, no
//! worker id copied, the rendezvous hash only on a tie) and builds the breakdown of the
//! [`EXPLAINED`] best only: the chosen worker is the one the full breakdown would choose,
//! holders of the prompt's prefix and idle workers alike, and the explanation names the
//! winner, the runner-up and the next best. A full explanation is still built when asked for
//! (the admin API's explain) and for a sample of the decisions (`serve`).

use std::cmp::Ordering;

use super::RouteRequest;
use super::cost::Scorer;
use super::explain::{self, WorkerScore};

/// Up to this many candidates a decision explains every one, as decisions always did.
pub(crate) const EXPLAIN_ALL_UP_TO: usize = 64;

/// Candidates a shortlisted decision explains: the best under the choice rule.
pub(crate) const EXPLAINED: usize = 8;

/// The breakdowns of the [`EXPLAINED`] best of the scorer's candidates under the choice rule,
/// in the candidates' order.
pub(crate) fn best_scores(request: &RouteRequest, scorer: &Scorer<'_>) -> Vec<WorkerScore> {
    let key = explain::request_key(request);
    let worker = |i: usize| &scorer.candidate(i).worker;
    // The best so far, best first: (cost, running requests, candidate).
    let mut top: Vec<(f64, u64, usize)> = Vec::with_capacity(EXPLAINED + 1);
    for i in 0..scorer.len() {
        let (cost, running) = scorer.cost(i);
        let beats = |t: &(f64, u64, usize)| {
            explain::order(key, (cost, running, worker(i)), (t.0, t.1, worker(t.2)))
                == Ordering::Less
        };
        if top.len() == EXPLAINED && !top.last().is_some_and(beats) {
            continue;
        }
        let at = top.iter().position(beats).unwrap_or(top.len());
        top.insert(at, (cost, running, i));
        top.truncate(EXPLAINED);
    }
    let mut kept: Vec<usize> = top.iter().map(|t| t.2).collect();
    kept.sort_unstable();
    kept.into_iter().map(|i| scorer.score(i)).collect()
}
