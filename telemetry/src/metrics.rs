//! Prometheus metrics: what every tandem process shares (bucket boundaries, the text encoding,
//! the `/metrics` endpoint, a collector for values read at scrape time).
//!
//! Each crate declares its own families in one `metrics` module on a
//! [`Registry`] from this crate; call sites hold typed handles, never names. Conventions:
//! - names start with `tandem_`, carry their base unit (`_seconds`, `_bytes`), and counters are
//!   registered without `_total` (the encoder appends it);
//! - labels come from closed sets (role, node, model, priority class, outcome, transport, and
//!   API key ids capped by configuration), never a request id or prompt;
//! - histogram buckets are chosen for the quantity: see [`buckets`];
//! - help text of registered families has no final period (the registry adds one).
//!
//! Cost: a counter increment is one relaxed atomic add; a histogram observation takes a
//! `parking_lot` mutex (uncontended: tens of nanoseconds). Values that already live elsewhere
//! (engine snapshots, queue occupancy) are read once per scrape by a [`FnCollector`] instead of
//! being copied into gauges on every change.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The `Content-Type` of [`render`]'s output (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Histogram bucket upper bounds, in seconds, chosen per quantity and written down here.
pub mod buckets {
    /// Time to first token: 10 ms to 60 s (a long prompt behind a queue takes seconds).
    pub const TTFT_SECONDS: &[f64] = &[
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
    ];
    /// Inter-token latency: 1 ms to 1 s (a decode step on a CPU is ~10-60 ms, on a GPU ~2-50).
    pub const ITL_SECONDS: &[f64] = &[
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
    ];
    /// End-to-end request time: 50 ms to 10 min.
    pub const E2E_SECONDS: &[f64] = &[
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ];
    /// Queue wait (admission at the router, scheduling on a node): 1 ms to 60 s.
    pub const QUEUE_SECONDS: &[f64] = &[
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    /// One engine step (forward pass): 0.5 ms to 5 s.
    pub const STEP_SECONDS: &[f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    ];
    /// One KV transfer (a request's blocks): 100 µs to 30 s.
    pub const TRANSFER_SECONDS: &[f64] = &[
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
        2.5, 10.0, 30.0,
    ];
    /// A canary generation: 10 ms to 30 s.
    pub const CANARY_SECONDS: &[f64] = &[
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
}

/// A histogram with these bucket bounds.
pub fn histogram(bounds: &'static [f64]) -> Histogram {
    Histogram::new(bounds.iter().copied())
}

/// A constructor for `Family<_, Histogram>` with fixed bounds (a plain `fn`, as `Family` wants).
pub type HistogramCtor = fn() -> Histogram;

/// Renders every metric of `registry` in the Prometheus text format (0.0.4).
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail; a collector that fails truncates its own family only.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
    {
        tracing::warn!(error = %e, "encoding metrics failed part-way");
    }
    out
}

/// What a `/metrics` endpoint serves: the text of every family, rendered per scrape.
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

/// An axum router answering `GET /metrics` with `render()` (for processes whose HTTP server is
/// only this; the router adds the same handler to its own server).
pub fn routes(render: RenderFn) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let render = Arc::clone(&render);
            async move { ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], render()) }
        }),
    )
}

/// A running metrics endpoint.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl MetricsServer {
    /// Serves `GET /metrics` with `render()` on `listener` until [`stop`](Self::stop).
    pub fn spawn(listener: TcpListener, render: RenderFn) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let signal = stop.clone();
        let task = tokio::spawn(async move {
            axum::serve(listener, routes(render))
                .with_graceful_shutdown(signal.cancelled_owned())
                .await
        });
        Ok(MetricsServer { addr, stop, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving (last of a node's phases: scrapes see the drain to the end).
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// The kind of a [`Family`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down.
    Gauge,
    /// A monotonic count (`_total` is appended to the name).
    Counter,
    /// A distribution kept elsewhere (bucket counts, sum, count).
    Histogram,
}

/// One series' value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A gauge or counter value.
    Number(f64),
    /// A histogram: `(upper bound, observations in this bucket alone)` with `+Inf` last, the
    /// sum and the count.
    Histogram {
        /// Per-bucket (not cumulative) counts.
        buckets: Vec<(f64, u64)>,
        /// Sum of observations.
        sum: f64,
        /// Number of observations.
        count: u64,
    },
}

/// One family read at scrape time: a name, help, kind and its labelled values.
#[derive(Clone, Debug)]
pub struct Family {
    /// Full name (without `_total` for counters).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Gauge or counter.
    pub kind: Kind,
    /// `(labels, value)` per series.
    pub samples: Vec<(Vec<(&'static str, String)>, Value)>,
}

impl Family {
    /// A gauge family.
    pub fn gauge(name: &'static str, help: &'static str) -> Self {
        Family {
            name,
            help,
            kind: Kind::Gauge,
            samples: Vec::new(),
        }
    }

    /// A counter family.
    pub fn counter(name: &'static str, help: &'static str) -> Self {
        Family {
            name,
            help,
            kind: Kind::Counter,
            samples: Vec::new(),
        }
    }

    /// A histogram family.
    pub fn histogram(name: &'static str, help: &'static str) -> Self {
        Family {
            name,
            help,
            kind: Kind::Histogram,
            samples: Vec::new(),
        }
    }

    /// Adds a series.
    pub fn with(mut self, labels: Vec<(&'static str, String)>, value: f64) -> Self {
        self.samples.push((labels, Value::Number(value)));
        self
    }

    /// Adds a histogram series (see [`Value::Histogram`]).
    pub fn with_histogram(
        mut self,
        labels: Vec<(&'static str, String)>,
        buckets: Vec<(f64, u64)>,
        sum: f64,
    ) -> Self {
        let count = buckets.iter().map(|b| b.1).sum();
        self.samples.push((
            labels,
            Value::Histogram {
                buckets,
                sum,
                count,
            },
        ));
        self
    }

    /// Adds an unlabelled series.
    pub fn value(self, value: f64) -> Self {
        self.with(Vec::new(), value)
    }
}

/// A [`Collector`] whose families come from a closure run at every scrape (reading a watch
/// channel, an atomic, a queue's length).
pub struct FnCollector<F> {
    f: F,
}

impl<F> FnCollector<F>
where
    F: Fn() -> Vec<Family> + Send + Sync + 'static,
{
    /// A collector calling `f` per scrape.
    pub fn new(f: F) -> Self {
        FnCollector { f }
    }
}

impl<F> std::fmt::Debug for FnCollector<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnCollector")
    }
}

impl<F> Collector for FnCollector<F>
where
    F: Fn() -> Vec<Family> + Send + Sync + 'static,
{
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in (self.f)() {
            let kind = match family.kind {
                Kind::Gauge => MetricType::Gauge,
                Kind::Counter => MetricType::Counter,
                Kind::Histogram => MetricType::Histogram,
            };
            let mut metric = encoder.encode_descriptor(family.name, family.help, None, kind)?;
            for (labels, value) in &family.samples {
                let mut series = metric.encode_family(labels)?;
                match (family.kind, value) {
                    // Whole numbers print as integers (`3`, not `3.0`), as counters usually do.
                    (Kind::Gauge, Value::Number(v)) if is_whole(*v) => {
                        ConstGauge::new(*v as i64).encode(series)?
                    }
                    (Kind::Gauge, Value::Number(v)) => ConstGauge::new(*v).encode(series)?,
                    (Kind::Counter, Value::Number(v)) if is_whole(*v) && *v >= 0.0 => {
                        ConstCounter::new(*v as u64).encode(series)?
                    }
                    (Kind::Counter, Value::Number(v)) => ConstCounter::new(*v).encode(series)?,
                    (Kind::Histogram, Value::Histogram { buckets, sum, count }) => series
                        .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                            *sum, *count, buckets, None,
                        )?,
                    // A family mixing kinds is a bug in its collector: skip the series.
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

fn is_whole(v: f64) -> bool {
    v.fract() == 0.0 && v.abs() < 9.0e15
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn counters_gauges_and_histograms_render_in_the_text_format_prometheus_reads() {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        r.register("tandem_test_requests", "Requests", c.clone());
        let h = histogram(buckets::TTFT_SECONDS);
        r.register("tandem_test_ttft_seconds", "TTFT", h.clone());
        r.register_collector(Box::new(FnCollector::new(|| {
            vec![
                Family::gauge("tandem_test_blocks", "Blocks.")
                    .with(vec![("state", "free".into())], 7.0)
                    .with(vec![("state", "used".into())], 3.0),
                Family::counter("tandem_test_steps", "Steps.").value(12.0),
                Family::histogram("tandem_test_transfer_seconds", "Transfers.").with_histogram(
                    vec![("transport", "tcp".into())],
                    vec![(0.1, 2), (1.0, 1), (f64::INFINITY, 0)],
                    0.9,
                ),
            ]
        })));
        c.inc_by(2);
        h.observe(0.3);
        let text = render(&r);
        for line in [
            "# TYPE tandem_test_requests_total counter",
            "tandem_test_requests_total 2",
            "# TYPE tandem_test_ttft_seconds histogram",
            "tandem_test_ttft_seconds_bucket{le=\"0.25\"} 0",
            "tandem_test_ttft_seconds_bucket{le=\"0.5\"} 1",
            "tandem_test_ttft_seconds_bucket{le=\"+Inf\"} 1",
            "tandem_test_ttft_seconds_count 1",
            "# TYPE tandem_test_blocks gauge",
            "tandem_test_blocks{state=\"free\"} 7",
            "tandem_test_blocks{state=\"used\"} 3",
            "tandem_test_steps_total 12",
            "# TYPE tandem_test_transfer_seconds histogram",
            "tandem_test_transfer_seconds_bucket{transport=\"tcp\",le=\"0.1\"} 2",
            "tandem_test_transfer_seconds_bucket{transport=\"tcp\",le=\"1\"} 3",
            "tandem_test_transfer_seconds_bucket{transport=\"tcp\",le=\"+Inf\"} 3",
            "tandem_test_transfer_seconds_count{transport=\"tcp\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn every_bucket_list_is_strictly_increasing() {
        for b in [
            buckets::TTFT_SECONDS,
            buckets::ITL_SECONDS,
            buckets::E2E_SECONDS,
            buckets::QUEUE_SECONDS,
            buckets::STEP_SECONDS,
            buckets::TRANSFER_SECONDS,
            buckets::CANARY_SECONDS,
        ] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
