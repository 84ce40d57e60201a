//! [`RedisStore`]: quota counts in one Redis shared by every gateway replica.
//!
//! Each check is one Lua script (one round trip, atomic in Redis): it reads the server's clock
//! (`TIME`, so replicas' clocks need not agree), checks the token count of the current window,
//! drops expired leases and counts the live ones, and only when everything fits `INCR`s the
//! request counter and adds the lease. Counters expire two windows after they start; a lease is a
//! member of the tenant's sorted set scored by its expiry, so a crashed replica's leases lapse
//! after the lease TTL. Keys: `<prefix>:quota:{<tenant>}:<requests|tokens|leases>[:<window>]`
//! (the tenant in a hash tag keeps a tenant's keys on one Redis Cluster slot).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::config::{Limits, RedisConfig};
use super::store::{Lease, Limit, QuotaStore, StoreError, Verdict};

const ENTER: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local index = math.floor(now / window)
local retry = window - (now % window)
local max_requests, max_tokens, max_leases = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if max_tokens > 0 then
  local used = tonumber(redis.call('GET', KEYS[2] .. ':' .. index) or '0')
  if used >= max_tokens then return {2, retry} end
end
if max_leases > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_leases then return {3, 1000} end
end
if max_requests > 0 then
  local key = KEYS[1] .. ':' .. index
  local n = redis.call('INCR', key)
  if n == 1 then redis.call('PEXPIRE', key, window * 2) end
  if n > max_requests then return {1, retry} end
end
if max_leases > 0 then
  local ttl = tonumber(ARGV[6])
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  if redis.call('PTTL', KEYS[3]) < ttl then redis.call('PEXPIRE', KEYS[3], ttl) end
end
return {0, 0}
"#;

const CHARGE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local key = KEYS[1] .. ':' .. math.floor(now / window)
redis.call('INCRBY', key, ARGV[2])
redis.call('PEXPIRE', key, window * 2)
return 0
"#;

/// KEYS: lease sets; ARGV: the TTL, then one lease id per key.
const RENEW: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ttl, ARGV[i + 1])
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 0
"#;

/// Counts in Redis; one multiplexed connection that reconnects by itself.
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
    enter: Script,
    charge: Script,
    renew: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for `config`; connects lazily, so a Redis that is down at start is a store
    /// error per request (handled as configured), not a gateway that will not start. Only a
    /// bad URL or an unreadable file fails here. `timeout` bounds each call.
    pub fn connect(
        config: &RedisConfig,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let connection = connection_of(config, timeout)?;
        Ok(Self {
            connection,
            prefix: format!("{prefix}:quota"),
            enter: Script::new(ENTER),
            charge: Script::new(CHARGE),
            renew: Script::new(RENEW),
        })
    }

    fn key(&self, tenant: &str, what: &str) -> String {
        format!("{}:{{{tenant}}}:{what}", self.prefix)
    }
}

/// A lazily connecting, self-reconnecting connection to the Redis `config` names, each call
/// bounded by `timeout`: a Redis that is down at start fails calls, not the gateway's start.
pub(crate) fn connection_of(
    config: &RedisConfig,
    timeout: Duration,
) -> Result<ConnectionManager, StoreError> {
    let client = client_of(config)?;
    let manager_config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_lazy_with_config(client, manager_config)
        .map_err(|e| StoreError(format!("redis at {}: {e}", redacted(&config.url))))
}

/// The Redis client: URL, then the password and user from their files, then TLS roots.
fn client_of(config: &RedisConfig) -> Result<Client, StoreError> {
    let url = redacted(&config.url);
    let bad = |e: &dyn std::fmt::Display| StoreError(format!("redis url {url}: {e}"));
    let mut info: redis::ConnectionInfo =
        redis::IntoConnectionInfo::into_connection_info(config.url.as_str())
            .map_err(|e| bad(&e))?;
    if let Some(path) = &config.password_file {
        let password = std::fs::read_to_string(path).map_err(|e| {
            StoreError(format!(
                "cannot read the redis password file {}: {e}",
                path.display()
            ))
        })?;
        let mut settings = info.redis_settings().clone().set_password(password.trim());
        if let Some(user) = &config.username {
            settings = settings.set_username(user);
        }
        info = info.set_redis_settings(settings);
    }
    match &config.ca_file {
        Some(path) => {
            let root_cert = std::fs::read(path).map_err(|e| {
                StoreError(format!(
                    "cannot read the redis CA file {}: {e}",
                    path.display()
                ))
            })?;
            let certs = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root_cert),
            };
            Client::build_with_tls(info, certs).map_err(|e| bad(&e))
        }
        None => Client::open(info).map_err(|e| bad(&e)),
    }
}

/// The URL without a password it may carry.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***{}", &url[..scheme], &url[at..])
        }
        _ => url.to_owned(),
    }
}

fn failed(e: redis::RedisError) -> StoreError {
    StoreError(e.to_string())
}

fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

#[async_trait::async_trait]
impl QuotaStore for RedisStore {
    async fn enter(
        &self,
        lease: &Lease,
        limits: Limits,
        window: Duration,
        lease_ttl: Duration,
    ) -> Result<Verdict, StoreError> {
        let mut connection = self.connection.clone();
        let (code, retry_ms): (u8, u64) = self
            .enter
            .key(self.key(&lease.tenant, "requests"))
            .key(self.key(&lease.tenant, "tokens"))
            .key(self.key(&lease.tenant, "leases"))
            .arg(ms(window))
            .arg(limits.requests_per_window)
            .arg(limits.tokens_per_window)
            .arg(limits.concurrent_requests)
            .arg(&lease.id)
            .arg(ms(lease_ttl))
            .invoke_async(&mut connection)
            .await
            .map_err(failed)?;
        let limit = match code {
            0 => return Ok(Verdict::Admit),
            1 => Limit::Requests,
            2 => Limit::Tokens,
            3 => Limit::Concurrency,
            other => return Err(StoreError(format!("the quota script answered {other}"))),
        };
        Ok(Verdict::Refuse {
            limit,
            retry_after: Duration::from_millis(retry_ms),
        })
    }

    async fn charge_tokens(
        &self,
        tenant: &str,
        tokens: u64,
        window: Duration,
    ) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let _: i64 = self
            .charge
            .key(self.key(tenant, "tokens"))
            .arg(ms(window))
            .arg(tokens)
            .invoke_async(&mut connection)
            .await
            .map_err(failed)?;
        Ok(())
    }

    async fn renew(&self, leases: &[Lease], lease_ttl: Duration) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let mut invocation = self.renew.prepare_invoke();
        invocation.arg(ms(lease_ttl));
        for lease in leases {
            invocation
                .key(self.key(&lease.tenant, "leases"))
                .arg(&lease.id);
        }
        let mut connection = self.connection.clone();
        let _: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .map_err(failed)?;
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let _: i64 = redis::cmd("ZREM")
            .arg(self.key(&lease.tenant, "leases"))
            .arg(&lease.id)
            .query_async(&mut connection)
            .await
            .map_err(failed)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::quota::store::conformance;

    #[test]
    fn passwords_do_not_reach_the_log() {
        assert_eq!(
            redacted("redis://:s3cret@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redacted("rediss://host:6380"), "rediss://host:6380");
    }

    #[test]
    fn unreadable_files_and_bad_urls_are_named() {
        let config = RedisConfig {
            url: "redis://127.0.0.1:1".into(),
            password_file: Some("/nonexistent/redis-password".into()),
            ..RedisConfig::default()
        };
        let err = RedisStore::connect(&config, "t", Duration::from_secs(1)).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/redis-password"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn the_redis_store_passes_the_conformance_suite() {
        let server = switchyard_testkit::redis::RedisServer::start().unwrap();
        let config = RedisConfig {
            url: server.url(),
            ..RedisConfig::default()
        };
        let store = RedisStore::connect(&config, "conformance", Duration::from_secs(2)).unwrap();
        conformance::run_all(&store, "redis").await;
    }

    #[tokio::test]
    async fn a_password_from_its_file_is_used() {
        let server = switchyard_testkit::redis::RedisServer::start_with_password("pw-1").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("password");
        std::fs::write(&file, "pw-1\n").unwrap();
        let limits = Limits {
            requests_per_window: 1,
            ..Limits::default()
        };
        let lease = Lease {
            tenant: "t".into(),
            id: "1".into(),
        };
        let (window, ttl) = (Duration::from_secs(60), Duration::from_secs(5));
        let without = RedisConfig {
            url: server.url(),
            ..RedisConfig::default()
        };
        let store = RedisStore::connect(&without, "pw", Duration::from_secs(2)).unwrap();
        let refused = store.enter(&lease, limits, window, ttl).await;
        assert!(refused.is_err(), "{refused:?}");
        let with = RedisConfig {
            password_file: Some(file),
            ..without
        };
        let store = RedisStore::connect(&with, "pw", Duration::from_secs(2)).unwrap();
        assert_eq!(
            store.enter(&lease, limits, window, ttl).await.unwrap(),
            Verdict::Admit
        );
    }
}
