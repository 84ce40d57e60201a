//! The registry's one error type.

use std::time::Duration;

use switchyard_core::{BlockSize, CoreError, WorkerId};

/// Whose fault an error is, so callers know whether to fix their input, wait for the backend,
/// or look at what someone else wrote into the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The caller asked for something the registry refuses (bad input, conflicting worker).
    Caller,
    /// The backend (etcd) is unreachable or slow.
    Backend,
    /// A value stored in the registry is not what Switchyard writes.
    Data,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("etcd is unavailable while trying to {action} ({source})")]
    Unavailable {
        action: &'static str,
        source: etcd_client::Error,
    },
    /// etcd answered that the lease does not exist: it expired (etcd was stalled or cut off for
    /// longer than its TTL) or someone revoked it. Keeping it alive cannot succeed; a new lease
    /// can.
    #[error("etcd no longer knows lease {lease:x} (it expired or was revoked)")]
    LeaseNotFound { lease: i64 },
    #[error("etcd did not answer within {after:?} while trying to {action}")]
    Timeout {
        action: &'static str,
        after: Duration,
    },
    #[error(
        "block size mismatch for model {model:?}: worker {worker} announces {requested} tokens \
         per block but live worker {existing_worker} uses {existing}; workers of one model must \
         agree on the block size"
    )]
    BlockSizeMismatch {
        model: String,
        worker: WorkerId,
        requested: BlockSize,
        existing_worker: WorkerId,
        existing: BlockSize,
    },
    #[error(
        "worker {0} is already registered by a live process (it answers at its registered \
         address as that registration); give this worker another id"
    )]
    AlreadyRegistered(WorkerId),
    #[error("invalid worker info")]
    InvalidWorkerInfo(#[source] CoreError),
    #[error("invalid cluster name {0:?}: use 1 to 128 ASCII letters, digits, '.', '_' or '-'")]
    InvalidCluster(String),
    #[error("invalid etcd member user {0:?}: give a name other than root")]
    InvalidUser(String),
    #[error("invalid lease ttl {0:?}: it must be at least one second")]
    InvalidTtl(Duration),
    #[error("a registration cannot change its worker id (from {from} to {to}); register anew")]
    IdChanged { from: WorkerId, to: WorkerId },
    #[error("the lease of worker {0} is gone; it is being re-registered in the background")]
    LeaseLost(WorkerId),
    #[error("invalid gateway replica: {0}")]
    InvalidReplica(String),
    #[error("malformed value under {key}: {reason}")]
    Malformed { key: String, reason: String },
    #[error("worker entry {key} carries no valid proof of who wrote it; ignored")]
    Unverified { key: String },
    /// A discovery source other than etcd (the Kubernetes API) cannot be read; it may answer
    /// later.
    #[error("{backend} discovery is unavailable: {reason}")]
    DiscoveryUnavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("cannot encode the value for {key}")]
    Encode {
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

impl RegistryError {
    /// `error` from a call about `lease`, with etcd's "lease not found" told apart from an
    /// unreachable etcd: the first ends a lease for good, the second may pass.
    pub(crate) fn from_lease_call(
        action: &'static str,
        lease: i64,
        source: etcd_client::Error,
    ) -> Self {
        let not_found = match &source {
            // etcd's ErrGRPCLeaseNotFound: codes.NotFound, "etcdserver: requested lease not found".
            etcd_client::Error::GRpcStatus(status) => {
                status.code() == tonic::Code::NotFound
                    || status.message().contains("lease not found")
            }
            etcd_client::Error::LeaseKeepAliveError(message) => message.contains("lease not found"),
            _ => false,
        };
        if not_found {
            Self::LeaseNotFound { lease }
        } else {
            Self::Unavailable { action, source }
        }
    }

    /// Whether trying the same call again later can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            // etcd may come back; a lost lease is being replaced; a duplicate id may be a
            // previous incarnation of the same worker whose lease has not expired yet.
            Self::Unavailable { .. }
            | Self::Timeout { .. }
            | Self::LeaseLost(_)
            | Self::LeaseNotFound { .. }
            | Self::DiscoveryUnavailable { .. }
            | Self::AlreadyRegistered(_) => true,
            Self::BlockSizeMismatch { .. }
            | Self::InvalidWorkerInfo(_)
            | Self::InvalidCluster(_)
            | Self::InvalidUser(_)
            | Self::InvalidTtl(_)
            | Self::InvalidReplica(_)
            | Self::IdChanged { .. }
            | Self::Malformed { .. }
            | Self::Unverified { .. }
            | Self::Encode { .. } => false,
        }
    }

    /// Whose fault the error is.
    pub fn fault(&self) -> Fault {
        match self {
            Self::Unavailable { .. }
            | Self::Timeout { .. }
            | Self::LeaseLost(_)
            | Self::LeaseNotFound { .. }
            | Self::DiscoveryUnavailable { .. } => Fault::Backend,
            Self::Malformed { .. } | Self::Unverified { .. } => Fault::Data,
            Self::BlockSizeMismatch { .. }
            | Self::AlreadyRegistered(_)
            | Self::InvalidWorkerInfo(_)
            | Self::InvalidCluster(_)
            | Self::InvalidUser(_)
            | Self::InvalidTtl(_)
            | Self::InvalidReplica(_)
            | Self::IdChanged { .. }
            | Self::Encode { .. } => Fault::Caller,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_message_names_both_sizes_and_the_other_worker() {
        let err = RegistryError::BlockSizeMismatch {
            model: "m".into(),
            worker: WorkerId::new("new").unwrap(),
            requested: BlockSize::new(32).unwrap(),
            existing_worker: WorkerId::new("old").unwrap(),
            existing: BlockSize::new(16).unwrap(),
        };
        let msg = err.to_string();
        for part in ["\"m\"", "new", "32", "old", "16"] {
            assert!(msg.contains(part), "{msg}");
        }
        assert!(!err.is_retryable());
        assert_eq!(err.fault(), Fault::Caller);
    }

    #[test]
    fn lease_not_found_is_told_apart_from_an_unreachable_etcd() {
        let gone = RegistryError::from_lease_call(
            "keep a lease alive",
            0x2a,
            etcd_client::Error::GRpcStatus(tonic::Status::not_found(
                "etcdserver: requested lease not found",
            )),
        );
        assert!(
            matches!(gone, RegistryError::LeaseNotFound { lease: 0x2a }),
            "{gone:?}"
        );
        assert!(gone.to_string().contains("2a"), "{gone}");
        let down = RegistryError::from_lease_call(
            "keep a lease alive",
            0x2a,
            etcd_client::Error::GRpcStatus(tonic::Status::unavailable("connection refused")),
        );
        assert!(
            matches!(down, RegistryError::Unavailable { .. }),
            "{down:?}"
        );
        assert!(down.to_string().contains("connection refused"), "{down}");
    }

    #[test]
    fn timeouts_are_retryable_backend_faults() {
        let err = RegistryError::Timeout {
            action: "list workers",
            after: Duration::from_secs(5),
        };
        assert!(err.is_retryable());
        assert_eq!(err.fault(), Fault::Backend);
    }
}
