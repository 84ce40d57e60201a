//! The planner sizes the prefill and decode pools.
//!
//! `connector` is how a plan reaches the cluster: a [`connector::Connector`] reports the pool
//! sizes it controls and moves them toward a target (the local connector re-roles running
//! workers over gRPC; the Kubernetes connector scales two Deployments).

pub mod connector;

pub use connector::{Connector, ConnectorError, PoolSizes};
