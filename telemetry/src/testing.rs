//! A real OTLP trace receiver for tests (feature `testing`): an OTLP/gRPC collector built from
//! the `opentelemetry-proto` types and an OTLP/HTTP (protobuf) endpoint, both collecting every
//! span they are sent, on port 0.
//!
//! ```no_run
//! # async fn f() {
//! let rx = tandem_telemetry::testing::OtlpReceiver::start().await;
//! // point a process at rx.grpc_endpoint() (or rx.http_endpoint() with http/protobuf)
//! let spans = rx.wait_for(std::time::Duration::from_secs(10), |s| s.len() >= 3).await;
//! # }
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One received span, flattened for assertions.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// `service.name` of the process that sent it.
    pub service: String,
    /// Span name.
    pub name: String,
    /// Trace id, 32 hex digits.
    pub trace_id: String,
    /// Span id, 16 hex digits.
    pub span_id: String,
    /// Parent span id (empty for a root).
    pub parent_span_id: String,
    /// Attributes as strings (arrays joined by `,`).
    pub attributes: BTreeMap<String, String>,
    /// Links: (trace id, span id).
    pub links: Vec<(String, String)>,
    /// Whether its status is ERROR.
    pub error: bool,
    /// Start and end, Unix ns.
    pub start_unix_ns: u64,
    /// End, Unix ns.
    pub end_unix_ns: u64,
}

impl ReceivedSpan {
    /// An attribute's value.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value_string(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::ArrayValue(a)) => a
            .values
            .iter()
            .map(|v| value_string(&Some(v.clone())))
            .collect::<Vec<_>>()
            .join(","),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn flatten(req: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
            .map(|a| value_string(&a.value))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: s.name.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    attributes: s
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), value_string(&a.value)))
                        .collect(),
                    links: s
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    error: s.status.as_ref().is_some_and(|st| st.code == 2),
                    start_unix_ns: s.start_time_unix_nano,
                    end_unix_ns: s.end_time_unix_nano,
                });
            }
        }
    }
    out
}

#[derive(Clone, Default)]
struct Store(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = flatten(request.into_inner());
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver; stops when dropped.
pub struct OtlpReceiver {
    grpc: SocketAddr,
    http: SocketAddr,
    store: Store,
    stop: CancellationToken,
}

impl OtlpReceiver {
    /// Starts both endpoints on free loopback ports.
    pub async fn start() -> OtlpReceiver {
        let store = Store::default();
        let stop = CancellationToken::new();
        let grpc_l = TcpListener::bind("127.0.0.1:0").await.expect("bind OTLP/gRPC");
        let http_l = TcpListener::bind("127.0.0.1:0").await.expect("bind OTLP/HTTP");
        let (grpc, http) = (
            grpc_l.local_addr().expect("bound"),
            http_l.local_addr().expect("bound"),
        );
        let (s, t) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(s))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(grpc_l),
                    t.cancelled_owned(),
                )
                .await;
        });
        let (s, t) = (store.clone(), stop.clone());
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let s = s.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(req) => {
                            s.0.lock().unwrap_or_else(|p| p.into_inner()).extend(flatten(req));
                            (axum::http::StatusCode::OK, Vec::new())
                        }
                        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(http_l, app)
                .with_graceful_shutdown(t.cancelled_owned())
                .await;
        });
        OtlpReceiver {
            grpc,
            http,
            store,
            stop,
        }
    }

    /// `http://127.0.0.1:PORT` of the OTLP/gRPC endpoint.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// `http://127.0.0.1:PORT` of the OTLP/HTTP endpoint (`/v1/traces` is appended by clients).
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.store.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until `cond(spans)` holds or `within` passes; returns the spans either way.
    pub async fn wait_for(
        &self,
        within: Duration,
        cond: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let spans = self.spans();
            if cond(&spans) || tokio::time::Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
