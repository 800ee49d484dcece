//! [`TelemetryError`], this crate's boundary error.

/// Why telemetry could not start. Every variant names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// An `OTEL_*` variable (or the flag that stands for it) has a value the specification does
    /// not allow.
    #[error("{var}={value:?} is invalid: {reason}")]
    InvalidSetting {
        /// The variable or flag.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        reason: String,
    },
    /// The OTLP exporter could not be built (a malformed endpoint, for instance).
    #[error("building the OTLP {protocol} exporter for {endpoint}: {reason}")]
    Exporter {
        /// `grpc` or `http/protobuf`.
        protocol: &'static str,
        /// The endpoint it was built for.
        endpoint: String,
        /// The exporter's own message.
        reason: String,
    },
    /// The exporter's runtime thread could not start.
    #[error("starting the trace exporter's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A global subscriber was installed already (telemetry is initialised once per process).
    #[error("a tracing subscriber is already installed in this process")]
    AlreadyInstalled,
}
