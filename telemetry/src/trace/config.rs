//! Trace export settings: the `--otlp-*` flags and the standard `OTEL_*` variables, read and
//! checked once at startup (an invalid value is a startup error naming it, never a silent
//! default).

use clap::{Args, ValueEnum};

use crate::error::TelemetryError;

/// `OTEL_EXPORTER_OTLP_ENDPOINT`: where spans go (unset: tracing is off, at no cost).
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc` or `http/protobuf`.
pub const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
/// `OTEL_SERVICE_NAME`: overrides the process's default service name.
pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
/// `OTEL_RESOURCE_ATTRIBUTES`: `key=value,key=value` added to every span's resource.
pub const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
/// `OTEL_TRACES_SAMPLER`: the sampler (default `parentbased_always_on`).
pub const OTEL_TRACES_SAMPLER: &str = "OTEL_TRACES_SAMPLER";
/// `OTEL_TRACES_SAMPLER_ARG`: the ratio of the `*traceidratio` samplers.
pub const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";

/// The OTLP wire protocol.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (collectors listen on 4317).
    #[default]
    #[value(name = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (collectors listen on 4318; `/v1/traces` is appended).
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// The name the specification uses.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Trace export flags, shared by every tandem binary (`#[command(flatten)]`). Each falls back
/// to its standard OpenTelemetry variable.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceArgs {
    /// OTLP collector to send spans to, e.g. http://127.0.0.1:4317 (gRPC) or
    /// http://127.0.0.1:4318 (HTTP). Unset: no spans are exported and tracing costs nothing.
    /// The sampler, service name and resource come from OTEL_TRACES_SAMPLER(_ARG),
    /// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    #[arg(long, env = OTEL_EXPORTER_OTLP_ENDPOINT)]
    pub otlp_endpoint: Option<String>,

    /// OTLP protocol: grpc or http/protobuf.
    #[arg(long, env = OTEL_EXPORTER_OTLP_PROTOCOL, value_enum, default_value_t = OtlpProtocol::Grpc)]
    pub otlp_protocol: OtlpProtocol,
}

impl TraceArgs {
    /// The flags that hand these settings to a child process (`tandem up`).
    pub fn to_flags(&self) -> Vec<String> {
        match &self.otlp_endpoint {
            Some(e) => vec![
                "--otlp-endpoint".into(),
                e.clone(),
                "--otlp-protocol".into(),
                self.otlp_protocol.as_str().into(),
            ],
            None => Vec::new(),
        }
    }
}

/// The head sampler, per the specification's `OTEL_TRACES_SAMPLER` values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SamplerSetting {
    /// `always_on`.
    AlwaysOn,
    /// `always_off`.
    AlwaysOff,
    /// `traceidratio` with its ratio.
    TraceIdRatio(f64),
    /// `parentbased_always_on` (the default).
    ParentBasedAlwaysOn,
    /// `parentbased_always_off`.
    ParentBasedAlwaysOff,
    /// `parentbased_traceidratio` with its ratio.
    ParentBasedTraceIdRatio(f64),
}

impl SamplerSetting {
    /// Parses the two variables' values (`None`: unset).
    pub fn parse(sampler: Option<&str>, arg: Option<&str>) -> Result<Self, TelemetryError> {
        let ratio = || -> Result<f64, TelemetryError> {
            let Some(a) = arg else { return Ok(1.0) };
            let r: f64 = a.trim().parse().map_err(|_| TelemetryError::InvalidSetting {
                var: OTEL_TRACES_SAMPLER_ARG,
                value: a.into(),
                reason: "must be a number between 0 and 1".into(),
            })?;
            if !(0.0..=1.0).contains(&r) {
                return Err(TelemetryError::InvalidSetting {
                    var: OTEL_TRACES_SAMPLER_ARG,
                    value: a.into(),
                    reason: "must be between 0 and 1".into(),
                });
            }
            Ok(r)
        };
        Ok(match sampler.map(str::trim) {
            None | Some("") | Some("parentbased_always_on") => SamplerSetting::ParentBasedAlwaysOn,
            Some("always_on") => SamplerSetting::AlwaysOn,
            Some("always_off") => SamplerSetting::AlwaysOff,
            Some("traceidratio") => SamplerSetting::TraceIdRatio(ratio()?),
            Some("parentbased_always_off") => SamplerSetting::ParentBasedAlwaysOff,
            Some("parentbased_traceidratio") => SamplerSetting::ParentBasedTraceIdRatio(ratio()?),
            Some(other) => {
                return Err(TelemetryError::InvalidSetting {
                    var: OTEL_TRACES_SAMPLER,
                    value: other.into(),
                    reason: "expected always_on, always_off, traceidratio, parentbased_always_on, \
                             parentbased_always_off or parentbased_traceidratio"
                        .into(),
                });
            }
        })
    }

    /// From the process environment.
    pub fn from_env() -> Result<Self, TelemetryError> {
        let s = std::env::var(OTEL_TRACES_SAMPLER).ok();
        let a = std::env::var(OTEL_TRACES_SAMPLER_ARG).ok();
        Self::parse(s.as_deref(), a.as_deref())
    }
}

/// Parses `OTEL_RESOURCE_ATTRIBUTES` (`key=value` pairs separated by commas; values may be
/// percent-encoded per the specification).
pub fn parse_resource_attributes(value: &str) -> Result<Vec<(String, String)>, TelemetryError> {
    let mut out = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(TelemetryError::InvalidSetting {
                var: OTEL_RESOURCE_ATTRIBUTES,
                value: value.into(),
                reason: format!("`{part}` is not key=value"),
            });
        };
        let k = k.trim();
        if k.is_empty() {
            return Err(TelemetryError::InvalidSetting {
                var: OTEL_RESOURCE_ATTRIBUTES,
                value: value.into(),
                reason: format!("`{part}` has an empty key"),
            });
        }
        out.push((k.to_string(), percent_decode(v.trim())));
    }
    Ok(out)
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks an endpoint: an `http://` or `https://` URL with a host.
pub fn validate_endpoint(endpoint: &str) -> Result<(), TelemetryError> {
    let invalid = |reason: &str| TelemetryError::InvalidSetting {
        var: OTEL_EXPORTER_OTLP_ENDPOINT,
        value: endpoint.into(),
        reason: reason.into(),
    };
    let uri: axum::http::Uri = endpoint
        .parse()
        .map_err(|_| invalid("not a URL (expected e.g. http://127.0.0.1:4317)"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(invalid(
                "https collectors are not supported by this build (no TLS); use a local \
                 collector or agent over http",
            ));
        }
        _ => return Err(invalid("must start with http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("has no host"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samplers_parse_per_the_specification_and_bad_values_name_the_variable() {
        assert_eq!(
            SamplerSetting::parse(None, None).unwrap(),
            SamplerSetting::ParentBasedAlwaysOn
        );
        assert_eq!(
            SamplerSetting::parse(Some("parentbased_traceidratio"), Some("0.25")).unwrap(),
            SamplerSetting::ParentBasedTraceIdRatio(0.25)
        );
        assert_eq!(
            SamplerSetting::parse(Some("traceidratio"), None).unwrap(),
            SamplerSetting::TraceIdRatio(1.0)
        );
        for (s, a, var) in [
            (Some("sometimes"), None, OTEL_TRACES_SAMPLER),
            (Some("traceidratio"), Some("half"), OTEL_TRACES_SAMPLER_ARG),
            (Some("traceidratio"), Some("1.5"), OTEL_TRACES_SAMPLER_ARG),
        ] {
            match SamplerSetting::parse(s, a) {
                Err(TelemetryError::InvalidSetting { var: v, .. }) => assert_eq!(v, var),
                other => panic!("{s:?} {a:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn resource_attributes_parse_and_malformed_ones_are_refused() {
        assert_eq!(
            parse_resource_attributes("deployment.environment=prod, team=infer%20ence").unwrap(),
            vec![
                ("deployment.environment".into(), "prod".into()),
                ("team".into(), "infer ence".into())
            ]
        );
        assert!(parse_resource_attributes("").unwrap().is_empty());
        assert!(matches!(
            parse_resource_attributes("novalue"),
            Err(TelemetryError::InvalidSetting {
                var: OTEL_RESOURCE_ATTRIBUTES,
                ..
            })
        ));
    }

    #[test]
    fn endpoints_must_be_plain_http_urls() {
        validate_endpoint("http://127.0.0.1:4317").unwrap();
        for bad in ["127.0.0.1:4317", "ftp://x:1", "https://collector:4317", "http://"] {
            assert!(validate_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flags_for_a_child_carry_endpoint_and_protocol() {
        let a = TraceArgs {
            otlp_endpoint: Some("http://127.0.0.1:4318".into()),
            otlp_protocol: OtlpProtocol::HttpProtobuf,
        };
        assert_eq!(
            a.to_flags(),
            [
                "--otlp-endpoint",
                "http://127.0.0.1:4318",
                "--otlp-protocol",
                "http/protobuf"
            ]
        );
        assert!(TraceArgs::default().to_flags().is_empty());
    }
}
