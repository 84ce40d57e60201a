//! Who may use the gateway's HTTP listener (`[access]`): API keys for `/v1`, a token for
//! `/metrics`, and HTTPS. The admin token stays `admin_token` (top level), the workers' side is
//! `[security]`. See `docs/security.md`.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
use switchyard_security::SecurityError;
use switchyard_security::listener::{HttpsConfig, https_config, https_files};

use crate::access::api_keys::ApiKeyFile;

/// The `[access]` table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessConfig {
    /// API keys `/v1` requires (`<sha256 hex> <tenant>` per line, re-read when it changes);
    /// none: `/v1` is open.
    pub api_keys_file: Option<PathBuf>,
    /// Bearer token `/metrics` requires; none: `/metrics` is open.
    pub metrics_token: Option<String>,
    /// HTTPS: the listener's certificate chain (PEM), re-read when it changes.
    pub tls_cert: Option<PathBuf>,
    /// HTTPS: the certificate's private key (PEM).
    pub tls_key: Option<PathBuf>,
}

/// Flags and `SWITCHYARD_*` environment variables of `[access]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AccessArgs {
    /// API key file for /v1: one `<sha256 hex of the key> <tenant>` per line.
    #[arg(long, env = "SWITCHYARD_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Bearer token /metrics requires (default: open).
    #[arg(long, env = "SWITCHYARD_METRICS_TOKEN")]
    pub metrics_token: Option<String>,
    /// HTTPS certificate chain (PEM) of the gateway's listener.
    #[arg(long, env = "SWITCHYARD_HTTP_TLS_CERT")]
    pub http_tls_cert: Option<PathBuf>,
    /// HTTPS private key (PEM) of the gateway's listener.
    #[arg(long, env = "SWITCHYARD_HTTP_TLS_KEY")]
    pub http_tls_key: Option<PathBuf>,
}

impl AccessArgs {
    pub fn apply(&self, config: &mut AccessConfig) {
        for (flag, target) in [
            (&self.api_keys_file, &mut config.api_keys_file),
            (&self.http_tls_cert, &mut config.tls_cert),
            (&self.http_tls_key, &mut config.tls_key),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        if self.metrics_token.is_some() {
            config.metrics_token.clone_from(&self.metrics_token);
        }
    }
}

/// What the listener and the handlers check, built once at start.
#[derive(Debug, Default)]
pub struct ClientAccess {
    pub api_keys: Option<ApiKeyFile>,
    pub metrics_token: Option<String>,
    pub tls: Option<Arc<HttpsConfig>>,
}

impl AccessConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("HTTPS needs [access] tls_cert and tls_key together".into());
        }
        if self
            .metrics_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err("metrics_token must not be empty when set".into());
        }
        Ok(())
    }

    /// Reads the key file and the certificate (a bad one is a configuration error at start).
    pub fn build(&self) -> Result<ClientAccess, SecurityError> {
        let api_keys = self
            .api_keys_file
            .clone()
            .map(ApiKeyFile::open)
            .transpose()?;
        let tls = https_files(
            self.tls_cert.as_ref(),
            self.tls_key.as_ref(),
            "[access] tls_cert and tls_key",
        )?
        .map(|files| https_config(&files))
        .transpose()?;
        Ok(ClientAccess {
            api_keys,
            metrics_token: self.metrics_token.clone(),
            tls,
        })
    }
}
