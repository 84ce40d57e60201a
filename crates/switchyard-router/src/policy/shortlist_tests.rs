//! The shortlist decides as the full breakdown does: a holder of the prompt's prefix and the
//! least-loaded worker are found wherever they are among many candidates.

use super::tests::{prompt, request, setup, store, w};
use super::*;
use crate::load::LoadView;
use switchyard_core::LoadStats;
use switchyard_core::rng::SplitMix64;

const MANY: usize = 200;

fn names() -> Vec<String> {
    (0..MANY).map(|i| format!("w{i}")).collect()
}

fn many() -> Vec<Candidate> {
    names().iter().map(|n| Candidate::from(w(n))).collect()
}

fn busy(load: &mut LoadView, worker: &str, queued_prefill_tokens: u64, active_blocks: u64) {
    let stats = LoadStats {
        queued_prefill_tokens,
        active_blocks,
        running_requests: 1,
        capacity_blocks: 10_000,
        ..LoadStats::default()
    };
    load.report(&w(worker), stats, 0);
}

/// The decision the full breakdown makes ([`KvPolicy::decide`] explains every candidate).
fn full(
    req: &RouteRequest,
    candidates: &[Candidate],
    index: &PrefixIndex,
    load: &LoadView,
) -> Decision {
    let mut kv = KvPolicy::new(KvConfig::default(), 0).unwrap();
    kv.explain_all(true);
    kv.choose(req, candidates, index, load).unwrap()
}

fn shortlisted(
    req: &RouteRequest,
    candidates: &[Candidate],
    index: &PrefixIndex,
    load: &LoadView,
) -> Decision {
    let d = KvPolicy::new(KvConfig::default(), 0)
        .unwrap()
        .choose(req, candidates, index, load)
        .unwrap();
    assert_eq!(d.explanation.workers.len(), shortlist::EXPLAINED);
    d
}

#[test]
fn the_least_loaded_worker_is_chosen_wherever_it_is() {
    for idle in [0, 63, 64, 150, MANY - 1] {
        let (index, mut load) = setup();
        for (i, name) in names().iter().enumerate() {
            if i != idle {
                busy(&mut load, name, 4096 + i as u64, 100);
            }
        }
        let req = request(&prompt(1, 8), None, 0);
        let d = shortlisted(&req, &many(), &index, &load);
        assert_eq!(d.worker, w(&format!("w{idle}")), "idle worker at {idle}");
        assert_eq!(d.worker, full(&req, &many(), &index, &load).worker);
    }
}

#[test]
fn a_holder_is_chosen_wherever_it_is() {
    for holder in [0, 64, 137, MANY - 1] {
        let (mut index, mut load) = setup();
        for (i, name) in names().iter().enumerate() {
            busy(&mut load, name, 512, 100 + i as u64);
        }
        let p = prompt(1, 64);
        store(&mut index, &format!("w{holder}"), 0, &p, 64);
        let req = request(&p, None, 0);
        let d = shortlisted(&req, &many(), &index, &load);
        assert_eq!(d.worker, w(&format!("w{holder}")), "holder at {holder}");
        assert_eq!(d.chosen().unwrap().overlap.device, 64);
    }
}

#[test]
fn the_shortlist_decides_and_ranks_as_the_full_breakdown() {
    let mut rng = SplitMix64::new(43);
    for round in 0..30 {
        let (mut index, mut load) = setup();
        let p = prompt(round, 32);
        for name in &names() {
            // Ties on purpose: few distinct loads, so the rendezvous hash decides among them.
            if !rng.next_u64().is_multiple_of(3) {
                busy(&mut load, name, 1024 * (rng.next_u64() % 4), 50);
            }
            if rng.next_u64().is_multiple_of(4) {
                let held = (rng.next_u64() % 32) as usize + 1;
                store(&mut index, name, 0, &p, held);
            }
        }
        let req = request(&p, None, round.into());
        let all = full(&req, &many(), &index, &load);
        let few = shortlisted(&req, &many(), &index, &load);
        assert_eq!(few.worker, all.worker, "round {round}");
        assert_eq!(few.chosen(), all.chosen());
        // The shortlist is the head of the full ranking, in the candidates' order.
        let ranked = all.ranked(&req);
        let head: Vec<&WorkerId> = ranked[..shortlist::EXPLAINED].to_vec();
        let mut listed: Vec<&WorkerId> =
            few.explanation.workers.iter().map(|s| &s.worker).collect();
        assert_eq!(few.ranked(&req), head, "round {round}");
        listed.sort_by_key(|id| id.as_str()[1..].parse::<usize>().unwrap());
        assert_eq!(
            listed,
            few.explanation
                .workers
                .iter()
                .map(|s| &s.worker)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn few_candidates_are_all_explained() {
    let (index, load) = setup();
    let candidates: Vec<Candidate> = many()
        .into_iter()
        .take(shortlist::EXPLAIN_ALL_UP_TO)
        .collect();
    let req = request(&prompt(1, 8), None, 0);
    let d = KvPolicy::new(KvConfig::default(), 0)
        .unwrap()
        .choose(&req, &candidates, &index, &load)
        .unwrap();
    assert_eq!(d.explanation.workers.len(), shortlist::EXPLAIN_ALL_UP_TO);
}
