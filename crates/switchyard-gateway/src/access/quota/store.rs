//! Where quota counts live: the [`QuotaStore`] seam, and [`MemoryStore`], the counts of this
//! replica alone (quotas without Redis, and the reference the Redis store is checked against).
//!
//! Both count the same way, as Envoy's global rate limit service does: fixed windows aligned on
//! the Unix epoch (so every replica agrees on where a window starts), one counter per tenant,
//! limit and window; concurrency as leases that expire unless renewed.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::config::Limits;

/// Which of a tenant's limits refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Requests,
    Tokens,
    Concurrency,
}

impl Limit {
    /// The limit's configuration name, as the 429 says it.
    pub fn name(self) -> &'static str {
        match self {
            Limit::Requests => "requests_per_window",
            Limit::Tokens => "tokens_per_window",
            Limit::Concurrency => "concurrent_requests",
        }
    }
}

/// The store's answer to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Counted in; with a concurrency limit, its lease is held.
    Admit,
    /// Over `limit`; the next window (or a free slot) is `retry_after` away.
    Refuse { limit: Limit, retry_after: Duration },
}

/// One request's concurrency slot in its tenant's count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Lease {
    pub tenant: String,
    /// Unique over every replica (the replica's id and a sequence number).
    pub id: String,
}

/// The store could not answer; whether the request goes in is the configuration's call.
#[derive(Debug, thiserror::Error)]
#[error("quota store: {0}")]
pub struct StoreError(pub String);

/// Counts of every tenant, shared by the replicas that use the same store.
#[async_trait::async_trait]
pub trait QuotaStore: Send + Sync + std::fmt::Debug {
    /// Checks `limits` for one more request of `tenant` and, if it fits, counts it (and holds
    /// `lease` for `lease_ttl` when there is a concurrency limit). Atomic over every replica.
    async fn enter(
        &self,
        lease: &Lease,
        limits: Limits,
        window: Duration,
        lease_ttl: Duration,
    ) -> Result<Verdict, StoreError>;

    /// Adds `tokens` to `tenant`'s count of the current window.
    async fn charge_tokens(
        &self,
        tenant: &str,
        tokens: u64,
        window: Duration,
    ) -> Result<(), StoreError>;

    /// Extends `leases` to `lease_ttl` from now (their requests still run).
    async fn renew(&self, leases: &[Lease], lease_ttl: Duration) -> Result<(), StoreError>;

    /// Gives `lease`'s slot back.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError>;
}

/// Milliseconds since the Unix epoch.
pub(crate) fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The window `now_ms` falls in, and how long until the next one starts.
pub(crate) fn window_of(now_ms: u64, window: Duration) -> (u64, Duration) {
    let len = (window.as_millis() as u64).max(1);
    (now_ms / len, Duration::from_millis(len - now_ms % len))
}

/// Counts kept in this process: the limits hold per replica.
#[derive(Debug, Default)]
pub struct MemoryStore {
    tenants: Mutex<HashMap<String, TenantCounts>>,
}

#[derive(Debug, Default)]
struct TenantCounts {
    /// (window, count).
    requests: (u64, u64),
    tokens: (u64, u64),
    /// Lease id → expiry (ms since the epoch).
    leases: HashMap<String, u64>,
}

impl TenantCounts {
    fn in_window(count: &mut (u64, u64), window: u64) -> &mut u64 {
        if count.0 != window {
            *count = (window, 0);
        }
        &mut count.1
    }
}

#[async_trait::async_trait]
impl QuotaStore for MemoryStore {
    async fn enter(
        &self,
        lease: &Lease,
        limits: Limits,
        window: Duration,
        lease_ttl: Duration,
    ) -> Result<Verdict, StoreError> {
        let now = epoch_ms();
        let (index, retry_after) = window_of(now, window);
        let mut tenants = self.tenants.lock();
        let counts = tenants.entry(lease.tenant.clone()).or_default();
        let refuse = |limit| Ok(Verdict::Refuse { limit, retry_after });
        if limits.tokens_per_window > 0
            && *TenantCounts::in_window(&mut counts.tokens, index) >= limits.tokens_per_window
        {
            return refuse(Limit::Tokens);
        }
        if limits.concurrent_requests > 0 {
            counts.leases.retain(|_, expiry| *expiry > now);
            if counts.leases.len() as u64 >= limits.concurrent_requests {
                return Ok(Verdict::Refuse {
                    limit: Limit::Concurrency,
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        if limits.requests_per_window > 0 {
            let requests = TenantCounts::in_window(&mut counts.requests, index);
            if *requests >= limits.requests_per_window {
                return refuse(Limit::Requests);
            }
            *requests += 1;
        }
        if limits.concurrent_requests > 0 {
            counts
                .leases
                .insert(lease.id.clone(), now + lease_ttl.as_millis() as u64);
        }
        Ok(Verdict::Admit)
    }

    async fn charge_tokens(
        &self,
        tenant: &str,
        tokens: u64,
        window: Duration,
    ) -> Result<(), StoreError> {
        let (index, _) = window_of(epoch_ms(), window);
        let mut tenants = self.tenants.lock();
        let counts = tenants.entry(tenant.to_owned()).or_default();
        *TenantCounts::in_window(&mut counts.tokens, index) += tokens;
        Ok(())
    }

    async fn renew(&self, leases: &[Lease], lease_ttl: Duration) -> Result<(), StoreError> {
        let expiry = epoch_ms() + lease_ttl.as_millis() as u64;
        let mut tenants = self.tenants.lock();
        for lease in leases {
            if let Some(held) = tenants
                .get_mut(&lease.tenant)
                .and_then(|c| c.leases.get_mut(&lease.id))
            {
                *held = expiry;
            }
        }
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        if let Some(counts) = self.tenants.lock().get_mut(&lease.tenant) {
            counts.leases.remove(&lease.id);
        }
        Ok(())
    }
}

/// The behaviour every store must have, run against [`MemoryStore`] here and against a real
/// Redis in `redis.rs`'s tests.
#[cfg(test)]
pub(crate) mod conformance {
    use super::*;

    fn lease(tenant: &str, id: &str) -> Lease {
        Lease {
            tenant: tenant.to_owned(),
            id: id.to_owned(),
        }
    }

    /// An hour: a check crosses into the next window only if it runs over an hour's turn.
    const WINDOW: Duration = Duration::from_secs(3600);
    const TTL: Duration = Duration::from_secs(60);

    pub(crate) async fn requests_are_counted_per_tenant(store: &dyn QuotaStore, tenant: &str) {
        let limits = Limits {
            requests_per_window: 3,
            ..Limits::default()
        };
        for i in 0..3 {
            let verdict = store
                .enter(&lease(tenant, &i.to_string()), limits, WINDOW, TTL)
                .await
                .unwrap();
            assert_eq!(verdict, Verdict::Admit, "request {i}");
        }
        let Verdict::Refuse { limit, retry_after } = store
            .enter(&lease(tenant, "3"), limits, WINDOW, TTL)
            .await
            .unwrap()
        else {
            panic!("the fourth request was admitted");
        };
        assert_eq!(limit, Limit::Requests);
        assert!(retry_after <= WINDOW && retry_after > Duration::ZERO);
        // Another tenant has its own count.
        let other = format!("{tenant}-other");
        let verdict = store.enter(&lease(&other, "x"), limits, WINDOW, TTL).await;
        assert_eq!(verdict.unwrap(), Verdict::Admit);
    }

    pub(crate) async fn tokens_refuse_once_used_up(store: &dyn QuotaStore, tenant: &str) {
        let limits = Limits {
            tokens_per_window: 100,
            ..Limits::default()
        };
        let t = lease(tenant, "t");
        let enter = || store.enter(&t, limits, WINDOW, TTL);
        assert_eq!(enter().await.unwrap(), Verdict::Admit);
        store.charge_tokens(tenant, 99, WINDOW).await.unwrap();
        assert_eq!(enter().await.unwrap(), Verdict::Admit);
        store.charge_tokens(tenant, 1, WINDOW).await.unwrap();
        assert!(matches!(
            enter().await.unwrap(),
            Verdict::Refuse {
                limit: Limit::Tokens,
                ..
            }
        ));
    }

    pub(crate) async fn leases_hold_slots_until_released_or_expired(
        store: &dyn QuotaStore,
        tenant: &str,
    ) {
        let limits = Limits {
            concurrent_requests: 2,
            ..Limits::default()
        };
        let short = Duration::from_millis(300);
        let (a, b, c) = (lease(tenant, "a"), lease(tenant, "b"), lease(tenant, "c"));
        assert_eq!(
            store.enter(&a, limits, WINDOW, TTL).await.unwrap(),
            Verdict::Admit
        );
        // b's replica "crashes": its lease is never released nor renewed.
        assert_eq!(
            store.enter(&b, limits, WINDOW, short).await.unwrap(),
            Verdict::Admit
        );
        let full = store.enter(&c, limits, WINDOW, TTL).await.unwrap();
        assert!(
            matches!(
                full,
                Verdict::Refuse {
                    limit: Limit::Concurrency,
                    ..
                }
            ),
            "{full:?}"
        );
        // a renewed stays; b expires and its slot comes back.
        store.renew(std::slice::from_ref(&a), TTL).await.unwrap();
        tokio::time::sleep(short * 2).await;
        assert_eq!(
            store.enter(&c, limits, WINDOW, TTL).await.unwrap(),
            Verdict::Admit
        );
        let d = lease(tenant, "d");
        assert!(matches!(
            store.enter(&d, limits, WINDOW, TTL).await.unwrap(),
            Verdict::Refuse { .. }
        ));
        store.release(&a).await.unwrap();
        assert_eq!(
            store.enter(&d, limits, WINDOW, TTL).await.unwrap(),
            Verdict::Admit
        );
    }

    /// Every check, each on its own tenant so the store may be shared.
    pub(crate) async fn run_all(store: &dyn QuotaStore, prefix: &str) {
        requests_are_counted_per_tenant(store, &format!("{prefix}:requests")).await;
        tokens_refuse_once_used_up(store, &format!("{prefix}:tokens")).await;
        leases_hold_slots_until_released_or_expired(store, &format!("{prefix}:leases")).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_memory_store_passes_the_conformance_suite() {
        conformance::run_all(&MemoryStore::default(), "mem").await;
    }

    #[test]
    fn windows_are_aligned_on_the_epoch() {
        let minute = Duration::from_secs(60);
        assert_eq!(window_of(120_000, minute), (2, minute));
        assert_eq!(window_of(179_999, minute), (2, Duration::from_millis(1)));
    }
}
