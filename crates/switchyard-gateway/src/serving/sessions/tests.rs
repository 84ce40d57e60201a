//! Session scheduling over a test pool, on tokio's paused clock: a held turn waits until a
//! session leaves or its aging bound, a client going away withdraws it, and with scheduling
//! off nothing waits.

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::{BlockHash, KvTierCosts, WorkerInfo};
use tokio::task::JoinHandle;

use super::{Release, ScheduledTurn, SessionSchedule, SessionSettings, TurnAsk};
use crate::cluster::pool::test_pool::{TestPool, worker_info};
use crate::observe::session_metrics::SessionMetrics;

const MODEL: &str = "m";

/// A worker of 100 blocks (of 4 tokens) that prefills `tokens_per_s`.
fn worker(id: &str, tokens_per_s: u64) -> WorkerInfo {
    WorkerInfo {
        kv_tiers: Some(KvTierCosts {
            prefill_tokens_per_s: tokens_per_s,
            ..KvTierCosts::typical(1024)
        }),
        ..worker_info(id, MODEL)
    }
}

fn schedule(pool: &TestPool, idle_seconds: f64) -> (Arc<SessionSchedule>, SessionMetrics) {
    let metrics = SessionMetrics::default();
    let settings = SessionSettings {
        schedule: true,
        idle_seconds,
    };
    let schedule = SessionSchedule::new(&settings, Arc::clone(&pool.pool), metrics.clone());
    (Arc::new(schedule), metrics)
}

/// A turn of `session` on context `context`, `blocks` long, in a task of its own.
fn turn(
    schedule: &Arc<SessionSchedule>,
    session: &'static str,
    context: u64,
    blocks: u64,
) -> JoinHandle<ScheduledTurn> {
    let schedule = Arc::clone(schedule);
    tokio::spawn(async move {
        schedule
            .turn(TurnAsk {
                model: MODEL,
                block_size: switchyard_core::BlockSize::new(4).unwrap(),
                session,
                context: BlockHash(context),
                blocks,
            })
            .await
    })
}

/// Lets the spawned tasks run without moving the paused clock.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_turn_that_does_not_fit_waits_until_the_resident_session_leaves() {
    // Prefill at 1 token/s: the aging bound (20 blocks of 4 tokens) is 80 s, far past the
    // 1 s the resident session takes to leave once idle.
    let pool = TestPool::new(16, &[worker("w0", 1)]);
    let (schedule, metrics) = schedule(&pool, 1.0);
    let mut a = turn(&schedule, "a", 1, 80).await.unwrap();
    assert!(a.held().is_none());
    a.routed(&pool.workers()[0].id());
    let b = turn(&schedule, "b", 2, 40);
    settle().await;
    assert!(!b.is_finished(), "b does not fit beside a");
    assert_eq!((metrics.held.get(), metrics.waiting.get()), (1, 1));
    // a's turn runs for a minute: b still waits (neither a leaving nor its bound came).
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!b.is_finished());
    drop(a);
    let b = b.await.unwrap();
    // Let go when a left (1 s idle after its turn ended), well before b's bound (80 s).
    let (held, release) = b.held().unwrap();
    assert_eq!(release, Release::Room);
    assert!(
        (Duration::from_secs(61)..Duration::from_secs(80)).contains(&held),
        "{held:?}"
    );
    assert_eq!((metrics.aged.get(), metrics.waiting.get()), (0, 0));
    assert_eq!(metrics.resident.get(), 1, "a left, b is resident");
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_held_turn_goes_in_at_its_aging_bound_when_room_never_appears() {
    // Prefill at 8 tokens/s: the bound of b's 20 blocks over is 10 s; a stays for 300 s idle.
    let pool = TestPool::new(16, &[worker("w0", 8)]);
    let (schedule, metrics) = schedule(&pool, 300.0);
    let mut a = turn(&schedule, "a", 1, 80).await.unwrap();
    a.routed(&pool.workers()[0].id());
    drop(a);
    let b = turn(&schedule, "b", 2, 40).await.unwrap();
    let (held, release) = b.held().unwrap();
    assert_eq!(release, Release::Aged);
    assert_eq!(held, Duration::from_secs(10));
    assert_eq!(
        (
            metrics.held.get(),
            metrics.aged.get(),
            metrics.demotions.get()
        ),
        (1, 1, 1),
        "a, idle, gave up its residency for b"
    );
    assert_eq!((metrics.waiting.get(), metrics.resident.get()), (0, 1));
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_client_going_away_withdraws_its_held_turn_only() {
    let pool = TestPool::new(16, &[worker("w0", 1)]);
    let (schedule, metrics) = schedule(&pool, 300.0);
    let mut a = turn(&schedule, "a", 1, 80).await.unwrap();
    a.routed(&pool.workers()[0].id());
    let b = turn(&schedule, "b", 2, 40);
    settle().await;
    assert_eq!(metrics.waiting.get(), 1);
    // c would fit beside a, but waits behind b.
    let c = turn(&schedule, "c", 3, 10);
    settle().await;
    assert!(!c.is_finished());
    b.abort();
    assert!(b.await.unwrap_err().is_cancelled());
    // b's wait is gone, and c, behind it, goes in without waiting for a.
    let c = c.await.unwrap();
    // At once, not at its own bound (one block's recompute, 4 s).
    let (held, release) = c.held().unwrap();
    assert_eq!(release, Release::Room);
    assert!(held < Duration::from_secs(4), "{held:?}");
    assert_eq!(
        (
            metrics.withdrawn.get(),
            metrics.waiting.get(),
            metrics.aged.get()
        ),
        (1, 0, 0)
    );
    assert_eq!(metrics.resident.get(), 2, "a and c; b counts nothing");
    // b's session asks again later and is held again behind a, as before.
    let b = turn(&schedule, "b", 2, 40);
    settle().await;
    assert!(!b.is_finished());
    assert_eq!(metrics.held.get(), 3);
    b.abort();
    drop((a, c));
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_worker_joining_makes_room_for_a_held_turn() {
    let pool = TestPool::new(16, &[worker("w0", 1)]);
    let (schedule, metrics) = schedule(&pool, 300.0);
    let mut a = turn(&schedule, "a", 1, 80).await.unwrap();
    a.routed(&pool.workers()[0].id());
    let b = turn(&schedule, "b", 2, 40);
    settle().await;
    assert!(!b.is_finished());
    pool.upsert_worker(worker("w1", 1));
    // The join is seen at the scheduler's next call: a's turn ending.
    drop(a);
    let b = b.await.unwrap();
    let (held, release) = b.held().unwrap();
    assert_eq!(release, Release::Room);
    assert!(
        held < Duration::from_secs(80),
        "let go before its bound: {held:?}"
    );
    assert_eq!((metrics.aged.get(), metrics.resident.get()), (0, 2));
    pool.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn with_scheduling_off_no_turn_waits() {
    let pool = TestPool::new(16, &[worker("w0", 1)]);
    let metrics = SessionMetrics::default();
    let schedule = Arc::new(SessionSchedule::new(
        &SessionSettings::default(),
        Arc::clone(&pool.pool),
        metrics.clone(),
    ));
    let a = turn(&schedule, "a", 1, 80).await.unwrap();
    let b = turn(&schedule, "b", 2, 90).await.unwrap();
    assert!(a.held().is_none() && b.held().is_none());
    assert_eq!((metrics.held.get(), metrics.resident.get()), (0, 0));
    pool.shutdown().await;
}

#[test]
fn the_sessions_table_is_read_and_checked_with_the_gateways_configuration() {
    let config: crate::config::GatewayConfig =
        toml::from_str("[sessions]\nschedule = true\nidle_seconds = 30.0\n").unwrap();
    assert!(config.sessions.schedule);
    assert_eq!(config.sessions.idle_micros(), 30_000_000);
    for bad in ["0.0", "-1.0", "1e9", "nan"] {
        let settings = SessionSettings {
            schedule: true,
            idle_seconds: bad.parse().unwrap(),
        };
        let err = settings.validate().unwrap_err();
        assert!(err.contains("sessions.idle_seconds"), "{err}");
    }
}
