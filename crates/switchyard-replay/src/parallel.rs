//! Independent replays side by side: one thread per run, up to the cores there are.
//!
//! Each offline run (one policy at one load level) owns its cluster and its workload, and a
//! run is a pure function of its inputs, so runs share nothing and their order of completion
//! cannot change a figure. [`run_ordered`] hands out job indices to a few scoped threads and
//! gives the results back in job order, exactly as a serial loop would.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Threads to use for `jobs` runs when asked for `requested` (0: one per available core).
pub fn threads_for(jobs: usize, requested: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    let wanted = if requested == 0 { cores } else { requested };
    wanted.clamp(1, jobs.max(1))
}

/// Calls `job(i)` for every `i < jobs` on up to `threads` threads (the caller's own among them)
/// and returns the results in index order. With one thread, or one job, nothing is spawned.
pub fn run_ordered<T: Send>(
    jobs: usize,
    threads: usize,
    job: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    if threads <= 1 || jobs <= 1 {
        return (0..jobs).map(job).collect();
    }
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<T>>> = Mutex::new((0..jobs).map(|_| None).collect());
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= jobs {
                break;
            }
            let result = job(i);
            slots.lock()[i] = Some(result);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.min(jobs) {
            scope.spawn(work);
        }
        work();
    });
    // Every index below `jobs` was taken by exactly one thread, which filled its slot before
    // the scope ended (a panicking job propagates out of the scope instead).
    slots.into_inner().into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_job_order_whatever_the_thread_count() {
        let serial = run_ordered(9, 1, |i| i * i);
        for threads in [2, 3, 16] {
            assert_eq!(
                run_ordered(9, threads, |i| i * i),
                serial,
                "{threads} threads"
            );
        }
        assert_eq!(serial, vec![0, 1, 4, 9, 16, 25, 36, 49, 64]);
        assert!(run_ordered(0, 4, |i| i).is_empty());
    }

    #[test]
    fn jobs_really_run_on_several_threads() {
        let seen = Mutex::new(std::collections::HashSet::new());
        let barrier = std::sync::Barrier::new(2);
        // Two jobs that each wait for the other: only finishes if they run at once.
        run_ordered(2, 2, |_| {
            seen.lock().insert(std::thread::current().id());
            barrier.wait();
        });
        assert_eq!(seen.lock().len(), 2);
    }

    #[test]
    fn thread_counts_stay_between_one_and_the_jobs() {
        assert_eq!(threads_for(2, 8), 2);
        assert_eq!(threads_for(5, 1), 1);
        assert_eq!(threads_for(0, 0), 1);
        assert!(threads_for(64, 0) >= 1);
    }
}
