//! The gateway-replica capability ([`Replicas`]), one set of cases run against the in-memory
//! registry and against a real etcd (started by `switchyard-testkit` on free loopback ports),
//! plus what only etcd can show: an entry that outlives its ttl by being kept alive, and an
//! entry re-announced after its lease was revoked behind the replica's back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use support::{CLUSTER, Env, TTL, etcd_env, eventually, memory_env};

use std::sync::Arc;
use std::time::Duration;

use switchyard_registry::{Registry, RegistryError, ReplicaInfo};

fn replica(id: &str, port: u16) -> ReplicaInfo {
    ReplicaInfo {
        id: id.into(),
        address: format!("127.0.0.1:{port}"),
    }
}

async fn ids(registry: &dyn Registry) -> Vec<String> {
    let replicas = registry.list_replicas().await.unwrap();
    replicas.into_iter().map(|r| r.id).collect()
}

/// Announce, list sorted, replace by id, leave, drop: the same on every backend.
async fn announce_list_replace_leave(registry: Arc<dyn Registry>) {
    assert!(registry.list_replicas().await.unwrap().is_empty());
    let b = registry.announce(replica("gw-b", 2), TTL).await.unwrap();
    let a = registry.announce(replica("gw-a", 1), TTL).await.unwrap();
    assert_eq!(
        registry.list_replicas().await.unwrap(),
        vec![replica("gw-a", 1), replica("gw-b", 2)]
    );
    // A restarted pod announces its id again at a new address: that entry wins, and the old
    // announcement ending does not take the new one down.
    let b2 = registry.announce(replica("gw-b", 3), TTL).await.unwrap();
    drop(b);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        registry.list_replicas().await.unwrap(),
        vec![replica("gw-a", 1), replica("gw-b", 3)]
    );
    a.leave().await;
    assert_eq!(ids(registry.as_ref()).await, vec!["gw-b"]);
    drop(b2);
    eventually("a dropped announcement is withdrawn", || async {
        ids(registry.as_ref()).await.is_empty()
    })
    .await;
}

async fn bad_announcements_are_refused(registry: Arc<dyn Registry>) {
    for bad in [
        replica("a/b", 1),
        replica("", 1),
        ReplicaInfo {
            id: "g".into(),
            address: "".into(),
        },
    ] {
        assert!(matches!(
            registry.announce(bad, TTL).await,
            Err(RegistryError::InvalidReplica(_))
        ));
    }
    assert!(matches!(
        registry
            .announce(replica("g", 1), Duration::from_millis(10))
            .await,
        Err(RegistryError::InvalidTtl(_))
    ));
}

#[tokio::test]
async fn memory_announce_list_replace_leave() {
    announce_list_replace_leave(memory_env().await.registry).await;
}

#[tokio::test]
async fn memory_bad_announcements_are_refused() {
    bad_announcements_are_refused(memory_env().await.registry).await;
}

#[tokio::test]
async fn etcd_announce_list_replace_leave() {
    let Env {
        registry,
        etcd: _etcd,
    } = etcd_env().await;
    announce_list_replace_leave(registry).await;
}

#[tokio::test]
async fn etcd_bad_announcements_are_refused() {
    let Env {
        registry,
        etcd: _etcd,
    } = etcd_env().await;
    bad_announcements_are_refused(registry).await;
}

#[tokio::test]
async fn etcd_entry_is_kept_alive_and_comes_back_after_its_lease_is_revoked() {
    let Env { registry, etcd } = etcd_env().await;
    let etcd = etcd.expect("an etcd backend");
    let _a = registry.announce(replica("gw-a", 1), TTL).await.unwrap();
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(ids(registry.as_ref()).await, vec!["gw-a"]);
    // Someone revokes every lease: the entry goes, and the replica announces itself again.
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let leases = client.leases().await.unwrap();
    for lease in leases.leases() {
        client.lease_revoke(lease.id()).await.unwrap();
    }
    eventually("the replica is announced again", || async {
        ids(registry.as_ref()).await == vec!["gw-a"]
            && !client.clone().leases().await.unwrap().leases().is_empty()
    })
    .await;
}

#[tokio::test]
async fn etcd_garbage_under_gateways_is_skipped() {
    let Env { registry, etcd } = etcd_env().await;
    let etcd = etcd.expect("an etcd backend");
    let _a = registry.announce(replica("gw-a", 1), TTL).await.unwrap();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let root = format!("/switchyard/v1/{CLUSTER}/gateways/");
    client
        .put(format!("{root}junk"), "not json", None)
        .await
        .unwrap();
    let wrong_key = serde_json::to_vec(&replica("gw-z", 9)).unwrap();
    client
        .put(format!("{root}gw-y"), wrong_key, None)
        .await
        .unwrap();
    assert_eq!(ids(registry.as_ref()).await, vec!["gw-a"]);
}
