//! OpenTelemetry traces: the `tracing` → OTLP pipeline, its settings, and W3C trace context.
//!
//! [`init`] installs the process's one `tracing` subscriber: the log lines on stderr (filtered
//! by `--log` / `RUST_LOG`) and, when an OTLP endpoint is set, an OpenTelemetry layer that turns
//! every `info`-level span into an OTLP span (its own filter: the log level does not hide
//! spans). Without an endpoint the layer is absent and spans cost what a disabled `tracing` span
//! costs. See [`pipeline`] for sampling, failure retention and the bounded export queue.
//!
//! Span names are stable stage names (`router.request`, `prefill.forward`, `kv.push`,
//! `decode.stream`, ...); attributes follow the OpenTelemetry GenAI conventions first
//! (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...), `tandem.*` second.

pub mod config;
pub mod pipeline;
pub mod propagation;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use config::{OtlpProtocol, SamplerSetting, TraceArgs};

use crate::error::TelemetryError;
use pipeline::{
    KeepFailedProcessor, OwnRuntimeError, OwnRuntimeExporter, RecordUnsampled, ServiceAttribute,
};

/// Keeps the trace pipeline alive; dropping it flushes what is queued (bounded by the export
/// timeout) and stops the exporter.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn tracing_enabled(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

fn sampler(setting: SamplerSetting) -> Sampler {
    match setting {
        SamplerSetting::AlwaysOn => Sampler::AlwaysOn,
        SamplerSetting::AlwaysOff => Sampler::AlwaysOff,
        SamplerSetting::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
        SamplerSetting::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        SamplerSetting::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        SamplerSetting::ParentBasedTraceIdRatio(r) => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r)))
        }
    }
}

/// Builds the tracer provider for `args` (`None` when no endpoint is set). Every setting is
/// checked here, before anything is installed.
pub fn provider(
    service_name: &str,
    args: &TraceArgs,
) -> Result<Option<SdkTracerProvider>, TelemetryError> {
    let Some(endpoint) = args.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) else {
        return Ok(None);
    };
    config::validate_endpoint(endpoint)?;
    let sampling = SamplerSetting::from_env()?;
    let extra = match std::env::var(config::OTEL_RESOURCE_ATTRIBUTES) {
        Ok(v) => config::parse_resource_attributes(&v)?,
        Err(_) => Vec::new(),
    };
    let name = std::env::var(config::OTEL_SERVICE_NAME)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| service_name.to_string());
    let resource = Resource::builder_empty()
        .with_service_name(name)
        .with_attributes(
            extra
                .into_iter()
                .map(|(k, v)| KeyValue::new(k, v))
                .chain([
                    KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                    KeyValue::new("process.pid", i64::from(std::process::id())),
                ]),
        )
        .build();
    let protocol = args.otlp_protocol;
    let exporter_error = |reason: String| TelemetryError::Exporter {
        protocol: protocol.as_str(),
        endpoint: endpoint.to_string(),
        reason,
    };
    let processor = match protocol {
        OtlpProtocol::Grpc => {
            let exporter = OwnRuntimeExporter::build(endpoint, || {
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .with_timeout(pipeline::EXPORT_TIMEOUT)
                    .build()
            })
            .map_err(|e| match e {
                OwnRuntimeError::Runtime(io) => TelemetryError::Runtime(io),
                OwnRuntimeError::Build(b) => exporter_error(b.to_string()),
            })?;
            ServiceAttribute::new(KeepFailedProcessor::new(pipeline::batch(exporter)))
        }
        OtlpProtocol::HttpProtobuf => {
            let url = if endpoint.trim_end_matches('/').ends_with("/v1/traces") {
                endpoint.to_string()
            } else {
                format!("{}/v1/traces", endpoint.trim_end_matches('/'))
            };
            let exporter = OwnRuntimeExporter::build(&url, || {
                opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_endpoint(url.clone())
                    .with_timeout(pipeline::EXPORT_TIMEOUT)
                    .build()
            })
            .map_err(|e| match e {
                OwnRuntimeError::Runtime(io) => TelemetryError::Runtime(io),
                OwnRuntimeError::Build(b) => exporter_error(b.to_string()),
            })?;
            ServiceAttribute::new(KeepFailedProcessor::new(pipeline::batch(exporter)))
        }
    };
    Ok(Some(
        SdkTracerProvider::builder()
            .with_sampler(RecordUnsampled(sampler(sampling)))
            .with_span_processor(processor)
            .with_resource(resource)
            .build(),
    ))
}

/// Installs this process's `tracing` subscriber: stderr logs filtered by `log_filter` (an
/// invalid filter falls back to `info` for nodes and the router) and, with an OTLP endpoint in
/// `args`, span export as `service_name` (unless `OTEL_SERVICE_NAME` names it). Call once, early
/// in `main`, outside any async runtime; keep the guard until exit.
pub fn init(
    service_name: &str,
    log_filter: &str,
    args: &TraceArgs,
) -> Result<TelemetryGuard, TelemetryError> {
    let provider = provider(service_name, args)?;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(
            tracing_subscriber::EnvFilter::try_new(log_filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    let spans = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("tandem"))
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init()
        .map_err(|_| TelemetryError::AlreadyInstalled)?;
    if let Some(endpoint) = &args.otlp_endpoint {
        tracing::info!(
            endpoint,
            protocol = args.otlp_protocol.as_str(),
            "exporting traces over OTLP"
        );
    }
    Ok(TelemetryGuard { provider })
}
