//! Decisions for one model from several threads: a booking never waits for another thread's
//! decision (it is queued, `cluster::pool::journal`), and every booking and release is counted,
//! in order, once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use switchyard_core::KvIdentity;
use switchyard_router::serve::DecodeFilter;

use super::{DecodeAsk, RoutedRequest, route, route_request};
use crate::cluster::pool::ModelRoutes;
use crate::cluster::pool::test_pool::{TestPool, worker_info};
use crate::observe::audit::RequestTags;

fn pool() -> (TestPool, Arc<ModelRoutes>) {
    let workers: Vec<_> = (0..4).map(|i| worker_info(&format!("w{i}"), "m")).collect();
    let pool = TestPool::new(64, &workers);
    let routes = pool.model("m").unwrap();
    (pool, routes)
}

/// Routes one request of `prompt` (distinct per call) and returns it, booked.
fn route_one(pool: &TestPool, routes: &Arc<ModelRoutes>, seed: u32) -> RoutedRequest {
    let prompt: Vec<u32> = (0..32).map(|i| seed.wrapping_mul(7919) ^ i).collect();
    let request = route_request(pool, routes, &prompt, &KvIdentity::PLAIN, None);
    let tags = Arc::new(RequestTags::new("t"));
    route(
        pool,
        &pool.observers,
        routes,
        DecodeAsk::first(&request, 4, DecodeFilter::default(), &tags),
    )
    .unwrap()
}

/// What the load view counts: (request key, prefill done), sorted.
fn booked(routes: &ModelRoutes) -> Vec<(u64, bool)> {
    let mut b: Vec<_> = (routes.lock().serving.load.bookings().iter())
        .map(|b| (b.request, b.prefill_done))
        .collect();
    b.sort_unstable();
    b
}

/// While another thread holds the model's state shared (a decision in progress), a decision
/// still books and its request still ends: the booking and the end are queued, not waited for
/// (with an exclusive lock per booking, the routing thread would wait here for ever). The
/// holder sees neither; the next reader, once the state is free, sees both, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_does_not_wait_for_another_threads_decision() {
    let (pool, routes) = pool();
    let held = routes.read();
    let (tx, rx) = mpsc::channel();
    let first = std::thread::scope(|s| {
        // The routed request outlives the thread (returned, not dropped).
        let routing = s.spawn(|| {
            let mut routed = route_one(&pool, &routes, 1);
            let key = routed.booking.key;
            tx.send(("booked", key)).unwrap();
            routed.prefill_done();
            tx.send(("prefill done", key)).unwrap();
            routed
        });
        let (what, key) = rx.recv_timeout(Duration::from_secs(60)).expect(
            "a decision made while another thread held the model's state shared never booked",
        );
        assert_eq!(what, "booked");
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(60)).unwrap().0,
            "prefill done"
        );
        // The holder's view is the one it took: the booking waits in the journal.
        assert!(held.serving.load.bookings().is_empty());
        drop(held);
        let view = routes.read();
        assert_eq!(
            (view.serving.load.bookings().iter())
                .map(|b| (b.request, b.prefill_done))
                .collect::<Vec<_>>(),
            [(key, true)]
        );
        drop(view);
        routing.join().unwrap()
    });
    // An end queued behind a reader is applied by the next exclusive holder.
    let routed = route_one(&pool, &routes, 2);
    let key = routed.booking.key;
    {
        let held = routes.read();
        std::thread::scope(|s| {
            s.spawn(move || drop(routed));
        });
        assert_eq!(held.serving.load.bookings().len(), 2);
    }
    assert_eq!(booked(&routes).iter().filter(|b| b.0 == key).count(), 0);
    assert_eq!(booked(&routes), [(first.booking.key, true)]);
    drop(first);
    assert!(booked(&routes).is_empty());
    pool.shutdown().await;
}

/// Four threads route 400 requests each at once, keeping every third and ending the rest
/// (half after their prefill): every kept request is counted once with its state, every ended
/// one is gone, and ending the kept ones leaves nothing booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_from_many_threads_are_each_counted_once() {
    let (pool, routes) = pool();
    let kept: Vec<RoutedRequest> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let (pool, routes) = (&pool, &routes);
                s.spawn(move || {
                    let mut kept = Vec::new();
                    for i in 0..400u32 {
                        let mut routed = route_one(pool, routes, t * 1000 + i);
                        if i % 2 == 0 {
                            routed.prefill_done();
                        }
                        if i % 3 == 0 {
                            kept.push(routed);
                        }
                    }
                    kept
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    let mut expected: Vec<(u64, bool)> = kept
        .iter()
        .map(|r| (r.booking.key, r.prefill_done))
        .collect();
    expected.sort_unstable();
    assert_eq!(expected.len(), 4 * 134);
    assert_eq!(booked(&routes), expected);
    drop(kept);
    assert!(booked(&routes).is_empty());
    pool.shutdown().await;
}
