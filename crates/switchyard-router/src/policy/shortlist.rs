//! Deciding among many candidates while explaining few.
//!
//! The choice rule (`explain::compare`: cost, then running requests, then the request's
//! rendezvous hash, then the worker id) is a total order, so the winner is the minimum over the
//! candidates, and the runner-up the next. Above [`EXPLAIN_ALL_UP_TO`] candidates the `kv`
//! policy ranks every candidate by its cost alone ([`Scorer::cost`]: no breakdown built, no
//! worker id copied, the rendezvous hash only on a tie and once per candidate) and builds the breakdown of the
//! [`EXPLAINED`] best only: the chosen worker is the one the full breakdown would choose,
//! holders of the prompt's prefix and idle workers alike, and the explanation names the
//! winner, the runner-up and the next best. A full explanation is still built when asked for
//! (the admin API's explain) and for a sample of the decisions (`serve`). When the candidates
//! are the load view's roster, `ranked` finds the same best without scoring every candidate.

use std::cmp::Ordering;

use switchyard_core::WorkerId;

use super::RouteRequest;
use super::cost::Scorer;
use super::explain::{self, WorkerScore};

/// Up to this many candidates a decision explains every one, as decisions always did.
pub(crate) const EXPLAIN_ALL_UP_TO: usize = 64;

/// Candidates a shortlisted decision explains: the best under the choice rule.
pub(crate) const EXPLAINED: usize = 8;

/// A candidate kept among the best so far, with what the choice rule compares.
struct Ranked {
    cost: f64,
    running: u64,
    /// The request's rendezvous hash of the worker, computed only on a tie of cost and
    /// running requests (most candidates never need it).
    rendezvous: Option<u64>,
    at: usize,
}

/// The breakdowns of the [`EXPLAINED`] best of the scorer's candidates under the choice rule,
/// in the candidates' order.
pub(crate) fn best_scores(request: &RouteRequest, scorer: &Scorer<'_>) -> Vec<WorkerScore> {
    let key = explain::request_key(request);
    let worker = |i: usize| &scorer.candidate(i).worker;
    // The best so far, best first.
    let mut top: Vec<Ranked> = Vec::with_capacity(EXPLAINED + 1);
    for i in 0..scorer.len() {
        let (cost, running) = scorer.cost(i);
        let mut new = Ranked {
            cost,
            running,
            rendezvous: None,
            at: i,
        };
        if top.len() == EXPLAINED
            && !top
                .last_mut()
                .is_some_and(|t| beats(key, &mut new, t, worker))
        {
            continue;
        }
        let mut at = top.len();
        for (j, t) in top.iter_mut().enumerate() {
            if beats(key, &mut new, t, worker) {
                at = j;
                break;
            }
        }
        top.insert(at, new);
        top.truncate(EXPLAINED);
    }
    let mut kept: Vec<usize> = top.iter().map(|t| t.at).collect();
    kept.sort_unstable();
    kept.into_iter().map(|i| scorer.score(i)).collect()
}

/// Whether `a` goes before `b` under the choice rule (`explain::order`), hashing either worker
/// only on a tie of cost and running requests, once.
fn beats<'w>(
    key: u64,
    a: &mut Ranked,
    b: &mut Ranked,
    worker: impl Fn(usize) -> &'w WorkerId,
) -> bool {
    match a.cost.total_cmp(&b.cost).then(a.running.cmp(&b.running)) {
        Ordering::Less => true,
        Ordering::Greater => false,
        Ordering::Equal => {
            let ra = *a
                .rendezvous
                .get_or_insert_with(|| explain::rendezvous(key, worker(a.at)));
            let rb = *b
                .rendezvous
                .get_or_insert_with(|| explain::rendezvous(key, worker(b.at)));
            rb.cmp(&ra).then_with(|| worker(a.at).cmp(worker(b.at))) == Ordering::Less
        }
    }
}
