//! What every tandem process exports to the people who run it:
//!
//! | module | what |
//! |---|---|
//! | [`metrics`] | Prometheus: shared bucket bounds, the text encoding, `/metrics`, scrape-time collectors |
//! | [`trace`] | OpenTelemetry: the `tracing` subscriber with OTLP export (gRPC or HTTP/protobuf), sampling that keeps failures, W3C trace context in HTTP headers and gRPC metadata |
//! | `testing` | (feature `testing`) a real OTLP receiver, gRPC and HTTP/protobuf, for tests |
//! | [`error`] | [`TelemetryError`], this crate's boundary error |
//!
//! Both are off or cheap by default: no OTLP endpoint, no span export (spans are disabled
//! `tracing` spans); metrics are atomics read when scraped.

#![warn(missing_docs)]

pub mod error;
pub mod metrics;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trace;

pub use error::TelemetryError;
pub use prometheus_client;
pub use trace::{TelemetryGuard, TraceArgs, init};

/// Families describing this process's trace export (register with
/// `metrics::FnCollector::new(tandem_telemetry::trace_export_families)`).
pub fn trace_export_families() -> Vec<metrics::Family> {
    use std::sync::atomic::Ordering::Relaxed;
    use trace::pipeline::{EXPORT_FAILURES, EXPORTED_SPANS, KEPT_FAILED_TRACES};
    vec![
        metrics::Family::counter(
            "tandem_trace_exported_spans",
            "Spans delivered to the OTLP collector.",
        )
        .value(EXPORTED_SPANS.load(Relaxed) as f64),
        metrics::Family::counter(
            "tandem_trace_export_failures",
            "Span batches the collector refused or that timed out (the spans are dropped).",
        )
        .value(EXPORT_FAILURES.load(Relaxed) as f64),
        metrics::Family::counter(
            "tandem_trace_kept_failed_traces",
            "Traces the head sampler skipped but that were exported because they failed.",
        )
        .value(KEPT_FAILED_TRACES.load(Relaxed) as f64),
    ]
}
