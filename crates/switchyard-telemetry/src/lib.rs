//! Switchyard's telemetry: the process's `tracing` subscriber (logs on stderr, and OpenTelemetry
//! traces over OTLP/gRPC when an endpoint is configured) and the W3C trace context that links a
//! gateway's spans to the worker spans they cause.
//!
//! - [`init`] installs the subscriber. Logs go to stderr under `SWITCHYARD_LOG` as always. With
//!   an endpoint, each [`Service`] the process runs gets its own tracer provider (its own
//!   `service.name`) and batch exporter; `switchyard up` runs the gateway and the workers in one
//!   process and so exports as both.
//! - Trace spans have their own targets, [`GATEWAY_SPANS`] and [`WORKER_SPANS`], which the log
//!   filter switches off: without an endpoint no layer wants them, so they are disabled at their
//!   call sites (an atomic load each) and the logs read exactly as before. Which service a span
//!   belongs to is its target, so one process can export as two services.
//! - [`propagation`] carries the context across gRPC: the gateway injects `traceparent` into
//!   a call's metadata, the worker makes its span a child of it.
//!
//! Span fields that count things are recorded as `i64`: `tracing-opentelemetry` exports
//! unsigned integers as strings, which a trace backend cannot compare or sum.

pub mod propagation;

use std::io::IsTerminal;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracerProvider, TracerProviderBuilder};
use tracing::Level;
use tracing_subscriber::filter::{Directive, EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

pub use propagation::{extract_parent, inject_context};

/// Target of the gateway's trace spans (request, preprocess, route, prefill, decode).
pub const GATEWAY_SPANS: &str = "switchyard_trace::gateway";
/// Target of the worker's trace spans (generate, prefill, transfer).
pub const WORKER_SPANS: &str = "switchyard_trace::worker";

/// The prefix of both span targets, which the log filter turns off: trace spans are for OTLP,
/// and a log line should not change with tracing on or off.
const TRACE_SPANS: &str = "switchyard_trace";

/// How long shutdown waits for the last spans to reach the collector.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// One role of the system as traces name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// `service.name` of its spans.
    pub name: &'static str,
    /// Target of its spans.
    pub spans: &'static str,
    /// Target prefix of its log events; those at INFO and above that happen inside one of its
    /// spans become events of that span (a retry's warning shows on the request it delayed).
    pub events: &'static str,
}

/// The gateway: `switchyard gateway`, and the gateway half of `switchyard up`.
pub const GATEWAY: Service = Service {
    name: "switchyard-gateway",
    spans: GATEWAY_SPANS,
    events: "switchyard_gateway",
};

/// A worker agent: `switchyard worker`, and the workers of `switchyard up`.
pub const WORKER: Service = Service {
    name: "switchyard-worker",
    spans: WORKER_SPANS,
    events: "switchyard_worker",
};

/// Why telemetry could not start; the operator's to fix (a bad endpoint).
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid OTLP endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("cannot build the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("invalid log filter: {0}")]
    Filter(String),
    #[error("cannot install the tracing subscriber: {0}")]
    Install(String),
}

/// Checks an OTLP/gRPC endpoint the way the exporter will use it: a plain `http://host:port`
/// URL (the exporter is built without TLS; run a collector or agent next to the process).
pub fn validate_endpoint(endpoint: &str) -> Result<(), TelemetryError> {
    let invalid = |reason: &str| {
        Err(TelemetryError::Endpoint {
            endpoint: endpoint.to_owned(),
            reason: reason.to_owned(),
        })
    };
    if endpoint.starts_with("https://") {
        return invalid(
            "TLS to the collector is not supported; use http:// to a collector or agent nearby",
        );
    }
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return invalid("it must start with http://, e.g. http://otel-collector:4317");
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return invalid("it names no host");
    }
    match endpoint.parse::<tonic::transport::Uri>() {
        Ok(_) => Ok(()),
        Err(err) => invalid(&err.to_string()),
    }
}

/// Where traces go: the collector and the services this process exports as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceExport {
    /// The collector's OTLP/gRPC endpoint, `http://host:4317`.
    pub endpoint: String,
    pub services: Vec<Service>,
}

/// The installed telemetry: hold it for the life of the process and [`shutdown`](Self::shutdown)
/// it at the end, so the last spans are sent.
#[derive(Debug, Default)]
#[must_use = "dropping it without shutdown loses the spans not yet exported"]
pub struct Telemetry {
    providers: Vec<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        !self.providers.is_empty()
    }

    /// Exports what is still buffered and stops the exporters. Call it while the Tokio runtime
    /// that built them still runs: the exporter's connection lives there.
    pub fn shutdown(self) {
        for provider in self.providers {
            if let Err(err) = provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
                tracing::warn!(error = %err, "could not export the last spans");
            }
        }
    }
}

/// Installs the process's subscriber: logs on stderr under `log_filter`, and with `export`, one
/// OTLP exporter per service. Must run inside a Tokio runtime when `export` is given (the
/// exporter's gRPC channel is spawned there); without one it needs none.
pub fn init(
    log_filter: EnvFilter,
    export: Option<TraceExport>,
) -> Result<Telemetry, TelemetryError> {
    let quiet: Directive = format!("{TRACE_SPANS}=off").parse().map_err(
        |e: tracing_subscriber::filter::ParseError| TelemetryError::Filter(e.to_string()),
    )?;
    let log_filter = log_filter.add_directive(quiet);
    // Colours only for a person at a terminal: a log file, a pipe or a container's log
    // collector gets plain text (and NO_COLOR turns them off anywhere).
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_filter(log_filter)
        .boxed();
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![log];
    let mut providers = Vec::new();
    if let Some(export) = export {
        validate_endpoint(&export.endpoint)?;
        for service in export.services {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(export.endpoint.clone())
                .build()
                .map_err(|source| TelemetryError::Exporter {
                    endpoint: export.endpoint.clone(),
                    source,
                })?;
            let provider = provider(
                service,
                SdkTracerProvider::builder().with_batch_exporter(exporter),
            );
            layers.push(service_layer(service, &provider));
            providers.push(provider);
        }
    }
    tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .map_err(|e| TelemetryError::Install(e.to_string()))?;
    Ok(Telemetry { providers })
}

/// The tracer provider of `service`: `builder` (with its exporter) under the service's resource.
/// `OTEL_RESOURCE_ATTRIBUTES` adds to the resource (a pod's name, a cluster); the service name is
/// always ours.
pub fn provider(service: Service, builder: TracerProviderBuilder) -> SdkTracerProvider {
    let resource = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_service_name(service.name)
        .build();
    builder.with_resource(resource).build()
}

/// The layer that turns `service`'s spans into OpenTelemetry spans of `provider`.
///
/// Several of these may share a subscriber (`switchyard up`): each sees only its own service's
/// spans and events, so every span is exported once, by its own service (which is why
/// [`inject_context`] enters a span before it reads its context).
pub fn service_layer(
    service: Service,
    provider: &SdkTracerProvider,
) -> Box<dyn Layer<Registry> + Send + Sync> {
    let filter = Targets::new()
        .with_target(service.spans, Level::TRACE)
        .with_target(service.events, Level::INFO);
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("switchyard"))
        .with_location(false)
        .with_threads(false)
        .with_filter(filter)
        .boxed()
}

/// Marks `span` as failed with `description` (OpenTelemetry status `ERROR`). Nothing when the
/// span is disabled.
pub fn record_error(span: &tracing::Span, description: impl Into<String>) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !span.is_disabled() {
        span.set_status(opentelemetry::trace::Status::error(description.into()));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn endpoints_must_be_plain_http_urls() {
        validate_endpoint("http://otel-collector:4317").unwrap();
        validate_endpoint("http://127.0.0.1:4317/").unwrap();
        for bad in [
            "otel-collector:4317",
            "https://collector:4317",
            "http://",
            "http:// spaces:4317",
            "",
        ] {
            let err = validate_endpoint(bad).unwrap_err();
            assert!(err.to_string().contains("OTLP endpoint"), "{bad}: {err}");
        }
        let err = validate_endpoint("https://collector:4317").unwrap_err();
        assert!(err.to_string().contains("TLS"), "{err}");
    }
}
