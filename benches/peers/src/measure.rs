//! Heap accounting, percentiles and a description of the machine a run happened on.
//!
//! [`CountingAlloc`] wraps the system allocator. While an account is open
//! ([`Account::open`]), every allocation and free on any thread is added to that account's
//! balance, so the bytes an index keeps are measured the same way for every contender, whatever
//! its internal layout (hash maps, `Rc` nodes, `DashMap` shards) and whatever thread it
//! allocates on. Outside an open account the wrapper costs one relaxed load.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::time::Duration;

const ACCOUNTS: usize = 16;

static OPEN: AtomicUsize = AtomicUsize::new(0);
static BALANCE: [AtomicIsize; ACCOUNTS] = [const { AtomicIsize::new(0) }; ACCOUNTS];

/// The global allocator of the bench binary; see the module docs.
#[derive(Debug)]
pub struct CountingAlloc;

#[inline]
fn charge(delta: isize) {
    let open = OPEN.load(Ordering::Relaxed);
    if open != 0 {
        BALANCE[open].fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the wrapper
// only keeps counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        charge(-(layout.size() as isize));
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        charge(new_size as isize - layout.size() as isize);
        // SAFETY: forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// A heap account (1..16); at most one is open at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Account(pub usize);

impl Account {
    /// Runs `f` with this account open: its allocations and frees are charged here.
    pub fn charge<T>(self, f: impl FnOnce() -> T) -> T {
        assert!(self.0 > 0 && self.0 < ACCOUNTS, "account out of range");
        OPEN.store(self.0, Ordering::SeqCst);
        let out = f();
        OPEN.store(0, Ordering::SeqCst);
        out
    }

    /// Net bytes charged to this account so far.
    pub fn bytes(self) -> isize {
        BALANCE[self.0].load(Ordering::SeqCst)
    }

    pub fn reset(self) {
        BALANCE[self.0].store(0, Ordering::SeqCst);
    }
}

/// The `p`-quantile (0..=1) of unsorted samples, nearest rank.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

pub fn median(samples: &mut [Duration]) -> Duration {
    percentile(samples, 0.5)
}

/// CPU model, logical CPUs and the load averages, from `/proc`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cpus: usize,
    pub loadavg: String,
}

impl Machine {
    pub fn read() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            cpu,
            cpus,
            loadavg: loadavg(),
        }
    }
}

/// The 1/5/15-minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}
