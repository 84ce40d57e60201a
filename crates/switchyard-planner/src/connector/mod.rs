//! Connectors: how a planner decision becomes prefill and decode workers.
//!
//! [`local::LocalConnector`] re-roles the workers that run (gRPC `Control`);
//! [`kubernetes::KubernetesConnector`] scales a prefill and a decode Deployment through their
//! `scale` subresource.

pub mod kubernetes;
pub mod local;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// Workers per pool. A worker with role `both` counts in neither: the planner sizes the
/// dedicated pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PoolSizes {
    pub prefill: u32,
    pub decode: u32,
}

impl PoolSizes {
    pub fn total(&self) -> u32 {
        self.prefill + self.decode
    }
}

/// Why a connector could not read or change the pools. `retryable` says whether the next
/// planner interval may succeed where this one failed (a network error, a conflict) or not
/// (a missing Deployment, a forbidden request).
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    #[error("{what}")]
    Failed { what: String, retryable: bool },
}

impl ConnectorError {
    pub fn retryable(&self) -> bool {
        match self {
            Self::Failed { retryable, .. } => *retryable,
        }
    }
}

/// Moves the cluster toward a plan.
#[async_trait]
pub trait Connector: Send + Sync + std::fmt::Debug {
    /// A short name for logs, metrics and the admin API (`local`, `kubernetes`).
    fn name(&self) -> &'static str;

    /// The pool sizes the cluster has now, as this connector controls them.
    async fn current(&self) -> Result<PoolSizes, ConnectorError>;

    /// How many workers the pools can hold in all when the connector cannot add or remove
    /// workers (the local connector only moves the running ones between the pools): the
    /// planner then places exactly that many. `None`: as many as the plan asks for, up to the
    /// planner's maximum.
    async fn capacity(&self) -> Result<Option<u32>, ConnectorError> {
        Ok(None)
    }

    /// Moves the pools to `target`. Returns once the change is requested and, where the
    /// connector can tell, under way; workers leaving a pool drain first.
    async fn scale_to(&self, target: PoolSizes) -> Result<(), ConnectorError>;
}
