//! Setup shared by the registry's integration tests: a registry under test on either backend
//! (in memory, or a real etcd started by `switchyard-testkit` on free loopback ports) and the
//! bounded wait every case polls with.

#![allow(dead_code)] // each test binary uses its own subset

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use switchyard_registry::{EtcdRegistry, MemoryRegistry, Registry};
use switchyard_testkit::EtcdServer;

/// Lease ttl used by the suites: etcd's minimum lease is about 1.5 s.
pub const TTL: Duration = Duration::from_secs(2);
/// Upper bound for anything a suite waits for.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// The cluster every test registry lives in (each etcd is the test's own).
pub const CLUSTER: &str = "conformance";

/// A registry under test, plus whatever keeps its backend running.
pub struct Env {
    pub registry: Arc<dyn Registry>,
    pub etcd: Option<EtcdServer>,
}

/// Shows the registry's logs for failing tests (`RUST_LOG=switchyard_registry=debug`).
fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
}

pub async fn memory_env() -> Env {
    init_tracing();
    Env {
        registry: Arc::new(MemoryRegistry::new()),
        etcd: None,
    }
}

pub async fn etcd_env() -> Env {
    init_tracing();
    let etcd = EtcdServer::start().expect("start a test etcd");
    let registry = EtcdRegistry::connect(&[etcd.endpoint()], CLUSTER)
        .await
        .expect("connect to the test etcd");
    Env {
        registry: Arc::new(registry),
        etcd: Some(etcd),
    }
}

/// Polls `check` until it holds, failing the test after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
