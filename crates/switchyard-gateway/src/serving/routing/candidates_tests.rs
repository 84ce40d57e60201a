//! The model's member list ([`crate::cluster::pool::members`]) is reused across requests: each change
//! that removes a worker from routing reaches the very next request's candidates.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use switchyard_core::{EngineKind, Role, WorkerId, WorkerInfo};
use switchyard_router::serve::DecodeFilter;

use super::{Candidates, candidates, prefill_candidates};
use crate::cluster::pool::test_pool::TestPool;
use crate::cluster::pool::{ModelRoutes, WorkerPool};

fn info(id: &str, model: &str, role: Role) -> WorkerInfo {
    WorkerInfo {
        role,
        ..crate::cluster::pool::test_pool::worker_info(id, model)
    }
}

fn pool(workers: &[WorkerInfo]) -> (TestPool, Arc<ModelRoutes>) {
    let pool = TestPool::new(16, workers);
    let routes = pool.model("m").unwrap();
    (pool, routes)
}

/// Candidate ids in the order routing gives them to the policy.
fn ids(c: &Candidates) -> Vec<String> {
    c.ids().iter().map(|c| c.worker.to_string()).collect()
}

fn decode(pool: &WorkerPool, routes: &ModelRoutes) -> Vec<String> {
    ids(&candidates(pool, routes, DecodeFilter::default()))
}

fn prefill(pool: &WorkerPool, routes: &ModelRoutes) -> Vec<String> {
    ids(&prefill_candidates(
        pool,
        routes,
        EngineKind::Vllm,
        &[],
        None,
    ))
}

#[tokio::test]
async fn only_the_models_workers_are_candidates_in_id_order() {
    let (pool, routes) = pool(&[
        info("c", "m", Role::Both),
        info("a", "m", Role::Both),
        info("x", "other", Role::Both),
        info("b", "m", Role::Both),
    ]);
    assert_eq!(decode(&pool, &routes), ["a", "b", "c"]);
    pool.upsert_worker(info("aa", "m", Role::Both));
    assert_eq!(
        decode(&pool, &routes),
        ["a", "aa", "b", "c"],
        "a worker joins"
    );
}

#[tokio::test]
async fn a_worker_that_starts_draining_is_left_out_of_the_next_request() {
    let (pool, routes) = pool(&[info("a", "m", Role::Both), info("b", "m", Role::Both)]);
    assert_eq!(decode(&pool, &routes), ["a", "b"]);
    let b = pool.worker(&WorkerId::new("b").unwrap()).unwrap();
    b.set_draining(true);
    assert_eq!(decode(&pool, &routes), ["a"]);
    b.set_draining(false);
    assert_eq!(
        decode(&pool, &routes),
        ["a", "b"],
        "and back when it resumes"
    );
}

#[tokio::test]
async fn a_worker_that_stops_answering_is_left_out_unless_none_answers() {
    let (pool, routes) = pool(&[info("a", "m", Role::Both), info("b", "m", Role::Both)]);
    let a = pool.worker(&WorkerId::new("a").unwrap()).unwrap();
    let b = pool.worker(&WorkerId::new("b").unwrap()).unwrap();
    pool.worker_failed(&a, "load stream broke");
    assert_eq!(decode(&pool, &routes), ["b"]);
    pool.worker_failed(&b, "load stream broke");
    assert_eq!(
        decode(&pool, &routes),
        ["a", "b"],
        "none answers: every worker is tried rather than the request refused"
    );
    pool.worker_answered(&a);
    assert_eq!(decode(&pool, &routes), ["a"]);
}

#[tokio::test]
async fn a_worker_that_changes_role_moves_pools_on_the_next_request() {
    let (pool, routes) = pool(&[info("a", "m", Role::Both), info("b", "m", Role::Both)]);
    assert_eq!(prefill(&pool, &routes), Vec::<String>::new());
    pool.upsert_worker(info("b", "m", Role::Prefill));
    assert_eq!(decode(&pool, &routes), ["a"]);
    assert_eq!(prefill(&pool, &routes), ["b"]);
    pool.upsert_worker(info("b", "m", Role::Decode));
    assert_eq!(decode(&pool, &routes), ["a", "b"]);
    assert_eq!(prefill(&pool, &routes), Vec::<String>::new());
}

#[tokio::test]
async fn a_worker_that_changes_adapters_is_found_under_its_new_ones() {
    let (pool, routes) = pool(&[info("a", "m", Role::Both), info("b", "m", Role::Both)]);
    let sql = DecodeFilter {
        adapter: Some("sql"),
        ..DecodeFilter::default()
    };
    assert!(candidates(&pool, &routes, sql).is_empty());
    let mut b = info("b", "m", Role::Both);
    b.adapters = vec!["sql".into()];
    pool.upsert_worker(b);
    assert_eq!(ids(&candidates(&pool, &routes, sql)), ["b"]);
    pool.upsert_worker(info("b", "m", Role::Both));
    assert!(candidates(&pool, &routes, sql).is_empty(), "unloaded");
}

#[tokio::test]
async fn a_worker_that_leaves_or_restarts_is_replaced_on_the_next_request() {
    let (pool, routes) = pool(&[info("a", "m", Role::Both), info("b", "m", Role::Both)]);
    pool.remove_worker(&WorkerId::new("a").unwrap());
    assert_eq!(decode(&pool, &routes), ["b"]);
    let old = pool.worker(&WorkerId::new("b").unwrap()).unwrap();
    let mut restarted = info("b", "m", Role::Both);
    restarted.incarnation = 2;
    pool.upsert_worker(restarted);
    let chosen = candidates(&pool, &routes, DecodeFilter::default())
        .take(&WorkerId::new("b").unwrap())
        .unwrap();
    assert!(
        !Arc::ptr_eq(&chosen, &old),
        "the restarted worker's new handle is the candidate, not the old one"
    );
}

/// A request that may go to every member decides over the serving core's roster (the member
/// list's own candidates), through joins, leaves and drains; a narrowed list is a copy, and
/// the decision over the roster is the one over that copy.
#[tokio::test]
async fn a_request_open_to_every_member_decides_over_the_cores_roster() {
    let workers: Vec<WorkerInfo> = (0..80)
        .map(|i| info(&format!("w{i:02}"), "m", Role::Both))
        .collect();
    let (pool, routes) = pool(&workers);
    let rostered = |pool: &WorkerPool| {
        let c = candidates(pool, &routes, DecodeFilter::default());
        routes.read().serving.is_roster(c.ids())
    };
    assert!(rostered(&pool));
    pool.upsert_worker(info("w99", "m", Role::Both));
    assert!(
        rostered(&pool),
        "a worker joins: the new list is the roster"
    );
    pool.remove_worker(&WorkerId::new("w00").unwrap());
    assert!(rostered(&pool), "a worker leaves");
    let w05 = pool.worker(&WorkerId::new("w05").unwrap()).unwrap();
    w05.set_draining(true);
    assert!(
        !rostered(&pool),
        "a drained worker narrows the list to a copy"
    );
    w05.set_draining(false);
    assert!(rostered(&pool));
    // A prefill pool beside the generating workers: they are not in the roster.
    pool.upsert_worker(info("p0", "m", Role::Prefill));
    assert!(rostered(&pool), "prefill workers stay out of the roster");
    assert_eq!(prefill(&pool, &routes), ["p0"]);
    let c = candidates(&pool, &routes, DecodeFilter::default());
    assert!(c.take(&WorkerId::new("p0").unwrap()).is_none());
    let excluded = [WorkerId::new("w07").unwrap()];
    let narrowed = DecodeFilter {
        exclude: &excluded,
        ..DecodeFilter::default()
    };
    let c = candidates(&pool, &routes, narrowed);
    assert!(
        !routes.read().serving.is_roster(c.ids()),
        "an exclusion copies"
    );
    assert!(c.take(&excluded[0]).is_none());
    // Loads that differ and tie, then the same decision over the roster and over a copy.
    {
        let mut core = routes.lock();
        for i in (1..80).step_by(3) {
            let stats = switchyard_core::LoadStats {
                queued_prefill_tokens: (i % 4) as u64 * 512,
                running_requests: (i % 2) as u64,
                ..Default::default()
            };
            core.serving
                .load
                .report(&WorkerId::new(format!("w{i:02}")).unwrap(), stats, 0);
        }
    }
    let c = candidates(&pool, &routes, DecodeFilter::default());
    let copy = c.ids().to_vec();
    let request = switchyard_router::serve::route_request(
        &(0..64).collect::<Vec<u32>>(),
        routes.block_size,
        Some("s".into()),
        1,
    );
    let core = routes.read();
    // The core explains one decision in 256 in full, the first among them: past it, both
    // decisions below explain the best few.
    core.serving
        .decide_decode(&request, &copy)
        .unwrap()
        .unwrap();
    let ranked = core
        .serving
        .decide_decode(&request, c.ids())
        .unwrap()
        .unwrap();
    let scored = core
        .serving
        .decide_decode(&request, &copy)
        .unwrap()
        .unwrap();
    assert_eq!(ranked, scored);
    assert_eq!(ranked.explanation.workers.len(), 8);
}
