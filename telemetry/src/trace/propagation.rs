//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers and gRPC metadata,
//! and between `tracing` spans and OpenTelemetry contexts.
//!
//! A malformed `traceparent` is ignored (the request starts a new trace), never an error: the
//! W3C propagator returns an empty context for it. With tracing off (no OpenTelemetry layer
//! installed) spans carry no context, so nothing is injected and [`traceparent`] is `None`.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header / metadata key of the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";

struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeaderInjector<'a>(&'a mut axum::http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            axum::http::HeaderName::from_bytes(key.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// A caller's trace context (the parent of the span a request starts here), or none. Opaque:
/// crates that only pass it along need no OpenTelemetry types.
#[derive(Clone, Debug, Default)]
pub struct RemoteParent(Context);

impl RemoteParent {
    /// No caller context: the request starts a new trace.
    pub fn none() -> Self {
        RemoteParent(Context::new())
    }

    /// From HTTP headers (empty when absent or malformed).
    pub fn from_http(headers: &axum::http::HeaderMap) -> Self {
        RemoteParent(TraceContextPropagator::new().extract(&HeaderExtractor(headers)))
    }

    /// From gRPC metadata (empty when absent or malformed).
    pub fn from_grpc(metadata: &tonic::metadata::MetadataMap) -> Self {
        RemoteParent(TraceContextPropagator::new().extract(&MetadataExtractor(metadata)))
    }

    /// From a bare `traceparent` value (a KV-transfer descriptor, say).
    pub fn from_traceparent(value: &str) -> Self {
        let mut h = axum::http::HeaderMap::new();
        if let Ok(v) = axum::http::HeaderValue::from_str(value) {
            h.insert(TRACEPARENT, v);
        }
        Self::from_http(&h)
    }

    /// Whether a valid parent was carried.
    pub fn is_some(&self) -> bool {
        self.0.span().span_context().is_valid()
    }

    /// The carried trace id in hex.
    pub fn trace_id(&self) -> Option<String> {
        let sc = self.0.span().span_context().clone();
        sc.is_valid().then(|| sc.trace_id().to_string())
    }
}

/// Makes `span` a child of `parent` (no-op when it carries none, or with tracing off).
pub fn adopt(span: &tracing::Span, parent: RemoteParent) {
    if parent.is_some() {
        let _ = span.set_parent(parent.0);
    }
}

/// Writes `span`'s context into outgoing gRPC metadata (no-op with tracing off).
pub fn inject_grpc(span: &tracing::Span, metadata: &mut tonic::metadata::MetadataMap) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
    }
}

/// Writes `span`'s context into HTTP headers (no-op with tracing off).
pub fn inject_http(span: &tracing::Span, headers: &mut axum::http::HeaderMap) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
    }
}

/// `span`'s `traceparent` value (for responses and wire descriptors); `None` with tracing off.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// The trace id of `span` in hex (logs), if it has one.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Marks `span` failed: status ERROR with `message`, and the `error.type` attribute (a closed
/// set: the error's kind).
pub fn mark_error(span: &tracing::Span, kind: &'static str, message: impl std::fmt::Display) {
    span.set_attribute("error.type", kind);
    span.set_status(opentelemetry::trace::Status::error(message.to_string()));
}

/// Links `span` to the span a `traceparent` names (the sender's side of a KV transfer); no-op
/// for an empty or malformed value.
pub fn link(span: &tracing::Span, traceparent: &str) {
    if traceparent.is_empty() {
        return;
    }
    let parent = RemoteParent::from_traceparent(traceparent);
    if parent.is_some() {
        span.add_link(parent.0.span().span_context().clone());
    }
}

/// Sets a string-array attribute (`gen_ai.response.finish_reasons`).
pub fn set_strings(span: &tracing::Span, key: &'static str, values: &[&str]) {
    let v: Vec<opentelemetry::StringValue> =
        values.iter().map(|s| s.to_string().into()).collect();
    span.set_attribute(key, opentelemetry::Value::Array(v.into()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_traceparent_is_read_and_a_malformed_one_starts_fresh() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = RemoteParent::from_traceparent(good).0;
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-zzzz-01",
        ] {
            assert!(!RemoteParent::from_traceparent(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn grpc_metadata_round_trips_the_context() {
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        md.insert("tracestate", "vendor=x".parse().unwrap());
        let cx = RemoteParent::from_grpc(&md).0;
        let mut out = tonic::metadata::MetadataMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(&mut out));
        assert_eq!(
            out.get(TRACEPARENT).unwrap(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(out.get("tracestate").unwrap(), "vendor=x");
    }

    #[test]
    fn with_tracing_off_nothing_is_injected() {
        let span = tracing::info_span!("x");
        let mut md = tonic::metadata::MetadataMap::new();
        inject_grpc(&span, &mut md);
        assert!(md.is_empty());
        assert_eq!(traceparent(&span), None);
    }
}
