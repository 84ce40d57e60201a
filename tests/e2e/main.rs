//! The end-to-end suite as one test binary: each module is a former binary of its own
//! (`tests/<name>.rs`), all sharing one build of the support code (`tests/support`) and one link
//! of the dependency tree. Run one module with `cargo nextest run -p switchyard --test e2e
//! <module>::` (for example `anthropic_e2e::`); nextest still runs every test in a process of
//! its own.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

#[path = "../support/mod.rs"]
mod support;

#[path = "../agent_clients_e2e.rs"]
mod agent_clients_e2e;

#[path = "../anthropic_e2e.rs"]
mod anthropic_e2e;

#[path = "../audit_counterfactual_e2e.rs"]
mod audit_counterfactual_e2e;

#[path = "../audit_e2e.rs"]
mod audit_e2e;

#[path = "../chaos/etcd.rs"]
mod chaos_etcd;

#[path = "../chaos/gateway.rs"]
mod chaos_gateway;

#[path = "../chaos/network.rs"]
mod chaos_network;

#[path = "../chaos/workers.rs"]
mod chaos_workers;

#[path = "../chat_tools_e2e.rs"]
mod chat_tools_e2e;

#[path = "../cli_e2e.rs"]
mod cli_e2e;

#[path = "../disagg_e2e.rs"]
mod disagg_e2e;

#[path = "../disagg_replay_e2e.rs"]
mod disagg_replay_e2e;

#[path = "../engine_pd_e2e.rs"]
mod engine_pd_e2e;

#[path = "../epp_e2e.rs"]
mod epp_e2e;

#[path = "../etcd_security_e2e.rs"]
mod etcd_security_e2e;

#[path = "../event_plane_e2e.rs"]
mod event_plane_e2e;

#[path = "../fleet_e2e.rs"]
mod fleet_e2e;

#[path = "../fleet_scale_e2e.rs"]
mod fleet_scale_e2e;

#[path = "../gateway_access_e2e.rs"]
mod gateway_access_e2e;

#[path = "../gateway_api_e2e.rs"]
mod gateway_api_e2e;

#[path = "../gateway_limits_e2e.rs"]
mod gateway_limits_e2e;

#[path = "../gateway_resilience_e2e.rs"]
mod gateway_resilience_e2e;

#[path = "../gateway_routing_e2e.rs"]
mod gateway_routing_e2e;

#[path = "../host_tier_e2e.rs"]
mod host_tier_e2e;

#[path = "../kube_discovery_e2e.rs"]
mod kube_discovery_e2e;

#[path = "../kv_identity_e2e.rs"]
mod kv_identity_e2e;

#[path = "../listener_tls_e2e.rs"]
mod listener_tls_e2e;

#[path = "../lora_e2e.rs"]
mod lora_e2e;

#[path = "../placement_e2e.rs"]
mod placement_e2e;

#[path = "../planner_e2e.rs"]
mod planner_e2e;

#[path = "../prefix_cache_e2e.rs"]
mod prefix_cache_e2e;

#[path = "../quota_e2e.rs"]
mod quota_e2e;

#[path = "../replay_e2e.rs"]
mod replay_e2e;

#[path = "../request_priority_e2e.rs"]
mod request_priority_e2e;

#[path = "../responses_e2e.rs"]
mod responses_e2e;

#[path = "../retention_e2e.rs"]
mod retention_e2e;

#[path = "../session_scheduling_e2e.rs"]
mod session_scheduling_e2e;

#[path = "../security_e2e.rs"]
mod security_e2e;

#[path = "../sglang_retention_e2e.rs"]
mod sglang_retention_e2e;

#[path = "../tracing_e2e.rs"]
mod tracing_e2e;

#[path = "../trtllm_adapter_e2e.rs"]
mod trtllm_adapter_e2e;

#[path = "../trtllm_pd_e2e.rs"]
mod trtllm_pd_e2e;

#[path = "../vllm_adapter_e2e.rs"]
mod vllm_adapter_e2e;

#[path = "../worker_cluster.rs"]
mod worker_cluster;

#[path = "../worker_metrics_e2e.rs"]
mod worker_metrics_e2e;
