//! W3C trace context (`traceparent`, `tracestate`) over gRPC metadata.
//!
//! The gateway injects the context of the span that makes a call into the call's metadata; the
//! worker makes its own span a child of what it finds there. A disabled span (tracing off)
//! injects nothing, and a worker that finds nothing keeps its span's local parent, so both ends
//! work with tracing on or off on either side.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator only writes lowercase ASCII keys and printable values; anything else
        // is dropped rather than failing the call it rides on.
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                KeyRef::Ascii(k) => Some(k.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes `span`'s trace context into `metadata` (the outgoing call becomes its child).
pub fn inject_context(span: &tracing::Span, metadata: &mut MetadataMap) {
    if span.is_disabled() {
        return;
    }
    // Entering starts the OpenTelemetry span in its own service's layer. Reading the context of
    // a span nobody entered yet would start it in whichever layer `tracing-opentelemetry` finds
    // first, which in `switchyard up` may be the other service's.
    let context = span.in_scope(|| span.context());
    if !context.span().span_context().is_valid() {
        return;
    }
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(metadata));
}

/// Makes `span` a child of the caller's span named in `metadata`, when there is one. Call it
/// right after creating the span, before it is entered: an OpenTelemetry span's parent is fixed
/// when it starts.
pub fn extract_parent(span: &tracing::Span, metadata: &MetadataMap) {
    if span.is_disabled() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    if parent.span().span_context().is_valid() {
        // Fails only when the span already started, which the caller's order rules out; the
        // span then keeps its local parent, which is all a trace can lose here.
        let _ = span.set_parent(parent);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use crate::{GATEWAY, GATEWAY_SPANS, WORKER, WORKER_SPANS, provider, service_layer};

    /// Keeps what it is given, so a test can look at the exported spans and their service.
    #[derive(Debug, Clone, Default)]
    struct Collect(Arc<Mutex<Vec<SpanData>>>, Arc<Mutex<Option<Resource>>>);

    impl SpanExporter for Collect {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }

        fn set_resource(&mut self, resource: &Resource) {
            *self.1.lock().unwrap() = Some(resource.clone());
        }
    }

    impl Collect {
        fn service(&self) -> String {
            let resource = self.1.lock().unwrap().clone().unwrap();
            resource
                .get(&opentelemetry::Key::from_static_str("service.name"))
                .unwrap()
                .to_string()
        }

        fn named(&self, name: &str) -> SpanData {
            let spans = self.0.lock().unwrap();
            spans
                .iter()
                .find(|s| s.name == name)
                .cloned()
                .unwrap_or_else(|| panic!("no span {name} among {} exported", spans.len()))
        }
    }

    /// A subscriber exporting as the gateway and as a worker, each to its own collector, the
    /// way `switchyard up` exports (the simple processor exports each span as it ends). The
    /// worker's layer comes first, so a gateway span whose context were read before it started
    /// would be exported as the worker's.
    fn two_services() -> (impl tracing::Subscriber + Send + Sync, Collect, Collect) {
        let (gateway, worker) = (Collect::default(), Collect::default());
        let gateway_provider = provider(
            GATEWAY,
            SdkTracerProvider::builder().with_simple_exporter(gateway.clone()),
        );
        let worker_provider = provider(
            WORKER,
            SdkTracerProvider::builder().with_simple_exporter(worker.clone()),
        );
        let subscriber = tracing_subscriber::registry().with(vec![
            service_layer(WORKER, &worker_provider),
            service_layer(GATEWAY, &gateway_provider),
        ]);
        (subscriber, gateway, worker)
    }

    #[test]
    fn traceparent_crosses_metadata_and_parents_the_worker_span() {
        let (subscriber, gateway, worker) = two_services();
        let mut metadata = MetadataMap::new();
        tracing::subscriber::with_default(subscriber, || {
            let decode = tracing::info_span!(target: GATEWAY_SPANS, "decode");
            inject_context(&decode, &mut metadata);
            drop(decode);

            let generate = tracing::info_span!(target: WORKER_SPANS, "generate");
            extract_parent(&generate, &metadata);
            let transfer =
                generate.in_scope(|| tracing::info_span!(target: WORKER_SPANS, "transfer"));
            drop(transfer);
            drop(generate);
        });

        let traceparent = metadata.get("traceparent").unwrap().to_str().unwrap();
        let parts: Vec<&str> = traceparent.split('-').collect();
        assert_eq!(parts.len(), 4, "{traceparent}");
        assert_eq!(parts[0], "00", "{traceparent}");
        assert_eq!(parts[3], "01", "sampled: {traceparent}");

        let decode = gateway.named("decode");
        assert_eq!(parts[1], decode.span_context.trace_id().to_string());
        assert_eq!(parts[2], decode.span_context.span_id().to_string());
        assert!(gateway.0.lock().unwrap().iter().all(|s| s.name == "decode"));

        let generate = worker.named("generate");
        assert_eq!(
            generate.span_context.trace_id(),
            decode.span_context.trace_id()
        );
        assert_eq!(generate.parent_span_id, decode.span_context.span_id());
        assert!(generate.parent_span_is_remote);
        let transfer = worker.named("transfer");
        assert_eq!(
            transfer.span_context.trace_id(),
            decode.span_context.trace_id()
        );
        assert_eq!(transfer.parent_span_id, generate.span_context.span_id());
        assert_eq!(gateway.service(), "switchyard-gateway");
        assert_eq!(worker.service(), "switchyard-worker");
    }

    #[test]
    fn without_traceparent_the_worker_span_is_a_root() {
        let (subscriber, _gateway, worker) = two_services();
        tracing::subscriber::with_default(subscriber, || {
            let generate = tracing::info_span!(target: WORKER_SPANS, "generate");
            extract_parent(&generate, &MetadataMap::new());
            let mut garbage = MetadataMap::new();
            garbage.insert("traceparent", MetadataValue::from_static("00-nothex-zz-01"));
            let other = tracing::info_span!(target: WORKER_SPANS, "prefill");
            extract_parent(&other, &garbage);
        });
        for name in ["generate", "prefill"] {
            let span = worker.named(name);
            assert_eq!(span.parent_span_id, SpanId::INVALID, "{name}");
            assert_ne!(span.span_context.trace_id(), TraceId::INVALID, "{name}");
        }
    }

    #[test]
    fn disabled_spans_inject_nothing() {
        // No subscriber wants the span (tracing off): the call carries no context.
        let mut metadata = MetadataMap::new();
        let span = tracing::info_span!(target: GATEWAY_SPANS, "decode");
        inject_context(&span, &mut metadata);
        assert!(metadata.is_empty());
        extract_parent(&span, &metadata);
    }
}
