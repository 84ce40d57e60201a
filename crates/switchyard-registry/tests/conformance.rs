//! One registry conformance suite, run against every backend.
//!
//! `memory::*` runs each case on [`MemoryRegistry`] with tokio's clock paused (lease expiry is
//! virtual time); `etcd::*` runs the same cases on [`EtcdRegistry`] against a real etcd started
//! by `switchyard-testkit` on free loopback ports. `etcd_only::*` covers what only a real etcd
//! can show: garbage written by someone else, an etcd outage, a lease lost behind our back.
//!
//! Waits are polls against a generous deadline, never assertions about how long things took.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use support::{CLUSTER, DEADLINE, Env, TTL, etcd_env, eventually, memory_env};

use std::collections::BTreeMap;
use std::time::Duration;

use switchyard_core::{BlockSize, EngineKind, Role, WorkerId, WorkerInfo};
use switchyard_registry::{
    EtcdRegistry, LeaseState, Registry, RegistryError, WorkerChange, WorkerWatch,
};

fn worker(id: &str, model: &str, block_size: u32) -> WorkerInfo {
    WorkerInfo {
        adapters: Vec::new(),
        id: WorkerId::new(id).unwrap(),
        address: format!("127.0.0.1:{}", 5000 + id.len()),
        model: model.into(),
        role: Role::Both,
        block_size: BlockSize::new(block_size).unwrap(),
        kv_capacity_blocks: 1024,
        max_context_tokens: 32768,
        engine: EngineKind::Sim,
        incarnation: 1,
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    }
}

fn id(id: &str) -> WorkerId {
    WorkerId::new(id).unwrap()
}

async fn next_change(watch: &mut WorkerWatch) -> WorkerChange {
    tokio::time::timeout(DEADLINE, watch.next())
        .await
        .expect("timed out waiting for a worker change")
        .expect("worker watch ended")
}

async fn listed_ids(registry: &dyn Registry) -> Vec<String> {
    registry
        .list_workers()
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.id.to_string())
        .collect()
}

/// The cases, each written once against `dyn Registry`.
mod cases {
    use super::*;
    use std::sync::Arc;

    pub async fn registered_worker_is_listed_exactly(env: Env) {
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        assert_eq!(registration.info(), info);
        assert_eq!(*registration.status().borrow(), LeaseState::Live);
        assert_eq!(env.registry.list_workers().await.unwrap(), vec![info]);
    }

    pub async fn many_workers_registering_at_once_all_get_in(env: Env) {
        let _first = env
            .registry
            .register(worker("w-0", "m", 16), TTL)
            .await
            .unwrap();
        let registrations = (1..40).map(|i| {
            let registry = Arc::clone(&env.registry);
            tokio::spawn(async move {
                registry
                    .register(worker(&format!("w-{i}"), "m", 16), TTL)
                    .await
            })
        });
        let mut kept = Vec::new();
        for registration in registrations {
            kept.push(registration.await.unwrap().unwrap());
        }
        assert_eq!(listed_ids(&*env.registry).await.len(), 40);
    }

    pub async fn first_workers_of_a_model_racing_with_two_block_sizes_get_one(env: Env) {
        let registrations = (0..8).map(|i| {
            let registry = Arc::clone(&env.registry);
            let block_size = if i % 2 == 0 { 16 } else { 32 };
            tokio::spawn(async move {
                registry
                    .register(worker(&format!("r-{i}"), "m", block_size), TTL)
                    .await
            })
        });
        let mut kept = Vec::new();
        for registration in registrations {
            if let Ok(registration) = registration.await.unwrap() {
                kept.push(registration);
            }
        }
        let sizes: std::collections::BTreeSet<_> = env
            .registry
            .list_workers()
            .await
            .unwrap()
            .iter()
            .map(|w| w.block_size)
            .collect();
        assert_eq!(sizes.len(), 1, "one block size per model: {sizes:?}");
        assert!(!kept.is_empty());
    }

    pub async fn one_worker_is_read_by_id(env: Env) {
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        let _other = env
            .registry
            .register(worker("w2", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(env.registry.worker(&id("w1")).await.unwrap(), Some(info));
        assert_eq!(env.registry.worker(&id("w3")).await.unwrap(), None);
        registration.deregister().await.unwrap();
        assert_eq!(env.registry.worker(&id("w1")).await.unwrap(), None);
    }

    pub async fn list_is_sorted_and_watch_starts_from_a_snapshot(env: Env) {
        let _b = env
            .registry
            .register(worker("b", "m", 16), TTL)
            .await
            .unwrap();
        let _a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["a", "b"]);
        let mut watch = env.registry.watch_workers().await.unwrap();
        assert_eq!(
            watch.initial,
            vec![worker("a", "m", 16), worker("b", "m", 16)]
        );
        let _c = env
            .registry
            .register(worker("c", "m", 16), TTL)
            .await
            .unwrap();
        // The snapshot's workers are not announced again.
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(worker("c", "m", 16))
        );
    }

    pub async fn watch_sees_changes_in_order(env: Env) {
        let mut watch = env.registry.watch_workers().await.unwrap();
        assert!(watch.initial.is_empty());
        let a = worker("a", "m", 16);
        let registration = env.registry.register(a.clone(), TTL).await.unwrap();
        let a_decode = WorkerInfo {
            role: Role::Decode,
            ..a.clone()
        };
        registration.update(a_decode.clone()).await.unwrap();
        assert_eq!(registration.info(), a_decode);
        let b = worker("b", "m", 16);
        let _b = env.registry.register(b.clone(), TTL).await.unwrap();
        registration.deregister().await.unwrap();
        assert_eq!(next_change(&mut watch).await, WorkerChange::Added(a));
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Updated(a_decode)
        );
        assert_eq!(next_change(&mut watch).await, WorkerChange::Added(b));
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Removed(id("a"))
        );
        assert_eq!(
            env.registry.list_workers().await.unwrap(),
            vec![worker("b", "m", 16)]
        );
    }

    pub async fn deregister_removes_at_once_and_frees_the_id(env: Env) {
        let registration = env
            .registry
            .register(worker("w1", "m", 16), TTL)
            .await
            .unwrap();
        registration.deregister().await.unwrap();
        assert!(env.registry.list_workers().await.unwrap().is_empty());
        let again = env.registry.register(worker("w1", "m", 16), TTL).await;
        assert!(again.is_ok(), "{again:?}");
    }

    pub async fn abandoned_worker_vanishes_after_its_ttl(env: Env) {
        let mut watch = env.registry.watch_workers().await.unwrap();
        let registration = env
            .registry
            .register(worker("w1", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(worker("w1", "m", 16))
        );
        registration.abandon();
        // Nobody deleted it: it is still there until the lease runs out.
        assert_eq!(listed_ids(&*env.registry).await, ["w1"]);
        eventually("the abandoned worker's lease expired", || async {
            env.registry.list_workers().await.unwrap().is_empty()
        })
        .await;
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Removed(id("w1"))
        );
    }

    pub async fn kept_alive_worker_outlives_its_ttl(env: Env) {
        let _registration = env
            .registry
            .register(worker("w1", "m", 16), TTL)
            .await
            .unwrap();
        tokio::time::sleep(TTL * 3).await;
        assert_eq!(listed_ids(&*env.registry).await, ["w1"]);
    }

    pub async fn block_size_mismatch_is_refused_clearly(env: Env) {
        let _a = env
            .registry
            .register(worker("a", "llama", 16), TTL)
            .await
            .unwrap();
        let err = env
            .registry
            .register(worker("b", "llama", 32), TTL)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RegistryError::BlockSizeMismatch { .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        for part in ["llama", "16", "32", "worker b", "worker a"] {
            assert!(msg.contains(part), "{part:?} missing from {msg:?}");
        }
        assert!(!err.is_retryable());
        assert_eq!(listed_ids(&*env.registry).await, ["a"]);
    }

    pub async fn update_cannot_break_the_block_size_rule_or_change_the_id(env: Env) {
        let _a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        let b = env
            .registry
            .register(worker("b", "m", 16), TTL)
            .await
            .unwrap();
        let err = b.update(worker("b", "m", 32)).await.unwrap_err();
        assert!(
            matches!(err, RegistryError::BlockSizeMismatch { .. }),
            "{err:?}"
        );
        let err = b.update(worker("c", "m", 16)).await.unwrap_err();
        assert!(matches!(err, RegistryError::IdChanged { .. }), "{err:?}");
        assert_eq!(
            env.registry.list_workers().await.unwrap(),
            vec![worker("a", "m", 16), worker("b", "m", 16)]
        );
    }

    pub async fn different_models_may_use_different_block_sizes(env: Env) {
        let _a = env
            .registry
            .register(worker("a", "m1", 16), TTL)
            .await
            .unwrap();
        let _b = env
            .registry
            .register(worker("b", "m2", 32), TTL)
            .await
            .unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["a", "b"]);
    }

    pub async fn duplicate_live_id_is_refused(env: Env) {
        let _a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        let other = WorkerInfo {
            address: "10.0.0.9:1".into(),
            ..worker("a", "m", 16)
        };
        let err = env.registry.register(other, TTL).await.unwrap_err();
        assert!(
            matches!(err, RegistryError::AlreadyRegistered(_)),
            "{err:?}"
        );
        assert_eq!(
            env.registry.list_workers().await.unwrap(),
            vec![worker("a", "m", 16)]
        );
    }

    pub async fn a_stale_registration_is_taken_over_exactly(env: Env) {
        let old = worker("a", "m", 16);
        let abandoned = env.registry.register(old.clone(), TTL).await.unwrap();
        let mut watch = env.registry.watch_workers().await.unwrap();
        let restarted = WorkerInfo {
            address: "127.0.0.1:6001".into(),
            incarnation: 2,
            adapters: Vec::new(),
            ..worker("a", "m", 16)
        };
        // Only the registration as it was seen may be replaced.
        let seen_wrong = WorkerInfo {
            incarnation: 7,
            adapters: Vec::new(),
            ..old.clone()
        };
        let err = env
            .registry
            .take_over(restarted.clone(), TTL, &seen_wrong)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RegistryError::AlreadyRegistered(_)),
            "{err:?}"
        );
        // The rules still hold for the new registration.
        let other_block = WorkerInfo {
            block_size: BlockSize::new(32).unwrap(),
            ..restarted.clone()
        };
        let _b = env
            .registry
            .register(worker("b", "m", 16), TTL)
            .await
            .unwrap();
        let err = env
            .registry
            .take_over(other_block, TTL, &old)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RegistryError::BlockSizeMismatch { .. }),
            "{err:?}"
        );
        let _new = env
            .registry
            .take_over(restarted.clone(), TTL, &old)
            .await
            .unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(worker("b", "m", 16))
        );
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Updated(restarted.clone())
        );
        // The old lease running out takes nothing with it.
        abandoned.abandon();
        tokio::time::sleep(TTL * 3).await;
        let listed = env.registry.list_workers().await.unwrap();
        assert!(listed.contains(&restarted), "{listed:?}");
        // Once the id is free, taking over is registering.
        let free = worker("c", "m", 16);
        let _c = env
            .registry
            .take_over(free.clone(), TTL, &worker("c", "m", 16))
            .await
            .unwrap();
        assert!(env.registry.list_workers().await.unwrap().contains(&free));
    }

    pub async fn bad_registrations_are_refused(env: Env) {
        let err = env
            .registry
            .register(worker("a", "m", 16), Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::InvalidTtl(_)), "{err:?}");
        let empty_model = worker("a", "", 16);
        let err = env.registry.register(empty_model, TTL).await.unwrap_err();
        assert!(
            matches!(err, RegistryError::InvalidWorkerInfo(_)),
            "{err:?}"
        );
        assert!(env.registry.list_workers().await.unwrap().is_empty());
    }

    pub async fn desired_roles_are_stored(env: Env) {
        let w = id("w1");
        assert_eq!(env.registry.desired_role(&w).await.unwrap(), None);
        env.registry
            .set_desired_role(&w, Role::Prefill)
            .await
            .unwrap();
        assert_eq!(
            env.registry.desired_role(&w).await.unwrap(),
            Some(Role::Prefill)
        );
        env.registry
            .set_desired_role(&w, Role::Decode)
            .await
            .unwrap();
        assert_eq!(
            env.registry.desired_role(&w).await.unwrap(),
            Some(Role::Decode)
        );
        assert_eq!(env.registry.desired_role(&id("w2")).await.unwrap(), None);
    }

    pub async fn plan_is_stored(env: Env) {
        assert_eq!(env.registry.plan().await.unwrap(), None);
        let plan = serde_json::json!({"prefill": 2, "decode": 3, "why": ["load"]});
        env.registry.put_plan(&plan).await.unwrap();
        assert_eq!(env.registry.plan().await.unwrap(), Some(plan));
        let next = serde_json::json!({"prefill": 1});
        env.registry.put_plan(&next).await.unwrap();
        assert_eq!(env.registry.plan().await.unwrap(), Some(next));
    }
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(start_paused = true)]
                async fn $case() {
                    super::cases::$case(super::memory_env().await).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test]
                async fn $case() {
                    super::cases::$case(super::etcd_env().await).await;
                }
            )*
        }
    };
}

conformance!(
    registered_worker_is_listed_exactly,
    one_worker_is_read_by_id,
    many_workers_registering_at_once_all_get_in,
    first_workers_of_a_model_racing_with_two_block_sizes_get_one,
    list_is_sorted_and_watch_starts_from_a_snapshot,
    watch_sees_changes_in_order,
    deregister_removes_at_once_and_frees_the_id,
    abandoned_worker_vanishes_after_its_ttl,
    kept_alive_worker_outlives_its_ttl,
    block_size_mismatch_is_refused_clearly,
    update_cannot_break_the_block_size_rule_or_change_the_id,
    different_models_may_use_different_block_sizes,
    duplicate_live_id_is_refused,
    a_stale_registration_is_taken_over_exactly,
    bad_registrations_are_refused,
    desired_roles_are_stored,
    plan_is_stored,
);

/// What only a real etcd can show.
mod etcd_only {
    use super::*;
    use etcd_client::{Client, GetOptions, Txn, TxnOp};
    use switchyard_registry::keys::Keys;

    async fn raw_client(env: &Env) -> Client {
        let endpoint = env.etcd.as_ref().unwrap().endpoint();
        Client::connect([endpoint], None).await.unwrap()
    }

    #[tokio::test]
    async fn garbage_under_workers_is_skipped() {
        let env = etcd_env().await;
        let keys = Keys::new(CLUSTER).unwrap();
        let prefix = keys.workers_prefix();
        let mut raw = raw_client(&env).await;
        let _good = env
            .registry
            .register(worker("good", "m", 16), TTL)
            .await
            .unwrap();
        let mut impostor = serde_json::to_value(worker("y", "m", 16)).unwrap();
        impostor["id"] = "someone-else".into();
        raw.put(format!("{prefix}junk"), "not json", None)
            .await
            .unwrap();
        raw.put(
            format!("{prefix}bad id"),
            serde_json::to_vec(&worker("z", "m", 16)).unwrap(),
            None,
        )
        .await
        .unwrap();
        raw.put(format!("{prefix}y"), impostor.to_string(), None)
            .await
            .unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["good"]);

        let mut watch = env.registry.watch_workers().await.unwrap();
        assert_eq!(watch.initial, vec![worker("good", "m", 16)]);
        raw.put(format!("{prefix}junk2"), "{\"id\":", None)
            .await
            .unwrap();
        // A valid worker overwritten with garbage is reported gone.
        raw.put(keys.worker(&id("good")), "garbage", None)
            .await
            .unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Removed(id("good"))
        );
        let _next = env
            .registry
            .register(worker("next", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(worker("next", "m", 16))
        );
        assert_eq!(listed_ids(&*env.registry).await, ["next"]);
    }

    /// Bytes etcd has sent to its gRPC clients, from its `/metrics` page.
    async fn grpc_bytes_sent(env: &Env) -> f64 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let endpoint = env.etcd.as_ref().unwrap().endpoint();
        let address = endpoint.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n")
            .await
            .unwrap();
        let mut page = String::new();
        stream.read_to_string(&mut page).await.unwrap();
        page.lines()
            .filter_map(|l| l.strip_prefix("etcd_network_client_grpc_sent_bytes_total "))
            .map(|v| v.trim().parse::<f64>().unwrap())
            .sum()
    }

    /// Registers `info`, which must be refused for its block size; the refusal.
    async fn refused_for_block_size(env: &Env, info: WorkerInfo, ttl: Duration) -> RegistryError {
        let err = env.registry.register(info, ttl).await.unwrap_err();
        assert!(
            matches!(&err, RegistryError::BlockSizeMismatch { .. }),
            "{err:?}"
        );
        err
    }

    /// A list longer than one answer may carry (gRPC's 4 MiB; 10,000 worker entries were 4.9 MB)
    /// is read a page at a time, all of it, in key order.
    #[tokio::test]
    async fn a_list_longer_than_a_page_is_read_whole() {
        let env = etcd_env().await;
        let keys = Keys::new(CLUSTER).unwrap();
        let mut raw = raw_client(&env).await;
        let n = 2_345;
        for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
            let puts: Vec<TxnOp> = chunk
                .iter()
                .map(|i| {
                    let info = worker(&format!("w{i:05}"), "m", 16);
                    TxnOp::put(
                        keys.worker(&info.id),
                        serde_json::to_vec(&info).unwrap(),
                        None,
                    )
                })
                .collect();
            raw.txn(Txn::new().and_then(puts)).await.unwrap();
        }
        let listed = listed_ids(&*env.registry).await;
        assert_eq!(listed.len(), n);
        let want: Vec<String> = (0..n).map(|i| format!("w{i:05}")).collect();
        assert_eq!(listed, want);
        let watch = env.registry.watch_workers().await.unwrap();
        assert_eq!(watch.initial.len(), n);
    }

    /// A registration checks the block-size rule against one live member of its model
    /// (`models/<model>/`), so it reads a couple of entries, not every worker: a fleet of W
    /// starting read W² entries before (10⁸ at 10,000 workers).
    #[tokio::test]
    async fn a_registration_reads_one_member_of_its_model_not_every_worker() {
        const LONG: Duration = Duration::from_secs(60);
        let env = etcd_env().await;
        let keys = Keys::new(CLUSTER).unwrap();
        let mut raw = raw_client(&env).await;
        let mut fleet = Vec::new();
        for i in 0..120 {
            let info = worker(&format!("w{i:03}"), "m", 16);
            fleet.push(env.registry.register(info, LONG).await.unwrap());
        }
        let listed = raw
            .get(keys.workers_prefix(), Some(GetOptions::new().with_prefix()))
            .await
            .unwrap();
        let fleet_bytes: usize = listed.kvs().iter().map(|kv| kv.value().len()).sum();
        let before = grpc_bytes_sent(&env).await;
        let new = env
            .registry
            .register(worker("new", "m", 16), LONG)
            .await
            .unwrap();
        let read = grpc_bytes_sent(&env).await - before;
        assert!(
            read * 4.0 < fleet_bytes as f64,
            "a registration beside 120 workers ({fleet_bytes} bytes of entries) received {read} bytes"
        );
        // The rule still holds, on the witness's word.
        let err = refused_for_block_size(&env, worker("odd", "m", 32), LONG).await;
        assert!(
            matches!(&err, RegistryError::BlockSizeMismatch { existing, .. }
                if existing.get() == 16),
            "{err:?}"
        );
        // Each member entry lives and goes with its worker.
        let member = keys.model_member("m", &id("new"));
        assert_eq!(raw.get(member.as_str(), None).await.unwrap().kvs().len(), 1);
        new.deregister().await.unwrap();
        assert!(
            raw.get(member.as_str(), None)
                .await
                .unwrap()
                .kvs()
                .is_empty()
        );
        for registration in fleet {
            registration.deregister().await.unwrap();
        }
        let members = raw
            .get(
                keys.model_members_prefix("m"),
                Some(GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        assert!(members.kvs().is_empty());
        // With the model's last worker gone, another block size may start it again.
        let _again = env
            .registry
            .register(worker("again", "m", 32), LONG)
            .await
            .unwrap();
    }

    /// A member entry that is not one (garbage, or naming another worker than its key) is no
    /// witness: the registration checks against every worker, as before member entries.
    #[tokio::test]
    async fn an_unreadable_member_entry_falls_back_to_every_worker() {
        let env = etcd_env().await;
        let keys = Keys::new(CLUSTER).unwrap();
        let mut raw = raw_client(&env).await;
        let _a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        // Sorted before `a`'s entry, so it is what a registration reads first.
        let prefix = keys.model_members_prefix("m");
        raw.put(format!("{prefix}0junk"), "not json", None)
            .await
            .unwrap();
        let err = refused_for_block_size(&env, worker("b", "m", 32), TTL).await;
        assert!(
            matches!(&err, RegistryError::BlockSizeMismatch { existing_worker, .. }
                if existing_worker.as_str() == "a"),
            "{err:?}"
        );
        raw.put(
            format!("{prefix}0junk"),
            r#"{"worker":"zzz","block_size":32}"#,
            None,
        )
        .await
        .unwrap();
        refused_for_block_size(&env, worker("b", "m", 32), TTL).await;
        let _b = env
            .registry
            .register(worker("b", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["a", "b"]);
    }

    /// An update that moves a worker to another model moves its member entry with it.
    #[tokio::test]
    async fn an_update_to_another_model_moves_the_member_entry() {
        let env = etcd_env().await;
        let keys = Keys::new(CLUSTER).unwrap();
        let raw = raw_client(&env).await;
        let a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        a.update(worker("a", "n", 32)).await.unwrap();
        let count = |key: String| {
            let mut raw = raw.clone();
            async move { raw.get(key, None).await.unwrap().kvs().len() }
        };
        assert_eq!(count(keys.model_member("m", &id("a"))).await, 0);
        assert_eq!(count(keys.model_member("n", &id("a"))).await, 1);
        // `m` has no member now: another block size may start it; `n` keeps its 32.
        let _b = env
            .registry
            .register(worker("b", "m", 64), TTL)
            .await
            .unwrap();
        refused_for_block_size(&env, worker("c", "n", 16), TTL).await;
    }

    #[tokio::test]
    async fn worker_survives_etcd_being_briefly_down() {
        let mut env = etcd_env().await;
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        let mut watch = env.registry.watch_workers().await.unwrap();
        let mut view: BTreeMap<WorkerId, WorkerInfo> = watch
            .initial
            .iter()
            .map(|w| (w.id.clone(), w.clone()))
            .collect();
        let mut status = registration.status();
        assert_eq!(*status.borrow_and_update(), LeaseState::Live);

        env.etcd.as_mut().unwrap().stop();
        tokio::time::timeout(
            DEADLINE,
            status.wait_for(|s| *s == LeaseState::Reconnecting),
        )
        .await
        .expect("status never went Reconnecting")
        .unwrap();
        // Longer than the lease, so a clock-based lease would have run out.
        tokio::time::sleep(TTL + Duration::from_secs(1)).await;
        env.etcd.as_mut().unwrap().restart().unwrap();

        tokio::time::timeout(DEADLINE, status.wait_for(|s| *s == LeaseState::Live))
            .await
            .expect("status never came back to Live")
            .unwrap();
        eventually("the worker is listed again", || async {
            env.registry
                .list_workers()
                .await
                .is_ok_and(|ws| ws == vec![info.clone()])
        })
        .await;
        // The watch resynchronised: applying its changes yields the truth.
        while let Some(change) = watch.try_next() {
            apply(&mut view, change);
        }
        assert_eq!(view.into_values().collect::<Vec<_>>(), vec![info.clone()]);
        // And it still delivers changes after the outage.
        let _w2 = env
            .registry
            .register(worker("w2", "m", 16), TTL)
            .await
            .unwrap();
        let change = loop {
            match next_change(&mut watch).await {
                WorkerChange::Added(w) if w.id == id("w2") => break WorkerChange::Added(w),
                other => assert_ne!(other, WorkerChange::Removed(id("w2"))),
            }
        };
        assert_eq!(change, WorkerChange::Added(worker("w2", "m", 16)));
        registration.deregister().await.unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["w2"]);
    }

    #[tokio::test]
    async fn worker_re_registers_after_an_etcd_stall_longer_than_its_ttl() {
        let mut env = etcd_env().await;
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        let mut status = registration.status();
        assert_eq!(*status.borrow_and_update(), LeaseState::Live);

        // Frozen, not dead: the connection stays open, nothing answers, and when etcd thaws its
        // clock has run past every lease's deadline, so it revokes them all.
        env.etcd.as_mut().unwrap().pause().unwrap();
        tokio::time::timeout(
            DEADLINE,
            status.wait_for(|s| *s == LeaseState::Reconnecting),
        )
        .await
        .expect("status never went Reconnecting")
        .unwrap();
        tokio::time::sleep(TTL * 3).await;
        env.etcd.as_mut().unwrap().resume().unwrap();

        eventually("the worker is listed again after the stall", || async {
            env.registry
                .list_workers()
                .await
                .is_ok_and(|ws| ws == vec![info.clone()])
        })
        .await;
        tokio::time::timeout(DEADLINE, status.wait_for(|s| *s == LeaseState::Live))
            .await
            .expect("status never came back to Live")
            .unwrap();
        // It stays: the new lease is kept alive past its own TTL.
        tokio::time::sleep(TTL * 2).await;
        assert_eq!(listed_ids(&*env.registry).await, ["w1"]);
        registration.deregister().await.unwrap();
        assert!(env.registry.list_workers().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_etcd_that_lost_its_data_gets_the_worker_back_and_watchers_never_lose_it() {
        let mut env = etcd_env().await;
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        let mut watch = env.registry.watch_workers().await.unwrap();
        let mut status = registration.status();

        // Keys, leases and revisions all gone.
        env.etcd.as_mut().unwrap().restart_empty().unwrap();
        eventually("the worker registers again in the empty etcd", || async {
            env.registry
                .list_workers()
                .await
                .is_ok_and(|ws| ws == vec![info.clone()])
        })
        .await;
        tokio::time::timeout(DEADLINE, status.wait_for(|s| *s == LeaseState::Live))
            .await
            .expect("status never came back to Live")
            .unwrap();
        // Past the resync grace, the watch has neither dropped nor re-added it...
        tokio::time::sleep(switchyard_registry::etcd::RESYNC_REMOVAL_GRACE + TTL).await;
        if let Some(change) = watch.try_next() {
            panic!("the watch reported {change:?} for a worker that never left");
        }
        // ...and follows the new etcd.
        let _w2 = env
            .registry
            .register(worker("w2", "m", 16), TTL)
            .await
            .unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(worker("w2", "m", 16))
        );
        registration.deregister().await.unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Removed(info.id.clone())
        );
    }

    #[tokio::test]
    async fn lost_lease_is_replaced_and_the_worker_re_registered() {
        let env = etcd_env().await;
        let mut raw = raw_client(&env).await;
        let keys = Keys::new(CLUSTER).unwrap();
        let info = worker("w1", "m", 16);
        let registration = env.registry.register(info.clone(), TTL).await.unwrap();
        let mut watch = env.registry.watch_workers().await.unwrap();
        let response = raw.get(keys.worker(&info.id), None).await.unwrap();
        let lease = response.kvs()[0].lease();
        assert_ne!(lease, 0, "worker key is not attached to a lease");
        raw.lease_revoke(lease).await.unwrap();
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Removed(info.id.clone())
        );
        assert_eq!(
            next_change(&mut watch).await,
            WorkerChange::Added(info.clone())
        );
        eventually("the worker is listed again", || async {
            env.registry
                .list_workers()
                .await
                .is_ok_and(|ws| ws == vec![info.clone()])
        })
        .await;
        let response = raw.get(keys.worker(&info.id), None).await.unwrap();
        assert_ne!(response.kvs()[0].lease(), lease);
        assert_eq!(*registration.status().borrow(), LeaseState::Live);
        // The replacement lease is the one deregistration releases.
        registration.deregister().await.unwrap();
        assert!(env.registry.list_workers().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn connect_refuses_bad_cluster_names_and_unreachable_etcd() {
        let endpoint = format!("http://127.0.0.1:{}", switchyard_testkit::free_port());
        let err = EtcdRegistry::connect(std::slice::from_ref(&endpoint), "a/b")
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::InvalidCluster(_)), "{err:?}");
        let err = EtcdRegistry::connect(&[endpoint], CLUSTER)
            .await
            .unwrap_err();
        assert!(err.is_retryable(), "{err:?}");
    }

    #[tokio::test]
    async fn clusters_do_not_see_each_other() {
        let env = etcd_env().await;
        let endpoint = env.etcd.as_ref().unwrap().endpoint();
        let other = EtcdRegistry::connect(&[endpoint], "other").await.unwrap();
        let _a = env
            .registry
            .register(worker("a", "m", 16), TTL)
            .await
            .unwrap();
        // Same model, different block size: fine, it is another cluster.
        let _b = other.register(worker("b", "m", 32), TTL).await.unwrap();
        assert_eq!(listed_ids(&*env.registry).await, ["a"]);
        assert_eq!(listed_ids(&other).await, ["b"]);
    }

    fn apply(view: &mut BTreeMap<WorkerId, WorkerInfo>, change: WorkerChange) {
        match change {
            WorkerChange::Added(w) | WorkerChange::Updated(w) => {
                view.insert(w.id.clone(), w);
            }
            WorkerChange::Removed(id) => {
                view.remove(&id);
            }
        }
    }
}
