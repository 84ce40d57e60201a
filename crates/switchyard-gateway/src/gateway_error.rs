//! [`GatewayError`], why the gateway could not start or stopped badly. It has a module of its
//! own, not the crate root, so that the parts that fail at start (discovery, the fleet) name it
//! without importing the root, which imports every part.

use std::net::SocketAddr;

use crate::observe::audit;

/// Why the gateway could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cannot load tokenizers: {0}")]
    Tokenizers(String),
    #[error("invalid routing configuration: {0}")]
    Routing(String),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot watch the registry: {0}")]
    Registry(String),
    #[error("worker discovery: {0}")]
    Discovery(String),
    #[error(transparent)]
    DecisionLog(#[from] audit::disk::DiskLogError),
    #[error("gateway fleet: {0}")]
    Fleet(String),
    #[error("quota: {0}")]
    Quota(String),
    #[error("security: {0}")]
    Security(#[from] switchyard_security::SecurityError),
}
