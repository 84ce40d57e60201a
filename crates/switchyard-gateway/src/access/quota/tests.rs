use super::*;
use prometheus_client::registry::Registry;

fn limited(limits: Limits) -> QuotaConfig {
    QuotaConfig {
        default: limits,
        ..QuotaConfig::default()
    }
}

fn gate(config: QuotaConfig) -> Arc<Quotas> {
    Arc::new(Quotas::new(config, QuotaMetrics::default()).unwrap())
}

fn encoded(quotas: &Quotas) -> String {
    let mut registry = Registry::default();
    quotas.metrics.register(&mut registry);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    out
}

#[tokio::test]
async fn a_tenant_over_its_requests_gets_429_naming_the_limit() {
    let quotas = gate(limited(Limits {
        requests_per_window: 2,
        ..Limits::default()
    }));
    let _a = quotas.enter("user:a").await.unwrap();
    let _b = quotas.enter("user:a").await.unwrap();
    let refused = quotas.enter("user:a").await.unwrap_err();
    let ApiError::QuotaExceeded {
        limit,
        retry_after_secs,
    } = refused
    else {
        panic!("{refused:?}");
    };
    assert_eq!(limit, "requests_per_window");
    assert!((1..=60).contains(&retry_after_secs));
    // Another tenant is not affected.
    quotas.enter("user:b").await.unwrap();
    assert!(encoded(&quotas).contains(r#"quota_refused_total{limit="requests_per_window"} 1"#));
}

#[tokio::test]
async fn per_tenant_limits_replace_the_default() {
    let mut config = limited(Limits {
        requests_per_window: 1,
        ..Limits::default()
    });
    config
        .tenants
        .insert("tenant:free".into(), Limits::default());
    let quotas = gate(config);
    for _ in 0..5 {
        quotas.enter("tenant:free").await.unwrap();
    }
    quotas.enter("tenant:paid").await.unwrap();
    assert!(quotas.enter("tenant:paid").await.is_err());
}

#[tokio::test]
async fn concurrency_slots_come_back_when_passes_drop() {
    let quotas = gate(limited(Limits {
        concurrent_requests: 1,
        ..Limits::default()
    }));
    let held = quotas.enter("user:a").await.unwrap();
    let refused = quotas.enter("user:a").await.unwrap_err();
    assert!(
        matches!(
            refused,
            ApiError::QuotaExceeded {
                limit: "concurrent_requests",
                retry_after_secs: 1
            }
        ),
        "{refused:?}"
    );
    assert_eq!(quotas.leases.lock().len(), 1);
    drop(held);
    // The release runs off the request's path.
    quotas.settled().await;
    assert!(quotas.leases.lock().is_empty());
    quotas.enter("user:a").await.unwrap();
}

#[tokio::test]
async fn tokens_used_are_charged_when_the_request_ends() {
    let quotas = gate(limited(Limits {
        tokens_per_window: 100,
        ..Limits::default()
    }));
    let pass = quotas.enter("user:a").await.unwrap();
    pass.charge(60);
    pass.charge(40);
    // Not charged before the request ends.
    let second = quotas.enter("user:a").await.unwrap();
    drop(pass);
    drop(second);
    quotas.settled().await;
    let refused = quotas.enter("user:a").await.unwrap_err();
    assert!(
        matches!(
            refused,
            ApiError::QuotaExceeded {
                limit: "tokens_per_window",
                ..
            }
        ),
        "{refused:?}"
    );
}

/// A Redis nobody listens on: every call fails, as with the store away.
fn unreachable_redis(on_store_error: StoreDown) -> QuotaConfig {
    QuotaConfig {
        redis: Some(config::RedisConfig {
            url: format!("redis://127.0.0.1:{}", switchyard_testkit::free_port()),
            ..config::RedisConfig::default()
        }),
        on_store_error,
        store_timeout_ms: 200,
        ..limited(Limits {
            requests_per_window: 1,
            ..Limits::default()
        })
    }
}

#[tokio::test]
async fn with_the_store_away_requests_fail_open_or_closed_as_configured() {
    let open = gate(unreachable_redis(StoreDown::FailOpen));
    for _ in 0..3 {
        // Over the limit of 1, but nothing can count them: in they go.
        open.enter("user:a").await.unwrap();
    }
    assert!(encoded(&open).contains(r#"quota_store_errors_total{outcome="fail_open"} 3"#));
    let closed = gate(unreachable_redis(StoreDown::FailClosed));
    let refused = closed.enter("user:a").await.unwrap_err();
    assert!(matches!(refused, ApiError::QuotaStoreDown), "{refused:?}");
    assert!(encoded(&closed).contains(r#"quota_store_errors_total{outcome="fail_closed"} 1"#));
}

#[tokio::test]
async fn replicas_sharing_a_redis_share_the_limit() {
    let server = switchyard_testkit::redis::RedisServer::start().unwrap();
    let config = QuotaConfig {
        redis: Some(config::RedisConfig {
            url: server.url(),
            ..config::RedisConfig::default()
        }),
        store_timeout_ms: 2000,
        // An hour: both rounds fall in one window unless the test runs over an hour's turn.
        window_secs: 3600,
        ..limited(Limits {
            requests_per_window: 10,
            concurrent_requests: 4,
            ..Limits::default()
        })
    };
    let replicas: Vec<_> = (0..3).map(|_| gate(config.clone())).collect();
    let mut held = Vec::new();
    let mut refused = Vec::new();
    for i in 0..12 {
        match replicas[i % 3].enter("tenant:t").await {
            Ok(pass) => held.push(pass),
            Err(ApiError::QuotaExceeded { limit, .. }) => refused.push(limit),
            Err(other) => panic!("{other:?}"),
        }
    }
    // Four in flight over the three replicas, whichever served them.
    assert_eq!(held.len(), 4);
    assert!(refused.iter().all(|l| *l == "concurrent_requests"));
    drop(held);
    for replica in &replicas {
        replica.settled().await;
    }
    // The request count went on over the replicas: 4 counted, 6 more fit.
    let mut admitted = 0;
    for i in 0..12 {
        if let Ok(pass) = replicas[i % 3].enter("tenant:t").await {
            admitted += 1;
            drop(pass);
            replicas[i % 3].settled().await;
        }
    }
    assert_eq!(admitted, 6);
}
