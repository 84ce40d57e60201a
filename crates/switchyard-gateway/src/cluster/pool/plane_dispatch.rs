//! Where a model's consumer on the event plane ([`super::plane_feed`]) sends each message: to
//! the follower of the worker whose subject it came on ([`super::plane`]), found by the
//! subject's last token. No I/O and no task: the feed drives it, the followers read their
//! queues, and the tests script it.
//!
//! Each follower has a bounded queue, and the feed never waits on one: a follower busy taking a
//! snapshot over gRPC must not hold up the model's other workers. A message that finds its
//! queue full is dropped and the follower is told [`FeedItem::Lost`] as soon as there is room
//! (it then takes a snapshot, and what follows in its queue is stale or next).
//!
//! A message can come before the registry tells the gateway about its worker (a worker
//! publishes its first snapshot while it registers), or be of another incarnation than the one
//! registered (a restart the registry has not shown yet). Such messages are kept per subject,
//! a few and for a while ([`UNCLAIMED_MESSAGES`], [`UNCLAIMED_BYTES`], [`UNCLAIMED_FOR`]), and
//! handed to the worker's follower when it joins; a subject whose kept messages overflowed
//! hands over [`FeedItem::Lost`] instead, so the follower starts from a snapshot. Messages of
//! workers that left (their history stays in the stream until it ages out) are kept the same
//! way and dropped unclaimed. A follower that joined and finds nothing of its worker once the
//! consumer holds the whole history ([`FeedItem::CaughtUp`]) waits a little for its worker's
//! first message, then takes a snapshot (`plane.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use switchyard_proto::v1;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Messages a follower's queue holds before the feed drops them (and tells it so).
pub const FOLLOWER_QUEUE: usize = 256;
/// Messages kept per subject no follower claims yet.
pub const UNCLAIMED_MESSAGES: usize = 64;
/// Bytes of messages kept for subjects no follower claims, every subject together.
pub const UNCLAIMED_BYTES: usize = 16 << 20;
/// How long a subject's unclaimed messages are kept after its last one.
pub const UNCLAIMED_FOR: Duration = Duration::from_secs(60);

/// What a worker's follower reads from its model's consumer.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedItem {
    /// A message of the worker's subject, in stream order.
    Message(v1::KvEventsResponse),
    /// A message of the worker's subject that is not a KV events message.
    Undecodable(String),
    /// Messages of the worker's subject were lost on the way (a full queue, unclaimed messages
    /// that overflowed, a consumer that could not resume): only a snapshot says what it has.
    Lost,
    /// The consumer has read everything the stream held when it started.
    CaughtUp,
}

#[derive(Debug)]
struct Follower {
    generation: u64,
    incarnation: u64,
    tx: mpsc::Sender<FeedItem>,
    /// Items were dropped on a full queue: [`FeedItem::Lost`] goes first when there is room.
    lost: bool,
}

impl Follower {
    /// Queues `item`, or drops it and remembers the loss when the queue is full.
    fn send(&mut self, item: FeedItem) {
        if self.lost {
            if self.tx.try_send(FeedItem::Lost).is_err() {
                return;
            }
            self.lost = false;
        }
        if self.tx.try_send(item).is_err() {
            self.lost = true;
        }
    }
}

#[derive(Debug, Default)]
struct Unclaimed {
    messages: Vec<(v1::KvEventsResponse, usize)>,
    bytes: usize,
    /// Messages were dropped: the follower that claims the subject starts from a snapshot.
    lost: bool,
    last: Option<Instant>,
}

/// The followers of one model's workers, by subject token, and what waits for a follower.
#[derive(Debug, Default)]
pub struct Dispatch {
    followers: HashMap<String, Follower>,
    unclaimed: HashMap<String, Unclaimed>,
    unclaimed_bytes: usize,
    caught_up: bool,
    next_generation: u64,
}

impl Dispatch {
    /// A follower for the worker of subject token `token` and `incarnation`: it gets what was
    /// kept for the subject, then the subject's messages as they come. It replaces a follower
    /// of the same token (a restarted worker). Returns the follower's generation (for
    /// [`Self::leave`]) and its queue.
    pub fn join(&mut self, token: &str, incarnation: u64) -> (u64, mpsc::Receiver<FeedItem>) {
        let (tx, rx) = mpsc::channel(FOLLOWER_QUEUE);
        self.next_generation += 1;
        let mut follower = Follower {
            generation: self.next_generation,
            incarnation,
            tx,
            lost: false,
        };
        if let Some(kept) = self.unclaimed.remove(token) {
            self.unclaimed_bytes -= kept.bytes;
            if kept.lost {
                follower.send(FeedItem::Lost);
            }
            for (message, _) in kept.messages {
                if message.incarnation == incarnation {
                    follower.send(FeedItem::Message(message));
                }
            }
        }
        if self.caught_up {
            follower.send(FeedItem::CaughtUp);
        }
        self.followers.insert(token.to_owned(), follower);
        (self.next_generation, rx)
    }

    /// The follower of `generation` for `token` is gone (a newer one of the token stays).
    pub fn leave(&mut self, token: &str, generation: u64) {
        if self
            .followers
            .get(token)
            .is_some_and(|f| f.generation == generation)
        {
            self.followers.remove(token);
        }
    }

    /// How many followers are joined.
    pub fn followers(&self) -> usize {
        self.followers.len()
    }

    /// One message read on subject token `token`, `bytes` long (or why it did not decode).
    pub fn deliver(
        &mut self,
        token: &str,
        bytes: usize,
        message: Result<v1::KvEventsResponse, String>,
        now: Instant,
    ) {
        let follower = self.followers.get_mut(token);
        match (follower, message) {
            (Some(follower), Ok(message)) if message.incarnation == follower.incarnation => {
                follower.send(FeedItem::Message(message));
            }
            (Some(follower), Err(error)) => follower.send(FeedItem::Undecodable(error)),
            (_, Ok(message)) => self.keep(token, message, bytes, now),
            // Undecodable, and no follower to tell: whoever claims the subject takes a
            // snapshot.
            (None, Err(_)) => self.keep_lost(token, now),
        }
    }

    fn keep(&mut self, token: &str, message: v1::KvEventsResponse, bytes: usize, now: Instant) {
        let kept = self.unclaimed.entry(token.to_owned()).or_default();
        kept.last = Some(now);
        if kept.lost {
            return;
        }
        if kept.messages.len() >= UNCLAIMED_MESSAGES
            || self.unclaimed_bytes + bytes > UNCLAIMED_BYTES
        {
            self.keep_lost(token, now);
            return;
        }
        kept.messages.push((message, bytes));
        kept.bytes += bytes;
        self.unclaimed_bytes += bytes;
    }

    fn keep_lost(&mut self, token: &str, now: Instant) {
        let kept = self.unclaimed.entry(token.to_owned()).or_default();
        self.unclaimed_bytes -= kept.bytes;
        *kept = Unclaimed {
            lost: true,
            last: Some(now),
            ..Unclaimed::default()
        };
    }

    /// The consumer holds everything the stream held when it started: every follower is told.
    pub fn caught_up(&mut self) {
        if self.caught_up {
            return;
        }
        self.caught_up = true;
        for follower in self.followers.values_mut() {
            follower.send(FeedItem::CaughtUp);
        }
    }

    pub fn is_caught_up(&self) -> bool {
        self.caught_up
    }

    /// The consumer was made again: it reads on from where the last one stopped (`resumed`:
    /// nothing is lost, each cursor meets what it missed in order and the ingest rules find any
    /// gap), or could not (every follower and every kept subject starts from a snapshot).
    pub fn restarted(&mut self, resumed: bool, now: Instant) {
        self.caught_up = false;
        if resumed {
            return;
        }
        for follower in self.followers.values_mut() {
            follower.send(FeedItem::Lost);
        }
        let tokens: Vec<String> = self.unclaimed.keys().cloned().collect();
        for token in tokens {
            self.keep_lost(&token, now);
        }
    }

    /// Drops what was kept for subjects quiet for [`UNCLAIMED_FOR`], and tells followers whose
    /// queue had no room for it of their loss (a loss must not wait for the worker's next
    /// message, which may never come).
    pub fn tidy(&mut self, now: Instant) {
        let mut dropped = 0;
        self.unclaimed.retain(|_, kept| {
            let keep = kept
                .last
                .is_some_and(|last| now.duration_since(last) < UNCLAIMED_FOR);
            if !keep {
                dropped += kept.bytes;
            }
            keep
        });
        self.unclaimed_bytes -= dropped;
        for follower in self.followers.values_mut().filter(|f| f.lost) {
            if follower.tx.try_send(FeedItem::Lost).is_ok() {
                follower.lost = false;
            }
        }
    }

    /// Subjects with kept messages or losses, and the bytes kept (for tests and logs).
    pub fn unclaimed(&self) -> (usize, usize) {
        (self.unclaimed.len(), self.unclaimed_bytes)
    }
}

/// A follower's place in its model's [`Dispatch`]: its queue, and, when dropped (the follower
/// stops: its worker left or restarted, the gateway stops), its departure.
#[derive(Debug)]
pub struct FeedSubscription {
    rx: mpsc::Receiver<FeedItem>,
    dispatch: Arc<parking_lot::Mutex<Dispatch>>,
    token: String,
    generation: u64,
}

impl FeedSubscription {
    /// Joins `dispatch` as the follower of `token` and `incarnation` ([`Dispatch::join`]).
    pub fn join(
        dispatch: &Arc<parking_lot::Mutex<Dispatch>>,
        token: &str,
        incarnation: u64,
    ) -> Self {
        let (generation, rx) = dispatch.lock().join(token, incarnation);
        Self {
            rx,
            dispatch: Arc::clone(dispatch),
            token: token.to_owned(),
            generation,
        }
    }

    /// The next item; `None` when the feed is gone (the gateway stops).
    pub async fn recv(&mut self) -> Option<FeedItem> {
        self.rx.recv().await
    }
}

impl Drop for FeedSubscription {
    fn drop(&mut self) {
        self.dispatch.lock().leave(&self.token, self.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_proto::v1::kv_events_response::Payload;

    fn event(incarnation: u64, seq: u64) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: "w".into(),
            incarnation,
            payload: Some(Payload::Event(v1::KvEvent { seq, kind: None })),
        }
    }

    fn drain(rx: &mut mpsc::Receiver<FeedItem>) -> Vec<FeedItem> {
        let mut items = Vec::new();
        while let Ok(item) = rx.try_recv() {
            items.push(item);
        }
        items
    }

    #[tokio::test(start_paused = true)]
    async fn messages_go_to_their_worker_s_follower_by_subject_token() {
        let mut d = Dispatch::default();
        let (_, mut a) = d.join("a", 1);
        let (_, mut b) = d.join("b", 7);
        let now = Instant::now();
        d.deliver("a", 10, Ok(event(1, 0)), now);
        d.deliver("b", 10, Ok(event(7, 0)), now);
        d.deliver("a", 10, Ok(event(1, 1)), now);
        d.deliver("b", 10, Err("not ours".into()), now);
        assert_eq!(
            drain(&mut a),
            [
                FeedItem::Message(event(1, 0)),
                FeedItem::Message(event(1, 1))
            ]
        );
        assert_eq!(
            drain(&mut b),
            [
                FeedItem::Message(event(7, 0)),
                FeedItem::Undecodable("not ours".into())
            ]
        );
        d.caught_up();
        d.caught_up();
        assert_eq!(drain(&mut a), [FeedItem::CaughtUp], "told once");
        assert_eq!(d.unclaimed(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn messages_before_the_worker_joins_are_handed_over_when_it_does() {
        let mut d = Dispatch::default();
        let now = Instant::now();
        // Its old incarnation's history, then the new one's first messages.
        d.deliver("late", 10, Ok(event(1, 5)), now);
        d.deliver("late", 10, Ok(event(2, 0)), now);
        d.deliver("late", 10, Ok(event(2, 1)), now);
        d.caught_up();
        assert_eq!(d.unclaimed(), (1, 30));
        let (_, mut late) = d.join("late", 2);
        assert_eq!(
            drain(&mut late),
            [
                FeedItem::Message(event(2, 0)),
                FeedItem::Message(event(2, 1)),
                FeedItem::CaughtUp
            ]
        );
        assert_eq!(d.unclaimed(), (0, 0));
        // A restart not registered yet: its messages wait apart from the follower's.
        d.deliver("late", 10, Ok(event(3, 0)), now);
        assert!(drain(&mut late).is_empty());
        let (_, mut restarted) = d.join("late", 3);
        assert_eq!(
            drain(&mut restarted),
            [FeedItem::Message(event(3, 0)), FeedItem::CaughtUp]
        );
        // The first follower's queue is closed: it was replaced.
        assert!(late.recv().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn kept_messages_are_bounded_and_an_overflow_is_handed_over_as_a_loss() {
        let mut d = Dispatch::default();
        let now = Instant::now();
        for seq in 0..=UNCLAIMED_MESSAGES as u64 {
            d.deliver("w", 100, Ok(event(1, seq)), now);
        }
        assert_eq!(d.unclaimed(), (1, 0), "overflowed: only the loss is kept");
        d.deliver("w", 100, Ok(event(1, 99)), now);
        assert_eq!(d.unclaimed(), (1, 0));
        let (_, mut w) = d.join("w", 1);
        assert_eq!(drain(&mut w), [FeedItem::Lost]);
        // Bytes, every subject together.
        d.deliver("x", UNCLAIMED_BYTES - 10, Ok(event(1, 0)), now);
        d.deliver("y", 11, Ok(event(1, 0)), now);
        assert_eq!(d.unclaimed(), (2, UNCLAIMED_BYTES - 10));
        let (_, mut y) = d.join("y", 1);
        assert_eq!(drain(&mut y), [FeedItem::Lost]);
        // Kept only for a while.
        tokio::time::advance(UNCLAIMED_FOR).await;
        d.tidy(Instant::now());
        assert_eq!(d.unclaimed(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_drops_and_the_follower_learns_of_it_as_soon_as_there_is_room() {
        let mut d = Dispatch::default();
        let (_, mut w) = d.join("w", 1);
        let now = Instant::now();
        for seq in 0..FOLLOWER_QUEUE as u64 + 5 {
            d.deliver("w", 10, Ok(event(1, seq)), now);
        }
        let items = drain(&mut w);
        assert_eq!(items.len(), FOLLOWER_QUEUE);
        assert_eq!(
            items.last(),
            Some(&FeedItem::Message(event(1, FOLLOWER_QUEUE as u64 - 1)))
        );
        // Nothing more comes from the worker: the tidy tells it.
        d.tidy(now);
        assert_eq!(drain(&mut w), [FeedItem::Lost]);
        d.deliver("w", 10, Ok(event(1, 900)), now);
        assert_eq!(drain(&mut w), [FeedItem::Message(event(1, 900))]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_consumer_that_could_not_resume_sends_everyone_to_a_snapshot() {
        let mut d = Dispatch::default();
        let (_, mut a) = d.join("a", 1);
        let now = Instant::now();
        d.deliver("gone", 10, Ok(event(1, 0)), now);
        d.caught_up();
        assert_eq!(drain(&mut a), [FeedItem::CaughtUp]);
        d.restarted(true, now);
        assert!(drain(&mut a).is_empty(), "resumed: nothing lost");
        assert!(!d.is_caught_up());
        d.restarted(false, now);
        assert_eq!(drain(&mut a), [FeedItem::Lost]);
        let (_, mut gone) = d.join("gone", 1);
        assert_eq!(drain(&mut gone), [FeedItem::Lost]);
    }

    #[tokio::test]
    async fn a_subscription_dropped_leaves_unless_a_newer_one_took_its_place() {
        let dispatch = Arc::new(parking_lot::Mutex::new(Dispatch::default()));
        let first = FeedSubscription::join(&dispatch, "w", 1);
        let second = FeedSubscription::join(&dispatch, "w", 2);
        drop(first);
        assert_eq!(
            dispatch.lock().followers(),
            1,
            "the restart's follower stays"
        );
        drop(second);
        assert_eq!(dispatch.lock().followers(), 0);
    }
}
