//! The crate's one error type.

use std::path::PathBuf;

/// What went wrong setting up or checking security; every variant is the operator's to fix
/// (a file, a certificate, a setting) except [`SecurityError::Connect`], which is the remote's
/// and may pass on a retry.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path} is invalid: {message}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("tls configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("invalid security setting: {0}")]
    Setting(String),
    #[error("{address:?} is not a worker address: {message}")]
    Address { address: String, message: String },
    #[error("cannot connect to {address}: {source}")]
    Connect {
        address: String,
        source: tonic::transport::Error,
    },
}
