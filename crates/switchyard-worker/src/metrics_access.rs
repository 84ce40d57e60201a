//! Who may scrape the worker's metrics port: its bearer token and HTTPS (`metrics_token`,
//! `metrics_tls_cert`, `metrics_tls_key`), checked with the rest of [`WorkerConfig`].

use std::sync::Arc;

use switchyard_security::SecurityError;
use switchyard_security::listener::{HttpsConfig, https_config, https_files};

use crate::config::{ConfigError, WorkerConfig};

impl WorkerConfig {
    /// The metrics port's HTTPS configuration (certificate files read now), when it has one.
    pub fn metrics_tls(&self) -> Result<Option<Arc<HttpsConfig>>, SecurityError> {
        https_files(
            self.metrics_tls_cert.as_ref(),
            self.metrics_tls_key.as_ref(),
            "metrics_tls_cert and metrics_tls_key",
        )?
        .map(|files| https_config(&files))
        .transpose()
    }

    pub(crate) fn validate_metrics_access(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self
            .metrics_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return invalid("metrics_token must not be empty when set");
        }
        https_files(
            self.metrics_tls_cert.as_ref(),
            self.metrics_tls_key.as_ref(),
            "metrics_tls_cert and metrics_tls_key",
        )
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let protected = self.metrics_token.is_some() || self.metrics_tls_cert.is_some();
        if protected && self.metrics_listen.is_none() {
            return invalid(
                "metrics_token and metrics_tls_cert protect the metrics port: set metrics_listen too",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_port_is_protected_only_when_it_exists() {
        let listen = Some("127.0.0.1:0".parse().unwrap());
        let with = |f: fn(&mut WorkerConfig)| {
            let mut config = WorkerConfig::default();
            f(&mut config);
            config.validate()
        };
        with(|c| c.metrics_token = Some("t0ken".into())).unwrap_err();
        let err = with(|c| {
            c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
            c.metrics_token = Some(" ".into());
        })
        .unwrap_err();
        assert!(err.to_string().contains("metrics_token"), "{err}");
        let err = with(|c| {
            c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
            c.metrics_tls_cert = Some("/cert.pem".into());
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("metrics_tls_cert and metrics_tls_key together"),
            "{err}"
        );
        let mut config = WorkerConfig {
            metrics_listen: listen,
            metrics_token: Some("t0ken".into()),
            ..WorkerConfig::default()
        };
        config.validate().unwrap();
        config.metrics_listen = None;
        let err = config.validate().unwrap_err();
        assert!(err.to_string().contains("set metrics_listen"), "{err}");
    }
}
