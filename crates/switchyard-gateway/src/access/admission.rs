//! Fair admission: at most `max_concurrent_requests` requests run; when every slot is taken,
//! waiters queue per flow and free slots go round-robin across flows, so one session's
//! sub-agent fan-out cannot starve the other sessions.
//!
//! A flow is a (tenant, session) pair ([`FlowKey`]). The tenant is the request's `user`, else a
//! hash of its bearer key, else the client's IP address, else one shared anonymous tenant; the
//! session is the `x-session-id` header (requests without one share their tenant's
//! session-less flow). [`FairQueue`] serves two levels of round-robin: one turn per active
//! tenant, and within a tenant's turn one waiter of its next active session. This is deficit
//! round-robin with equal weights and a cost of one request per grant; inside a flow, waiters
//! are served by their request's `priority` with aging (below), first come, first served at
//! equal priority.
//!
//! Priority orders a flow's own waiters only (a session's sub-agents, say), never one flow
//! against another: a client cannot buy its way past other tenants' fair turns by sending a
//! low number. Aging counts arrivals, not time, so it is deterministic: a waiter's place is its
//! arrival number plus its priority (lower is earlier, clamped to ±[`PRIORITY_LEVELS`]) times
//! [`AGING_ARRIVALS`]. A waiter is overtaken only by waiters of its flow that arrive within
//! `2 × PRIORITY_LEVELS × AGING_ARRIVALS` arrivals after it, so none waits unboundedly
//! however many more urgent requests keep coming.
//!
//! [`FairQueue`] is the synchronous core. [`Admission`] wraps it: exactly one waiter, the
//! *head* (the next one the fair order chose), waits on the semaphore; when it gets a slot it
//! leaves, and the fair order chooses the next head. New arrivals take a free slot directly only
//! when nobody waits, so they cannot overtake the line. A waiter whose client goes away (its
//! future dropped) leaves the line at once, passing the head on if it held it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use axum::http::{HeaderMap, header};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::error::ApiError;
use crate::observe::metrics::Metrics;

/// Seconds a client refused for a full queue is asked to wait.
const RETRY_AFTER_SECS: u64 = 1;

/// Who a waiting request belongs to, for fair shares.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// `tenant:<an API key's tenant>`, `user:<user>`, `key:<hash of the bearer key>`,
    /// `ip:<address>` or `anonymous`.
    pub tenant: String,
    /// The `x-session-id`, if the request gave one.
    pub session: Option<String>,
}

impl FlowKey {
    /// The flow of a request: its session within its tenant, the tenant taken from the
    /// `user` field, else the `Authorization` bearer key or Anthropic's `x-api-key` (hashed,
    /// never kept in clear), else the client's address.
    pub fn of_request(
        session: Option<String>,
        user: Option<&str>,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Self {
        let user = user.map(str::trim).filter(|u| !u.is_empty());
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
                    .unwrap_or(v)
                    .trim()
            })
            .filter(|k| !k.is_empty())
            .or_else(|| {
                headers
                    .get("x-api-key")
                    .and_then(|v| v.to_str().ok())
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
            });
        let tenant = match (user, key, peer) {
            (Some(user), _, _) => format!("user:{user}"),
            (None, Some(key), _) => {
                let mut hasher = std::hash::DefaultHasher::new();
                key.hash(&mut hasher);
                format!("key:{:016x}", hasher.finish())
            }
            (None, None, Some(ip)) => format!("ip:{ip}"),
            (None, None, None) => "anonymous".to_owned(),
        };
        Self { tenant, session }
    }
}

impl FlowKey {
    /// The flow of a request let in by an API key: the key's tenant, and the session within it.
    pub fn of_tenant(tenant: &str, session: Option<String>) -> Self {
        Self {
            tenant: format!("tenant:{tenant}"),
            session,
        }
    }
}

/// Identifies one waiter in a [`FairQueue`].
pub type Ticket = u64;

/// Priorities beyond ± this many levels order a flow's waiters as these do.
pub const PRIORITY_LEVELS: i32 = 8;

/// Arrivals one priority level is worth: a waiter one level more urgent goes ahead of those
/// that arrived up to this many arrivals before it.
pub const AGING_ARRIVALS: i64 = 16;

/// A waiter's place in its flow: its arrival number moved by its priority, then the ticket
/// (arrival order) among equal places.
type Place = (i64, Ticket);

fn place_of(ticket: Ticket, priority: i32) -> Place {
    let levels = i64::from(priority.clamp(-PRIORITY_LEVELS, PRIORITY_LEVELS));
    let arrival = i64::try_from(ticket).unwrap_or(i64::MAX);
    (arrival.saturating_add(levels * AGING_ARRIVALS), ticket)
}

/// Why a [`FairQueue`] refused a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    #[error("the admission queue is full")]
    Total,
    #[error("this flow has as many waiters queued as it may")]
    Flow,
}

/// Waiters per flow, served round-robin across tenants and then across each tenant's sessions.
#[derive(Debug)]
pub struct FairQueue<T> {
    tenants: HashMap<String, TenantLine<T>>,
    /// Tenants with waiters, the next to be served in front.
    tenant_turns: VecDeque<String>,
    /// Where each queued ticket waits, and its place there.
    flow_of: HashMap<Ticket, (FlowKey, Place)>,
    next_ticket: Ticket,
    max_total: usize,
    max_per_flow: usize,
}

#[derive(Debug)]
struct TenantLine<T> {
    /// Each session's waiters by place: the first is the next to serve.
    sessions: HashMap<Option<String>, BTreeMap<Place, T>>,
    /// Sessions with waiters, the next to be served in front.
    session_turns: VecDeque<Option<String>>,
}

impl<T> FairQueue<T> {
    pub fn new(max_total: usize, max_per_flow: usize) -> Self {
        Self {
            tenants: HashMap::new(),
            tenant_turns: VecDeque::new(),
            flow_of: HashMap::new(),
            next_ticket: 0,
            max_total,
            max_per_flow,
        }
    }

    /// Waiters queued.
    pub fn len(&self) -> usize {
        self.flow_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flow_of.is_empty()
    }

    /// Queues `item` at the back of its flow, unless the queue or the flow is full.
    pub fn push(&mut self, flow: FlowKey, item: T) -> Result<Ticket, QueueFull> {
        self.push_at(flow, 0, item)
    }

    /// Queues `item` in its flow at `priority` (lower is earlier, 0 the default, aged as the
    /// module says), unless the queue or the flow is full.
    pub fn push_at(&mut self, flow: FlowKey, priority: i32, item: T) -> Result<Ticket, QueueFull> {
        if self.len() >= self.max_total {
            return Err(QueueFull::Total);
        }
        let flow_len = self
            .tenants
            .get(&flow.tenant)
            .and_then(|t| t.sessions.get(&flow.session))
            .map_or(0, BTreeMap::len);
        if flow_len >= self.max_per_flow {
            return Err(QueueFull::Flow);
        }
        let tenant = self
            .tenants
            .entry(flow.tenant.clone())
            .or_insert_with(|| TenantLine {
                sessions: HashMap::new(),
                session_turns: VecDeque::new(),
            });
        let waiters = tenant.sessions.entry(flow.session.clone()).or_default();
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        if waiters.is_empty() {
            tenant.session_turns.push_back(flow.session.clone());
            if tenant.session_turns.len() == 1 {
                self.tenant_turns.push_back(flow.tenant.clone());
            }
        }
        let place = place_of(ticket, priority);
        waiters.insert(place, item);
        self.flow_of.insert(ticket, (flow, place));
        Ok(ticket)
    }

    /// The next waiter in fair order: the first waiter (by place) of the next session of the
    /// next tenant.
    pub fn pop(&mut self) -> Option<(Ticket, T)> {
        let tenant_name = self.tenant_turns.pop_front()?;
        let tenant = self.tenants.get_mut(&tenant_name)?;
        let session = tenant.session_turns.pop_front()?;
        let waiters = tenant.sessions.get_mut(&session)?;
        let ((_, ticket), item) = waiters.pop_first()?;
        if waiters.is_empty() {
            tenant.sessions.remove(&session);
        } else {
            tenant.session_turns.push_back(session);
        }
        if tenant.session_turns.is_empty() {
            self.tenants.remove(&tenant_name);
        } else {
            self.tenant_turns.push_back(tenant_name);
        }
        self.flow_of.remove(&ticket);
        Some((ticket, item))
    }

    /// Takes a waiter out wherever it is (its client went away).
    pub fn remove(&mut self, ticket: Ticket) -> Option<T> {
        let (flow, place) = self.flow_of.remove(&ticket)?;
        let tenant = self.tenants.get_mut(&flow.tenant)?;
        let waiters = tenant.sessions.get_mut(&flow.session)?;
        let item = waiters.remove(&place)?;
        if waiters.is_empty() {
            tenant.sessions.remove(&flow.session);
            tenant.session_turns.retain(|s| *s != flow.session);
            if tenant.session_turns.is_empty() {
                self.tenants.remove(&flow.tenant);
                self.tenant_turns.retain(|t| *t != flow.tenant);
            }
        }
        Some(item)
    }
}

/// Bounded fair admission: `max_concurrent` requests run, at most `max_queued` wait (and at
/// most `max_queued_per_flow` of one flow), the rest get 429 with `Retry-After`. Independently,
/// one client address may have at most `max_per_client` requests waiting or running.
#[derive(Debug)]
pub struct Admission {
    permits: Arc<Semaphore>,
    max_queued: usize,
    line: Mutex<Line>,
    clients: Arc<Clients>,
}

/// What an admitted request holds until it is done: its slot, and its place in its client's
/// count.
#[derive(Debug)]
pub struct Admitted {
    _slot: OwnedSemaphorePermit,
    _client: Option<ClientSlot>,
}

/// Requests in flight per client address (0 = no limit).
#[derive(Debug, Default)]
struct Clients {
    max: usize,
    in_flight: Mutex<HashMap<IpAddr, usize>>,
}

impl Clients {
    fn lock(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for one more request of `client`, unless it has `max` already.
    fn enter(self: &Arc<Self>, client: IpAddr) -> Result<ClientSlot, ApiError> {
        let mut in_flight = self.lock();
        let count = in_flight.entry(client).or_insert(0);
        if *count >= self.max {
            return Err(ApiError::ClientLimit(self.max));
        }
        *count += 1;
        Ok(ClientSlot {
            clients: Arc::clone(self),
            client,
        })
    }
}

/// One request counted against its client; leaving (dropped) frees the place.
#[derive(Debug)]
struct ClientSlot {
    clients: Arc<Clients>,
    client: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut in_flight = self.clients.lock();
        if let Some(count) = in_flight.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&self.client);
            }
        }
    }
}

#[derive(Debug)]
struct Line {
    /// Waiters not yet chosen; each is told through its sender when it becomes the head.
    queue: FairQueue<oneshot::Sender<()>>,
    /// The waiter chosen to take the next free slot, the only one waiting on the semaphore.
    /// Invariant between calls: the queue is empty, or there is a head.
    head: Option<Ticket>,
}

impl Line {
    /// Chooses the next head in fair order if there is none.
    fn choose_head(&mut self) {
        if self.head.is_some() {
            return;
        }
        while let Some((ticket, chosen)) = self.queue.pop() {
            // A failed send means that waiter is leaving right now; try the next one.
            if chosen.send(()).is_ok() {
                self.head = Some(ticket);
                return;
            }
        }
    }
}

impl Admission {
    pub fn new(max_concurrent: usize, max_queued: usize, max_queued_per_flow: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max_concurrent)),
            max_queued,
            line: Mutex::new(Line {
                queue: FairQueue::new(max_queued, max_queued_per_flow),
                head: None,
            }),
            clients: Arc::default(),
        }
    }

    /// At most `max` requests in flight per client address (0: no limit).
    pub fn with_client_limit(mut self, max: usize) -> Self {
        self.clients = Arc::new(Clients {
            max,
            in_flight: Mutex::default(),
        });
        self
    }

    fn line(&self) -> MutexGuard<'_, Line> {
        // The line's state is consistent between statements, so a panic elsewhere cannot have
        // left it half-changed.
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot to run in, waiting in `flow`'s line (at the request's `priority` among that
    /// flow's waiters) when all are taken and the line has room, unless `client` (the
    /// connection's address) already has as many requests in flight as one client may.
    /// Everything is released when the [`Admitted`] drops.
    pub async fn admit(
        &self,
        flow: FlowKey,
        priority: Option<i32>,
        client: Option<IpAddr>,
        metrics: &Metrics,
    ) -> Result<Admitted, ApiError> {
        let client = match client {
            Some(ip) if self.clients.max > 0 => Some(self.clients.enter(ip)?),
            _ => None,
        };
        let slot = self.slot(flow, priority.unwrap_or(0), metrics).await?;
        Ok(Admitted {
            _slot: slot,
            _client: client,
        })
    }

    async fn slot(
        &self,
        flow: FlowKey,
        priority: i32,
        metrics: &Metrics,
    ) -> Result<OwnedSemaphorePermit, ApiError> {
        let queued_at = Instant::now();
        let saturated = ApiError::Saturated {
            retry_after_secs: RETRY_AFTER_SECS,
        };
        let (ticket, chosen) = {
            let mut line = self.line();
            // No head means nobody waits: a free slot may be taken without queueing.
            if line.head.is_none()
                && let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned()
            {
                metrics.admission_wait.observe(0.0);
                return Ok(permit);
            }
            let waiting = line.queue.len() + usize::from(line.head.is_some());
            if waiting >= self.max_queued {
                tracing::debug!(reason = %QueueFull::Total, "request refused");
                return Err(saturated);
            }
            let (chosen_tx, chosen_rx) = oneshot::channel();
            let ticket = line
                .queue
                .push_at(flow, priority, chosen_tx)
                .map_err(|full| {
                    tracing::debug!(reason = %full, "request refused");
                    saturated
                })?;
            line.choose_head();
            (ticket, chosen_rx)
        };
        metrics.queued.inc();
        // From here on, dropping this future (the client went away) leaves the line.
        let waiting = Waiting {
            admission: self,
            metrics,
            ticket,
        };
        chosen.await.map_err(|_| shutting_down())?;
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| shutting_down())?;
        drop(waiting);
        metrics
            .admission_wait
            .observe(queued_at.elapsed().as_secs_f64());
        Ok(permit)
    }
}

fn shutting_down() -> ApiError {
    ApiError::Unavailable("the gateway is shutting down".into())
}

/// A queued waiter; dropping it (admitted or gone) takes it out of the line.
struct Waiting<'a> {
    admission: &'a Admission,
    metrics: &'a Metrics,
    ticket: Ticket,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut line = self.admission.line();
        if line.head == Some(self.ticket) {
            line.head = None;
            line.choose_head();
        } else {
            line.queue.remove(self.ticket);
        }
        drop(line);
        self.metrics.queued.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(tenant: &str, session: &str) -> FlowKey {
        FlowKey {
            tenant: tenant.to_owned(),
            session: (!session.is_empty()).then(|| session.to_owned()),
        }
    }

    fn drain(queue: &mut FairQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| queue.pop().map(|(_, item)| item)).collect()
    }

    #[test]
    fn flows_take_turns_and_keep_their_own_order() {
        let mut queue = FairQueue::new(100, 100);
        for item in ["a1", "a2", "a3", "a4"] {
            queue.push(flow("t", "a"), item).unwrap();
        }
        queue.push(flow("t", "b"), "b1").unwrap();
        queue.push(flow("t", "c"), "c1").unwrap();
        queue.push(flow("t", "c"), "c2").unwrap();
        assert_eq!(queue.len(), 7);
        assert_eq!(
            drain(&mut queue),
            ["a1", "b1", "c1", "a2", "c2", "a3", "a4"]
        );
        assert!(queue.is_empty());
    }

    #[test]
    fn tenants_take_turns_before_their_sessions_do() {
        let mut queue = FairQueue::new(100, 100);
        // Tenant x fans out over three sessions; tenant y has one request.
        for (session, item) in [("s1", "x1"), ("s2", "x2"), ("s3", "x3"), ("s1", "x4")] {
            queue.push(flow("user:x", session), item).unwrap();
        }
        queue.push(flow("user:y", ""), "y1").unwrap();
        queue.push(flow("user:y", ""), "y2").unwrap();
        // y is served every other grant although x has three busy sessions.
        assert_eq!(drain(&mut queue), ["x1", "y1", "x2", "y2", "x3", "x4"]);
    }

    #[test]
    fn a_flow_cannot_fill_the_queue_and_the_queue_is_bounded() {
        let mut queue = FairQueue::new(5, 3);
        for _ in 0..3 {
            queue.push(flow("t", "fan"), "fan").unwrap();
        }
        assert_eq!(queue.push(flow("t", "fan"), "fan"), Err(QueueFull::Flow));
        queue.push(flow("t", "b"), "b").unwrap();
        queue.push(flow("u", ""), "u").unwrap();
        assert_eq!(queue.push(flow("v", ""), "v"), Err(QueueFull::Total));
        assert_eq!(queue.len(), 5);
        // Room again once one leaves.
        queue.pop().unwrap();
        queue.push(flow("t", "fan"), "fan").unwrap();
        assert_eq!(queue.push(flow("w", ""), "w"), Err(QueueFull::Total));
    }

    #[test]
    fn within_a_flow_a_lower_priority_goes_first_and_flows_still_take_turns() {
        let mut queue = FairQueue::new(100, 100);
        queue.push_at(flow("t", "a"), 0, "a1").unwrap();
        queue.push_at(flow("t", "a"), 0, "a2").unwrap();
        // A very urgent waiter of another flow gets its flow's turn, no more.
        queue.push_at(flow("t", "b"), -100, "b1").unwrap();
        queue.push_at(flow("t", "b"), 3, "b2").unwrap();
        queue.push_at(flow("t", "a"), -2, "a3").unwrap();
        let b3 = queue.push_at(flow("t", "b"), -1, "b3").unwrap();
        assert_eq!(queue.len(), 6);
        // Removal finds a waiter wherever its priority put it.
        assert_eq!(queue.remove(b3), Some("b3"));
        assert_eq!(drain(&mut queue), ["a3", "b1", "a1", "b2", "a2"]);
        assert!(queue.flow_of.is_empty());
    }

    #[test]
    fn aging_bounds_how_often_a_waiter_can_be_overtaken() {
        let bound = 2 * PRIORITY_LEVELS as usize * AGING_ARRIVALS as usize;
        let mut queue = FairQueue::new(10_000, 10_000);
        // The least urgent waiter there is (any larger value counts as PRIORITY_LEVELS)...
        queue.push_at(flow("t", "s"), i32::MAX, "late").unwrap();
        // ...then a stream of the most urgent ones, twice as long as the bound.
        for _ in 0..2 * bound {
            queue.push_at(flow("t", "s"), i32::MIN, "urgent").unwrap();
        }
        let order = drain(&mut queue);
        let served_at = order.iter().position(|w| *w == "late").unwrap();
        // Overtaken by exactly the urgent waiters that arrived within the bound (tickets 1 to
        // bound - 1), and by no later one.
        assert_eq!(served_at, bound - 1);
        assert_eq!(order.len(), 2 * bound + 1);
    }

    #[test]
    fn cancelled_waiters_leave_no_trace() {
        let mut queue = FairQueue::new(100, 100);
        let a1 = queue.push(flow("t", "a"), "a1").unwrap();
        queue.push(flow("t", "a"), "a2").unwrap();
        let b1 = queue.push(flow("t", "b"), "b1").unwrap();
        let x1 = queue.push(flow("x", ""), "x1").unwrap();
        queue.push(flow("t", "c"), "c1").unwrap();
        assert_eq!(queue.remove(b1), Some("b1"));
        assert_eq!(queue.remove(b1), None);
        assert_eq!(queue.remove(x1), Some("x1"));
        assert_eq!(queue.remove(a1), Some("a1"));
        assert_eq!(queue.len(), 2);
        assert_eq!(drain(&mut queue), ["a2", "c1"]);
        // Nothing of the removed flows is left behind.
        assert!(queue.tenants.is_empty() && queue.tenant_turns.is_empty());
        assert!(queue.flow_of.is_empty());
    }

    /// Random pushes, pops and removals against a plain list: nothing is lost or duplicated,
    /// `len` is exact, and a non-empty queue always yields a waiter.
    #[test]
    fn random_operations_keep_the_queue_consistent() {
        let mut queue = FairQueue::new(40, 12);
        let mut present: Vec<Ticket> = Vec::new();
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..20_000 {
            let roll = next();
            match roll % 4 {
                0 | 1 => {
                    let f = flow(&format!("t{}", next() % 3), &format!("s{}", next() % 4));
                    if let Ok(ticket) = queue.push(f, ()) {
                        present.push(ticket);
                    }
                }
                2 => match queue.pop() {
                    Some((ticket, ())) => present.retain(|t| *t != ticket),
                    None => assert!(present.is_empty()),
                },
                _ if !present.is_empty() => {
                    let ticket = present.swap_remove((next() % present.len() as u64) as usize);
                    assert_eq!(queue.remove(ticket), Some(()));
                }
                _ => {}
            }
            assert_eq!(queue.len(), present.len());
            assert_eq!(queue.tenants.len(), queue.tenant_turns.len());
        }
    }

    #[test]
    fn the_flow_is_the_session_within_the_tenant() {
        let mut headers = HeaderMap::new();
        let ip = Some(IpAddr::from([10, 0, 0, 7]));
        let f = FlowKey::of_request(Some("s".into()), None, &headers, ip);
        assert_eq!(f, flow("ip:10.0.0.7", "s"));
        assert_eq!(
            FlowKey::of_request(None, None, &headers, None),
            flow("anonymous", "")
        );
        let mut anthropic = HeaderMap::new();
        anthropic.insert("x-api-key", "sk-1".parse().unwrap());
        headers.insert(header::AUTHORIZATION, "Bearer sk-1".parse().unwrap());
        let keyed = FlowKey::of_request(None, None, &headers, ip);
        assert!(keyed.tenant.starts_with("key:") && !keyed.tenant.contains("sk-1"));
        // The same key sent as Anthropic's clients send it is the same tenant.
        assert_eq!(FlowKey::of_request(None, None, &anthropic, ip), keyed);
        let user = FlowKey::of_request(None, Some("alice"), &headers, ip);
        assert_eq!(user, flow("user:alice", ""));
    }

    /// An [`Admission`] under test, recording the order requests are admitted in.
    struct Harness {
        admission: Arc<Admission>,
        metrics: Arc<Metrics>,
        grants: Arc<Mutex<Vec<String>>>,
    }

    impl Harness {
        fn new(max_concurrent: usize, max_queued: usize, max_per_flow: usize) -> Self {
            Self {
                admission: Arc::new(Admission::new(max_concurrent, max_queued, max_per_flow)),
                metrics: Arc::new(Metrics::new()),
                grants: Arc::new(Mutex::new(Vec::new())),
            }
        }

        /// A request of `f` that records `name` when admitted, then finishes.
        fn request(&self, f: FlowKey, name: &str) -> tokio::task::JoinHandle<Result<(), ApiError>> {
            self.request_at(f, None, name)
        }

        /// As [`Harness::request`], at `priority`.
        fn request_at(
            &self,
            f: FlowKey,
            priority: Option<i32>,
            name: &str,
        ) -> tokio::task::JoinHandle<Result<(), ApiError>> {
            let admission = Arc::clone(&self.admission);
            let metrics = Arc::clone(&self.metrics);
            let grants = Arc::clone(&self.grants);
            let name = name.to_owned();
            tokio::spawn(async move {
                let _permit = admission.admit(f, priority, None, &metrics).await?;
                grants.lock().unwrap().push(name);
                tokio::task::yield_now().await;
                Ok(())
            })
        }

        fn grants(&self) -> Vec<String> {
            self.grants.lock().unwrap().clone()
        }
    }

    async fn until_queued(metrics: &Metrics, n: i64) {
        while metrics.queued.get() != n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_fan_out_does_not_starve_single_requests() {
        let h = Harness::new(1, 64, 64);
        let holder = h
            .admission
            .admit(flow("ip:1", "x"), None, None, &h.metrics)
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for i in 0..32 {
            tasks.push(h.request(flow("ip:1", "fan"), &format!("fan{i}")));
        }
        until_queued(&h.metrics, 32).await;
        for s in ["b", "c", "d", "e"] {
            tasks.push(h.request(flow("ip:1", s), s));
        }
        until_queued(&h.metrics, 36).await;
        drop(holder);
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let grants = h.grants();
        assert_eq!(grants.len(), 36);
        // fan0 was chosen as the head before the others arrived; then the flows take turns.
        assert_eq!(grants[..6], ["fan0", "fan1", "b", "c", "d", "e"]);
        let fans: Vec<_> = grants.iter().filter(|g| g.starts_with("fan")).collect();
        let in_order: Vec<_> = (0..32).map(|i| format!("fan{i}")).collect();
        assert!(fans.iter().zip(&in_order).all(|(a, b)| *a == b), "{fans:?}");
        assert_eq!(h.metrics.queued.get(), 0);
        let text = h.metrics.encode();
        assert!(text.contains("switchyard_admission_wait_seconds_count 37"));
    }

    #[tokio::test]
    async fn a_flows_waiters_are_admitted_by_priority() {
        let h = Harness::new(1, 64, 64);
        let holder = h
            .admission
            .admit(flow("t", "s"), None, None, &h.metrics)
            .await
            .unwrap();
        // The first waiter becomes the head at once (nobody was waiting to be chosen over).
        let mut tasks = vec![h.request_at(flow("t", "s"), Some(5), "head")];
        until_queued(&h.metrics, 1).await;
        for (name, priority) in [
            ("p0", None),
            ("urgent", Some(-3)),
            ("p1", Some(1)),
            ("urgent2", Some(-3)),
        ] {
            tasks.push(h.request_at(flow("t", "s"), priority, name));
            until_queued(&h.metrics, tasks.len() as i64).await;
        }
        drop(holder);
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        assert_eq!(h.grants(), ["head", "urgent", "urgent2", "p0", "p1"]);
    }

    #[tokio::test]
    async fn full_lines_are_refused_and_departed_waiters_free_their_place() {
        let h = Harness::new(1, 3, 2);
        let holder = h
            .admission
            .admit(flow("t", "x"), None, None, &h.metrics)
            .await
            .unwrap();
        let head = h.request(flow("t", "a"), "a0");
        let a1 = h.request(flow("t", "a"), "a1");
        let a2 = h.request(flow("t", "a"), "a2");
        until_queued(&h.metrics, 3).await;
        // The line is full (3 waiting), and flow a has its share queued behind the head.
        let refused = h
            .admission
            .admit(flow("t", "b"), None, None, &h.metrics)
            .await;
        assert!(matches!(refused, Err(ApiError::Saturated { .. })));
        // A waiter whose client leaves gives its place back, the head included.
        a1.abort();
        assert!(a1.await.unwrap_err().is_cancelled());
        head.abort();
        assert!(head.await.unwrap_err().is_cancelled());
        assert_eq!(h.metrics.queued.get(), 1);
        let b = h.request(flow("t", "b"), "b");
        until_queued(&h.metrics, 2).await;
        drop(holder);
        a2.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
        assert_eq!(h.grants(), ["a2", "b"]);
        assert_eq!(h.metrics.queued.get(), 0);
        // With nobody waiting, a free slot is taken at once.
        assert!(
            h.admission
                .admit(flow("t", "c"), None, None, &h.metrics)
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn one_client_may_hold_only_its_share_queued_or_running() {
        let admission = Admission::new(1, 16, 16).with_client_limit(2);
        let metrics = Metrics::new();
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let running = admission
            .admit(flow("t", "1"), None, Some(a), &metrics)
            .await
            .unwrap();
        // The second of client a waits for the one slot: it counts while it waits.
        let waiting = admission.admit(flow("t", "2"), None, Some(a), &metrics);
        tokio::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        let third = admission
            .admit(flow("t", "3"), None, Some(a), &metrics)
            .await;
        assert!(matches!(third, Err(ApiError::ClientLimit(2))), "{third:?}");
        // Another client is not affected by a's share; without an address there is no limit.
        let other = admission.admit(flow("t", "4"), None, Some(b), &metrics);
        tokio::pin!(other);
        assert!(futures::poll!(other.as_mut()).is_pending());
        drop(running);
        let second = waiting.await.unwrap();
        drop(second);
        drop(other.await.unwrap());
        // Places free as requests finish: a may send two again.
        let again = admission
            .admit(flow("t", "5"), None, Some(a), &metrics)
            .await
            .unwrap();
        drop(again);
        assert!(admission.clients.lock().is_empty());
        let unlimited = Admission::new(4, 4, 4);
        let held: Vec<_> = futures::future::join_all(
            (0..4).map(|i| unlimited.admit(flow("t", &i.to_string()), None, Some(a), &metrics)),
        )
        .await;
        assert!(held.iter().all(Result::is_ok));
    }
}
