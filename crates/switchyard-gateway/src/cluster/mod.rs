//! The cluster as this gateway knows it.
//!
//! [`discovery`] follows the registered workers (etcd, Kubernetes, or both); [`pool`] holds
//! them, their gRPC clients, and each model's routing state, fed by each worker's KV events
//! and load reports ([`pool::subscriber`], applied through the pure [`pool::ingest`]) by the
//! follower tasks [`pool::followers`] starts with their own context ([`pool::follow`]);
//! [`health`] says whether a worker answers whatever its lease says; [`fleet`] is the other
//! gateway replicas (shared sessions, forwarded turns).

pub mod discovery;
pub mod fleet;
pub mod health;
pub mod pool;
