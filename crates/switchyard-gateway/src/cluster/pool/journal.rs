//! Bookings that wait for the model's routing state: a request's booking, its prefill's end
//! and its end change the load view, which takes the model's [`RouterCore`] exclusively. Taken
//! while other threads decide under the shared lock, that exclusive section waits for every
//! decision in progress and stops the ones that start meanwhile, so decisions for one model
//! from two threads took turns (and spun waiting for each other) instead of running at once.
//!
//! Instead, a change is made at once when the state is free ([`ModelRoutes::change`]) and
//! otherwise queued here, in order; whoever next takes the state exclusively, or shared when it
//! is free ([`ModelRoutes::read`]), first applies the queue. A decision therefore sees every
//! change made before it began except those queued while another thread held the state — the
//! bookings of decisions made at the same moment, which it could not have seen anyway had the
//! two run in the other order. The queue is bounded ([`JOURNAL_LIMIT`]): past it the change
//! waits for the state as before.
//!
//! [`RouterCore`]: super::RouterCore
//! [`ModelRoutes::change`]: super::ModelRoutes::change
//! [`ModelRoutes::read`]: super::ModelRoutes::read

use std::sync::atomic::{AtomicBool, Ordering};

use switchyard_core::BlockHash;
use switchyard_router::Tick;
use switchyard_router::serve::{Booking, ServingCore};

/// Queued changes past which a change waits for the model's state instead.
pub const JOURNAL_LIMIT: usize = 1024;

/// A change of the load view waiting for the model's state.
#[derive(Debug)]
pub enum Deferred {
    /// Count a decode booking ([`ServingCore::count_booking`]).
    Book {
        booking: Booking,
        blocks: Vec<BlockHash>,
        prompt_tokens: u64,
        now: Tick,
    },
    /// The booked request's prefill finished ([`ServingCore::prefill_done`]).
    PrefillDone(Booking),
    /// The booked request ended ([`ServingCore::finished`]).
    Finished(Booking),
}

impl Deferred {
    /// Makes the change on `serving` (held exclusively).
    fn apply(self, serving: &mut ServingCore) {
        match self {
            Deferred::Book {
                booking,
                blocks,
                prompt_tokens,
                now,
            } => serving.count_booking(&booking, &blocks, prompt_tokens, now),
            Deferred::PrefillDone(booking) => serving.prefill_done(&booking),
            Deferred::Finished(booking) => serving.finished(&booking),
        }
    }
}

/// The queue of one model's waiting changes.
#[derive(Debug, Default)]
pub struct Journal {
    queue: parking_lot::Mutex<Vec<Deferred>>,
    /// Whether the queue may hold something: read without its lock by every decision.
    queued: AtomicBool,
}

impl Journal {
    /// Queues `change`; returns how many changes wait now.
    pub fn push(&self, change: Deferred) -> usize {
        let mut queue = self.queue.lock();
        queue.push(change);
        self.queued.store(true, Ordering::Release);
        queue.len()
    }

    /// Whether changes may be waiting.
    pub fn is_queued(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    /// Applies every waiting change to `serving`, in the order they were queued. Callers hold
    /// the model's state exclusively.
    pub fn apply(&self, serving: &mut ServingCore) {
        if !self.is_queued() {
            return;
        }
        let waiting = {
            let mut queue = self.queue.lock();
            self.queued.store(false, Ordering::Release);
            std::mem::take(&mut *queue)
        };
        for change in waiting {
            change.apply(serving);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use switchyard_core::{BlockHash, BlockSize, WorkerId};
    use switchyard_router::serve::{BookingKind, ServingCore};
    use switchyard_router::{IndexConfig, LoadConfig, PolicyConfig, PolicyKind};

    use super::{Deferred, Journal};

    fn booking(key: u64) -> switchyard_router::serve::Booking {
        switchyard_router::serve::Booking {
            worker: WorkerId::new("w").unwrap(),
            key,
            kind: BookingKind::Aggregated,
            uncached_prompt_tokens: 8,
            prefill_tokens: 8,
            blocks: 3,
            onboard_bytes: 0,
        }
    }

    fn book(key: u64) -> Deferred {
        Deferred::Book {
            booking: booking(key),
            blocks: vec![BlockHash(key), BlockHash(key + 100)],
            prompt_tokens: 8,
            now: 0,
        }
    }

    /// Queued changes are applied in the order they were queued, once: a request's end queued
    /// after its booking releases it, and the queue is empty afterwards.
    #[test]
    fn queued_changes_apply_in_order_once() {
        let bs = BlockSize::new(4).unwrap();
        let mut serving = ServingCore::new(
            bs,
            IndexConfig::new(bs),
            LoadConfig::default(),
            PolicyKind::Kv,
            &PolicyConfig::default(),
        )
        .unwrap();
        let journal = Journal::default();
        assert!(!journal.is_queued());
        assert_eq!(journal.push(book(1)), 1);
        assert_eq!(journal.push(book(2)), 2);
        assert_eq!(journal.push(Deferred::PrefillDone(booking(2))), 3);
        assert_eq!(journal.push(Deferred::Finished(booking(1))), 4);
        assert!(journal.is_queued());
        journal.apply(&mut serving);
        assert!(!journal.is_queued());
        let booked = serving.load.bookings();
        assert_eq!(
            booked
                .iter()
                .map(|b| (b.request, b.prefill_done))
                .collect::<Vec<_>>(),
            [(2, true)]
        );
        // Nothing is applied twice.
        journal.apply(&mut serving);
        assert_eq!(serving.load.bookings().len(), 1);
        journal.push(Deferred::Finished(booking(2)));
        journal.apply(&mut serving);
        assert!(serving.load.bookings().is_empty());
    }
}
