#![allow(clippy::unwrap_used)]

//! The forwarding middleware over loopback HTTP: a turn reaches its owner once, a forwarded
//! turn is never forwarded again, a forged hop is refused when the cluster has a secret, and an
//! owner that does not answer leaves the turn to be served here (counted).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use switchyard_registry::{MemoryRegistry, ReplicaInfo, Replicas};
use switchyard_security::ClusterSecret;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{FORWARDED_HEADER, Fleet, FleetConfig, owner};
use crate::api::forward::forward_session;
use crate::observe::metrics::Metrics;

/// A replica's API stand-in: answers who served the turn and whether it came forwarded.
async fn serve(name: &'static str, fleet: Option<Arc<Fleet>>) -> SocketAddr {
    let handler = move |headers: HeaderMap| async move {
        let hop = headers.contains_key(FORWARDED_HEADER);
        format!("{name} forwarded={hop}")
    };
    let mut app = Router::new().route("/v1/chat/completions", post(handler));
    if let Some(fleet) = fleet {
        app = app.layer(axum::middleware::from_fn_with_state(fleet, forward_session));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn join(
    registry: &MemoryRegistry,
    me: ReplicaInfo,
    secret: Option<ClusterSecret>,
) -> (Arc<Fleet>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let config = FleetConfig {
        share_sessions: true,
        ..FleetConfig::default()
    };
    let fleet = Fleet::join(
        &config,
        me,
        Arc::new(registry.clone()),
        secret,
        "test",
        Arc::clone(&metrics),
        1 << 20,
        &TaskTracker::new(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    (fleet, metrics)
}

/// A session id `owner` owns among `replicas`.
fn session_owned_by(owner_id: &str, replicas: &[ReplicaInfo]) -> String {
    (0..)
        .map(|i| format!("session-{i}"))
        .find(|s| owner::owner(s, replicas).is_some_and(|o| o.id == owner_id))
        .unwrap()
}

async fn send(addr: SocketAddr, session: &str, hop: Option<&str>) -> (u16, String) {
    let mut request = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("x-session-id", session)
        .body("{}");
    if let Some(hop) = hop {
        request = request.header(FORWARDED_HEADER, hop);
    }
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn forwarded(metrics: &Metrics, outcome: &'static str) -> u64 {
    metrics
        .fleet
        .forwarded
        .get_or_create(&super::ForwardLabels { outcome })
        .get()
}

#[tokio::test]
async fn a_turn_is_served_by_its_owner_once_and_an_unreachable_owner_falls_back_here() {
    let registry = MemoryRegistry::new();
    let owner_addr = serve("owner", None).await;
    let owner = ReplicaInfo {
        id: "owner".into(),
        address: owner_addr.to_string(),
    };
    // A replica listed but gone: nothing listens on its port any more.
    let dead_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dead = ReplicaInfo {
        id: "dead".into(),
        address: format!("127.0.0.1:{dead_port}"),
    };
    let _owner_entry = registry
        .announce(owner.clone(), std::time::Duration::from_secs(2))
        .await
        .unwrap();
    let _dead_entry = registry
        .announce(dead.clone(), std::time::Duration::from_secs(2))
        .await
        .unwrap();
    let me_addr_placeholder = ReplicaInfo {
        id: "me".into(),
        address: "127.0.0.1:9".into(),
    };
    let (fleet, metrics) = join(&registry, me_addr_placeholder.clone(), None).await;
    let me = serve("me", Some(Arc::clone(&fleet))).await;
    let all = [dead.clone(), me_addr_placeholder.clone(), owner.clone()];

    let theirs = session_owned_by("owner", &all);
    assert_eq!(
        send(me, &theirs, None).await,
        (200, "owner forwarded=true".into())
    );
    assert_eq!(forwarded(&metrics, "forwarded"), 1);

    let mine = session_owned_by("me", &all);
    assert_eq!(
        send(me, &mine, None).await,
        (200, "me forwarded=false".into())
    );

    // Already forwarded: served here whoever owns it, never forwarded again.
    assert_eq!(
        send(me, &theirs, Some("open")).await,
        (200, "me forwarded=true".into())
    );
    assert_eq!(metrics.fleet.received.get(), 1);
    assert_eq!(forwarded(&metrics, "forwarded"), 1);

    let orphan = session_owned_by("dead", &all);
    assert_eq!(
        send(me, &orphan, None).await,
        (200, "me forwarded=false".into())
    );
    assert_eq!(forwarded(&metrics, "owner_unreachable"), 1);
    // Set aside until the registry lists it again: the next turn does not wait on it.
    assert_eq!(send(me, &orphan, None).await.0, 200);
    assert_eq!(forwarded(&metrics, "owner_unreachable"), 1);
}

#[tokio::test]
async fn with_a_cluster_secret_only_a_member_may_forward() {
    let registry = MemoryRegistry::new();
    let secret = ClusterSecret::from_bytes(b"0123456789abcdef0123").unwrap();
    let (fleet, metrics) = join(
        &registry,
        ReplicaInfo {
            id: "me".into(),
            address: "127.0.0.1:9".into(),
        },
        Some(secret.clone()),
    )
    .await;
    let me = serve("me", Some(Arc::clone(&fleet))).await;
    assert_eq!(send(me, "s", Some("open")).await.0, 401);
    assert_eq!(send(me, "s", Some("v1.gateway.1.00")).await.0, 401);
    let worker = switchyard_security::Identity::new("test", switchyard_security::PeerRole::Worker);
    let not_a_gateway = secret.credential(&worker, std::time::SystemTime::now());
    assert_eq!(send(me, "s", Some(&not_a_gateway)).await.0, 401);
    assert_eq!(
        send(me, "s", Some(&fleet.credential())).await,
        (200, "me forwarded=true".into())
    );
    assert_eq!(metrics.fleet.received.get(), 1);
}
