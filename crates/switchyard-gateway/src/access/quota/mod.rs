//! Fleet-wide per-tenant quotas: requests and tokens per window, and requests in flight, that
//! hold over every gateway replica because the replicas count in one store (Redis, see
//! [`redis`]), the way Envoy's global rate limiting does.
//!
//! The tenant is the one fair admission already derives ([`crate::access::admission::FlowKey`]): an
//! API key's tenant, else the request's `user`, its bearer key's hash or its address. A request
//! first passes its tenant's quota ([`Quotas::enter`]), then waits for a local slot in fair
//! admission. Over a limit it gets 429 with `Retry-After` (the next window, or 1 s for
//! concurrency) and the limit's name. Its [`QuotaPass`] holds its concurrency lease (renewed
//! while it runs, so a crashed replica's slots come back after the lease TTL) and, when it
//! ends, charges the tokens it used to the current window.
//!
//! When the store does not answer in time the request fails open or closed as configured
//! ([`StoreDown`]); each such request is counted in `switchyard_quota_store_errors_total` and
//! logged (at most once a second).
//!
//! Without `[quota.redis]` the counts live in this replica ([`store::MemoryStore`]), so the
//! limits hold per replica.

pub mod config;
pub mod redis;
pub mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{Limits, QuotaArgs, QuotaConfig, RedisConfig, StoreDown};
pub(crate) use redis::connection_of as redis_connection;
use store::{Lease, MemoryStore, QuotaStore, StoreError, Verdict};

use crate::error::ApiError;
pub use crate::observe::quota_metrics::QuotaMetrics;
use crate::observe::quota_metrics::{LimitLabels, StoreErrorLabels};

/// The quota gate of one replica.
#[derive(Debug)]
pub struct Quotas {
    config: QuotaConfig,
    /// None when no tenant has a limit.
    store: Option<Arc<dyn QuotaStore>>,
    metrics: QuotaMetrics,
    /// Leases of this replica's running requests, renewed by [`Quotas::renew_leases`].
    leases: Mutex<HashMap<String, Lease>>,
    /// This replica's part of every lease id.
    replica: String,
    next_lease: AtomicU64,
    /// Releases and token charges, which outlive the request that made them.
    tasks: TaskTracker,
    /// When a store error was last logged (they are counted each, logged once a second).
    last_logged: Mutex<Option<Instant>>,
}

impl Quotas {
    /// The gate `config` describes, counting in Redis when it names one.
    pub fn new(config: QuotaConfig, metrics: QuotaMetrics) -> Result<Self, StoreError> {
        let store: Option<Arc<dyn QuotaStore>> = match (&config.redis, config.enabled()) {
            (_, false) => None,
            (Some(redis), true) => Some(Arc::new(redis::RedisStore::connect(
                redis,
                &config.key_prefix,
                config.store_timeout(),
            )?)),
            (None, true) => Some(Arc::new(MemoryStore::default())),
        };
        Ok(Self::with_store(config, store, metrics))
    }

    fn with_store(
        config: QuotaConfig,
        store: Option<Arc<dyn QuotaStore>>,
        metrics: QuotaMetrics,
    ) -> Self {
        // Random per gate (the standard library's hasher keys come from the OS): replicas in
        // containers share pid 1 and may start in the same millisecond.
        let replica = {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(store::epoch_ms());
            format!("{:016x}", hasher.finish())
        };
        Self {
            config,
            store,
            metrics,
            leases: Mutex::new(HashMap::new()),
            replica,
            next_lease: AtomicU64::new(0),
            tasks: TaskTracker::new(),
            last_logged: Mutex::new(None),
        }
    }

    /// Whether any limit applies (a disabled gate costs nothing per request).
    pub fn enabled(&self) -> bool {
        self.store.is_some()
    }

    /// Counts one request of `tenant` against its limits: a pass to hold until the request
    /// ends, or the 429 (or, with the store away and failing closed, the 503) to answer.
    pub async fn enter(self: &Arc<Self>, tenant: &str) -> Result<QuotaPass, ApiError> {
        let Some(store) = &self.store else {
            return Ok(QuotaPass::free());
        };
        let limits = self.config.limits_of(tenant);
        if limits.is_unlimited() {
            return Ok(QuotaPass::free());
        }
        let n = self.next_lease.fetch_add(1, Ordering::Relaxed);
        let lease = Lease {
            tenant: tenant.to_owned(),
            id: format!("{}-{n}", self.replica),
        };
        let verdict = tokio::time::timeout(
            self.config.store_timeout(),
            store.enter(
                &lease,
                limits,
                self.config.window(),
                self.config.lease_ttl(),
            ),
        )
        .await
        .unwrap_or_else(|_| Err(StoreError("no answer in time".into())));
        match verdict {
            Ok(Verdict::Admit) => {
                let held = limits.concurrent_requests > 0;
                if held {
                    self.leases.lock().insert(lease.id.clone(), lease.clone());
                }
                let count_tokens = limits.tokens_per_window > 0;
                Ok(QuotaPass {
                    quotas: (held || count_tokens).then(|| Arc::clone(self)),
                    tenant: lease.tenant.clone(),
                    lease: held.then_some(lease),
                    count_tokens,
                    tokens: AtomicU64::new(0),
                })
            }
            Ok(Verdict::Refuse { limit, retry_after }) => {
                self.metrics
                    .refused
                    .get_or_create(&LimitLabels {
                        limit: limit.name(),
                    })
                    .inc();
                tracing::debug!(
                    tenant,
                    limit = limit.name(),
                    "request over its tenant's quota"
                );
                Err(ApiError::QuotaExceeded {
                    limit: limit.name(),
                    retry_after_secs: retry_after.as_millis().div_ceil(1000).max(1) as u64,
                })
            }
            Err(err) => self.store_down(tenant, &err),
        }
    }

    /// What a request gets when the store could not answer.
    fn store_down(&self, tenant: &str, err: &StoreError) -> Result<QuotaPass, ApiError> {
        let outcome = self.config.on_store_error;
        self.metrics
            .store_errors
            .get_or_create(&StoreErrorLabels {
                outcome: outcome.label(),
            })
            .inc();
        let mut last = self.last_logged.lock();
        if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            *last = Some(Instant::now());
            tracing::warn!(error = %err, tenant, outcome = outcome.label(), "quota store unavailable");
        }
        match outcome {
            StoreDown::FailOpen => Ok(QuotaPass::free()),
            StoreDown::FailClosed => Err(ApiError::QuotaStoreDown),
        }
    }

    /// Renews this replica's leases every third of their TTL until `cancel`; a crashed replica
    /// stops renewing, and its slots lapse.
    pub async fn renew_leases(self: Arc<Self>, cancel: CancellationToken) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let ttl = self.config.lease_ttl();
        let mut tick = tokio::time::interval(ttl / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                _ = tick.tick() => {}
            }
            let leases: Vec<Lease> = self.leases.lock().values().cloned().collect();
            if leases.is_empty() {
                continue;
            }
            let renewed = tokio::time::timeout(ttl / 3, store.renew(&leases, ttl)).await;
            if !matches!(renewed, Ok(Ok(()))) {
                tracing::warn!(leases = leases.len(), "cannot renew quota leases; retrying");
            }
        }
        // Releases and charges in flight get the store's timeout to finish.
        self.tasks.close();
        let _ = tokio::time::timeout(self.config.store_timeout(), self.tasks.wait()).await;
    }

    /// Gives a finished request's lease back and charges its tokens, off the request's path.
    fn settle(self: &Arc<Self>, tenant: String, lease: Option<Lease>, tokens: u64) {
        let Some(store) = self.store.clone() else {
            return;
        };
        if let Some(lease) = &lease {
            self.leases.lock().remove(&lease.id);
        }
        if lease.is_none() && tokens == 0 {
            return;
        }
        let timeout = self.config.store_timeout();
        let window = self.config.window();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let task = self.tasks.track_future(async move {
            if let Some(lease) = lease
                && !matches!(
                    tokio::time::timeout(timeout, store.release(&lease)).await,
                    Ok(Ok(()))
                )
            {
                tracing::debug!(tenant = %lease.tenant, "cannot release a quota lease; it lapses");
            }
            if tokens > 0
                && !matches!(
                    tokio::time::timeout(timeout, store.charge_tokens(&tenant, tokens, window))
                        .await,
                    Ok(Ok(()))
                )
            {
                tracing::debug!(tenant, tokens, "cannot charge tokens to the quota store");
            }
        });
        runtime.spawn(task);
    }
}

impl Quotas {
    /// Waits for the releases and charges of the passes dropped so far to reach the store.
    pub async fn settled(&self) {
        self.tasks.close();
        self.tasks.wait().await;
        self.tasks.reopen();
    }
}

impl Default for Quotas {
    /// A gate with no limit.
    fn default() -> Self {
        Self::with_store(QuotaConfig::default(), None, QuotaMetrics::default())
    }
}

/// What a request admitted by its quota holds until it ends.
#[derive(Debug)]
pub struct QuotaPass {
    quotas: Option<Arc<Quotas>>,
    tenant: String,
    lease: Option<Lease>,
    /// Whether the tenant has a token limit (else its tokens are not sent to the store).
    count_tokens: bool,
    tokens: AtomicU64,
}

impl QuotaPass {
    /// A pass that holds nothing (no limit applies, or the store was away and the request
    /// failed open).
    pub fn free() -> Self {
        Self {
            quotas: None,
            tenant: String::new(),
            lease: None,
            count_tokens: false,
            tokens: AtomicU64::new(0),
        }
    }

    /// Counts `tokens` the request used; charged to its tenant's window when it ends.
    pub fn charge(&self, tokens: u64) {
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
    }
}

impl Drop for QuotaPass {
    fn drop(&mut self) {
        if let Some(quotas) = self.quotas.take() {
            let tokens = if self.count_tokens {
                *self.tokens.get_mut()
            } else {
                0
            };
            quotas.settle(std::mem::take(&mut self.tenant), self.lease.take(), tokens);
        }
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
