//! The export pipeline behind the `tracing` layer:
//!
//! ```text
//!  span ends ─▶ KeepFailedProcessor ─ sampled ───────────────────────────▶ BatchSpanProcessor
//!                  │ not sampled (recorded only)                         (bounded queue; full:
//!                  └▶ held per trace until its local root ends:           spans dropped, never
//!                       any span failed? ─ yes: marked sampled ─────────▶ a wait)
//!                                        └ no: dropped                        │ own thread
//!                                                                             ▼
//!                                                         OwnRuntimeExporter (OTLP gRPC / HTTP,
//!                                                         on a 1-thread tokio runtime of its own)
//! ```
//!
//! - **Parent-based head sampling, failures always kept.** [`RecordUnsampled`] turns the head
//!   sampler's *drop* into *record only*, so an unsampled request's spans still exist in this
//!   process; [`KeepFailedProcessor`] holds them until the local root span ends and exports the
//!   whole local part of the trace if any of its spans has an error status. Bounded: at most
//!   [`MAX_HELD_TRACES`] traces and [`MAX_SPANS_PER_TRACE`] spans each are held; beyond that
//!   the oldest trace is forgotten. (A failure is kept per process: the other processes of the
//!   trace keep their own part only where they saw the failure too.)
//! - **Serving never waits for the collector.** `on_end` is a `try_send` into the batch
//!   processor's bounded queue ([`MAX_QUEUE_SPANS`]); the export runs on the processor's own
//!   thread with a timeout. A collector that is down costs dropped spans, counted and logged at
//!   most once per [`FAILURE_LOG_INTERVAL`].
//! - **Every span names its process.** [`ServiceAttribute`] copies the resource's
//!   `service.name` onto each span as [`SERVICE_ATTRIBUTE`]: tracing UIs that keep span
//!   attributes only (Arize Phoenix stores the resource's project name and drops the rest)
//!   still show which service a span came from.
//! - The OTLP exporters need a tokio reactor, and the batch processor's thread has none: the
//!   exporter owns a one-thread runtime and runs each export on it.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SamplingDecision, SamplingResult, ShouldSample, Span, SpanData,
    SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;

/// Traces held while their local root runs (unsampled ones, waiting to see if they fail).
pub const MAX_HELD_TRACES: usize = 1024;
/// Spans held per trace.
pub const MAX_SPANS_PER_TRACE: usize = 256;
/// Spans queued for export; beyond this, new spans are dropped (never waited for).
pub const MAX_QUEUE_SPANS: usize = 4096;
/// How long one export may take before it is abandoned.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one log line per this interval about failing exports.
pub const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(30);

/// The span attribute naming the service that recorded the span (a copy of the resource's
/// `service.name`).
pub const SERVICE_ATTRIBUTE: &str = "tandem.service";

/// Export counters of this process (`tandem_trace_*` metrics).
pub static EXPORTED_SPANS: AtomicU64 = AtomicU64::new(0);
/// Batches the collector refused or that timed out.
pub static EXPORT_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Unsampled traces exported because a span failed.
pub static KEPT_FAILED_TRACES: AtomicU64 = AtomicU64::new(0);

/// A head sampler whose *drop* becomes *record only* (see the module docs).
#[derive(Clone, Debug)]
pub struct RecordUnsampled<S>(pub S);

impl<S: ShouldSample + Clone + 'static> ShouldSample for RecordUnsampled<S> {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let mut r =
            self.0
                .should_sample(parent_context, trace_id, name, span_kind, attributes, links);
        if r.decision == SamplingDecision::Drop {
            r.decision = SamplingDecision::RecordOnly;
        }
        r
    }
}

#[derive(Default)]
struct HeldTrace {
    spans: Vec<SpanData>,
    failed: bool,
}

#[derive(Default)]
struct Held {
    traces: HashMap<TraceId, HeldTrace>,
    order: VecDeque<TraceId>,
}

/// Sampled spans go to the batch processor; unsampled ones are held per trace and exported
/// only if the trace failed here (see the module docs).
#[derive(Debug)]
pub struct KeepFailedProcessor<P> {
    inner: P,
    held: Mutex<Held>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Held({} traces)", self.traces.len())
    }
}

impl<P: SpanProcessor> KeepFailedProcessor<P> {
    /// Wraps `inner` (the batch processor).
    pub fn new(inner: P) -> Self {
        KeepFailedProcessor {
            inner,
            held: Mutex::new(Held::default()),
        }
    }

    /// Traces held now (tests).
    pub fn held_traces(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).traces.len()
    }
}

fn as_sampled(mut span: SpanData) -> SpanData {
    let c = &span.span_context;
    span.span_context = SpanContext::new(
        c.trace_id(),
        c.span_id(),
        c.trace_flags() | TraceFlags::SAMPLED,
        c.is_remote(),
        c.trace_state().clone(),
    );
    span
}

impl<P: SpanProcessor> SpanProcessor for KeepFailedProcessor<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.inner.on_end(span);
            return;
        }
        let trace_id = span.span_context.trace_id();
        let failed = matches!(span.status, Status::Error { .. });
        let local_root = span.parent_span_is_remote || span.parent_span_id == SpanId::INVALID;
        let finished = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            if !held.traces.contains_key(&trace_id) {
                if held.order.len() >= MAX_HELD_TRACES
                    && let Some(old) = held.order.pop_front()
                {
                    held.traces.remove(&old);
                }
                held.order.push_back(trace_id);
            }
            let t = held.traces.entry(trace_id).or_default();
            t.failed |= failed;
            if t.spans.len() < MAX_SPANS_PER_TRACE {
                t.spans.push(span);
            }
            if local_root {
                held.order.retain(|id| *id != trace_id);
                held.traces.remove(&trace_id)
            } else {
                None
            }
        };
        if let Some(t) = finished
            && t.failed
        {
            KEPT_FAILED_TRACES.fetch_add(1, Ordering::Relaxed);
            for s in t.spans {
                self.inner.on_end(as_sampled(s));
            }
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// An exporter run on a tokio runtime of its own (see the module docs), counting and
/// rate-limiting the log of its failures.
pub struct OwnRuntimeExporter<E> {
    inner: E,
    rt: tokio::runtime::Runtime,
    last_failure_log: Mutex<Option<Instant>>,
    endpoint: String,
}

impl<E> std::fmt::Debug for OwnRuntimeExporter<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OwnRuntimeExporter({})", self.endpoint)
    }
}

impl<E: SpanExporter> OwnRuntimeExporter<E> {
    /// Builds the exporter with `build` inside a new one-thread runtime's context.
    pub fn build<B, Err>(endpoint: &str, build: B) -> Result<Self, OwnRuntimeError<Err>>
    where
        B: FnOnce() -> Result<E, Err>,
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(OwnRuntimeError::Runtime)?;
        let inner = {
            let _entered = rt.enter();
            build().map_err(OwnRuntimeError::Build)?
        };
        Ok(OwnRuntimeExporter {
            inner,
            rt,
            last_failure_log: Mutex::new(None),
            endpoint: endpoint.to_string(),
        })
    }
}

/// Why [`OwnRuntimeExporter::build`] failed.
#[derive(Debug)]
pub enum OwnRuntimeError<E> {
    /// The runtime did not start.
    Runtime(std::io::Error),
    /// The exporter did not build.
    Build(E),
}

impl<E: SpanExporter> SpanExporter for OwnRuntimeExporter<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len() as u64;
        let result = self.rt.block_on(async {
            match tokio::time::timeout(EXPORT_TIMEOUT, self.inner.export(batch)).await {
                Ok(r) => r,
                Err(_) => Err(opentelemetry_sdk::error::OTelSdkError::Timeout(EXPORT_TIMEOUT)),
            }
        });
        match &result {
            Ok(()) => {
                EXPORTED_SPANS.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                EXPORT_FAILURES.fetch_add(1, Ordering::Relaxed);
                let mut last = self
                    .last_failure_log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if last.is_none_or(|t| t.elapsed() >= FAILURE_LOG_INTERVAL) {
                    *last = Some(Instant::now());
                    tracing::warn!(
                        target: "tandem_telemetry",
                        endpoint = %self.endpoint,
                        error = %e,
                        dropped_spans = n,
                        "trace export failed; spans are dropped, serving is not affected \
                         (logged at most every {FAILURE_LOG_INTERVAL:?})"
                    );
                }
            }
        }
        std::future::ready(result)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _entered = self.rt.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        let _entered = self.rt.enter();
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Sets [`SERVICE_ATTRIBUTE`] on every span from the `service.name` of the resource the
/// provider hands over (`set_resource`, before any span starts), then passes the span on.
#[derive(Debug)]
pub struct ServiceAttribute<P> {
    inner: P,
    service: Option<opentelemetry::Value>,
}

impl<P: SpanProcessor> ServiceAttribute<P> {
    /// Wraps `inner`.
    pub fn new(inner: P) -> Self {
        ServiceAttribute { inner, service: None }
    }
}

impl<P: SpanProcessor> SpanProcessor for ServiceAttribute<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        if let Some(service) = &self.service {
            use opentelemetry::trace::Span as _;
            span.set_attribute(KeyValue::new(SERVICE_ATTRIBUTE, service.clone()));
        }
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.service = resource.get(&opentelemetry::Key::from_static_str("service.name"));
        self.inner.set_resource(resource);
    }
}

/// Returns the batch processor for `exporter` with a bounded queue.
pub fn batch<E: SpanExporter + 'static>(exporter: E) -> BatchSpanProcessor {
    let config = opentelemetry_sdk::trace::BatchConfigBuilder::default()
        .with_max_queue_size(MAX_QUEUE_SPANS)
        .with_max_export_batch_size(512)
        .with_scheduled_delay(Duration::from_millis(500))
        .build();
    BatchSpanProcessor::builder(exporter)
        .with_batch_config(config)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use std::sync::Arc;

    /// Collects what reaches it (stands in for the batch processor).
    #[derive(Debug, Default, Clone)]
    struct Collect(Arc<Mutex<Vec<SpanData>>>);

    impl SpanProcessor for Collect {
        fn on_start(&self, _: &mut Span, _: &Context) {}
        fn on_end(&self, span: SpanData) {
            assert!(span.span_context.is_sampled(), "only sampled spans are exported");
            self.0.lock().unwrap().push(span);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    fn provider(sampler: Sampler) -> (SdkTracerProvider, Collect) {
        let c = Collect::default();
        let p = SdkTracerProvider::builder()
            .with_sampler(RecordUnsampled(sampler))
            .with_span_processor(KeepFailedProcessor::new(c.clone()))
            .build();
        (p, c)
    }

    #[test]
    fn every_span_carries_the_resource_service_name() {
        let c = Collect::default();
        let p = SdkTracerProvider::builder()
            .with_span_processor(ServiceAttribute::new(c.clone()))
            .with_resource(Resource::builder_empty().with_service_name("tandem-test").build())
            .build();
        let tracer = p.tracer("t");
        tracer.in_span("outer", |_| tracer.in_span("inner", |_| {}));
        let spans = c.0.lock().unwrap();
        assert_eq!(spans.len(), 2);
        for s in spans.iter() {
            let service = s.attributes.iter().find(|kv| kv.key.as_str() == SERVICE_ATTRIBUTE);
            assert_eq!(
                service.map(|kv| kv.value.as_str().into_owned()).as_deref(),
                Some("tandem-test"),
                "{s:?}"
            );
        }
    }

    fn names(c: &Collect) -> Vec<String> {
        c.0.lock().unwrap().iter().map(|s| s.name.to_string()).collect()
    }

    #[test]
    fn unsampled_traces_are_exported_whole_only_when_a_span_failed() {
        let (p, c) = provider(Sampler::AlwaysOff);
        let t = p.tracer("test");
        // A healthy request: nothing exported.
        let root = t.start("ok.root");
        let cx = Context::current_with_span(root);
        t.start_with_context("ok.child", &cx).end();
        drop(cx);
        assert!(names(&c).is_empty(), "{:?}", names(&c));
        // A failed one: the child fails, the root ends: both exported, as sampled.
        let root = t.start("bad.root");
        let cx = Context::current_with_span(root);
        let mut child = t.start_with_context("bad.child", &cx);
        child.set_status(Status::error("decode node died"));
        child.end();
        assert!(names(&c).is_empty(), "held until the local root ends");
        drop(cx);
        assert_eq!(names(&c), ["bad.child", "bad.root"]);
        let spans = c.0.lock().unwrap();
        assert_eq!(
            spans[0].span_context.trace_id(),
            spans[1].span_context.trace_id()
        );
    }

    #[test]
    fn sampled_traces_pass_straight_through() {
        let (p, c) = provider(Sampler::AlwaysOn);
        let t = p.tracer("test");
        let root = t.start("root");
        let cx = Context::current_with_span(root);
        t.start_with_context("child", &cx).end();
        assert_eq!(names(&c), ["child"], "not held");
        drop(cx);
        assert_eq!(names(&c), ["child", "root"]);
    }

    #[test]
    fn held_traces_are_bounded() {
        let c = Collect::default();
        let proc = Arc::new(KeepFailedProcessor::new(c.clone()));
        struct Shared(Arc<KeepFailedProcessor<Collect>>);
        impl std::fmt::Debug for Shared {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Shared")
            }
        }
        impl SpanProcessor for Shared {
            fn on_start(&self, s: &mut Span, cx: &Context) {
                self.0.on_start(s, cx)
            }
            fn on_end(&self, s: SpanData) {
                self.0.on_end(s)
            }
            fn force_flush(&self) -> OTelSdkResult {
                Ok(())
            }
            fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
                Ok(())
            }
        }
        let p = SdkTracerProvider::builder()
            .with_sampler(RecordUnsampled(Sampler::AlwaysOff))
            .with_span_processor(Shared(Arc::clone(&proc)))
            .build();
        let t = p.tracer("test");
        // Children whose roots never end (leaked tasks) must not grow memory without bound.
        let mut roots = Vec::new();
        for _ in 0..MAX_HELD_TRACES + 50 {
            let root = t.start("root");
            let cx = Context::current_with_span(root);
            t.start_with_context("child", &cx).end();
            roots.push(cx);
        }
        assert_eq!(proc.held_traces(), MAX_HELD_TRACES);
        std::mem::forget(roots);
    }
}
