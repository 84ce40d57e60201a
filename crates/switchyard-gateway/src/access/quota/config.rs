//! `[quota]`: per-tenant limits, the store that counts them, and what happens when it is away;
//! with its flags (`--quota-*`, `SWITCHYARD_QUOTA_*`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// The limits one tenant has; 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Requests a tenant may start per window.
    pub requests_per_window: u64,
    /// Prompt plus completion tokens a tenant may use per window; counted when a request ends,
    /// checked when the next one arrives.
    pub tokens_per_window: u64,
    /// Requests of a tenant in flight at once, over every gateway replica.
    pub concurrent_requests: u64,
}

impl Limits {
    pub fn is_unlimited(&self) -> bool {
        *self == Self::default()
    }
}

/// What a request gets when the store cannot answer in time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum StoreDown {
    /// Let it in (the limits are not enforced while the store is away).
    #[default]
    FailOpen,
    /// Refuse it with 503 and `Retry-After`.
    FailClosed,
}

impl StoreDown {
    pub fn label(self) -> &'static str {
        match self {
            StoreDown::FailOpen => "fail_open",
            StoreDown::FailClosed => "fail_closed",
        }
    }
}

/// The Redis every replica counts in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://host:port[/db]` or `rediss://…` for TLS.
    pub url: String,
    /// File holding the password (`AUTH`), so it is not in the URL or the config; a Kubernetes
    /// Secret mounted as a file works. Surrounding whitespace is dropped.
    pub password_file: Option<PathBuf>,
    /// User name for Redis ACLs (with `password_file`).
    pub username: Option<String>,
    /// PEM CA bundle a `rediss://` server's certificate is checked against (default: the
    /// system's roots).
    pub ca_file: Option<PathBuf>,
}

/// Fleet-wide per-tenant quotas (see [`super`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaConfig {
    /// Length of a counting window in seconds (60 makes the limits per minute).
    pub window_secs: u64,
    /// Limits of every tenant without its own entry.
    #[serde(flatten)]
    pub default: Limits,
    /// Per-tenant limits, by the tenant as fairness names it (`tenant:<API key tenant>`,
    /// `user:<user>`, `key:<hash>`, `ip:<address>`, `anonymous`); replace the default.
    pub tenants: BTreeMap<String, Limits>,
    /// Where the counts live; none counts in this replica alone.
    pub redis: Option<RedisConfig>,
    /// What a request gets when Redis does not answer within `store_timeout_ms`.
    pub on_store_error: StoreDown,
    /// Longest wait for Redis per request, in milliseconds.
    pub store_timeout_ms: u64,
    /// Seconds a concurrency lease lives unless its replica renews it (every third of it): a
    /// crashed replica's slots come back after this.
    pub lease_ttl_secs: u64,
    /// Prefix of every key in Redis (several clusters may share one Redis).
    pub key_prefix: String,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        Self {
            window_secs: 60,
            default: Limits::default(),
            tenants: BTreeMap::new(),
            redis: None,
            on_store_error: StoreDown::FailOpen,
            store_timeout_ms: 250,
            lease_ttl_secs: 30,
            key_prefix: "switchyard".to_owned(),
        }
    }
}

impl QuotaConfig {
    /// Whether any tenant has a limit.
    pub fn enabled(&self) -> bool {
        !self.default.is_unlimited() || self.tenants.values().any(|l| !l.is_unlimited())
    }

    /// The limits of `tenant`.
    pub fn limits_of(&self, tenant: &str) -> Limits {
        self.tenants.get(tenant).copied().unwrap_or(self.default)
    }

    pub fn window(&self) -> Duration {
        Duration::from_secs(self.window_secs)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    pub fn store_timeout(&self) -> Duration {
        Duration::from_millis(self.store_timeout_ms)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.window_secs == 0 {
            return Err("quota.window_secs must be at least 1".into());
        }
        if self.store_timeout_ms == 0 {
            return Err("quota.store_timeout_ms must be at least 1".into());
        }
        if self.lease_ttl_secs < 3 {
            return Err(
                "quota.lease_ttl_secs must be at least 3 (leases are renewed every third of it)"
                    .into(),
            );
        }
        if self.key_prefix.is_empty() {
            return Err("quota.key_prefix must not be empty".into());
        }
        if let Some(redis) = &self.redis {
            let scheme_ok = redis.url.starts_with("redis://") || redis.url.starts_with("rediss://");
            if !scheme_ok {
                return Err(format!(
                    "quota.redis.url must start with redis:// or rediss://, got {:?}",
                    redis.url
                ));
            }
            if redis.ca_file.is_some() && !redis.url.starts_with("rediss://") {
                return Err("quota.redis.ca_file needs a rediss:// url (TLS)".into());
            }
            if redis.username.is_some() && redis.password_file.is_none() {
                return Err("quota.redis.username needs quota.redis.password_file".into());
            }
        }
        Ok(())
    }
}

/// The quota flags; each overrides its `[quota]` key.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct QuotaArgs {
    /// Requests each tenant may start per quota window, over every replica (0: no limit).
    #[arg(long, env = "SWITCHYARD_QUOTA_REQUESTS_PER_WINDOW")]
    pub quota_requests_per_window: Option<u64>,
    /// Tokens (prompt + completion) each tenant may use per quota window (0: no limit).
    #[arg(long, env = "SWITCHYARD_QUOTA_TOKENS_PER_WINDOW")]
    pub quota_tokens_per_window: Option<u64>,
    /// Requests of each tenant in flight at once over every replica (0: no limit).
    #[arg(long, env = "SWITCHYARD_QUOTA_CONCURRENT_REQUESTS")]
    pub quota_concurrent_requests: Option<u64>,
    /// Quota window in seconds (default 60: limits per minute).
    #[arg(long, env = "SWITCHYARD_QUOTA_WINDOW_SECS")]
    pub quota_window_secs: Option<u64>,
    /// Redis the replicas share quota counts in (redis:// or rediss://).
    #[arg(long, env = "SWITCHYARD_QUOTA_REDIS_URL")]
    pub quota_redis_url: Option<String>,
    /// File with the Redis password.
    #[arg(long, env = "SWITCHYARD_QUOTA_REDIS_PASSWORD_FILE")]
    pub quota_redis_password_file: Option<PathBuf>,
    /// Redis ACL user name.
    #[arg(long, env = "SWITCHYARD_QUOTA_REDIS_USERNAME")]
    pub quota_redis_username: Option<String>,
    /// CA bundle (PEM) for a rediss:// Redis.
    #[arg(long, env = "SWITCHYARD_QUOTA_REDIS_CA_FILE")]
    pub quota_redis_ca_file: Option<PathBuf>,
    /// When Redis does not answer: fail-open (admit) or fail-closed (503).
    #[arg(long, env = "SWITCHYARD_QUOTA_ON_STORE_ERROR")]
    pub quota_on_store_error: Option<StoreDown>,
    /// Longest wait for Redis per request, in milliseconds.
    #[arg(long, env = "SWITCHYARD_QUOTA_STORE_TIMEOUT_MS")]
    pub quota_store_timeout_ms: Option<u64>,
}

impl QuotaArgs {
    pub fn apply(&self, config: &mut QuotaConfig) {
        let limits = &mut config.default;
        if let Some(v) = self.quota_requests_per_window {
            limits.requests_per_window = v;
        }
        if let Some(v) = self.quota_tokens_per_window {
            limits.tokens_per_window = v;
        }
        if let Some(v) = self.quota_concurrent_requests {
            limits.concurrent_requests = v;
        }
        if let Some(v) = self.quota_window_secs {
            config.window_secs = v;
        }
        if let Some(url) = &self.quota_redis_url {
            config.redis.get_or_insert_with(RedisConfig::default).url = url.clone();
        }
        if let Some(redis) = &mut config.redis {
            if let Some(v) = &self.quota_redis_password_file {
                redis.password_file = Some(v.clone());
            }
            if let Some(v) = &self.quota_redis_username {
                redis.username = Some(v.clone());
            }
            if let Some(v) = &self.quota_redis_ca_file {
                redis.ca_file = Some(v.clone());
            }
        }
        if let Some(v) = self.quota_on_store_error {
            config.on_store_error = v;
        }
        if let Some(v) = self.quota_store_timeout_ms {
            config.store_timeout_ms = v;
        }
    }

    /// Redis settings given without a Redis URL would be silently ignored: refuse them.
    pub fn check(&self, config: &QuotaConfig) -> Result<(), String> {
        let orphan = [
            (
                "--quota-redis-password-file",
                self.quota_redis_password_file.is_some(),
            ),
            (
                "--quota-redis-username",
                self.quota_redis_username.is_some(),
            ),
            ("--quota-redis-ca-file", self.quota_redis_ca_file.is_some()),
        ]
        .into_iter()
        .find(|(_, given)| *given);
        match orphan {
            Some((flag, _)) if config.redis.is_none() => Err(format!(
                "{flag} needs a Redis (--quota-redis-url or quota.redis.url)"
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_override_the_default_and_bad_values_are_named() {
        let config: QuotaConfig = toml::from_str(
            r#"
            window_secs = 10
            requests_per_window = 5
            on_store_error = "fail-closed"
            [tenants."tenant:big"]
            requests_per_window = 50
            concurrent_requests = 4
            [redis]
            url = "redis://127.0.0.1:6379"
            "#,
        )
        .unwrap();
        assert!(config.enabled());
        assert_eq!(config.limits_of("user:x").requests_per_window, 5);
        let big = config.limits_of("tenant:big");
        assert_eq!((big.requests_per_window, big.concurrent_requests), (50, 4));
        assert_eq!(config.on_store_error, StoreDown::FailClosed);
        config.validate().unwrap();
        let mut bad = config.clone();
        bad.redis = Some(RedisConfig {
            url: "http://x".into(),
            ..RedisConfig::default()
        });
        assert!(bad.validate().unwrap_err().contains("quota.redis.url"));
        let mut bad = config;
        bad.window_secs = 0;
        assert!(bad.validate().unwrap_err().contains("window_secs"));
        assert!(!QuotaConfig::default().enabled());
        let unknown = toml::from_str::<QuotaConfig>("request_per_window = 1");
        assert!(unknown.is_err());
    }

    #[test]
    fn flags_override_and_orphan_redis_flags_are_refused() {
        let args = QuotaArgs {
            quota_requests_per_window: Some(7),
            quota_redis_url: Some("redis://h:1".into()),
            quota_on_store_error: Some(StoreDown::FailClosed),
            ..QuotaArgs::default()
        };
        let mut config = QuotaConfig::default();
        args.apply(&mut config);
        assert_eq!(config.default.requests_per_window, 7);
        assert_eq!(
            config.redis.as_ref().map(|r| r.url.as_str()),
            Some("redis://h:1")
        );
        assert_eq!(config.on_store_error, StoreDown::FailClosed);
        args.check(&config).unwrap();
        let orphan = QuotaArgs {
            quota_redis_ca_file: Some("/ca.pem".into()),
            ..QuotaArgs::default()
        };
        let mut config = QuotaConfig::default();
        orphan.apply(&mut config);
        assert!(
            orphan
                .check(&config)
                .unwrap_err()
                .contains("--quota-redis-ca-file")
        );
    }
}
