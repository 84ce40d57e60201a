//! The event plane's settings (`[event_plane]` in the worker's and the gateway's configuration,
//! `--event-plane*` flags): where NATS is, how to authenticate to it, and how much history the
//! JetStream stream keeps.

use std::path::PathBuf;

use serde::Deserialize;

/// Where the KV event plane is and how it is reached. Without a URL there is no plane: workers
/// serve KV events only over their gRPC streams, gateways open one per worker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventPlaneConfig {
    /// NATS server URL(s), comma-separated: `nats://host:4222` (`tls://` forces TLS).
    pub url: Option<String>,
    /// NATS user (with `password`).
    pub user: Option<String>,
    pub password: Option<String>,
    /// NATS authentication token (instead of user and password).
    pub token: Option<String>,
    /// PEM CA certificate(s) the NATS server's certificate is checked against; setting it
    /// requires TLS.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate and key, for a NATS server that verifies its clients.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Seconds of history the stream keeps (a gateway that starts later than this after an
    /// event asks the worker for a snapshot instead).
    pub max_age_secs: u64,
    /// Bytes of history the stream keeps at most (the oldest messages go first).
    pub max_bytes: i64,
    /// Where the JetStream server keeps the stream: `file` or `memory`.
    pub storage: Storage,
    /// Copies of the stream in a clustered JetStream.
    pub replicas: usize,
    /// Workers publish a digest of their blocks to the plane this often (milliseconds; 0: none),
    /// which every gateway checks against its index as it does a gRPC stream's digests.
    pub digest_interval_ms: u32,
}

/// Where JetStream keeps the stream's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    #[default]
    File,
    Memory,
}

/// An hour of history at most by default: long enough for a gateway restart to catch up from
/// the stream, short enough that a busy fleet's stream stays small.
pub const DEFAULT_MAX_AGE_SECS: u64 = 3600;
/// 1 GiB of history at most by default.
pub const DEFAULT_MAX_BYTES: i64 = 1 << 30;

/// A digest every 10 s by default: one small message per worker, whatever the gateways.
pub const DEFAULT_DIGEST_INTERVAL_MS: u32 = 10_000;

impl Default for EventPlaneConfig {
    fn default() -> Self {
        Self {
            url: None,
            user: None,
            password: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            max_age_secs: DEFAULT_MAX_AGE_SECS,
            max_bytes: DEFAULT_MAX_BYTES,
            storage: Storage::File,
            replicas: 1,
            digest_interval_ms: DEFAULT_DIGEST_INTERVAL_MS,
        }
    }
}

impl EventPlaneConfig {
    /// Whether KV events go through the plane.
    pub fn enabled(&self) -> bool {
        self.url.as_deref().is_some_and(|u| !u.trim().is_empty())
    }

    /// Checks the settings once at start; the message is one sentence for the operator.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(url) = &self.url {
            for server in url.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let scheme_ok = ["nats://", "tls://"]
                    .iter()
                    .any(|scheme| server.starts_with(scheme));
                if !scheme_ok {
                    return Err(format!(
                        "event_plane.url: {server:?} is not a nats:// or tls:// URL"
                    ));
                }
            }
        }
        if self.user.is_some() != self.password.is_some() {
            return Err("event_plane: user and password go together".into());
        }
        if self.token.is_some() && self.user.is_some() {
            return Err("event_plane: give a token or a user and password, not both".into());
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("event_plane: tls_cert and tls_key go together".into());
        }
        if self.max_age_secs == 0 {
            return Err("event_plane.max_age_secs must be at least 1".into());
        }
        if self.max_bytes < 1 {
            return Err("event_plane.max_bytes must be at least 1".into());
        }
        if self.replicas == 0 || self.replicas > 5 {
            return Err("event_plane.replicas must be 1 to 5".into());
        }
        Ok(())
    }

    /// Whether the connection is encrypted (a CA, a client certificate or a `tls://` URL).
    pub fn tls(&self) -> bool {
        self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self
                .url
                .as_deref()
                .is_some_and(|u| u.split(',').any(|s| s.trim().starts_with("tls://")))
    }
}

/// The `--event-plane*` flags (and `SWITCHYARD_EVENT_PLANE*` variables), over the file's
/// `[event_plane]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EventPlaneArgs {
    /// Publish (worker) or consume (gateway) KV events through this NATS JetStream server,
    /// e.g. nats://nats:4222; unset: direct gRPC streams.
    #[arg(long = "event-plane", env = "SWITCHYARD_EVENT_PLANE")]
    pub event_plane: Option<String>,
    /// NATS user (with --event-plane-password).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_USER")]
    pub event_plane_user: Option<String>,
    /// NATS password.
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_PASSWORD", hide_env_values = true)]
    pub event_plane_password: Option<String>,
    /// NATS authentication token.
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_TOKEN", hide_env_values = true)]
    pub event_plane_token: Option<String>,
    /// PEM CA the NATS server's certificate is checked against (requires TLS).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_CA")]
    pub event_plane_ca: Option<PathBuf>,
    /// PEM client certificate for NATS (with --event-plane-key).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_CERT")]
    pub event_plane_cert: Option<PathBuf>,
    /// PEM client key for NATS.
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_KEY")]
    pub event_plane_key: Option<PathBuf>,
    /// Seconds of KV-event history the stream keeps (default 3600).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_MAX_AGE_SECS")]
    pub event_plane_max_age_secs: Option<u64>,
    /// Bytes of KV-event history the stream keeps (default 1 GiB).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_MAX_BYTES")]
    pub event_plane_max_bytes: Option<i64>,
    /// Where JetStream keeps the stream: file (default) or memory.
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_STORAGE")]
    pub event_plane_storage: Option<Storage>,
    /// Milliseconds between the digests a worker publishes to the plane (default 10000; 0: none).
    #[arg(long, env = "SWITCHYARD_EVENT_PLANE_DIGEST_INTERVAL_MS")]
    pub event_plane_digest_interval_ms: Option<u32>,
}

impl EventPlaneArgs {
    /// Lays the flags over `config`.
    pub fn apply(&self, config: &mut EventPlaneConfig) {
        if let Some(v) = &self.event_plane {
            // Empty (a variable left in a manifest) turns the plane off.
            config.url = Some(v.clone()).filter(|v| !v.trim().is_empty());
        }
        if let Some(v) = &self.event_plane_user {
            config.user = Some(v.clone());
        }
        if let Some(v) = &self.event_plane_password {
            config.password = Some(v.clone());
        }
        if let Some(v) = &self.event_plane_token {
            config.token = Some(v.clone());
        }
        if let Some(v) = &self.event_plane_ca {
            config.tls_ca = Some(v.clone());
        }
        if let Some(v) = &self.event_plane_cert {
            config.tls_cert = Some(v.clone());
        }
        if let Some(v) = &self.event_plane_key {
            config.tls_key = Some(v.clone());
        }
        if let Some(v) = self.event_plane_max_age_secs {
            config.max_age_secs = v;
        }
        if let Some(v) = self.event_plane_max_bytes {
            config.max_bytes = v;
        }
        if let Some(v) = self.event_plane_storage {
            config.storage = v;
        }
        if let Some(v) = self.event_plane_digest_interval_ms {
            config.digest_interval_ms = v;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bad_settings_are_refused_with_what_is_wrong() {
        let ok = EventPlaneConfig {
            url: Some("nats://127.0.0.1:4222".into()),
            ..EventPlaneConfig::default()
        };
        assert!(ok.validate().is_ok());
        assert!(ok.enabled());
        assert!(!ok.tls());
        assert!(!EventPlaneConfig::default().enabled());
        let bad = |f: fn(&mut EventPlaneConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert!(bad(|c| c.url = Some("http://x:1".into())).contains("nats://"));
        assert!(bad(|c| c.user = Some("u".into())).contains("together"));
        assert!(
            bad(|c| {
                c.user = Some("u".into());
                c.password = Some("p".into());
                c.token = Some("t".into());
            })
            .contains("not both")
        );
        assert!(bad(|c| c.tls_cert = Some("c.pem".into())).contains("tls_key"));
        assert!(bad(|c| c.max_age_secs = 0).contains("max_age_secs"));
        assert!(bad(|c| c.max_bytes = 0).contains("max_bytes"));
        let tls = EventPlaneConfig {
            url: Some("tls://nats:4222".into()),
            ..EventPlaneConfig::default()
        };
        assert!(tls.tls());
    }

    #[test]
    fn flags_override_the_file_and_an_empty_url_turns_the_plane_off() {
        let mut config = EventPlaneConfig {
            url: Some("nats://a:1".into()),
            ..EventPlaneConfig::default()
        };
        let args = EventPlaneArgs {
            event_plane_max_age_secs: Some(5),
            event_plane_storage: Some(Storage::Memory),
            ..EventPlaneArgs::default()
        };
        args.apply(&mut config);
        assert_eq!(config.max_age_secs, 5);
        assert_eq!(config.storage, Storage::Memory);
        assert!(config.enabled());
        EventPlaneArgs {
            event_plane: Some(String::new()),
            ..EventPlaneArgs::default()
        }
        .apply(&mut config);
        assert!(!config.enabled());
    }
}
