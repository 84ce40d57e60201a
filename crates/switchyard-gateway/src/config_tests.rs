//! Tests of the gateway configuration (`config.rs`).

use super::*;
use crate::cluster::fleet::FleetArgs;

#[test]
fn defaults_validate_and_flags_override() {
    GatewayConfig::default().validate().unwrap();
    let args = GatewayArgs {
        policy: Some(PolicyKind::RoundRobin),
        model_tokenizers: vec![("m".into(), "builtin:cl100k".into())],
        ..Default::default()
    };
    let config = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(config.policy, PolicyKind::RoundRobin);
    assert_eq!(config.models["m"], "builtin:cl100k");
    assert_eq!(config.disagg().kv_transfer, KvTransfer::Pipelined);
    let args = GatewayArgs {
        kv_transfer: Some(KvTransfer::AfterPrefill),
        ..Default::default()
    };
    let config = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(config.disagg().kv_transfer, KvTransfer::AfterPrefill);
    let file: GatewayConfig = toml::from_str("kv_transfer = \"after-prefill\"").unwrap();
    assert_eq!(file.kv_transfer, KvTransfer::AfterPrefill);
}

#[test]
fn bad_values_are_refused() {
    let args = GatewayArgs {
        default_max_tokens: Some(0),
        ..Default::default()
    };
    assert!(args.resolve_onto(GatewayConfig::default()).is_err());
    let args = GatewayArgs {
        max_queued_per_session: Some(0),
        ..Default::default()
    };
    assert!(args.resolve_onto(GatewayConfig::default()).is_err());
    assert!(parse_model_tokenizer("nomodel").is_err());
    let args = GatewayArgs {
        session_verify_sample_rate: Some(1.5),
        ..Default::default()
    };
    let err = args.resolve_onto(GatewayConfig::default()).unwrap_err();
    assert!(err.to_string().contains("verify_sample_rate"), "{err}");
    let args = GatewayArgs {
        session_verify_sample_rate: Some(1.0),
        ..Default::default()
    };
    let config = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(
        config.session_cache.to_session_config().verify_sample_rate,
        1.0
    );
}

#[test]
fn http_limits_come_from_flags_and_files_and_are_checked() {
    let args = GatewayArgs {
        max_connections: Some(7),
        idle_timeout_secs: Some(3),
        max_requests_per_client: Some(2),
        ..Default::default()
    };
    let config = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(config.http.max_connections, 7);
    assert_eq!(config.max_requests_per_client, 2);
    assert_eq!(config.http.limits(7).idle_timeout, Duration::from_secs(3));
    let file: GatewayConfig =
        toml::from_str("[http]\nbody_timeout_secs = 5\nshutdown_grace_secs = 0").unwrap();
    assert_eq!(file.http.body_timeout_secs, 5);
    file.validate().unwrap();
    assert!(toml::from_str::<GatewayConfig>("[http]\nheader_timeout = 5").is_err());
    let args = GatewayArgs {
        header_timeout_secs: Some(0),
        ..Default::default()
    };
    let err = args.resolve_onto(GatewayConfig::default()).unwrap_err();
    assert!(err.to_string().contains("header_timeout_secs"), "{err}");
}

#[test]
fn otlp_endpoint_is_checked_once() {
    let args = GatewayArgs {
        otlp_endpoint: Some("http://otel-collector:4317".into()),
        ..Default::default()
    };
    let config = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(
        config.otlp_endpoint.as_deref(),
        Some("http://otel-collector:4317")
    );
    let args = GatewayArgs {
        otlp_endpoint: Some("otel-collector:4317".into()),
        ..Default::default()
    };
    let err = args.resolve_onto(GatewayConfig::default()).unwrap_err();
    assert!(err.to_string().contains("OTLP endpoint"), "{err}");
    let args = GatewayArgs {
        otlp_endpoint: Some(String::new()),
        ..Default::default()
    };
    let traced = GatewayConfig {
        otlp_endpoint: Some("http://otel-collector:4317".into()),
        ..GatewayConfig::default()
    };
    assert_eq!(args.resolve_onto(traced).unwrap().otlp_endpoint, None);
}

#[test]
fn fleet_settings_are_read_and_what_the_hop_cannot_do_is_refused() {
    let file: GatewayConfig = toml::from_str(
        "[fleet]\nshare_sessions = true\nreplica_id = \"gw-a\"\nadvertise = \"10.0.0.7:8000\"",
    )
    .unwrap();
    file.validate().unwrap();
    assert_eq!(file.fleet.replica_id.as_deref(), Some("gw-a"));
    let refused = |toml_text: &str, needle: &str| {
        let config: GatewayConfig = toml::from_str(toml_text).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(needle), "{toml_text}: {err}");
    };
    refused(
        "[fleet]\nshare_sessions = true\nreplica_id = \"a/b\"",
        "fleet.replica_id",
    );
    refused(
        "[fleet]\nshare_sessions = true\nadvertise = \"nohost\"",
        "fleet.advertise",
    );
    refused(
        "[fleet]\nshare_sessions = true\nrefresh_ms = 0",
        "fleet.refresh_ms",
    );
    refused(
        "[fleet]\nshare_sessions = true\n[access]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"",
        "HTTPS",
    );
    refused(
        "[fleet]\nshare_sessions = true\n[security]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\ntls_ca = \"ca.pem\"",
        "cluster secret",
    );
    let config = GatewayArgs {
        fleet: FleetArgs {
            share_sessions: true,
            ..FleetArgs::default()
        },
        ..Default::default()
    }
    .resolve_onto(GatewayConfig::default())
    .unwrap();
    assert!(config.fleet.share_sessions);
}

#[test]
fn the_prefix_cache_bound_comes_from_files_and_flags() {
    let default = GatewayConfig::default().session_cache.to_session_config();
    assert_eq!(
        default.prefix_cache_bytes,
        switchyard_tokenize::DEFAULT_PREFIX_CACHE_BYTES
    );
    let file: GatewayConfig = toml::from_str("[session_cache]\nprefix_cache_bytes = 4096").unwrap();
    assert_eq!(
        file.session_cache.to_session_config().prefix_cache_bytes,
        4096
    );
    let args = GatewayArgs {
        prefix_cache_bytes: Some(0),
        ..Default::default()
    };
    let config = args.resolve_onto(file).unwrap();
    assert_eq!(
        config.session_cache.to_session_config().prefix_cache_bytes,
        0
    );
}

#[test]
fn load_push_comes_from_files_and_flags_and_must_beat_the_interval() {
    assert_eq!(GatewayConfig::default().load_push_min_ms, 5);
    let file: GatewayConfig =
        toml::from_str("load_interval_ms = 200\nload_push_min_ms = 20").unwrap();
    file.validate().unwrap();
    assert_eq!(file.load_push_min_ms, 20);
    let args = GatewayArgs {
        load_push_min_ms: Some(0),
        ..Default::default()
    };
    let config = args.resolve_onto(file.clone()).unwrap();
    assert_eq!(config.load_push_min_ms, 0, "0 turns pushing off");
    let args = GatewayArgs {
        load_push_min_ms: Some(200),
        ..Default::default()
    };
    let err = args.resolve_onto(file).unwrap_err();
    assert!(err.to_string().contains("load_push_min_ms"), "{err}");
}

#[test]
fn the_load_interval_is_a_heartbeat_with_pushes_and_a_poll_without() {
    let default = GatewayConfig::default();
    assert_eq!(
        default.load_interval_ms(),
        1_000,
        "pushes on: idle heartbeat"
    );
    assert_eq!(default.unresponsive_after(), Duration::from_secs(4));
    let args = GatewayArgs {
        load_push_min_ms: Some(0),
        ..Default::default()
    };
    let polling = args.resolve_onto(GatewayConfig::default()).unwrap();
    assert_eq!(
        polling.load_interval_ms(),
        100,
        "pushes off: the interval is the view's age"
    );
    assert_eq!(polling.unresponsive_after(), Duration::from_secs(2));

    // A file's or a flag's interval wins over both defaults, and is checked against the rest.
    let file: GatewayConfig = toml::from_str("load_interval_ms = 250").unwrap();
    file.validate().unwrap();
    assert_eq!(file.load_interval_ms(), 250);
    let args = GatewayArgs {
        load_interval_ms: Some(300),
        unresponsive_after_ms: Some(1_000),
        ..Default::default()
    };
    let config = args.resolve_onto(file.clone()).unwrap();
    assert_eq!(config.load_interval_ms(), 300);
    let args = GatewayArgs {
        unresponsive_after_ms: Some(1_000),
        ..Default::default()
    };
    let err = args.resolve_onto(GatewayConfig::default()).unwrap_err();
    assert!(err.to_string().contains("unresponsive_after_ms"), "{err}");
    let args = GatewayArgs {
        load_interval_ms: Some(4),
        ..Default::default()
    };
    let err = args.resolve_onto(file).unwrap_err();
    assert!(err.to_string().contains("load_push_min_ms"), "{err}");
}

#[test]
fn subscribe_concurrency_comes_from_files_and_flags_and_zero_is_refused() {
    assert_eq!(GatewayConfig::default().subscribe_concurrency, 64);
    let file: GatewayConfig = toml::from_str("subscribe_concurrency = 8").unwrap();
    file.validate().unwrap();
    assert_eq!(file.subscribe_concurrency, 8);
    let args = GatewayArgs {
        subscribe_concurrency: Some(3),
        ..Default::default()
    };
    assert_eq!(
        args.resolve_onto(file.clone())
            .unwrap()
            .subscribe_concurrency,
        3
    );
    let args = GatewayArgs {
        subscribe_concurrency: Some(0),
        ..Default::default()
    };
    let err = args.resolve_onto(file).unwrap_err();
    assert!(err.to_string().contains("subscribe_concurrency"), "{err}");
}
